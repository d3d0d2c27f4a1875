"""DynamicLossScaler on its own: the schedule, the check, the state."""

import numpy
import pytest

from chainer import serializers

from fastchain.precision import DynamicLossScaler


def grads(*values):
    return [numpy.array(v, dtype=numpy.float16) for v in values]


@pytest.mark.parametrize('bad', [numpy.inf, -numpy.inf, numpy.nan])
def test_any_nonfinite_gradient_skips_the_step(bad):
    s = DynamicLossScaler(init_scale=1024.0)
    assert s.step(grads([1, 2], [3, bad], [4])) is False
    assert s.stepped is False
    assert s.update() == 512.0
    assert (s.steps, s.skipped_steps) == (0, 1)


def test_fp16_values_near_the_limit_are_not_mistaken_for_overflow():
    s = DynamicLossScaler()
    big = numpy.full(100000, 65504, numpy.float16)    # sum overflows fp16, not fp32
    assert s.step([big, None]) is True


def test_backoff_then_growth_after_the_interval():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=3, growth_factor=2.0,
                          backoff_factor=0.25)
    history = []
    for found in [False, True, False, False, False, False, False, False]:
        s.step(grads([numpy.nan if found else 1.0]))
        history.append(s.update())
    assert history == [8, 2, 2, 2, 4, 4, 4, 8]
    assert (s.steps, s.skipped_steps) == (7, 1)


def test_scale_is_clamped_to_min_and_max():
    s = DynamicLossScaler(init_scale=4.0, min_scale=2.0, max_scale=8.0,
                          growth_interval=1)
    for _ in range(3):
        s.step(grads([numpy.inf]))
        s.update()
    assert s.scale == 2.0
    for _ in range(5):
        s.step(grads([1.0]))
        s.update()
    assert s.scale == 8.0


def test_reducer_makes_every_rank_skip_together():
    s = DynamicLossScaler()
    seen = []

    def other_rank_overflowed(found_inf):
        seen.append(found_inf)
        return True
    s.set_found_inf_reducer(other_rank_overflowed)
    assert s.step(grads([1.0])) is False
    assert seen == [False]


def test_update_without_step_is_a_clear_error():
    s = DynamicLossScaler()
    with pytest.raises(RuntimeError, match='without a step'):
        s.update()


@pytest.mark.parametrize('kwargs', [
    {'init_scale': 0}, {'init_scale': float('inf')}, {'growth_factor': 1.0},
    {'backoff_factor': 1.0}, {'growth_interval': 0}, {'growth_interval': 1.5},
    {'min_scale': 10.0, 'init_scale': 1.0}, {'max_scale': 1.0},
])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        DynamicLossScaler(**kwargs)


def test_state_round_trips_through_npz(tmp_path):
    s = DynamicLossScaler(init_scale=64.0, growth_interval=5)
    for found in [False, True, False, False]:
        s.step(grads([numpy.inf if found else 1.0]))
        s.update()
    path = str(tmp_path / 's.npz')
    serializers.save_npz(path, s)
    t = DynamicLossScaler(growth_interval=5)
    serializers.load_npz(path, t)
    assert t.state_dict() == s.state_dict() == {
        'scale': 32.0, 'good_steps': 2, 'steps': 3, 'skipped_steps': 1}
    assert isinstance(t.scale, float) and isinstance(t.steps, int)
    u = DynamicLossScaler()
    u.load_state_dict(s.state_dict())
    assert repr(u) == repr(s).replace('/5', '/1000')


def test_steps_skipped_at_the_smallest_scale_are_said_once():
    """Every step overflowing even at min_scale: nothing learns, and only
    NumPy's RuntimeWarnings said anything (a new-user trial: 29 of 30 steps
    skipped, the loss NaN)."""
    import warnings
    from fastchain.precision._scaler import STUCK_STEPS
    inf = [numpy.array([numpy.inf], numpy.float16)]
    ok = [numpy.ones(1, numpy.float16)]
    s = DynamicLossScaler(init_scale=4.0, min_scale=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        # down to 1, one good step, not quite enough at 1, a good step again
        for grads in [inf] * 2 + [ok] + [inf] * (STUCK_STEPS - 1) + [ok] + \
                [inf] * (STUCK_STEPS - 1):
            s.step(grads)
            s.update()
        before = [str(w.message) for w in caught]
        assert [m for m in before if 'smallest loss scale' in m] == []
        for _ in range(10):
            s.step(inf)
            s.update()
    said = [str(w.message) for w in caught if 'smallest loss scale' in str(w.message)]
    assert len(said) == 1 and said[0].startswith(
        'fastchain fp16: {} steps in a row were skipped at the smallest loss scale (1)'.format(
            STUCK_STEPS)), said
