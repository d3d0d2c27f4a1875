"""Three measured faults of Chainer 7.8.1's ``static_graph``, fixed where they
arise.

1. Wrong BatchNormalization gradients from the second batch on: the cached
   backward keeps the ``BatchNormalizationGrad`` node made on the first
   iteration, which holds that batch's mean and inverse std; replaying the
   forward recomputes them on the forward node only. Fix: the grad node reads
   them from its forward node when it runs (the same arrays in define-by-run,
   so nothing changes there).
2. Running statistics updated twice on the iteration that builds a schedule:
   the define-by-run pass updates them, then the new schedule is run once
   more. Fix: the statistics are put back as they were before that pass once
   the schedule is built, so the schedule's own run is the one update.
3. Output on stdout whatever the verbosity ('Creating new backward
   schedule...'). Fix: the module's prints go through a filter that keeps
   them only when verbosity was asked for.

All three are layers (:mod:`fastchain.config._patches`, layer
``static_graph``) on ``BatchNormalization.backward``,
``StaticScheduleFunction.build_schedule`` and the ``print`` of Chainer's
static_graph module, held while any chain is cached: each cached chain holds
a lease (:func:`acquire`), released when the cache is undone or the chain is
collected, and the layers leave with the last lease. Once a schedule is built
the same layer binds lean kernels into it (:mod:`fastchain.kernels._bind`,
unless ``cpu_conv=False`` is in force) and gives it a flat program
(:mod:`fastchain.static._flat`). None changes define-by-run execution.
"""

import threading

from fastchain.config import _patches
from fastchain.kernels import _bind
from fastchain.static import _flat

# Reentrant: a chain collected while the lock is held releases its lease
# from inside (weakref.finalize runs wherever the collector runs).
_lock = threading.RLock()
_local = threading.local()
_leases = set()
verbose = False


def installed():
    """True while some cached chain holds the fixes."""
    return bool(_leases)


def _targets():
    from chainer.functions.normalization import batch_normalization as bn
    from chainer.graph_optimizations import static_graph as sg
    return ((bn.BatchNormalization, 'backward', _bn_backward),
            (sg.StaticScheduleFunction, 'build_schedule', _build_then_fix),
            (sg, 'print', _quiet_print))


def acquire():
    """Keep the fixes in place until the returned ``release()`` is called
    (it may be called any number of times; the first counts)."""
    token = object()
    with _lock:
        _leases.add(token)      # first: a release from inside cannot empty the set
        if len(_leases) == 1:
            for owner, name, fn in _targets():
                _patches.wrap(owner, name, 'static_graph', fn)

    def release():
        with _lock:
            if token not in _leases:
                return
            _leases.discard(token)
            if not _leases:
                _remove()
    return release


def uninstall():
    """Take the fixes out whatever holds them (for tests)."""
    with _lock:
        _leases.clear()
        _remove()


def _remove():
    for owner, name, _ in _targets():
        _patches.unwrap(owner, name, 'static_graph')


def _build_then_fix(next_, schedule, *args, **kwargs):
    result = next_(schedule, *args, **kwargs)
    saved = getattr(_local, 'statistics', None)
    if saved is not None and not schedule.pass_depth:   # the forward schedule
        _restore(saved)
    _bind.bind_schedule(schedule)
    _flat.compile_schedule(schedule)
    return result


def _quiet_print(next_, *args, **kwargs):
    if verbose:
        next_(*args, **kwargs)


# --- 1. BatchNormalization gradients ------------------------------------------

def _bn_backward(next_, self, indexes, grad_outputs):
    x, gamma = self.get_retained_inputs()
    gy, = grad_outputs
    grad = _LiveStatisticsGrad(self)
    return grad.apply((x, gamma, gy))


def _make_live_grad_class():
    from chainer.functions.normalization import batch_normalization as bn

    class LiveStatisticsGrad(bn.BatchNormalizationGrad):
        """BatchNormalizationGrad that takes the batch statistics from its
        forward node at the time it runs, not when it was made."""

        def __init__(self, forward_node):
            self._forward = forward_node
            self.eps = forward_node.eps
            self.expander = forward_node.expander
            self.axis = forward_node.axis
            self.key_axis = forward_node.key_axis
            self._impl = forward_node._impl

        # Chainer's __init__ sets these as attributes; here they are live.
        mean = property(lambda self: self._forward.mean, lambda self, v: None)
        inv_std = property(lambda self: self._forward.inv_std, lambda self, v: None)
        forward_data = property(lambda self: self._forward.forward_data,
                                lambda self, v: None)

        @property
        def var(self):
            # Only iDeep's implementation keeps var (as Chainer's backward).
            if isinstance(self._forward._impl, bn._IDeepBatchNormalizationImpl):
                return self._forward.var
            return None

        @var.setter
        def var(self, value):
            pass

    return LiveStatisticsGrad


class _LazyGradClass:
    cls = None

    def __call__(self, forward_node):
        if self.cls is None:
            self.cls = _make_live_grad_class()
        return self.cls(forward_node)


_LiveStatisticsGrad = _LazyGradClass()


# --- 2. running statistics on the building iteration -----------------------------

def snapshot_statistics(chain):
    """Copies of every BatchNormalization's running statistics in ``chain``."""
    import chainer.links as L
    saved = []
    for link in chain.links():
        if isinstance(link, L.BatchNormalization) and link.avg_mean is not None:
            saved.append((link, link.avg_mean.copy(), link.avg_var.copy(), link.N))
    return saved


def _restore(saved):
    for link, mean, var, n in saved:
        link.avg_mean[...] = mean
        link.avg_var[...] = var
        link.N = n


class building_statistics:
    """While a schedule may be built, remember the statistics to go back to."""

    def __init__(self, chain):
        self.chain = chain

    def __enter__(self):
        _local.statistics = snapshot_statistics(self.chain)

    def __exit__(self, *exc):
        _local.statistics = None
        return False
