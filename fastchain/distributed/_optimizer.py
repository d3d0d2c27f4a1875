"""Makes a Chainer optimizer data-parallel (ChainerMN's multi-node optimizer).

The optimizer keeps its class (``isinstance(opt, MomentumSGD)`` still holds)
and its serialisation; what changes are layers named ``distributed`` on the
instance's methods (:mod:`fastchain.config._patches`), for its whole life:

- at ``setup`` (or at once, if already set up): the ranks check they built
  the same model (names, shapes, dtypes) and rank 0's parameters are
  broadcast to every rank;
- ``update(lossfun)`` runs the forward/backward with the gradient capture
  hook on, so buckets are averaged while backward goes on;
- after backward (``reallocate_cleared_grads``, which also zero-fills the
  parameters that got no gradient) the averaged gradients are in place
  before the loss-scale check and the update;
- with fastchain's loss scaler, every rank reaches the same skip decision.

Layers of enabled handles (nvtx, fp16) come and go around these without
touching them.
"""

import functools
import time
import weakref

import numpy

import chainer

from fastchain.config import _patches
from fastchain.distributed import _arguments, _learners
from fastchain.distributed._learners import AllReduce, Learner
from fastchain.distributed._quantize import QuantizedSGD
from fastchain.distributed._same_batches import SameBatches, of_gradients, of_step
from fastchain.distributed._sync import GradientCapture, GradientSync

COMMUNICATOR = 'communicator'       # attachment key: the optimizer's communicator
LEARNER = 'learner'                 # attachment key: its distributed learner


def communicator_of(optimizer):
    """The communicator ``optimizer`` averages gradients over, or None."""
    return _patches.attached(optimizer, COMMUNICATOR)


def gradient_sync_of(optimizer):
    """The :class:`GradientSync` averaging ``optimizer``'s gradients, or None."""
    return _patches.attached(optimizer, 'gradient_sync')


def learner_of(optimizer):
    """The :class:`~fastchain.distributed.Learner` of a data-parallel
    ``optimizer`` (its ``report()`` gives bytes sent and time spent); an
    optimizer that is not data-parallel is refused by name."""
    learner = _patches.attached(optimizer, LEARNER)
    if learner is None:
        raise ValueError('learner_of: this {} is not data-parallel: make it so with '
                         'distributed.create_multi_node_optimizer(optimizer, comm, ...)'
                         .format(type(optimizer).__name__))
    return learner


def create_multi_node_optimizer(optimizer, comm, bucket_cap_mb=25, fp16_allreduce=False,
                                overlap=None, learner=None, distributed_after=0,
                                zero_fill=True, double_buffering=False):
    """Make ``optimizer`` data-parallel over ``comm``; returns it.

    Args:
        optimizer: a Chainer GradientMethod, set up or not yet.
        comm: a communicator from :func:`create_communicator`.
        bucket_cap_mb (float): largest gradient bucket, in MiB.
        fp16_allreduce (bool): send gradients as fp16 (half the bytes).
        overlap (bool): start each bucket's allreduce during backward
            (default: where the communicator progresses on its own: NCCL).
        learner: how the ranks combine their work (see ``_learners``):
            ``'allreduce'`` (default: the exact mean gradient every step),
            ``'1bit'``, or ``distributed.QuantizedSGD(bits,
            error_feedback)``, ``distributed.BlockMomentum(block_size,
            ...)``, ``distributed.ModelAveraging(block_size)``.
        distributed_after (int): warm start: the first this many samples
            (over all ranks) are trained with exact averaging every step,
            as one worker with the global batch; then ``learner`` takes over.
        zero_fill, double_buffering: ChainerMN's, taken at its defaults
            (what fastchain does); the other choice is refused, saying why.

    Every collective waits at most the communicator's timeout
    (``FASTCHAIN_COLLECTIVE_TIMEOUT`` seconds, default 300, or
    ``create_communicator(timeout=...)``); past it the job is aborted, naming
    the rank and the operation. A rank that exits (``sys.exit()``) while the
    others wait for it ends the job within seconds.
    """
    _arguments.check_optimizer(optimizer, comm, bucket_cap_mb, fp16_allreduce, overlap,
                               distributed_after, zero_fill, double_buffering)
    if communicator_of(optimizer) is not None:
        raise ValueError('this optimizer is already data-parallel')
    learner = make_learner(learner)
    learner._prebind(optimizer, comm, int(distributed_after))
    _patches.attach(optimizer, COMMUNICATOR, comm)
    _patches.attach(optimizer, LEARNER, learner)
    # From now on, not at attach: a snapshot may be loaded before a lazily
    # shaped model's first update.
    _patches.wrap(optimizer, 'serialize', 'distributed',
                  functools.partial(_serialize_learner, learner))
    options = dict(cap=int(bucket_cap_mb * 2 ** 20),
                   dtype=numpy.float16 if fp16_allreduce else None, overlap=overlap,
                   learner=learner)
    if getattr(optimizer, 'target', None) is not None:
        _attach_when_initialized(optimizer, comm, options)
    else:
        # (holds the optimizer until its setup, which takes this layer off:
        # `create_multi_node_optimizer(SGD(), comm).setup(model)` has no other
        # reference to it in between)
        def setup_data_parallel(next_, link):
            result = next_(link)
            _patches.unwrap(optimizer, 'setup', 'distributed')
            _attach_when_initialized(optimizer, comm, options)
            return result
        _patches.wrap(optimizer, 'setup', 'distributed', setup_data_parallel)
    return optimizer


def _attach_when_initialized(optimizer, comm, options):
    """Attach now, or, for a model with lazily shaped parameters
    (``L.Linear(None, n)``), at the first update: one forward pass without
    backprop (in test mode) gives them their shapes, then the ranks check and
    broadcast, then the real step runs on the broadcast weights.

    A first update without a loss function (a custom loop: forward and
    backward done by the script) comes after the parameters got their shapes
    and values on each rank, and after the gradients were computed on them:
    it goes on where every rank drew the same values (one process, or ranks
    seeded alike), and otherwise stops, saying why and the fix, rather than
    average gradients of different models."""
    if all(p.array is not None for p in optimizer.target.params()):
        _attach(optimizer, comm, options)
        return

    # held weakly: fastchain's points keep their layers by the optimizer,
    # weakly, and a strong reference back kept an optimizer whose first update
    # failed for ever (set up, the script holds it)
    ref = weakref.ref(optimizer)

    def first_update(next_, lossfun=None, *args, **kwds):
        optimizer = ref()
        if lossfun is None:
            _check_shaped_alike(comm, optimizer.target)
            _attach(optimizer, comm, options, broadcast=False)  # replaces this layer
            return optimizer.update(None, *args, **kwds)
        with chainer.no_backprop_mode(), chainer.using_config('train', False):
            lossfun(*args, **kwds)
        _attach(optimizer, comm, options)       # replaces this layer
        return optimizer.update(lossfun, *args, **kwds)
    _patches.wrap(optimizer, 'update', 'distributed', first_update)


def _check_shaped_alike(comm, target):
    """At a first update without a loss function on a lazily shaped model:
    every parameter has its shape now, and every rank the same values."""
    _check_shaped(target, forward_ran=False)
    if comm.size == 1:
        return
    everyone = comm.allgather_obj(_values_digest(target),
                                  what='check of the first step\'s weights (allgather)')
    if len(set(everyone)) == 1:
        return
    if comm.rank != 0:
        time.sleep(min(10.0, comm.timeout))     # rank 0 reports it (shown once)
    raise RuntimeError(
        'the ranks drew different initial values for the parameters the first forward pass '
        'shaped (lazy initialisation), and computed this first step\'s gradients on them: '
        'averaged, they would not be any one model\'s. Fix: call optimizer.update(lossfun, '
        '*inputs) for the first step (fastchain shapes the parameters, gives every rank '
        "rank 0's values, then computes the gradients), give the links their input sizes "
        "(L.Linear(n_in, n_out)), or seed every rank alike before the first forward pass "
        "(numpy.random.seed(0), and cupy.random.seed(0) for links on a GPU: Chainer's "
        "initializers draw from the global generator of the link's array module; seed each "
        'rank its own way after that step if it draws noise or dropout masks)')


def _check_shaped(target, forward_ran=True):
    """Every parameter has its shape (the gradients of all of them are
    averaged, in buckets laid out once). ``forward_ran``: False where the
    script's own forward pass may not have run yet."""
    missing = [name for name, p in sorted(target.namedparams()) if p.array is None]
    if missing:
        raise RuntimeError(
            'parameters of the model have no shape at its first data-parallel update (lazy '
            'initialisation): {}. {}he forward pass does not call their links (give those '
            'links their input sizes, or leave them out of the model): the data-parallel '
            "optimizer averages every parameter's gradient and lays them out once".format(
                ', '.join(missing), 'T' if forward_ran else
                'Either no forward pass has run yet (run it before optimizer.update(), or '
                'call optimizer.update(lossfun, *inputs)), or t'))


def _values_digest(link):
    import hashlib
    from chainer.backend import CpuDevice
    digest = hashlib.sha256()
    for name, p in sorted(link.namedparams()):
        digest.update(name.encode())
        digest.update(numpy.ascontiguousarray(CpuDevice().send(p.array)).tobytes())
    return digest.hexdigest()


def _attach(optimizer, comm, options, broadcast=True):
    """``broadcast``: rank 0's values to every rank (False where every
    rank's were checked equal after a forward pass each ran on its own
    batch: their running statistics stay each rank's, as after any step)."""
    target = optimizer.target
    _check_shaped(target)
    learner = options['learner']
    check_same_model(comm, target, dict(
        learner.settings(), bucket_cap_mb=options['cap'] / 2 ** 20,
        fp16_allreduce=options['dtype'] is not None))
    if broadcast:
        broadcast_parameters(comm, target)
    sync = GradientSync(comm, list(target.params()), options['cap'], options['dtype'],
                        options['overlap'])
    capture = GradientCapture(sync)
    learner._bind(sync)
    _patches.attach(optimizer, 'gradient_sync', sync)
    _patches.attach(optimizer, _all_ranks_any_key(),
                    functools.partial(comm.any, what='loss-scale agreement'))
    state = {'pending': False, 'exact': True}
    same = SameBatches(comm)        # ranks all training on the same batches
    # Capturing gradients during backward serves only to start buckets early;
    # where nothing overlaps (MPI on the CPU, a world of one) the hook is
    # left out: it only costs a function hook on every backward.
    captures = sync.overlap_enabled and comm.size > 1

    def update_data_parallel(next_, lossfun=None, *args, **kwds):
        learner.before_step()
        exact = state['exact'] = learner.averages_exactly()
        batch = _batch_size(args, kwds)
        if same.tries and lossfun is None:
            same.look(lambda: of_gradients(target.params()), batch)
        if lossfun is None:
            # Gradients were computed by the caller: average them all now.
            state['pending'] = True
            if exact:
                sync.begin_step()
            result = next_(None, *args, **kwds)
            learner.after_step(batch)
            return result
        inner = lossfun

        def lossfun_then_capture(*a, **k):
            loss = inner(*a, **k)
            if same.tries:
                same.look(lambda: of_step(loss, a, k), batch)
            target.cleargrads()             # what update() does next anyway
            if exact:
                sync.begin_step()
                if captures:
                    capture.refresh()
                    capture.__enter__()     # on for the backward only
            state['pending'] = True
            return loss
        try:
            result = next_(lossfun_then_capture, *args, **kwds)
        finally:
            if capture in _hooks():
                capture.__exit__(None, None, None)
        learner.after_step(batch)
        return result

    def reallocate_then_average(next_):
        if state['pending'] and capture in _hooks():
            capture.__exit__(None, None, None)
        next_()
        if state['pending']:
            state['pending'] = False
            if state['exact']:
                learner.exact_average()
            else:
                learner.average_gradients()

    _patches.wrap(optimizer, 'update', 'distributed', update_data_parallel)
    _patches.wrap(optimizer, 'reallocate_cleared_grads', 'distributed',
                  reallocate_then_average)


def _serialize_learner(learner, next_, serializer):
    next_(serializer)
    if isinstance(serializer, chainer.serializer.Deserializer):
        # A snapshot written before learners were saved, or by another
        # learner: nothing of this one's is in it (npz raises KeyError, HDF5
        # ValueError, a non-strict load gives None). A key missing further in
        # is the learner's to name, not taken for this.
        try:
            section = serializer[_learners.SERIAL_KEY]
            present = section('samples', None) is not None
        except (KeyError, ValueError):
            present = False
        if not present:
            if learner.per_rank_state or learner.distributed_after:
                raise ValueError(
                    'this snapshot holds no state of the {} learner (it was written with '
                    'another learner or an older fastchain); resume it with the learner it '
                    'was written with'.format(learner.name))
            return
    learner.serialize(serializer[_learners.SERIAL_KEY])


def make_learner(spec):
    """``None`` or ``'allreduce'``, ``'1bit'``, or a :class:`Learner`."""
    if spec is None or spec == 'allreduce':
        return AllReduce()
    if isinstance(spec, Learner):
        return spec
    if spec == '1bit':
        return QuantizedSGD(1)
    if isinstance(spec, type) and issubclass(spec, Learner):
        raise TypeError('learner={0}: give an instance, e.g. learner=distributed.{0}(...)'
                        .format(spec.__name__))
    raise ValueError(
        "learner must be 'allreduce', '1bit', or one of distributed.AllReduce(), "
        "QuantizedSGD(bits, error_feedback), BlockMomentum(block_size, ...), "
        "ModelAveraging(block_size); got {!r}".format(spec))


def _batch_size(args, kwds):
    """This rank's batch: the first input of ``update(lossfun, *inputs)``
    with a length, or None."""
    for value in list(args) + list(kwds.values()):
        shape = getattr(value, 'shape', None)
        if shape:
            return int(shape[0])
        if isinstance(value, (list, tuple)) and value:
            return len(value)
    return None


def _all_ranks_any_key():
    from fastchain.precision._attach import ALL_RANKS_ANY
    return ALL_RANKS_ANY


def _hooks():
    return list(chainer.get_function_hooks().values())


def check_same_model(comm, link, settings=None):
    """Every rank must have built the same parameters, and set up its
    optimizer alike (``settings``: its learner's and the exchange's); name
    the first difference and the rank that has it."""
    mine = ([(name, tuple(p.shape) if p.array is not None else None, str(p.dtype))
             for name, p in sorted(link.namedparams())], sorted((settings or {}).items()))
    everyone = comm.allgather_obj(mine, what='model check (allgather of parameter shapes '
                                  'and learner settings)')
    for rank, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        if comm.rank != 0:
            # Every rank sees the difference; let rank 0 report it (its abort
            # ends this process), so the error is shown once.
            time.sleep(min(10.0, comm.timeout))
        if theirs[0] == everyone[0][0]:     # the settings differ
            a, b = dict(everyone[0][1]), dict(theirs[1])
            first = next(k for k in sorted(set(a) | set(b), key=lambda k: (k != 'learner', k))
                         if a.get(k) != b.get(k))       # the kind first
            raise ValueError(
                'rank {0} set up its data-parallel optimizer differently from rank 0: '
                '{1} is {2!r} on rank 0 and {3!r} on rank {0}. Every rank must give the '
                'same learner and create_multi_node_optimizer arguments (check values '
                'that depend on the rank).'.format(rank, first, a.get(first), b.get(first)))
        a = {n: (shape, dtype) for n, shape, dtype in everyone[0][0]}
        b = {n: (shape, dtype) for n, shape, dtype in theirs[0]}
        names = sorted(set(a) | set(b))
        first = next(n for n in names if a.get(n) != b.get(n))
        raise ValueError(
            'rank {} built a different model than rank 0: parameter {!r} is {} on rank 0 '
            'and {} on rank {}. Every rank must construct the same model (check '
            'arguments that depend on the rank or on local data).'.format(
                rank, first, a.get(first, 'absent'), b.get(first, 'absent'), rank))


def broadcast_parameters(comm, link):
    """Rank 0's parameter values, on every rank (one broadcast per array)."""
    for name, p in sorted(link.namedparams()):
        comm.bcast(p.array, root=0, what='broadcast of parameter {}'.format(name))
    for name, value in sorted(_persistents(link)):
        comm.bcast(value, root=0, what='broadcast of {}'.format(name))


def _persistents(link):
    # BatchNormalization's running statistics, and any other persistent array.
    for path, sub in link.namedlinks():
        for name in sorted(sub._persistent):
            value = getattr(sub, name)
            if isinstance(value, numpy.ndarray) or type(value).__module__.startswith('cupy'):
                if value.ndim > 0:
                    yield path + '/' + name, value
