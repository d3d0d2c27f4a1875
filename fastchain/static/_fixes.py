"""Faults of Chainer 7.8.1's ``static_graph``, fixed where they arise, and
the hook the cache's backward verification runs in.

1. Wrong BatchNormalization gradients from the second batch on: the cached
   backward keeps the ``BatchNormalizationGrad`` node made on the first
   iteration, which holds that batch's mean and inverse std; replaying the
   forward recomputes them on the forward node only. Fix: the grad node reads
   them from its forward node when it runs (the same arrays in define-by-run,
   so nothing changes there). The same for ``FixedBatchNormalization`` (train
   mode with statistics that change, e.g. trained), whose grad node keeps the
   first step's inverse std (:mod:`fastchain.static._live`).
2. Persistent values (running statistics) updated twice on the iteration
   that builds a schedule: the define-by-run pass updates them, then the new
   schedule is run once more. Fix: every persistent array of the chain's
   links is put back as it was before that pass once the schedule is built,
   so the schedule's own run is the one update.
3. Output on stdout whatever the verbosity ('Creating new backward
   schedule...'). Fix: the module's prints go through a filter that keeps
   them only when verbosity was asked for.
4. Wrong gradients when the last function of a cached chain retains its
   inputs or outputs for backward (``F.relu``, ``F.softmax``, ``F.elu``...):
   Chainer marks a function's retained arrays, so that the replay copies new
   values into them instead of rebinding, only when it appends the *next*
   function, so the last function's retained arrays keep the first step's
   values in its backward node. Fix: they are marked when the forward
   schedule is built.
5. Work define-by-run does not do: Chainer makes each array argument of a
   cached call a variable that requires a gradient (its schedule needs one to
   have a backward) and asks for that gradient when it builds the backward
   schedule, so every replayed step computes, for a convolutional network,
   the first convolution's input gradient, which nobody can read. Fix: those
   inputs are left out of what the backward is built for; a variable argument
   keeps its gradient.

The layers (:mod:`fastchain.config._patches`, layer ``static_graph``) are on
``BatchNormalization.backward``, ``FixedBatchNormalization.backward``,
``StaticScheduleFunction.build_schedule`` (a cached chain's schedules give
up their hooks that attach gradients, :mod:`fastchain.static._node`),
``StaticScheduleFunction.apply`` (the parameters as inputs of a cached call's
node), ``StaticScheduleFunction.backward`` (their gradients returned; a double
backward define-by-run; a schedule with a pending check attached under
:data:`CHECK` runs it: :class:`fastchain.static._verify.BackwardCheck`) and
the ``print`` of Chainer's static_graph module, and on ``Link.__setattr__``
and ``__delattr__``, ``serialize`` and ``add_persistent`` (what the training
loop sets on a cached chain's links, :mod:`fastchain.static._watch`), held
while any chain is
cached: each cached chain holds a lease (:func:`acquire`), released when the
cache is undone or the chain is collected, and the layers leave with the last
lease. Once a schedule is built the same layer binds lean kernels into it
(:mod:`fastchain.kernels._bind`, unless ``cpu_conv=False`` is in force) and
gives it a flat program (:mod:`fastchain.static._flat`). None changes
define-by-run execution.
"""

import contextlib
import functools
import threading

from fastchain.config import _patches
from fastchain.kernels import _bind
from fastchain.static import _flat, _live, _node, _outside, _verify, _watch

# _patches' own lock (reentrant): a chain collected while it is held
# releases its lease from inside (weakref.finalize runs wherever the
# collector runs), and one lock cannot be taken in two orders.
_lock = _patches.lock
_local = threading.local()
_leases = set()
CHECK = 'static_backward_check'     # attachment key on a schedule: a pending check
ARRAY_INPUTS = 'static_array_inputs'    # on a forward schedule: drop_input_gradients


def installed():
    """True while some cached chain holds the fixes."""
    return bool(_leases)


def _targets():
    import chainer
    from chainer.functions.normalization import batch_normalization as bn
    from chainer.graph_optimizations import static_graph as sg
    return ((bn.BatchNormalization, 'backward', _live.batch_normalization_backward),
            (bn.FixedBatchNormalization, 'backward', _live.fixed_batch_normalization_backward),
            (sg.StaticScheduleFunction, 'build_schedule', _build_then_fix),
            (sg.StaticScheduleFunction, 'apply', _node.apply_with_parameters),
            (sg.StaticScheduleFunction, 'backward', _backward_then_check),
            (sg, 'print', _quiet_print),
            (chainer.Variable, 'backward', _outside.backward_layer),
            (chainer.Link, '__setattr__', _watch.setattr_layer),
            (chainer.Link, '__delattr__', _watch.delattr_layer),
            (chainer.Link, 'serialize', _watch.noted_layer),
            (chainer.Link, 'add_persistent', _watch.noted_layer)) + tuple(
                (owner, name, _watch.noted_layer)
                for owner in (chainer.ChainList, chainer.Sequential)
                for name in ('insert', '__setitem__', '__delitem__'))


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
    if not schedule.pass_depth:
        _retain_last(schedule)
    result = next_(schedule, *args, **kwargs)
    if _node.owner(schedule) is not None:
        _node.take_gradient_hooks(schedule)
    saved = getattr(_local, 'statistics', None)
    if saved is not None and not schedule.pass_depth:   # the forward schedule
        _restore(saved)
        _patches.attach(schedule, ARRAY_INPUTS, _local.array_inputs)
    _bind.bind_schedule(schedule)
    _flat.compile_schedule(schedule)
    return result


def _backward_then_check(next_, schedule, indexes, grad_outputs):
    import chainer
    entry = _patches.attached(schedule, _node.PARAMS)     # a cached chain's
    if entry is not None:
        call = getattr(schedule, _node.CALL, None)
        if chainer.config.enable_backprop:      # a double backward
            return _node.double_backward(schedule, grad_outputs, call)
        if _node.late(schedule, call):
            _patches.detach(schedule, CHECK)
            return _node.late_backward(schedule, grad_outputs, call)
        setattr(schedule, _node.CALL, None)
        if call is not None and any(g is None for g in grad_outputs):
            if schedule.backward_schedule_func is None:
                drop_input_gradients(schedule)
            grads = _node.unused_outputs_backward(next_, schedule, indexes, grad_outputs,
                                                  call)
            check = _patches.attached(schedule, CHECK)
            if check is not None:       # it compares every output's path: not this call
                _patches.detach(schedule, CHECK, check)
                check.report((_verify.UNUSED, [i + 1 for i, g in enumerate(grad_outputs)
                                               if g is None]))
            return grads
        run = functools.partial(_node.backward, next_)
    else:
        run = next_
    if schedule.backward_schedule_func is None:     # this call builds it
        drop_input_gradients(schedule)
    with verbosity(getattr(schedule, 'verbosity_level', 0) > 0):
        check = _patches.attached(schedule, CHECK)
        if check is None:
            return run(schedule, indexes, grad_outputs)
        _patches.detach(schedule, CHECK, check)
        return check(run, schedule, indexes, grad_outputs, () if entry is None else entry[1])


def _quiet_print(next_, *args, **kwargs):
    if getattr(_local, 'verbose', False):
        next_(*args, **kwargs)


@contextlib.contextmanager
def verbosity(verbose):
    """Chainer's static-graph prints go out inside only if ``verbose`` (the
    cache being run asked for them)."""
    before = getattr(_local, 'verbose', False)
    _local.verbose = verbose
    try:
        yield
    finally:
        _local.verbose = before


# --- 5. input gradients nobody reads ----------------------------------------------

def drop_input_gradients(schedule):
    """Before Chainer builds ``schedule``'s backward: the inputs that were
    arrays in the call that built it (Chainer made them variables that require
    a gradient, which nobody can read; define-by-run computes none) are left
    out of the gradients it asks for (the parameters' and every input's), so
    the backward schedule has no kernel for them (for a convolutional
    network, the first convolution's input gradient)."""
    import chainer
    in_vars = getattr(schedule, 'in_vars', None)
    for i in _patches.attached(schedule, ARRAY_INPUTS, ()):
        if in_vars and i < len(in_vars) and in_vars[i] is not None:
            # a stand-in outside the graph: its gradient is None, and no
            # function's input gradient is on the way to it
            in_vars[i] = chainer.Variable(in_vars[i].array, requires_grad=False)


# --- 2. persistent values on the building iteration -----------------------------

def snapshot_statistics(chain):
    """Copies of the persistent arrays of every link in ``chain`` (running
    statistics); scalars such as BatchNormalization's ``N`` are left alone: the
    schedule does not replay the Python code that updates them."""
    saved = []
    for link in chain.links():
        for name in sorted(link._persistent):
            value = link.__dict__.get(name)
            if hasattr(value, 'shape') and hasattr(value, 'copy'):
                saved.append((value, value.copy()))
    return saved


def _restore(saved):
    for array, copy in saved:
        array[...] = copy


# --- 4. the last function's retained arrays ----------------------------------------

def _retain_last(schedule):
    """Mark the retained arrays of the schedule's last function, as Chainer's
    ``append_function`` does for every other function when the next is added."""
    if not schedule.schedule_info_list:
        return
    node = schedule.schedule_info_list[-1].function_node
    if node is None:
        return
    retained = (node.get_retained_inputs() or ()) + (node.get_retained_outputs() or ())
    for var in retained:
        array = var.data
        index = schedule.array_id_to_unique_index.get(id(array))
        # Only arrays with data of their own: the replay copies new values into
        # a retained array, which a view (a broadcast, a reshape) cannot take
        # or would pass on to the array it views (measured: F.broadcast_to).
        # (CuPy's flags have no ``writeable``: its arrays always are.)
        if (index is not None and array.flags.owndata
                and getattr(array.flags, 'writeable', True)
                and not schedule.unique_array_infos[index].was_deleted()):
            schedule.unique_array_infos[index].retain = True


class building_statistics:
    """While a schedule may be built, remember the statistics to go back to,
    and which of the call's inputs are arrays (``array_inputs``:
    :func:`fastchain.static._keys.array_inputs`)."""

    def __init__(self, chain, array_inputs=()):
        self.chain = chain
        self.array_inputs = array_inputs

    def __enter__(self):
        _local.statistics = snapshot_statistics(self.chain)
        _local.array_inputs = self.array_inputs

    def __exit__(self, *exc):
        _local.statistics = None
        _local.array_inputs = ()
        return False
