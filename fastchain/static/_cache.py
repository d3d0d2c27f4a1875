"""Static-subgraph caching that users can trust.

Chainer's ``static_graph`` records the forward and backward of a chain on
the first call and replays them afterwards, skipping most of Chainer's
per-function Python work. fastchain uses it with its faults fixed
(:mod:`fastchain.static._fixes`) and adds what a user needs around it:

- **verification**: on the first ``verify_steps`` replays the chain also runs
  define-by-run (without backprop, its statistics put back after) and the
  sequence of functions is compared with the recorded one; a model whose
  Python control flow depends on its data shows up here and falls back to
  ordinary execution, with a warning naming the first difference;
- **fallback** on any error of the caching machinery, with the reason;
- evaluation (``chainer.config.train == False``) runs define-by-run, and a
  new batch size or mode gets its own schedule (the last partial batch).

.. note:: Checking is by sampling and sees the forward only: a model whose
   control flow changes after the verified steps is not caught, nor is a
   value computed in Python from the data (``float(h.array.max())``): its
   forward replays right but its backward keeps the first value (measured).
   Do not read ``.array`` inside a cached chain; mark only models you know
   are static (ResNet-style networks are).
"""

import functools
import warnings
import weakref

import chainer

from fastchain.config import _patches
from fastchain.static import _fixes

STATE = 'static_cache'      # attachment key: the cache's bookkeeping


class StaticGraphFallback(UserWarning):
    """A chain marked static runs define-by-run instead, for the reason given."""


class _Sequence(chainer.FunctionHook):
    """Records the functions a forward pass applies (name and output shapes)."""

    name = 'fastchain_static_sequence'

    def __init__(self):
        self.calls = []

    def forward_postprocess(self, function, in_data):
        if type(function).__name__ == 'StaticScheduleFunction':
            return      # the replay node itself, not the model's own function
        self.calls.append('{}{}'.format(type(function).__name__,
                                        tuple(tuple(x.shape) for x in in_data)))


_RANDOM_FUNCTIONS = ('Dropout', 'Zoneout', 'Gaussian', 'SimplifiedDropconnect')


def _max_difference(a, b):
    import numpy
    from chainer import backend
    xs = a if isinstance(a, (tuple, list)) else (a,)
    ys = b if isinstance(b, (tuple, list)) else (b,)
    worst = 0.0
    for x, y in zip(xs, ys):
        x = getattr(x, 'array', x)
        y = getattr(y, 'array', y)
        if not hasattr(x, 'shape') or x.shape != y.shape:
            return float('inf')
        x, y = backend.CpuDevice().send(x), backend.CpuDevice().send(y)
        scale = max(1.0, float(numpy.abs(y).max())) if y.size else 1.0
        worst = max(worst, float(numpy.abs(x - y).max()) / scale if x.size else 0.0)
    return worst


def cache_state(chain):
    """The cache's bookkeeping for ``chain`` (None if it is not cached):
    ``{'fallback': reason or None, 'sequences': {key: calls}, 'verified': {key: n}}``."""
    return _patches.attached(chain, STATE)


def is_cached(chain):
    return 'static_graph' in _patches.layers(chain, 'forward')


def cache_static_graph(chain, verify_steps=2, verbosity=0, changes=None):
    """Make ``chain``'s forward a cached static subgraph (on this instance).

    Returns a callable that undoes it. See the module docstring for what is
    checked. ``verbosity`` > 0 lets Chainer's own static-graph messages out.
    ``changes``: record the cache there (a handle's), instead of keeping it
    until the undo is called or the chain is collected.
    """
    if is_cached(chain):
        raise ValueError('{} is already cached'.format(type(chain).__name__))
    if 'forward' in vars(chain):
        raise ValueError('{} has an instance-level forward of its own, which the cache '
                         'would not replay'.format(type(chain).__name__))
    from chainer.graph_optimizations.static_graph import static_graph
    release = _fixes.acquire()
    _fixes.verbose = verbosity > 0
    replay = static_graph(force_test_define_by_run=True, minimize_cache_size=False,
                          verbosity_level=verbosity)(type(chain).forward)
    state = {'fallback': None, 'sequences': {}, 'verified': {}}
    name = type(chain).__name__

    def fall_back(reason):
        state['fallback'] = reason
        warnings.warn('fastchain static_graph: {} runs define-by-run from now on: {}'
                      .format(name, reason), StaticGraphFallback,
                      stacklevel=_patches.user_stacklevel())

    def cached_forward(plain, *args, **kwargs):
        chain = ref()
        if state['fallback'] is not None or not chainer.config.train or kwargs:
            if kwargs and state['fallback'] is None:
                fall_back('keyword arguments are not supported by the cache')
            return plain(*args, **kwargs)
        key = tuple(getattr(a, 'shape', None) for a in args)
        if key not in state['sequences']:
            return _build(chain, plain, key, args)
        if state['verified'][key] >= verify_steps:
            return replay(chain, *args)
        state['verified'][key] += 1
        saved = _fixes.snapshot_statistics(chain)
        # The replay re-attaches the schedule's gradient arrays to the params.
        grads = [(p, p.grad_var) for p in chain.params()]
        out = replay(chain, *args)
        reason = _verify(chain, plain, key, args, out)
        if reason is None:
            return out
        # This call's replay is wrong: undo what it touched, run it for real.
        _fixes._restore(saved)
        for p, g in grads:
            p.grad_var = g
        fall_back(reason)
        return plain(*args)

    def _build(chain, plain, key, args):
        recorder = _Sequence()
        try:
            with _fixes.building_statistics(chain), recorder:
                out = replay(chain, *args)
        except Exception as e:      # the caching machinery could not handle it
            fall_back('the schedule could not be built ({}: {})'.format(
                type(e).__name__, e))
            return plain(*args)
        state['sequences'][key] = recorder.calls
        state['verified'][key] = 0
        return out

    def _verify(chain, plain, key, args, replayed):
        """None if define-by-run agrees with the replay, else the reason."""
        saved = _fixes.snapshot_statistics(chain)
        recorder = _Sequence()
        with chainer.no_backprop_mode(), recorder:
            expected_out = plain(*args)
        _fixes._restore(saved)
        expected = state['sequences'][key]
        if recorder.calls != expected:
            k = next((i for i, (a, b) in enumerate(zip(recorder.calls, expected)) if a != b),
                     min(len(recorder.calls), len(expected)))
            got = recorder.calls[k] if k < len(recorder.calls) else 'nothing'
            had = expected[k] if k < len(expected) else 'nothing'
            return ('the model is not static: on a later call its forward applied {} where '
                    'the recorded graph has {} (function #{}); Python control flow that '
                    'depends on the data?'.format(got, had, k + 1))
        if any(_RANDOM in call for call in expected for _RANDOM in _RANDOM_FUNCTIONS):
            return None     # outputs of random functions cannot be compared
        diff = _max_difference(replayed, expected_out)
        if diff is not None and diff > 1e-4:
            return ('the model is not static: the cached graph and define-by-run give '
                    'outputs that differ by {:.3g} on the same input (a value computed '
                    'in Python from the data, e.g. from x.array?)'.format(diff))
        return None

    ref = weakref.ref(chain)
    functools.update_wrapper(cached_forward, type(chain).forward)
    if changes is not None:
        point = changes.wrap(chain, 'forward', 'static_graph', cached_forward)
        changes.attach(chain, STATE, state)
        changes.call('static graph lease of ' + name, release)
    else:
        point = _patches.wrap(chain, 'forward', 'static_graph', cached_forward)
        _patches.attach(chain, STATE, state)
        weakref.finalize(chain, release)

    def undo():
        obj = ref()
        if obj is not None:
            _patches.unwrap(obj, 'forward', 'static_graph', point=point)
            _patches.detach(obj, STATE, state)
        release()
    return undo


def static_graph(cls_or_chain=None, verify_steps=2):
    """Mark a model for static-subgraph caching.

    As a class decorator (every instance is cached when first called)::

        @fastchain.static_graph
        class Net(chainer.Chain): ...

    or on an instance: ``fastchain.static_graph(model)`` (returns the model).
    """
    if cls_or_chain is None:
        return functools.partial(static_graph, verify_steps=verify_steps)
    if isinstance(cls_or_chain, chainer.Chain):
        cache_static_graph(cls_or_chain, verify_steps)
        return cls_or_chain
    if isinstance(cls_or_chain, type) and issubclass(cls_or_chain, chainer.Chain):
        cls = cls_or_chain
        init = cls.__init__

        @functools.wraps(init)
        def init_and_cache(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if type(self) is cls:       # subclasses decide for themselves
                cache_static_graph(self, verify_steps)
        cls.__init__ = init_and_cache
        return cls
    raise TypeError('fastchain.static_graph marks a chainer.Chain class or instance, '
                    'got {!r}'.format(cls_or_chain))
