"""Distributed learners: how the ranks of a data-parallel optimizer combine
their work (CNTK's distributed learners, on fastchain's communicators).

=====================  =========================================  =======================
learner                every step / every block                   sends per rank
=====================  =========================================  =======================
:class:`AllReduce`     average the gradients (exact)              2(N-1)/N x gradient bytes
(the default)                                                     a step
:class:`QuantizedSGD`  each rank encodes gradient + residual in   (N-1) x payload a step
                       1 (2, 4, 8, 16) bits per value, keeps the  (1 bit: 1/32 of the
                       encoding error as the next step's          gradient + 8 bytes a row)
                       residual; the ranks average the decoded
                       encodings
:class:`BlockMomentum` ranks train alone for ``block_size``       2(N-1)/N x model bytes
(BMUF)                 samples each; the block's averaged model   a block
                       change is applied with block momentum
:class:`ModelAveraging`  block momentum 0: the ranks' models are  the same
                       averaged every block
=====================  =========================================  =======================

Bytes are what one rank sends with ring algorithms (the bandwidth-optimal
allreduce and allgather that MPI and NCCL use for large messages); the
one-number agreements (the loss scaler's skip decision, a non-finite check)
are left out.

**Warm start** (``create_multi_node_optimizer(..., distributed_after=N)``):
for the first ``N`` samples (counted over all ranks) every learner averages
the exact gradients every step, which is the training of one worker with the
global batch, so the ranks stay bitwise identical; after that the learner
takes over. (For :class:`AllReduce` that is what it always does.)

Every rank must see the same sequence of batch sizes (what
:func:`scatter_dataset` and a repeating iterator give): the ranks count
samples to decide together when a block ends and when the warm start does.

State that differs between ranks (the quantization residuals; a block's
local models and optimizer state) is in a snapshot only when every rank
contributes to it: add the snapshot with :func:`multi_node_snapshot` on
every rank. A snapshot taken on rank 0 alone holds rank 0's part and says
so when it is written and when it is loaded.
"""

import time
import warnings
import weakref

import numpy

import chainer

from fastchain.config import _patches
from fastchain.distributed import _rank_state

SERIAL_KEY = 'fastchain_learner'


# -- the learners ----------------------------------------------------------------


class Learner:
    """What every learner does: count samples, run the warm start, keep
    statistics, save and load its state. The default learner, exact
    gradient averaging every step, is :class:`AllReduce`."""

    name = 'allreduce'
    per_rank_state = False      # has state that differs between ranks

    def __init__(self):
        self._optimizer = None      # held weakly: the optimizer holds its learner
        self.comm = None
        self.distributed_after = 0
        self.samples = 0            # over all ranks
        self.steps = 0
        self.batch_size = None      # this rank's, when update() is given no inputs
        self.started = False        # warm start over (the learner's own phase)
        # this process's counts (a resumed run: since its resume)
        self.stats = {'steps': 0, 'samples_since_start': 0, 'exchanges': 0, 'bytes_sent': 0,
                      'comm_seconds': 0.0}
        self.params = []
        self.names = {}
        self._gathered = None       # (steps, [each rank's local state]) for a snapshot
        self._pending = None        # this rank's local state, loaded, applied at next update
        self._pending_shared = None     # the same for the state all ranks share
        self._warned = set()

    @property
    def optimizer(self):
        """The optimizer served (None before set-up or once it is gone)."""
        return None if self._optimizer is None else self._optimizer()

    @optimizer.setter
    def optimizer(self, optimizer):
        # The optimizer's attachments (kept as long as it lives, in a weak
        # table) hold the learner: a strong reference back would keep the
        # optimizer and its model alive for the life of the process.
        self._optimizer = None if optimizer is None else weakref.ref(optimizer)

    # -- binding (create_multi_node_optimizer) ---------------------------------

    def _prebind(self, optimizer, comm, distributed_after):
        """At ``create_multi_node_optimizer``: a snapshot may be loaded
        before the parameters have shapes (and before :meth:`_bind`)."""
        if self.optimizer is not None:
            raise ValueError('this {} already serves another optimizer: make one learner '
                             'per optimizer'.format(type(self).__name__))
        self.optimizer = optimizer
        self.comm = comm
        self.distributed_after = int(distributed_after)

    def _bind(self, sync):
        """When the ranks have agreed on the model (its parameters have shapes)."""
        self.sync = sync
        self.params = list(sync.params)
        self.names = _unique_names(self.optimizer.target)
        self._exact_bytes = _ring_allreduce(self.comm.size, sum(
            p.size * numpy.dtype(sync.allreduce_dtype or p.dtype).itemsize
            for p in self.params))

    @property
    def warming(self):
        """Still in the warm start (exact averaging, ranks identical)."""
        return self.samples < self.distributed_after

    def averages_exactly(self):
        """This step: exact gradient averaging (GradientSync)?"""
        return not self.started

    # -- one step ------------------------------------------------------------

    def before_step(self):
        if self._pending_shared is not None:
            self._apply_shared_state(self._pending_shared)
            self._pending_shared = None
        if self._pending is not None:
            self._apply_local_state(self._pending)
            self._pending = None
        if not self.started and not self.warming:
            self.started = True
            self._start()

    def exact_average(self):
        """The warm start's (and AllReduce's) averaging, counted."""
        start = time.perf_counter()
        self.sync.finish()
        self._count(start, self._exact_bytes)

    def average_gradients(self):
        """After backward, when :meth:`averages_exactly` said no."""

    def after_step(self, batch):
        """After the update: count the samples, start or end phases."""
        if batch is None:
            batch = self.batch_size
        if batch is None and self._counts_samples():
            raise ValueError(
                'the {} learner counts samples, and this update() was given no inputs to '
                'count: call optimizer.update(lossfun, x, ...) or set '
                'distributed.learner_of(optimizer).batch_size to the batch size of each '
                'rank'.format(self.name))
        self.steps += 1
        self.stats['steps'] += 1
        self.stats['samples_since_start'] += (batch or 0) * self.comm.size
        self.samples += (batch or 0) * self.comm.size
        self._local_step(batch or 0)

    def _counts_samples(self):
        return self.warming

    def finish(self):
        """After the last update, on every rank: leave every rank the
        training's model (see ``_finish``; a Trainer run that ends normally
        calls it). The ranks of this learner hold the same model already."""

    def _start(self):
        """The warm start is over (or there was none): the learner's phase
        begins, before this step."""

    def _local_step(self, batch):
        pass

    def _count(self, start, nbytes):
        self.stats['exchanges'] += 1
        self.stats['bytes_sent'] += int(nbytes)
        self.stats['comm_seconds'] += time.perf_counter() - start

    def report(self):
        """Counts: ``samples`` (over all ranks, the whole training's: restored
        from a snapshot, as the warm start and the blocks follow it) and this
        process's (a resumed run: since its resume): ``steps``,
        ``samples_since_start``, exchanges, bytes this rank sent (ring
        algorithms), seconds the host spent in the exchanges
        (``comm_seconds``: on NCCL an allreduce the host only launches counts
        its launch; its time on the device is the timeline's allreduce
        device track), and the bytes' per-step and per-sample means. Samples
        are counted from ``update(lossfun, *inputs)``'s first input (or
        ``batch_size``): with neither, none are, and ``bytes_per_sample`` is
        None."""
        out = dict(self.stats, learner=self.describe(), samples=self.samples,
                   warm_start_over=self.started)
        steps = max(self.stats['steps'], 1)
        out['bytes_per_step'] = self.stats['bytes_sent'] / steps
        samples = self.stats['samples_since_start'] / max(self.comm.size, 1)
        out['bytes_per_sample'] = self.stats['bytes_sent'] / samples if samples else None
        return out

    def describe(self):
        """The learner in a few words (its settings, and the warm start)."""
        text = self._summary()
        if self.distributed_after:
            text += ' after {} samples'.format(self.distributed_after)
        return text

    def _summary(self):
        return self.name

    def settings(self):
        """What every rank's learner must agree on (compared at set-up:
        ranks given different settings would exchange mismatched messages or
        train apart without a word)."""
        return {'learner': type(self).__name__, 'distributed_after': self.distributed_after}

    def _xp(self):
        """The array module of the model's parameters (now: a model may
        have moved to a device since binding)."""
        return chainer.backend.get_array_module(self.params[0].array) if self.params \
            else numpy

    # -- state ---------------------------------------------------------------

    def local_state(self):
        """This rank's own state (name -> host array); empty if the ranks share it."""
        return {}

    def _apply_local_state(self, state):
        pass

    def _shared_state(self, serializer):
        """State every rank has the same copy of (saved from any rank);
        loaded into ``_pending_shared``, applied at the next update."""

    def _apply_shared_state(self, state):
        pass

    def _param_names(self):
        return sorted(set(_unique_names(self.optimizer.target).values()))

    def gather_for_snapshot(self):
        """Collective: every rank's local state, kept for the snapshot about
        to be written (:func:`multi_node_snapshot` calls it on every rank)."""
        if not self.per_rank_state or self.comm.size == 1:
            return
        what = "snapshot: sending rank 0 this rank's learner state"
        if self.comm.rank == 0:
            states = [self.local_state()]
            for rank in range(1, self.comm.size):
                states.append(self.comm.recv_obj(rank, what="snapshot: rank {}'s learner "
                                                  "state".format(rank)))
            self._gathered = (self.steps, states)
        else:
            self.comm.send_obj(self.local_state(), 0, what=what)

    def serialize(self, serializer):
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        if loading:
            saved = _saved_name(serializer)
            if saved is not None and saved != self.name:
                # (another learner's state went on silently, or failed on a
                # key of its own)
                raise ValueError('this snapshot was written with the {!r} learner, and this '
                                 "optimizer's is {!r}: resume it with the learner it was "
                                 'written with'.format(saved, self.name))
        else:
            serializer('learner', numpy.frombuffer(self.name.encode(), dtype=numpy.uint8))
        self.samples = int(serializer('samples', self.samples))
        self.steps = int(serializer('steps', self.steps))
        self.started = bool(serializer('started', self.started))
        self._shared_state(serializer)
        if not self.per_rank_state:
            return
        size = self.comm.size
        if not loading:
            gathered = self._gathered
            self._gathered = None
            if gathered is not None and gathered[0] == self.steps:
                states = gathered[1]
            else:
                states = [self.local_state()]
                if size > 1:
                    self._warn_once('save', _PARTIAL_SAVE.format(self.name, self.comm.rank))
            serializer('ranks_saved', len(states))
            for rank, state in enumerate(states):
                sub = serializer['rank{}'.format(rank)]
                for key in sorted(state):
                    sub(key, state[key])
            return
        saved = int(serializer('ranks_saved', 0))
        if saved == size:
            mine = self.comm.rank
        elif saved == 1:
            mine = 0
            if self.comm.rank != 0:
                self._warn_once('load', _PARTIAL_LOAD.format(self.name, self.comm.rank))
        else:
            raise ValueError(
                'this snapshot holds the {} learner state of {} ranks, and this job has {}: '
                'resume it with mpiexec -n {}'.format(self.name, saved, size, saved))
        sub = serializer['rank{}'.format(mine)]
        state = {key: numpy.asarray(sub(key, None)) for key in self._section_keys(sub)}
        if mine != self.comm.rank:
            state = self._foreign(state)
        self._pending = state

    def _foreign(self, state):
        """Rank 0's local state, loaded on another rank (a rank-0 snapshot)."""
        return state

    def _section_keys(self, sub):
        """The keys saved under ``sub``: read from the file where the
        deserializer shows it (npz), else those this rank's state has now."""
        keys = _rank_state.saved_keys(sub)
        return keys if keys is not None else sorted(self.local_state())

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            from fastchain.config._warning import FastchainWarning
            warnings.warn(message, FastchainWarning, stacklevel=_patches.user_stacklevel())


_PARTIAL_SAVE = (
    'fastchain: this snapshot is written by rank {1} alone, so it holds only that rank\'s '
    '{0} state (the other ranks\' residuals or block state are not in it) and a run '
    'resumed from it will not continue identically. Fix: add the snapshot on every rank '
    'with distributed.multi_node_snapshot(comm, extensions.snapshot(...))')
_PARTIAL_LOAD = (
    'fastchain: rank {1} resumes the {0} learner from a snapshot that holds rank 0\'s state '
    'only (written without distributed.multi_node_snapshot): this rank starts from rank '
    '0\'s model and no residual, so the run does not continue identically')


def _saved_name(serializer):
    """The learner's name a snapshot keeps, or None (one written before it
    was kept: npz raises KeyError, HDF5 ValueError)."""
    try:
        value = serializer('learner', None)
    except (KeyError, ValueError):
        return None
    return None if value is None else bytes(numpy.asarray(value, numpy.uint8)).decode()


class AllReduce(Learner):
    """Average the exact gradients every step (ChainerMN's synchronous
    data parallelism; the default)."""

    def averages_exactly(self):
        return True


# -- helpers --------------------------------------------------------------------


def _unique_names(link):
    """Each parameter's name in snapshots: its first in sorted order (a
    parameter two links hold, tied by assignment, has a name in each)."""
    names = {}
    for name, p in sorted(link.namedparams(), key=lambda item: item[0]):
        names.setdefault(id(p), name)
    return names


def _ring_allreduce(size, nbytes):
    return 2 * (size - 1) * nbytes // size if size > 1 else 0


def _average(comm, arrays, what):
    """The element-wise mean over ranks of each array (float32 and other
    float dtypes packed one buffer per dtype); returns (means, bytes sent)."""
    xp = chainer.backend.get_array_module(arrays[0]) if arrays else numpy
    by_dtype = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype.str, []).append(i)
    out = [None] * len(arrays)
    nbytes = 0
    for _, indexes in sorted(by_dtype.items()):
        buffer = xp.concatenate([arrays[i].ravel() for i in indexes])
        comm.allreduce(buffer, what)
        buffer /= buffer.dtype.type(comm.size)
        nbytes += _ring_allreduce(comm.size, buffer.nbytes)
        offset = 0
        for i in indexes:
            n = arrays[i].size
            out[i] = buffer[offset:offset + n].reshape(arrays[i].shape)
            offset += n
    return out, nbytes
