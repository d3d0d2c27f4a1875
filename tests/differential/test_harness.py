"""The differential harness's own measures: ``deviation`` is the smallest
tolerance ``compare`` passes, and ``measure_tolerance`` (what the tied and
onednn tolerances are set from) runs on the suite's current draws."""

import numpy
import pytest

from tests.differential import harness, measure_tolerance, models


def _trace(rng, steps=3):
    return [{'W/l0/W': rng.standard_normal((3, 4)).astype(numpy.float32),
             'backward grad/l0/W': rng.standard_normal((3, 4)).astype(numpy.float32),
             'avg_mean/bn': rng.standard_normal(3).astype(numpy.float32) * 1e-3,
             'avg_var/bn': rng.random(3).astype(numpy.float32) + 0.5,
             'loss': numpy.array(rng.random() + 1, numpy.float32),
             'optimizer.t': step + 1} for step in range(steps)]


@pytest.mark.parametrize('seed', range(5))
def test_deviation_is_the_smallest_tolerance_compare_passes(seed):
    rng = numpy.random.default_rng(seed)
    expected = _trace(rng)
    got = [{k: (v + rng.standard_normal(v.shape).astype(v.dtype) * 1e-4
                if isinstance(v, numpy.ndarray) else v) for k, v in state.items()}
           for state in expected]
    ratio, where = harness.deviation(expected, got)
    assert ratio > 0 and where.startswith('step ')
    harness.compare(expected, got, ratio * (1 + 1e-9))
    with pytest.raises(AssertionError, match=where):
        harness.compare(expected, got, ratio * (1 - 1e-6))


def test_deviation_of_equal_traces_is_zero():
    expected = _trace(numpy.random.default_rng(0))
    assert harness.deviation(expected, expected) == (0.0, None)


def test_a_pair_of_tolerances_holds_the_first_step_to_the_first():
    expected = _trace(numpy.random.default_rng(3))
    off = [dict(state) for state in expected]
    largest = harness._largest(expected[0])['W']
    off[0]['W/l0/W'] = expected[0]['W/l0/W'] + numpy.float32(1e-3 * largest)
    with pytest.raises(AssertionError, match='step 0 W/l0/W'):
        harness.compare(expected, off, (1e-4, 1e-2))
    harness.compare(expected, off, (1e-2, 1e-4))       # later steps are equal
    later = [dict(state) for state in expected]
    later[1]['W/l0/W'] = expected[1]['W/l0/W'] + numpy.float32(1e-3 * largest)
    harness.compare(expected, later, (1e-4, 1e-2))
    with pytest.raises(AssertionError, match='step 1 W/l0/W'):
        harness.compare(expected, later, (1e-2, 1e-4))


def test_measure_tolerance_runs_on_the_suites_draws(tmp_path):
    out = tmp_path / 'said.jsonl'
    records = measure_tolerance.measure(False, 12, 3, str(out))
    lines = out.read_text().splitlines() if out.exists() else []
    assert len(lines) == len(records)
    for record in records:
        assert record['draws']['layout'][0]['static_graph'] is True
        assert models.tied(record['draws']['model'])
        assert 0 <= record['deviation'] <= harness.TIED_TOLERANCE[False], record


def test_measure_tolerance_measures_every_onednn_run(tmp_path):
    pytest.importorskip('torch', reason="onednn's kernels come from PyTorch")
    out = tmp_path / 'onednn.jsonl'
    records = measure_tolerance.measure_onednn(6, 3, str(out), twin=True)
    assert len(out.read_text().splitlines()) == len(records) == 6
    for record in records:
        assert any(options.get('onednn') for options in record['draws']['layout'][:2])
        first, later = harness.ONEDNN_TOLERANCE
        assert 0 <= record['first_step'] <= first, record
        assert 0 <= record['deviation'] <= later, record
        # the twins move from the first step: their weights start one unit
        # apart (those made before the first call: not a lazy head's)
        model = record['draws']['model']
        eager = [not model['lazy_head'], model['extra_input'], model['branch'],
                 model['recurrent']] + [layer[0] in ('conv', 'deconv', 'res', 'res_twice', 'bn')
                                        for layer in model['layers']]
        if any(eager):
            assert record['twin_first_step'] > 0, record


def _diverge(trace, step):
    """The trace with its loss and weights overflowed from ``step`` on."""
    out = [dict(state) for state in trace]
    for state in out[step:]:
        state['W/l0/W'] = numpy.full_like(state['W/l0/W'], numpy.inf)
        state['loss'] = numpy.array(numpy.nan, numpy.float32)
    return out


def test_a_tolerance_holds_until_the_trainings_diverge():
    expected = _trace(numpy.random.default_rng(1), steps=4)
    # one overflows a step before the other: past that, not comparable
    harness.compare(_diverge(expected, 3), _diverge(expected, 2), 1e-6)
    assert harness.deviation(_diverge(expected, 3), _diverge(expected, 2)) == (0.0, None)
    # before it, the tolerance holds
    got = _diverge(expected, 2)
    got[1]['backward grad/l0/W'] = got[1]['backward grad/l0/W'] + 1
    with pytest.raises(AssertionError, match='step 1 backward grad/l0/W'):
        harness.compare(_diverge(expected, 3), got, 1e-6)
    # bitwise comparisons are unchanged by it
    with pytest.raises(AssertionError):
        harness.compare(_diverge(expected, 3), _diverge(expected, 2))


def test_a_training_that_diverges_alone_fails():
    expected = _trace(numpy.random.default_rng(2), steps=4)
    with pytest.raises(AssertionError, match="plain Chainer's stayed finite"):
        harness.compare(expected, _diverge(expected, 2), 1e-3)


# The worst runs measured (DEVELOPERS.md, "The tolerance of a run said not
# bitwise"): trainings that diverge, where the first step's one-unit
# difference of order grows most. Each is held to the suite's tolerance, and
# shows why it is as loose as it is.
WORST = {
    False: ({'input': (2, 3, 5, 9), 'layers': (
        ('conv', 3, 3, 1, 1, 1, 1, True), ('conv', 3, 3, 1, 0, 1, 1, False),
        ('conv', 3, 5, 1, 2, 1, 1, True), ('conv', 9, 1, 2, 1, 1, 3, False),
        ('conv', 9, 3, 1, 1, 1, 1, True), ('conv', 9, 3, 1, 0, 1, 1, False),
        ('conv', 9, 5, 1, 2, 1, 1, True)), 'extra_input': False, 'branch': False,
        'lazy_head': False, 'calls': 3, 'recurrent': False, 'tied': 'penalty',
        'counter': False, 'knob': False},
        ({'_tuning': 'chainer', 'cpu_conv': True, 'autotune': False, 'static_graph': True},
         {'fused_update': True}, None), [], ('MomentumSGD', 0.01), 8, 1e-5),
    True: ({'input': (2, 2, 9, 7), 'layers': (
        ('conv', 2, 3, 1, 1, 1, 1, True), ('conv', 2, 3, 1, 0, 1, 1, False),
        ('conv', 2, 5, 1, 2, 1, 1, True), ('conv', 2, 3, 1, 1, 1, 1, True),
        ('conv', 2, 3, 1, 0, 1, 1, False), ('conv', 2, 5, 1, 2, 1, 1, True),
        ('maxpool', 3, 2), ('relu',)), 'extra_input': False, 'branch': False,
        'lazy_head': False, 'calls': 1, 'recurrent': False, 'tied': 'penalty',
        'counter': False, 'knob': 'config'},
        ({'_tuning': 'measure', 'fused_update': False, 'static_graph': True},
         {'nvtx': False}, None), [('WeightDecay', 0.0001)], ('SGD', 0.1), 7, 1e-2),
}


@pytest.mark.parametrize('fp16', [False, True], ids=['float32', 'fp16'])
def test_the_worst_measured_run_is_within_the_tolerance(fp16, monkeypatch):
    monkeypatch.setattr(harness, '_events', lambda model, optimizer: None)
    spec, layout, hooks, optimizer, steps, at_least = WORST[fp16]
    scales, said = [], []
    got = harness.run(spec, optimizer, hooks, steps, layout=layout, fp16=fp16,
                      loop='own_unscaled', scales=scales, said=said)
    expected = harness.run(spec, optimizer, hooks, steps, fp16=fp16, loop='own_unscaled',
                           scales=scales)
    assert said
    ratio, where = harness.deviation(expected, got)
    assert at_least < ratio, (ratio, where)
    harness.compare(expected, got, harness.TIED_TOLERANCE[fp16])


# The worst onednn run measured (DEVELOPERS.md, "oneDNN kernels"): a training
# that does not diverge, whose LSTM carries the kernels' rounding from step to
# step (its input weight's gradient 3e-7 of the largest gradient off at the
# first step, 1.5e-4 at the sixth here; the suite's tolerance was 1e-4).
WORST_ONEDNN = ({'input': (3, 4, 9, 11), 'layers': (
    ('maxpool', 2, 2), ('conv', 4, 3, 1, 1, 1, 1, True), ('conv', 4, 3, 1, 0, 1, 1, False),
    ('conv', 4, 5, 1, 2, 1, 1, True), ('conv', 4, 3, 1, 1, 1, 1, True),
    ('conv', 4, 3, 1, 0, 1, 1, False), ('conv', 4, 5, 1, 2, 1, 1, True)),
    'extra_input': True, 'branch': True, 'lazy_head': False, 'calls': 2, 'recurrent': True,
    'tied': 'penalty', 'counter': False, 'knob': False},
    ({'_tuning': 'chainer', 'fused_update': False, 'timeline': False},
     {'static_graph': False, 'cpu_conv': False, 'nvtx': True, 'onednn': True}, None),
    [], ('SGD', 0.1), 8)


def _onednn_traces(case, monkeypatch):
    """(plain Chainer's trace, the onednn run's) of a pinned case."""
    pytest.importorskip('torch', reason="onednn's kernels come from PyTorch")
    monkeypatch.setattr(harness, '_events', lambda model, optimizer: None)
    spec, layout, hooks, optimizer, steps = case
    return (harness.run(spec, optimizer, hooks, steps),
            harness.run(spec, optimizer, hooks, steps, layout=layout))


def test_the_worst_measured_onednn_run_is_within_the_tolerance(monkeypatch):
    expected, got = _onednn_traces(WORST_ONEDNN, monkeypatch)
    first = harness.deviation(expected[:1], got[:1])[0]
    ratio, where = harness.deviation(expected, got)
    # the exact figures depend on the BLAS and oneDNN's code path for this
    # CPU: asserted only that the difference grows from step to step
    assert 0 < first and 10 * first < ratio, (first, ratio, where)
    harness.compare(expected, got, harness.ONEDNN_TOLERANCE)


# The worst first step measured: nine convolutions feeding an L.LSTM, whose
# input weight's gradient was 2.3e-5 of the largest gradient at step 0
# (make test-differential seed 3948077197, 2026-11-27; the first-step
# tolerance was 2e-5 then).
WORST_FIRST_ONEDNN = ({'input': (4, 4, 10, 9), 'layers': (
    ('conv', 4, 3, 1, 1, 1, 1, True), ('conv', 4, 3, 1, 0, 1, 1, False),
    ('conv', 4, 5, 1, 2, 1, 1, True)) * 3 + (('relu',),),
    'extra_input': False, 'branch': True, 'lazy_head': False, 'calls': 1, 'recurrent': True,
    'tied': None, 'counter': True, 'knob': 'attribute'},
    ({'onednn': True, '_tuning': 'measure'}, {}, None), [], ('SGD', 0.01), 2)


# A training that diverges (its loss 4.4, then 0.65, 0.01, 11.7, 29.6, 8,210,
# 2.5e18) with every kernel rounding otherwise: its loss 5.4e-4 off at the last
# step (make test-differential seed 3948077197, run again after the first-step
# tolerance was widened; the later steps' was 5e-4 then).
DIVERGING_ONEDNN = ({'input': (2, 3, 8, 7), 'layers': (
    ('conv', 3, 3, 1, 1, 1, 1, True), ('conv', 3, 3, 1, 0, 1, 1, False),
    ('conv', 3, 5, 1, 2, 1, 1, True)) * 2,
    'extra_input': False, 'branch': False, 'lazy_head': True, 'calls': 1, 'recurrent': False,
    'tied': 'tie', 'counter': False, 'knob': False},
    ({'onednn': True, '_tuning': 'measure'}, {}, None), [('WeightDecay', 0.01)], ('SGD', 0.1), 7)


def test_a_diverging_onednn_run_is_within_the_tolerance(monkeypatch):
    expected, got = _onednn_traces(DIVERGING_ONEDNN, monkeypatch)
    assert float(expected[-1]['loss']) > 1e15 * float(expected[0]['loss'])     # it diverges
    harness.compare(expected, got, harness.ONEDNN_TOLERANCE)


def test_the_worst_measured_onednn_first_step_is_within_the_tolerance(monkeypatch):
    expected, got = _onednn_traces(WORST_FIRST_ONEDNN, monkeypatch)
    assert 0 < harness.deviation(expected[:1], got[:1])[0]     # not bitwise: a real case
    harness.compare(expected, got, harness.ONEDNN_TOLERANCE)


def _twin_traces(case, monkeypatch):
    """(plain Chainer's trace, the onednn run's, the twins') of a pinned case."""
    expected, got = _onednn_traces(case, monkeypatch)
    spec, layout, hooks, optimizer, steps = case
    twins = [harness.run(spec, optimizer, hooks, steps, twin=seed)
             for seed in range(harness.TWINS)]
    return expected, got, twins


# A training that magnifies rounding without diverging: deconvolutions and
# convolutions (weights of N(0, 0.3), no nonlinearity) feed an L.LSTM inputs
# of 170 at the third step, saturating its gates; every gradient there is
# about 1e-3 of the largest apart between any two kernels that round
# differently. Found by CI (2026-11-30): onednn 2.9e-3 off at step 2, over the
# fixed 2e-3.
SATURATED_ONEDNN = ({'input': (3, 3, 5, 6), 'layers': (
    ('deconv', 3, 1, 2, 0, 1, 3, False), ('deconv', 9, 1, 1, 1, 1, 3, True)) + (
    ('conv', 9, 3, 1, 1, 1, 1, True), ('conv', 9, 3, 1, 0, 1, 1, False),
    ('conv', 9, 5, 1, 2, 1, 1, True)) * 2,
    'extra_input': False, 'branch': True, 'lazy_head': False, 'calls': 1, 'recurrent': True,
    'tied': None, 'counter': True, 'knob': 'attribute'},
    ({'onednn': True, '_tuning': 'measure'}, {}, None), [], ('SGD', 0.01), 3)


@pytest.fixture(scope='module')
def saturated():
    """SATURATED_ONEDNN's traces (plain, onednn, the twins)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _twin_traces(SATURATED_ONEDNN, monkeypatch)


def test_a_training_that_magnifies_rounding_is_held_to_its_twins(saturated):
    expected, got, twins = saturated
    asked = []
    harness.compare_or_twin(expected, got, harness.ONEDNN_TOLERANCE,
                            lambda seed: asked.append(seed) or twins[seed])
    try:
        harness.compare(expected, got, harness.ONEDNN_TOLERANCE)
    except harness.OutsideTolerance:
        assert asked == list(range(harness.TWINS))
    else:
        assert not asked
        pytest.skip("this CPU's kernels round the case within the fixed tolerance: the twins "
                    'were not reached (measured 2.9e-3 against 2e-3 on an AMD EPYC)')


def _mutated(trace, step, key, value):
    out = [dict(state) for state in trace]
    out[step][key] = value
    return out


def test_the_twins_do_not_excuse_a_wrong_gradient_or_a_lost_update(saturated):
    expected, got, twins = saturated
    tolerance = harness.ONEDNN_TOLERANCE

    def fails(trace, where):
        with pytest.raises(harness.OutsideTolerance) as e:
            harness.compare_or_twin(expected, trace, tolerance, lambda seed: twins[seed])
        said = 'nor within {} times the most {} twin runs moved it'.format(
            harness.TWIN_FACTOR, harness.TWINS)
        assert said in str(e.value)
        assert str(e.value).split(said)[1].split(': ')[1].startswith(where), str(e.value)

    # a gradient 1% off at the first step
    key = 'backward grad/l4/W'
    fails(_mutated(got, 0, key, got[0][key] * numpy.float32(1.01)), 'step 0 ' + key)
    # 5% off at the third, where the largest gradients are 2.9e-3 apart (3%
    # fails too on an AMD EPYC), or, where a machine's kernels magnify the
    # twins' one unit more, twice what they allow: one AMD EPYC (AVX-512,
    # 2026-12-02) moved this gradient by up to 2.3% of its largest value in
    # the twins, an allowance of 11%, which excuses 5% by design
    key = 'backward grad/rec/upward/W'
    allowance = harness.twin_allowance(expected, twins)[2][key]
    off = max(0.05, 2 * float(allowance.max()) / float(numpy.abs(got[2][key]).max()))
    # a ceiling: twins excusing errors of a third of the largest value would
    # excuse a wrong gradient (measured 0.23 on the EPYC above, 0.05 elsewhere)
    assert off <= 0.3, "the twins' allowance is {:.0%} of the largest gradient".format(off / 2)
    fails(_mutated(got, 2, key, got[2][key] * numpy.float32(1 + off)), 'step 2 ' + key)
    # and as far off only in the elements the twins moved least (to the
    # floor: a tenth of their largest move)
    quiet = allowance <= harness.TWIN_FLOOR * allowance.max() * (1 + 1e-9)
    assert quiet.mean() > 0.5
    fails(_mutated(got, 2, key, numpy.where(quiet, got[2][key] * numpy.float32(1 + off),
                                            got[2][key]).astype(numpy.float32)),
          'step 2 ' + key)
    # a parameter's update lost at the third step: each that moves more than
    # the fixed tolerance allows
    largest = harness._largest(expected[2])['W']
    moved = [key for key in expected[2] if key.startswith('W/') and harness._difference(
        expected[2][key], expected[1][key]) > tolerance[1] * largest]
    assert len(moved) > 5
    for key in moved:
        fails(_mutated(got, 2, key, got[1][key]), 'step 2 ' + key)


def test_the_twins_are_asked_for_only_where_a_value_is_outside_the_tolerance():
    expected = _trace(numpy.random.default_rng(4))
    asked = []
    harness.compare_or_twin(expected, expected, (1e-4, 2e-3), asked.append)
    # a key missing, an exact value that differs (also behind a weight outside
    # the tolerance at an earlier key), a shape: not rounding
    later = _mutated(expected, 1, 'optimizer.t', 7)
    later[1]['W/l0/W'] = later[1]['W/l0/W'] + 1
    for bad in (_mutated(expected, 1, 'optimizer.t', 7), later, [
            {k: v for k, v in state.items() if k != 'loss'} for state in expected],
            _mutated(expected, 2, 'W/l0/W', expected[2]['W/l0/W'][:2])):
        with pytest.raises(AssertionError) as e:
            harness.compare_or_twin(expected, bad, (1e-4, 2e-3), asked.append)
        assert not isinstance(e.value, harness.OutsideTolerance)
    assert not asked


def test_twin_allowance_is_the_factor_times_the_most_a_twin_moved_each_element():
    expected = _trace(numpy.random.default_rng(5))
    key, other = 'W/l0/W', 'backward grad/l0/W'
    twins = []
    for moved in (1e-3, 4e-3, 2e-3, numpy.inf, 5e-3):
        twin = [dict(state) for state in expected]
        twin[1][key] = expected[1][key].copy()
        twin[1][key][0, 0] += numpy.float32(moved)      # one element only
        twins.append(twin)
    allowance = harness.twin_allowance(expected, twins)
    assert len(allowance) == len(expected)
    # the infinite move counts as none: the largest of 1, 4, 2, 0, 5 (e-3)
    assert allowance[1][key][0, 0] == pytest.approx(harness.TWIN_FACTOR * 5e-3, rel=1e-3)
    # the other elements: the floor, a tenth of the array's largest move
    assert allowance[1][key].ravel()[1:] == pytest.approx(
        harness.TWIN_FLOOR * harness.TWIN_FACTOR * 5e-3, rel=1e-3)
    assert not allowance[1][other].any() and not allowance[0][key].any()
    # it widens only that element, at that step
    got = [dict(state) for state in expected]
    got[1][key] = expected[1][key].copy()
    got[1][key][0, 0] += numpy.float32(0.9 * harness.TWIN_FACTOR * 5e-3)
    harness.compare(expected, got, 0.0, allowance)
    got[1][key][0, 1] += numpy.float32(2 * harness.TWIN_FLOOR * harness.TWIN_FACTOR * 5e-3)
    with pytest.raises(harness.OutsideTolerance, match=r'step 1 {}: 1 of 12 elements.*\(0, 1\)'
                       .format(key)):
        harness.compare(expected, got, 0.0, allowance)
    for step, name in ((1, other), (2, key)):
        wrong = _mutated(expected, step, name, expected[step][name] + numpy.float32(1e-4))
        with pytest.raises(harness.OutsideTolerance, match='step {} {}'.format(step, name)):
            harness.compare(expected, wrong, 0.0, allowance)


def test_a_twin_that_diverged_or_overflowed_widens_nothing_where_it_did():
    expected = _trace(numpy.random.default_rng(6))
    diverged = _diverge(expected, 1)
    for state in diverged[1:]:          # after it, a gradient moved, finite
        state['backward grad/l0/W'] = state['backward grad/l0/W'] + 1
    overflowed = [dict(state) for state in expected]
    overflowed[1]['backward grad/l0/W'] = numpy.full_like(
        expected[1]['backward grad/l0/W'], numpy.inf)     # not a kind that says diverged
    for twin in (diverged, overflowed):
        allowance = harness.twin_allowance(expected, [twin] * harness.TWINS)
        assert not any(width.any() for widths in allowance for width in widths.values())


def test_a_twin_moves_float32_weights_only():
    with pytest.raises(AssertionError, match='float32'):
        harness.run(SATURATED_ONEDNN[0], ('SGD', 0.01), [], 1, fp16=True, twin=0)


def test_the_twin_starts_one_unit_in_the_last_place_apart():
    spec = SATURATED_ONEDNN[0]
    numpy.random.seed(0)
    model = harness.build(spec)
    numpy.random.seed(0)
    nudged = harness.build(spec)
    rng = numpy.random.get_state()
    harness.nudge(nudged, 0)
    assert numpy.random.get_state()[2] == rng[2]
    assert (numpy.random.get_state()[1] == rng[1]).all()      # the global generator untouched
    ups = 0
    for (name, a), (_, b) in zip(sorted(model.namedparams()), sorted(nudged.namedparams())):
        a, b = a.array, b.array
        assert ((a == 0) == (b == 0)).all(), name
        nonzero = a != 0
        steps = numpy.abs(b.view(numpy.int32).astype(numpy.int64)
                          - a.view(numpy.int32).astype(numpy.int64))
        assert (steps[nonzero] == 1).all(), name
        ups += int((b > a).sum())
    total = sum(int((p.array != 0).sum()) for p in model.params())
    assert 0.4 * total < ups < 0.6 * total        # up or down at random
    numpy.random.seed(0)
    again = harness.build(spec)
    harness.nudge(again, 1)         # another seed, other signs
    assert any((p.array != q.array).any() for p, q in zip(nudged.params(), again.params()))
