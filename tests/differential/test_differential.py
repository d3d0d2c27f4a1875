"""The same training, faster: fastchain against plain Chainer on random
models, option sets (split over two handles, one disabled at a random
step), optimizers with hooks, ``optimizer.update(lossfun)`` or a script's own
loop, and a snapshot and resume at a random step.

Budget: ``FASTCHAIN_DIFFERENTIAL_EXAMPLES`` examples (default 30, what
``make test`` runs); ``make test-differential`` runs 2,000 and prints the
seed to repeat a failure with (``make test-differential SEED=...``).
"""

import os

import pytest
from hypothesis import HealthCheck, assume, event, given, settings, strategies as st

from tests.differential import harness, models
from tests.differential.models import HOOKS, OPTIMIZERS, SGD_FAMILY, model_specs

EXAMPLES = int(os.environ.get('FASTCHAIN_DIFFERENTIAL_EXAMPLES', 30))
OPTIONS = ('static_graph', 'cpu_conv', 'fused_update', 'nvtx', 'timeline', 'autotune')


def optimizer_for(tied):
    """The optimizers a run is drawn from. A tied run (harness.TIED_TOLERANCE)
    is held to a tolerance, which a step proportional to the gradient keeps,
    so SGD and MomentumSGD only: Adam divides each element's step by its own
    gradient's size, and a gradient that is zero in exact arithmetic (a
    convolution's bias before BatchNormalization) is rounding noise of either
    sign that it turns into a full step (measured: a bias's gradient 1.5e-8
    against 0.0, its weight 2.9e-4 off after 3 steps with Adam(0.01))."""
    return SGD_FAMILY if tied else OPTIMIZERS


@st.composite
def layouts(draw, steps):
    """Two handles' options, and when the second is disabled."""
    values = {'static_graph': st.booleans(), 'cpu_conv': st.booleans(),
              'fused_update': st.booleans(), 'nvtx': st.sampled_from([True, False, 'links']),
              'timeline': st.booleans(), 'autotune': st.booleans()}
    handles = ({}, {})
    # autotune (on unless a handle says False): measuring, or one side of
    # every choice forced (harness.FORCED).
    handles[0]['_tuning'] = draw(st.sampled_from(['measure', 'chainer', 'fastchain']))
    for name in OPTIONS:
        where = draw(st.sampled_from([None, 0, 1]))
        if where is not None:
            handles[where][name] = draw(values[name])
    for options in handles:
        if options.get('nvtx') is False:
            options.pop('timeline', None)
    disable_at = draw(st.one_of(st.none(), st.integers(1, steps - 1)))
    return handles[0], handles[1], disable_at


def draw_loop(data, steps, fp16):
    """(the step to snapshot and resume at or None, the training loop, the
    loss scaler's growth interval) of a run of ``steps`` steps."""
    resume_at = data.draw(st.one_of(st.none(), st.integers(1, steps - 1)), 'resume_at')
    return (resume_at,) + draw_training_loop(data, fp16)


def draw_training_loop(data, fp16):
    """(the training loop, the loss scaler's growth interval)."""
    loop = data.draw(st.sampled_from(['update', 'own', 'own_unscaled']), 'loop')
    # fp16: the loss scale kept, or doubled every 1 or 3 steps (plain Chainer
    # follows the scale fastchain's scaler used at each step)
    growth_interval = data.draw(st.sampled_from([10 ** 9, 1, 3]), 'growth_interval') \
        if fp16 else 10 ** 9
    return loop, growth_interval


def unloadable(error, spec, optimizer, hooks, steps, resume_at, loop, **kwargs):
    """A snapshot Chainer itself cannot load (a rule's state is made on its
    parameter's first update: a lazy head a data branch has not reached yet
    has none saved, and loading asks for it): plain Chainer must fail on it
    the same way (else the KeyError is fastchain's); the example then says
    nothing more."""
    with pytest.raises(KeyError) as plain:
        harness.run(spec, optimizer, hooks, steps, resume_at=resume_at, loop=loop, **kwargs)
    assert str(plain.value) == str(error)
    assume(False)


@settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_fastchain_trains_as_plain_chainer(data):
    spec = data.draw(model_specs(allow_calls=True), 'model')
    fp16 = data.draw(st.booleans(), 'fp16')
    hooks = data.draw(HOOKS, 'hooks')
    # up to 8: the static cache's choice starts after its build and 2 verified
    # replays (after a step that makes a lazily sized head's weights define-by-run)
    steps = data.draw(st.integers(2, 8), 'steps')
    layout = data.draw(layouts(steps), 'layout')
    tied = models.tied(spec) and any(options.get('static_graph') for options in layout[:2])
    optimizer = data.draw(optimizer_for(tied), 'optimizer')
    resume_at, loop, growth_interval = draw_loop(data, steps, fp16)
    scales, said = [], []
    try:
        got = harness.run(spec, optimizer, hooks, steps, layout=layout, fp16=fp16,
                          resume_at=resume_at, loop=loop, growth_interval=growth_interval,
                          scales=scales, said=said)
    except harness.Skipped:
        assume(False)
    except KeyError as e:
        unloadable(e, spec, optimizer, hooks, steps, resume_at, loop, fp16=fp16,
                   scales=scales)
        raise       # (unloadable rejects the example or fails)
    if len(set(scales)) > 1:
        event('fp16: the loss scale grew')
    expected = harness.run(spec, optimizer, hooks, steps, fp16=fp16, loop=loop,
                           scales=scales)
    if tied:
        event('static_graph with a parameter also used outside the call')
    if spec['counter'] and any(options.get('static_graph') for options in layout[:2]):
        event('static_graph on a model that counts its calls in Python')
    if any(layer[0] == 'res_twice' for layer in spec['layers']) and \
            any(options.get('static_graph') for options in layout[:2]):
        event('static_graph on a model that applies a link twice inside the call')
    if spec['knob'] and any(options.get('static_graph') for options in layout[:2]):
        event('static_graph on a model whose value the loop sets between steps')
    # Held to the tolerance only where the cache said so (StaticGraphOrder:
    # three or more gradient terms, some from outside the call); a tied run it
    # is quiet about (the head's weight used once more: two terms) is bitwise.
    assert tied or not said, 'StaticGraphOrder said on a model with no outside use'
    if said:
        event('static_graph: said the gradients are summed in another order')
    harness.compare(expected, got, harness.TIED_TOLERANCE[fp16] if said else None)


@settings(max_examples=max(1, EXAMPLES // 3), deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_replayed_schedules_train_as_plain_chainer(data):
    """static_graph on, on models the cache keeps (no dropout, call counts,
    outside uses, knobs or branches: the main test's draws reach a replay in
    about one run in sixteen), its schedules bound to fastchain's kernels or
    left to Chainer's: bitwise plain Chainer's training. What a replay gets
    wrong only on some models (two convolutions sharing a padded buffer with
    different paddings, ``make mutation-check``) is reached here far more
    often than there."""
    spec = data.draw(model_specs(allow_dropout=False, allow_branch=False), 'model')
    fp16 = data.draw(st.booleans(), 'fp16')
    hooks = data.draw(HOOKS, 'hooks')
    optimizer = data.draw(OPTIMIZERS, 'optimizer')
    # 4 or more: the build, then verified replays (after a step that makes a
    # lazily sized head's weights define-by-run)
    steps = data.draw(st.integers(4, 8), 'steps')
    options = data.draw(st.fixed_dictionaries(
        {'static_graph': st.just(True)},
        optional={'cpu_conv': st.booleans(), 'fused_update': st.booleans(),
                  'nvtx': st.booleans()}), 'options')
    # measuring, or the cached schedule and fastchain's kernels forced
    options['_tuning'] = data.draw(st.sampled_from(['measure', 'fastchain']), 'tuning')
    loop, growth_interval = draw_training_loop(data, fp16)
    scales = []
    try:
        got = harness.run(spec, optimizer, hooks, steps, layout=(options, {}, None),
                          fp16=fp16, loop=loop, growth_interval=growth_interval,
                          scales=scales)
    except harness.Skipped:
        assume(False)
    expected = harness.run(spec, optimizer, hooks, steps, fp16=fp16, loop=loop,
                           scales=scales)
    harness.compare(expected, got)


@settings(max_examples=max(1, EXAMPLES // 3), deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_a_plain_script_with_the_loader_trains_as_plain_chainer(data):
    """The loader replaces the script's SerialIterator: the same batches, in
    the same order, drawn at the same points of NumPy's global RNG."""
    spec = data.draw(model_specs(max_layers=3, allow_branch=False, allow_calls=True), 'model')
    hooks = data.draw(HOOKS, 'hooks')
    options = data.draw(st.fixed_dictionaries(
        # None: the default count, which autotune chooses among (harness.run_script
        # then gives a dataset that is not in memory, for which workers are used).
        {'loader_workers': st.sampled_from([1, 2, None])},
        optional={'prefetch_to_device': st.booleans(), 'static_graph': st.booleans(),
                  'cpu_conv': st.booleans(), 'fused_update': st.booleans(),
                  'nvtx': st.booleans()}), 'options')
    options['_tuning'] = data.draw(st.sampled_from(['measure', 'chainer', 'fastchain']),
                                   'tuning')
    tied = models.tied(spec) and options.get('static_graph')
    optimizer = data.draw(optimizer_for(tied), 'optimizer')
    iterations = data.draw(st.integers(1, 9), 'iterations')     # into the 4th epoch
    shuffle = data.draw(st.booleans(), 'shuffle')
    expected, rand = harness.run_script(spec, optimizer, hooks, iterations, shuffle)
    said = []
    got, rand_after = harness.run_script(spec, optimizer, hooks, iterations, shuffle,
                                         options, said=said)
    assert tied or not said, 'StaticGraphOrder said on a model with no outside use'
    harness.compare([expected], [got], harness.TIED_TOLERANCE[False] if said else None)
    assert rand_after == rand


@settings(max_examples=max(1, EXAMPLES // 2), deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_onednn_trains_within_its_stated_tolerance_of_plain_chainer(data):
    """enable(onednn=True) allows kernels that are not bitwise equal: the
    run stays within harness.ONEDNN_TOLERANCE of plain Chainer's (or, for a
    model that magnifies rounding past it, each value within five times the
    most plain Chainer's own run moves it when its initial weights move one
    unit in the last place: compare_or_twin), whatever
    else is on, whichever alternatives autotune takes for the calls oneDNN
    leaves (measuring, or forced to either side), with onednn in either handle
    (the second one disabled at a random step)."""
    pytest.importorskip('torch', reason="onednn's kernels come from PyTorch")
    draws = draw_onednn(data)
    expected, got = run_onednn(*draws)
    harness.compare_or_twin(expected, got, harness.ONEDNN_TOLERANCE,
                            lambda seed: run_onednn_twin(*draws, seed=seed))


def run_onednn(spec, hooks, optimizer, steps, layout, resume_at, loop):
    """(plain Chainer's trace, the onednn run's) of ``draw_onednn``'s draws;
    shared with measure_tolerance --onednn."""
    try:
        got = harness.run(spec, optimizer, hooks, steps, layout=layout,
                          resume_at=resume_at, loop=loop)
    except KeyError as e:
        unloadable(e, spec, optimizer, hooks, steps, resume_at, loop)
        raise       # (unloadable rejects the example or fails)
    return harness.run(spec, optimizer, hooks, steps, loop=loop), got


def run_onednn_twin(spec, hooks, optimizer, steps, layout, resume_at, loop, seed):
    """Plain Chainer's trace of ``draw_onednn``'s draws, its initial weights
    moved one unit in the last place as ``seed`` draws (``harness.compare_or_twin``)."""
    return harness.run(spec, optimizer, hooks, steps, loop=loop, twin=seed)


def draw_onednn(data):
    """An onednn run's draws: (model, hooks, optimizer, steps, layout,
    resume_at, loop); shared with measure_tolerance --onednn."""
    spec = data.draw(model_specs(allow_calls=True), 'model')
    hooks = data.draw(HOOKS, 'hooks')
    # Not Adam: its per-element normalisation turns rounding noise in a
    # gradient that is zero in exact arithmetic (a convolution's bias before
    # BatchNormalization) into a full step.
    optimizer = data.draw(SGD_FAMILY, 'optimizer')
    steps = data.draw(st.integers(2, 8), 'steps')
    first, second, disable_at = data.draw(layouts(steps), 'layout')
    (first, second)[data.draw(st.sampled_from([0, 1]), 'onednn in')]['onednn'] = True
    first['_tuning'] = data.draw(st.sampled_from(['measure', 'chainer', 'fastchain']),
                                 'tuning')
    resume_at = data.draw(st.one_of(st.none(), st.integers(1, steps - 1)), 'resume_at')
    loop = data.draw(st.sampled_from(['update', 'own']), 'loop')
    return spec, hooks, optimizer, steps, (first, second, disable_at), resume_at, loop
