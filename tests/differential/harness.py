"""Train one model twice, plain Chainer and with fastchain, and compare.

What is compared after every step: the loss, every parameter's gradient and
value, BatchNormalization's running statistics, and the optimizer's state
(each rule's ``t`` and state arrays, fp32 master weights, ``optimizer.t``).

fastchain claims (README, "The same training"):
- bitwise equality with plain Chainer on the CPU in fp32 for static_graph,
  cpu_conv, fused_update, nvtx and timeline, in any combination and any
  enable/disable order, across a snapshot and resume, with autotune
  measuring (its alternatives taking turns) or forced to either side of
  every choice it makes;
- with fp16, bitwise equality with Chainer's own fp16 training (mixed16,
  fp32 master weights) at the loss scale fastchain's scaler used at each step
  (from FP16_SCALE, or FP16_HOOKS_SCALE with optimizer hooks, kept or grown
  every ``growth_interval`` steps); with hooks, the reference script unscales
  the gradients into fp32 before the hooks run and gives them the fp32
  master weights (unscale_before_hooks): what fastchain does for every fp16
  script, so that the hooks see true gradients and the weights the update
  uses (under Chainer's own loss scaling, GradientClipping would clip the
  scaled ones; WeightDecay scales its rate to match, in fp16).
"""

import contextlib
import io
import os
import tempfile
import warnings
import zlib

import numpy

import chainer
import chainer.links as L
from chainer import serializers

import fastchain
from fastchain.precision import scaler_of
from fastchain.tune import _tuner

from tests.differential.models import batches, build, loss_of, make_optimizer

SEED = 1234
FP16_SCALE = 8.0                # the static scale both fp16 runs use
FP16_HOOKS_SCALE = 1024.0       # the static scale both use with optimizer hooks


class Skipped(Exception):
    """fastchain skipped a step on overflow (Chainer would apply inf/NaN):
    the two runs legitimately part; the example says nothing."""


def capture_gradients(optimizer, step):
    """Copy every gradient as backward left it (the first
    ``reallocate_cleared_grads`` of an update; loss-scaled if backward was) into
    ``step['grads']``: a user's own instance patch, put over fastchain's
    layers."""
    inner = optimizer.reallocate_cleared_grads

    def reallocate_cleared_grads():
        if step.get('grads') is None:
            step['grads'] = {name: None if p.grad is None else p.grad.copy()
                             for name, p in optimizer.target.namedparams()}
        return inner()
    optimizer.reallocate_cleared_grads = reallocate_cleared_grads


def unscale_before_hooks(optimizer):
    """The reference for fp16 with optimizer hooks: a plain Chainer script
    that unscales its gradients before the hooks (as PyTorch's
    ``GradScaler.unscale_`` before clipping), with the arithmetic Chainer's
    UpdateRule would apply later (an fp16 gradient: ``astype(float32)``, then
    ``/= scale``; an fp32 one: ``/= scale`` in place), by the scale the
    script's backward was seeded with (``optimizer._loss_scale``; set to None
    for a plain ``backward()``), every gradient alike (one the backward did
    not reach too: Chainer's ``reallocate_cleared_grads`` gave it zeros), and
    gives the fp16 parameters their own gradients back after the update.
    A per-parameter 'pre' hook is given, for each fp16 parameter given an
    fp32 gradient, its fp32 master weight (made from the fp16 weight where
    the rule has none yet, as its update would) holding that gradient, so it
    sees a weight and a gradient of one dtype (a weight decay adds rate
    times the master). A parameter two links hold is unscaled once.
    Instance patches of Chainer's own template methods."""
    check, update_loss_scale = optimizer.check_nan_in_grads, optimizer.update_loss_scale
    call_hooks, call_hook = optimizer.call_hooks, optimizer.call_hook
    kept = []
    phase = {'pre': False}

    def unscaling_check():
        scale = optimizer._loss_scale
        unique = {id(p): p for p in optimizer.target.params()}
        for param in unique.values():
            param._loss_scale = None        # the rule must not divide again
            if param.grad is None or scale is None:
                continue
            if param.grad.dtype == numpy.float16:
                unscaled = param.grad.astype(numpy.float32)
                unscaled /= scale
                kept.append((param, param.grad))
                param._set_grad_without_check(unscaled)
            else:
                param.grad /= scale
        return check()

    def hooks_on_masters(timing='pre'):
        phase['pre'] = timing == 'pre'
        try:
            return call_hooks(timing)
        finally:
            phase['pre'] = False

    def per_parameter_on_masters(hook):
        if not phase['pre'] or not getattr(hook, 'call_for_each_param', False):
            return call_hook(hook)
        fp32_grads = {id(param) for param, _ in kept}

        def on_master(rule, param):
            if id(param) not in fp32_grads:
                return hook(rule, param)
            if rule._fp32_param is None:
                rule._fp32_param = chainer.Parameter(param.array.astype(numpy.float32),
                                                     name=param.name)
            master = rule._fp32_param
            master.grad = param.grad
            hook(rule, master)
            param._set_grad_without_check(master.grad)
            master.grad = None
        on_master.call_for_each_param = True
        return call_hook(on_master)

    def giving_back():
        for param, grad in kept:
            param._set_grad_without_check(grad)
        kept.clear()
        return update_loss_scale()
    optimizer.check_nan_in_grads = unscaling_check
    optimizer.update_loss_scale = giving_back
    optimizer.call_hooks = hooks_on_masters
    optimizer.call_hook = per_parameter_on_masters


def state(model, optimizer, loss, grads):
    """Everything compared after a step, as {key: array or number}:
    ``grads`` as backward left them, and each parameter's ``.grad`` after
    the update."""
    # NumPy's global generator: where it stands decides later draws (a
    # script's shuffling, dropout's masks)
    key, position = numpy.random.get_state()[1:3]
    s = {'loss': numpy.array(loss, copy=True), 'optimizer.t': optimizer.t,
         'numpy random state': (zlib.crc32(key.tobytes()), position)}
    for name, p in model.namedparams():
        s['W' + name] = None if p.array is None else p.array.copy()  # not made yet
        if grads is not None:
            s['backward grad' + name] = grads[name]
        s['grad' + name] = None if p.grad is None else p.grad.copy()
        rule = p.update_rule
        if rule is None:
            continue
        s['t' + name] = rule.t
        for key, value in sorted((rule.state or {}).items()):
            s['state{}/{}'.format(name, key)] = value.copy()
        if rule._fp32_param is not None:
            s['master' + name] = rule._fp32_param.array.copy()
    for path, link in model.namedlinks():
        if isinstance(link, L.BatchNormalization):
            s['avg_mean' + path] = link.avg_mean.copy()
            s['avg_var' + path] = link.avg_var.copy()
            s['N' + path] = link.N
    return s


@contextlib.contextmanager
def handles(layout, folder):
    """Enable the layout's handles (options..., disable_at); yield (handles,
    disable_at)."""
    if layout is None:
        yield [], None
        return
    *options_list, disable_at = layout
    made = []
    tuning = options_list[0].get('_tuning', 'measure') if options_list else 'measure'
    options_list = [{k: v for k, v in o.items() if k != '_tuning'} for o in options_list]
    # autotune: each run measures afresh (else the choices of an earlier
    # example would be made already), after one timed call of each
    # alternative, or forced to one side of every choice.
    _tuner.forget()
    _tuner.forced.clear()
    _tuner.forced.update(FORCED.get(tuning, {}))
    from fastchain.kernels import _onednn
    _onednn.calls.clear()       # what this run's oneDNN kernels did (events)
    from fastchain.tune import _steps
    trials, step_trials = _tuner.TRIALS, _steps.TRIALS
    _tuner.TRIALS = _steps.TRIALS = 1     # the check of the picks starts within the steps
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            for i, options in enumerate(options_list):
                options = dict({'loader_workers': 0}, **options)   # no updater here
                if options.get('timeline'):
                    options['timeline'] = os.path.join(folder, 'trace{}.json'.format(i))
                else:
                    options.pop('timeline', None)
                made.append(fastchain.enable(**options))
        yield made, disable_at
    finally:
        for h in reversed(made):
            h.disable()
        _tuner.TRIALS, _steps.TRIALS = trials, step_trials
        _tuner.forced.clear()
        _tuner.forget()


# Every alternative the autotuner may pick, forced (tests/differential draws one).
FORCED = {
    'chainer': {'cpu_conv': 'chainer', 'cpu_conv_bound': 'chainer',
                'fused_update': 'chainer', 'static_graph': 'define-by-run',
                'loader_workers': '1', 'loader_prefetch': '1'},
    'fastchain': {'cpu_conv': 'fastchain', 'cpu_conv_bound': 'fastchain',
                  'fused_update': 'fused', 'static_graph': 'cached',
                  'loader_workers': '2', 'loader_prefetch': '2'},
}
# onednn: (the first step, the later ones), of the largest value of the same
# kind. Kernels that round differently: a few units of rounding at the first
# step, a difference that grows as the trainings drift apart, most where an
# LSTM carries it from step to step. Set from ``python -m
# tests.differential.measure_tolerance --onednn`` (DEVELOPERS.md, "oneDNN
# kernels"): over 6,000 runs, the first step at most 3.4e-6, later steps
# 1.5e-4 (test_harness.WORST_ONEDNN; 7.4e-5 the next). Before: 1e-4 for every
# step, from 1,000 examples whose worst was 3.2e-5. The first step's was 2e-5
# until make test-differential (seed 3948077197) met 2.3e-5 there: nine
# convolutions feeding an L.LSTM (test_harness.WORST_FIRST_ONEDNN). The later
# steps' was 5e-4 until the same seed, run again, met 5.4e-4 in the loss of a
# training going from 4.4 to 8,210 to 2.5e18 (test_harness.DIVERGING_ONEDNN):
# every kernel rounds otherwise, and a diverging training magnifies it.
# Where a model magnifies rounding more than that without diverging (an L.LSTM
# saturated by inputs of 170: test_harness.SATURATED_ONEDNN), the test holds
# the run to plain Chainer's own twin instead (compare_or_twin).
ONEDNN_TOLERANCE = (1e-4, 2e-3)
# static_graph, a parameter of the cached chain also used by the loss outside
# the call, where the cache says so (StaticGraphOrder: three or more gradient
# terms, some from outside, fastchain/static/_outside.py): the same terms
# summed in another order, about one unit of rounding at the first step, a
# difference that grows as the two trainings drift apart, most where they
# diverge. Of the largest value of the same kind, float32 and fp16, set from
# ``python -m tests.differential.measure_tolerance`` (DEVELOPERS.md, "The
# tolerance of a run said not bitwise"): the worst measured 2.0e-5 and 2.3e-2,
# both in diverging trainings (test_harness.WORST). Before: 2e-5 (that run
# came within 1% of it) and 4e-3 (failed by a tie at 4.05e-3, seed 733352369).
TIED_TOLERANCE = {False: 1e-4, True: 8e-2}


@contextlib.contextmanager
def quiet(said):
    """Warnings ignored (fallbacks, fp16 on a CPU), but the static cache's
    StaticGraphOrder (a model's gradient terms summed in another order) put
    in ``said`` if it is a list."""
    from fastchain.static._outside import StaticGraphOrder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('ignore')
        warnings.simplefilter('always', StaticGraphOrder)
        try:
            yield
        finally:
            if said is not None:
                said.extend(w for w in caught if issubclass(w.category, StaticGraphOrder))


def run(spec, opt_spec, hooks, steps, layout=None, fp16=False, resume_at=None,
        loop='update', growth_interval=10 ** 9, scales=None, said=None, twin=None):
    """Train ``steps`` steps; returns the list of states after each.

    ``loop``: ``'update'`` (``optimizer.update(lossfun, ...)``), ``'own'``
    (a script's own loop: ``cleargrads``, ``loss.backward(loss_scale=
    optimizer._loss_scale)``, ``optimizer.update()``) or ``'own_unscaled'``
    (the same with a plain ``loss.backward()``).

    ``layout``: None for plain Chainer, else (options of the first handle,
    options of the second, the step before which the second is disabled or
    None); fp16, if asked for, is in the first handle, its loss scaler
    doubling the scale every ``growth_interval`` steps (10**9: never).

    ``scales`` (fp16): the loss scale of each step's backward: a fastchain run
    appends to the list, plain Chainer's run follows it.

    ``said``: a list that gets the static cache's StaticGraphOrder warnings
    (a model's gradients summed in another order).

    ``twin`` (float32 only): a seed; every nonzero weight made with the model
    moved one unit in the last place, up or down as that seed draws
    (``compare_or_twin``). A resumed run's snapshot overwrites the move.
    """
    assert twin is None or not fp16, 'a twin moves float32 weights; fp16 units are 2**13 larger'
    scale = FP16_HOOKS_SCALE if (fp16 and hooks) else FP16_SCALE
    dtype = numpy.float16 if fp16 else numpy.float32
    data = batches(spec, steps, seed=7, dtype=dtype)
    if layout is not None and fp16:
        first = dict(layout[0], fp16=True,
                     loss_scale={'init_scale': scale, 'growth_interval': growth_interval})
        layout = (first,) + tuple(layout[1:])
    plain_fp16 = fp16 and layout is None

    def make(seed):
        numpy.random.seed(seed)
        model = build(spec)
        if twin is not None:
            nudge(model, twin)
        optimizer, hook_objects = make_optimizer(opt_spec, hooks)
        optimizer.setup(model)
        for hook in hook_objects:
            optimizer.add_hook(hook)
        if plain_fp16:
            optimizer.use_fp32_update()
            optimizer.set_loss_scale(scale)     # Chainer's static scaling
            if hooks:
                unscale_before_hooks(optimizer)
        return model, optimizer

    trace = []
    # Plain Chainer's fp16 script sets the compute dtype for the whole run
    # (a parameter whose size comes from its first input is made then)
    dtype_config = (chainer.using_config('dtype', chainer.mixed16) if plain_fp16
                    else contextlib.nullcontext())
    with tempfile.TemporaryDirectory() as folder, handles(layout, folder) as (made, disable_at):
        with quiet(said), dtype_config:
            model, optimizer = make(SEED)
            step = {}
            capture_gradients(optimizer, step)
            numpy.random.seed(SEED + 1)         # dropout's masks
            for i, batch in enumerate(data):
                if made and i == disable_at:
                    made[1].disable()
                if i == resume_at:
                    model, optimizer = resume(model, optimizer, make)
                    capture_gradients(optimizer, step)
                losses = []
                step['grads'] = None
                if plain_fp16 and scales is not None:
                    optimizer._loss_scale = scales[i]      # fastchain's scaler's
                elif fp16 and scales is not None:
                    scales.append(optimizer._loss_scale)

                def lossfun(*arrays):
                    loss = loss_of(model, arrays)
                    losses.append(loss.array.copy())
                    return loss
                if loop == 'update':
                    optimizer.update(lossfun, *batch)
                else:
                    model.cleargrads()
                    if loop == 'own_unscaled' and plain_fp16:
                        optimizer._loss_scale = None    # what the script seeds: nothing
                    lossfun(*batch).backward(loss_scale=optimizer._loss_scale
                                             if loop == 'own' else None)
                    optimizer.update()
                scaler = scaler_of(optimizer)
                if scaler is not None and scaler.skipped_steps:
                    raise Skipped()
                trace.append(state(model, optimizer, losses[-1], step['grads']))
            if layout is not None:
                _events(model, optimizer)
    return trace


def nudge(model, seed):
    """Move each of ``model``'s made, nonzero weights one unit in the last
    place, up or down as ``seed`` draws (its own generator: NumPy's global
    one is untouched)."""
    signs = numpy.random.RandomState(seed)
    for param in model.params():
        a = param.array
        if a is not None:
            toward = numpy.where(signs.randint(2, size=a.shape) == 1, numpy.inf, -numpy.inf)
            a[...] = numpy.where(a == 0, a, numpy.nextafter(a, toward.astype(a.dtype)))


def _events(model, optimizer):
    """What the fastchain run really did (shown by --hypothesis-show-statistics)."""
    from hypothesis import event
    from fastchain.kernels import _update
    from fastchain.static import cache_state
    cache = cache_state(model)
    if cache is not None:
        event('static_graph: ' + ('fell back ({})'.format(cache['cause'])
                                  if cache['fallback'] else 'replayed'))
        # A fallback for a defect of the cache keeps the training right, but
        # it is fastchain's own bug: the suite fails on it.
        assert cache['cause'] != 'defect', cache['fallback']
    if any(_update.is_fused(p.update_rule) for p in model.params()):
        event('fused_update: on')
    _tuner_events()


def _tuner_events():
    from hypothesis import event
    from fastchain.kernels import _onednn
    if _onednn.enabled and _onednn.calls:
        event('onednn: ran')
    for kind in ('cpu_conv', 'cpu_conv_bound', 'fused_update', 'static_graph',
                 'loader_workers', 'loader_prefetch', 'per_call_picks'):
        forced = _tuner.forced.get(kind) if _tuner.forced_calls.get(kind) else None
        picked = {c['picked'] for c in _tuner.choices(kind)} - {None}
        if forced or _tuner.choices(kind):
            event('autotune {}: {}'.format(kind, 'forced ' + forced if forced else
                                          'picked ' + '+'.join(sorted(picked)) if picked
                                          else 'alternatives took turns'))


def resume(model, optimizer, make):
    """Snapshot model and optimizer, build new ones (from other weights),
    load the snapshot into them; NumPy's global RNG is carried over (Chainer
    does not snapshot it)."""
    saved = io.BytesIO(), io.BytesIO()
    serializers.save_npz(saved[0], model)
    serializers.save_npz(saved[1], optimizer)
    rng = numpy.random.get_state()
    model, optimizer = make(SEED + 99)
    for buffer, target in zip(saved, (model, optimizer)):
        buffer.seek(0)
        serializers.load_npz(buffer, target)
    numpy.random.set_state(rng)
    return model, optimizer


def _kind(key):
    """What a key holds: 'W', 'backward grad', 'grad', 'state', 'master',
    'avg_mean', 'avg_var', 'N', 't', 'loss', 'optimizer.t'."""
    return key.split('/')[0]


def _largest(state):
    """The largest magnitude of each kind of value in one step's ``state``;
    for running means, of the means and the running standard deviation."""
    largest = {}
    for key, value in state.items():
        if isinstance(value, numpy.ndarray) and value.size:
            kind = _kind(key)
            largest[kind] = max(largest.get(kind, 0.0),
                                float(numpy.abs(value.astype(numpy.float64)).max()))
    if 'avg_var' in largest:
        # A running mean of fp16 activations is off by their rounding,
        # which scales with their spread: centred data has a mean near 0.
        largest['avg_mean'] = max(largest.get('avg_mean', 0.0), largest['avg_var'] ** 0.5)
    return largest


# What a diverged training shows first: its loss or weights left the
# floating range (gradients overflow under loss scaling in a healthy fp16 run)
_DIVERGED = ('loss', 'W', 'master')


def _finite(state):
    return all(numpy.isfinite(value).all() for key, value in state.items()
               if _kind(key) in _DIVERGED and isinstance(value, numpy.ndarray)
               and value.dtype.kind == 'f')


def comparable_steps(expected, got):
    """How many steps a tolerance holds for: those before the first where
    either training's loss or weights are no longer finite. Two trainings
    that differ by rounding and diverge go on differing by rounding until
    they overflow (measured: losses 1e3, 4e7, 3e21, then nan in both), and
    one may overflow a step before the other; from there the values are not
    comparable."""
    return next((step for step, (e, g) in enumerate(zip(expected, got))
                 if not (_finite(e) and _finite(g))), len(expected))


def _comparable(expected, got):
    """``comparable_steps``, asserting that where the trainings stop being
    comparable the reference diverged too (at some step of its trace)."""
    steps = comparable_steps(expected, got)
    if steps < len(expected):
        assert not all(_finite(state) for state in expected), (
            "step {}: the loss or weights went non-finite where plain Chainer's "
            'stayed finite to the end'.format(steps))
    return steps


class OutsideTolerance(AssertionError):
    """``compare``: a value outside its tolerance (not a key missing, an
    exact value that differs, or a training that diverged alone)."""


def compare(expected, got, atol_scale=None, allowance=None, exact_only=False):
    """Assert the two traces agree: exactly, or within ``atol_scale`` times
    the largest magnitude of the same kind of value (weights, gradients,
    statistics, optimizer state, loss) in the reference's step (``_largest``)
    up to where a training diverged (``_comparable``). ``atol_scale`` may be
    a pair: (the first step's, the later steps'). ``allowance``: for each
    step, {key: an array of absolute tolerances, element by element} that
    widens ``atol_scale``'s (``twin_allowance``). ``exact_only``: only what
    no tolerance covers (keys, shapes, the values compared exactly, where a
    training diverged), every step."""
    assert len(expected) == len(got)
    steps = len(expected) if atol_scale is None else _comparable(expected, got)
    first, later = atol_scale if isinstance(atol_scale, tuple) else (atol_scale, atol_scale)
    for step, (e, g) in enumerate(zip(expected, got)):
        assert sorted(e) == sorted(g), (step, sorted(set(e) ^ set(g)))
        if step >= steps:
            continue
        atol_scale = first if step == 0 else later
        largest = _largest(e)
        for key in sorted(e):
            a, b = e[key], g[key]
            where = 'step {} {}'.format(step, key)
            if a is None or b is None:
                assert a is None and b is None, where
            elif atol_scale is None or not isinstance(a, numpy.ndarray):
                numpy.testing.assert_array_equal(b, a, err_msg=where)
            elif not exact_only:
                assert numpy.shape(a) == numpy.shape(b), (where, numpy.shape(a), numpy.shape(b))
                atol = atol_scale * largest.get(_kind(key), 0.0)
                if allowance is not None and key in allowance[step]:
                    atol = numpy.maximum(atol, allowance[step][key])
                _within(a, b, atol, where)


def _within(a, b, atol, where):
    """Raise OutsideTolerance unless ``b`` is within ``atol`` (a number or an
    array of ``a``'s shape) of ``a`` element by element, NaN equal to NaN."""
    difference = _apart(a, b)
    bad = ~(difference <= atol)         # NaN against a number is outside
    if bad.any():
        atol = numpy.broadcast_to(atol, a.shape)
        with numpy.errstate(divide='ignore', invalid='ignore'):
            ratio = numpy.where(bad, difference / atol, -1.0)
        i = numpy.unravel_index(numpy.argmax(numpy.where(numpy.isnan(ratio), numpy.inf, ratio)),
                                a.shape)
        i = tuple(int(j) for j in i)
        raise OutsideTolerance(
            '{}: {} of {} elements outside the tolerance; the worst at {}: {!r} (got), {!r} '
            '(expected), {:.4g} apart, tolerance {:.4g}'.format(
                where, int(bad.sum()), a.size, i, float(b[i]), float(a[i]),
                float(difference[i]), float(atol[i])))


# A run held to a tolerance that a model magnifies past it (an L.LSTM
# saturated by inputs of 170: test_harness.SATURATED_ONEDNN) is held instead,
# element by element, to TWIN_FACTOR times the most that plain Chainer's own
# training moves that element when its initial weights move one unit in the
# last place, over TWINS such runs, their moves' signs drawn from different
# seeds (``run(..., twin=seed)``, ``compare_or_twin``), and at least
# TWIN_FLOOR of the most they moved any element of the array. Measured
# (``python -m tests.differential.measure_tolerance --family``; DEVELOPERS.md,
# "oneDNN kernels"): the runs outside the fixed tolerance needed at most 3.75.
TWIN_FACTOR = 5
TWIN_FLOOR = 0.1
TWINS = 5


def _apart(a, b):
    """|b - a| element by element in float64, 0 where they are equal or both
    NaN (inf against inf is 0, NaN against a number NaN)."""
    a, b = numpy.asarray(a, numpy.float64), numpy.asarray(b, numpy.float64)
    same = (a == b) | (numpy.isnan(a) & numpy.isnan(b))
    with numpy.errstate(invalid='ignore'):
        return numpy.where(same, 0.0, numpy.abs(b - a))


def _difference(a, b):
    """The largest absolute difference of two arrays (NaN equal to NaN)."""
    return float(_apart(a, b).max())


def twin_allowance(expected, twins):
    """For each step of ``expected``, {key: an array, element by element
    TWIN_FACTOR times the most that element moved from ``expected``'s in any
    of the ``twins`` traces, or TWIN_FLOOR times the most any element of the
    array moved, whichever is larger}. A twin that is not comparable at a step (its
    loss or weights no longer finite), or an element it moved by a
    difference that is not finite, counts as having moved nothing there."""
    assert all(len(twin) == len(expected) for twin in twins)
    comparable = [comparable_steps(expected, twin) for twin in twins]
    allowance = []
    for step, e in enumerate(expected):
        widths = {}
        for key, a in e.items():
            if not (isinstance(a, numpy.ndarray) and a.size and a.dtype.kind == 'f'):
                continue
            moved = numpy.zeros(a.shape)
            for twin, n in zip(twins, comparable):
                if step < n:
                    moved = numpy.maximum(moved, _moved(a, twin[step][key]))
            # each element at least a tenth of the array's largest move:
            # whether all five twins happen to leave one element still is
            # chance (measured: an element onednn moved 38 times as far)
            widths[key] = TWIN_FACTOR * numpy.maximum(moved, TWIN_FLOOR * moved.max())
        allowance.append(widths)
    return allowance


def _moved(a, b):
    """|b - a| element by element, 0 where both are NaN or it is not finite."""
    difference = _apart(a, b)
    return numpy.where(numpy.isfinite(difference), difference, 0.0)


def compare_or_twin(expected, got, atol_scale, twin):
    """``compare(expected, got, atol_scale)``, or, where a value is outside
    that tolerance (all else equal), the same with ``twin_allowance``:
    ``twin(seed)`` gives plain Chainer's trace with its initial weights moved
    one unit in the last place (``run(..., twin=seed)``), asked for TWINS
    seeds only then."""
    compare(expected, got, atol_scale, exact_only=True)
    try:
        compare(expected, got, atol_scale)
    except OutsideTolerance as fixed:
        allowance = twin_allowance(expected, [twin(seed) for seed in range(TWINS)])
        try:
            compare(expected, got, atol_scale, allowance)
        except OutsideTolerance as e:
            raise OutsideTolerance(
                '{}\nnor within {} times the most {} twin runs moved it (plain Chainer, '
                'its initial weights one unit in the last place apart): {}'.format(
                    fixed, TWIN_FACTOR, TWINS, e)) from None


def _step_deviation(e, g):
    """(the smallest ``atol_scale`` with which ``compare`` passes one step,
    the key where it is reached or None)."""
    worst = (0.0, None)
    largest = _largest(e)
    for key in sorted(e):
        a, b = e[key], g[key]
        if not (isinstance(a, numpy.ndarray) and a.size):
            continue
        difference = _difference(a, b)
        scale = largest.get(_kind(key), 0.0)
        ratio = difference / scale if scale else (float('inf') if difference else 0.0)
        if ratio > worst[0]:
            worst = (ratio, key)
    return worst


def deviation(expected, got):
    """(the smallest ``atol_scale`` with which ``compare`` passes the two
    traces, 'step N key' where it is reached, or None): what
    ``measure_tolerance`` records."""
    worst = (0.0, None)
    steps = _comparable(expected, got)
    for step, (e, g) in enumerate(zip(expected[:steps], got[:steps])):
        ratio, key = _step_deviation(e, g)
        if ratio > worst[0]:
            worst = (ratio, 'step {} {}'.format(step, key))
    return worst


class NotInMemory(chainer.dataset.DatasetMixin):
    """A dataset the loader does not take for arrays in memory."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def get_example(self, i):
        return self.dataset[i]


def run_script(spec, opt_spec, hooks, iterations, shuffle, options=None, said=None):
    """A plain Chainer script (SerialIterator, StandardUpdater) run for
    ``iterations`` updates, under ``options`` (one handle) or none; returns the
    last state and the next draw of NumPy's global RNG (which dropout and the
    loader's order both use)."""
    n = spec['input'][0]
    batch_list = batches(dict(spec, input=(1,) + spec['input'][1:]), 3 * n + 1, seed=7)
    dataset = chainer.datasets.TupleDataset(*[numpy.concatenate(column)
                                              for column in zip(*batch_list)])
    if options is not None and options.get('loader_workers', 0) is None:
        dataset = NotInMemory(dataset)      # else enable() keeps the SerialIterator
    with tempfile.TemporaryDirectory() as folder, \
            handles(None if options is None else (options, None), folder):
        with quiet(said):
            numpy.random.seed(SEED)
            model = build(spec)
            optimizer, hook_objects = make_optimizer(opt_spec, hooks)
            optimizer.setup(model)
            for hook in hook_objects:
                optimizer.add_hook(hook)
            losses = []

            def lossfun(*arrays):
                loss = loss_of(model, arrays)
                losses.append(loss.array.copy())
                return loss
            iterator = chainer.iterators.SerialIterator(dataset, n, shuffle=shuffle)
            updater = chainer.training.StandardUpdater(iterator, optimizer,
                                                       loss_func=lossfun)
            for _ in range(iterations):
                updater.update()
            updater.finalize()
            if options is not None:
                _tuner_events()
            return state(model, optimizer, losses[-1], None), numpy.random.rand()
