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

import numpy

import chainer

from fastchain.config import _patches
from fastchain.distributed._quantize import BITS, Encoding

SERIAL_KEY = 'fastchain_learner'


# -- the learners ----------------------------------------------------------------


class Learner:
    """What every learner does: count samples, run the warm start, keep
    statistics, save and load its state. The default learner, exact
    gradient averaging every step, is :class:`AllReduce`."""

    name = 'allreduce'
    per_rank_state = False      # has state that differs between ranks

    def __init__(self):
        self.optimizer = None
        self.comm = None
        self.distributed_after = 0
        self.samples = 0            # over all ranks
        self.steps = 0
        self.batch_size = None      # this rank's, when update() is given no inputs
        self.started = False        # warm start over (the learner's own phase)
        self.stats = {'steps': 0, 'exchanges': 0, 'bytes_sent': 0, 'comm_seconds': 0.0}
        self._gathered = None       # (steps, [each rank's local state]) for a snapshot
        self._pending = None        # this rank's local state, loaded, applied at next update
        self._warned = set()

    # -- binding (create_multi_node_optimizer) ---------------------------------

    def _bind(self, optimizer, comm, sync, distributed_after):
        if self.optimizer is not None:
            raise ValueError('this {} already serves another optimizer: make one learner '
                             'per optimizer'.format(type(self).__name__))
        self.optimizer = optimizer
        self.comm = comm
        self.sync = sync
        self.distributed_after = int(distributed_after)
        self.params = list(sync.params)
        self.names = {id(p): n for n, p in optimizer.target.namedparams()}

    @property
    def warming(self):
        """Still in the warm start (exact averaging, ranks identical)."""
        return self.samples < self.distributed_after

    def averages_exactly(self):
        """This step: exact gradient averaging (GradientSync)?"""
        return not self.started

    # -- one step ------------------------------------------------------------

    def before_step(self):
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
        self._count(start, _ring_allreduce(self.comm.size, sum(
            p.size * numpy.dtype(self.sync.allreduce_dtype or p.dtype).itemsize
            for p in self.params)))

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
        self.samples += (batch or 0) * self.comm.size
        self._local_step(batch or 0)

    def _counts_samples(self):
        return self.warming

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
        """Counts so far: steps, samples, exchanges, bytes this rank sent
        (ring algorithms), seconds spent exchanging, and their per-step and
        per-sample means."""
        out = dict(self.stats, learner=self.describe(), samples=self.samples,
                   warm_start_over=self.started)
        steps = max(self.stats['steps'], 1)
        out['bytes_per_step'] = self.stats['bytes_sent'] / steps
        out['bytes_per_sample'] = self.stats['bytes_sent'] / max(
            self.samples / max(self.comm.size, 1), 1)
        return out

    def describe(self):
        text = self.name
        if self.distributed_after:
            text += ' after {} samples'.format(self.distributed_after)
        return text

    # -- state ---------------------------------------------------------------

    def local_state(self):
        """This rank's own state (name -> host array); empty if the ranks share it."""
        return {}

    def _apply_local_state(self, state):
        pass

    def _shared_state(self, serializer):
        """State every rank has the same copy of (saved from any rank)."""

    def gather_for_snapshot(self):
        """Collective: every rank's local state, kept for the snapshot about
        to be written (:func:`multi_node_snapshot` calls it on every rank)."""
        if self.per_rank_state and self.comm.size > 1:
            self._gathered = (self.steps, self.comm.allgather_obj(
                self.local_state(), what='snapshot: gathering every rank\'s learner state'))

    def serialize(self, serializer):
        loading = isinstance(serializer, chainer.serializer.Deserializer)
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
        template = self.local_state()
        sub = serializer['rank{}'.format(mine)]
        state = {key: numpy.asarray(sub(key, None)) for key in sorted(template)}
        if mine != self.comm.rank:
            state = self._foreign(state)
        self._pending = state

    def _foreign(self, state):
        """Rank 0's local state, loaded on another rank (a rank-0 snapshot)."""
        return state

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=_patches.user_stacklevel())


_PARTIAL_SAVE = (
    'fastchain: this snapshot is written by rank {1} alone, so it holds only that rank\'s '
    '{0} state (the other ranks\' residuals or block state are not in it) and a run '
    'resumed from it will not continue identically. Fix: add the snapshot on every rank '
    'with distributed.multi_node_snapshot(comm, extensions.snapshot(...))')
_PARTIAL_LOAD = (
    'fastchain: rank {1} resumes the {0} learner from a snapshot that holds rank 0\'s state '
    'only (written without distributed.multi_node_snapshot): this rank starts from rank '
    '0\'s model and no residual, so the run does not continue identically')


class AllReduce(Learner):
    """Average the exact gradients every step (ChainerMN's synchronous
    data parallelism; the default)."""

    def averages_exactly(self):
        return True


class QuantizedSGD(Learner):
    """1-bit SGD (Seide et al., 2014) and its multi-bit relatives.

    Each step, each rank adds its residual to its gradient, encodes the sum
    with ``bits`` bits per value (see ``_quantize``), keeps what the
    encoding lost as the next residual (error feedback), and sends the
    packed encoding; every rank decodes all of them and averages, in rank
    order, so the ranks stay identical. Over many steps the applied updates
    add up to the true gradients' sum less the current residual.

    Args:
        bits (int): 1, 2, 4, 8, or 16 (IEEE half precision).
        error_feedback (bool): keep the residual (without it, what the
            encoding loses is lost).

    A step with a non-finite gradient on any rank (an fp16 overflow) is
    averaged exactly instead, the residuals untouched, so the loss
    scaler sees the overflow on every rank and skips the step everywhere.
    """

    name = 'quantized'
    per_rank_state = True

    def __init__(self, bits=1, error_feedback=True):
        super().__init__()
        if bits not in BITS:
            raise ValueError('QuantizedSGD bits must be one of {}, got {!r}'.format(
                ', '.join(map(str, BITS)), bits))
        self.bits = bits
        self.error_feedback = bool(error_feedback)
        self.residuals = None
        self.fallback_steps = 0
        self._scale = None

    def _bind(self, *args):
        super()._bind(*args)
        self.encoding = Encoding([p.shape for p in self.params], self.bits)

    def describe(self):
        text = '{}-bit SGD{}'.format(self.bits, '' if self.error_feedback
                                     else ' without error feedback')
        if self.bits == 16:
            text = 'fp16 SGD' + text[len('16-bit SGD'):]
        if self.distributed_after:
            text += ' after {} samples'.format(self.distributed_after)
        return text

    def _residuals(self, xp):
        if self.residuals is None:
            self.residuals = [xp.zeros(p.shape, xp.float32) for p in self.params]
        return self.residuals

    def average_gradients(self):
        params = self.params
        xp = chainer.backend.get_array_module(params[0].grad) if params else numpy
        grads = [p.grad for p in params]
        start = time.perf_counter()
        bad = any(not bool(xp.isfinite(g).all()) for g in grads)
        if self.comm.any(bad, 'non-finite gradient agreement'):
            self.fallback_steps += 1
            self.exact_average()
            return
        residuals = self._residuals(xp)
        scale = self.optimizer._loss_scale or 1.0
        if self._scale is not None and scale != self._scale:
            # The residual is in the units of the (loss-scaled) gradients.
            for r in residuals:
                r *= numpy.float32(scale / self._scale)
        self._scale = scale
        values = [g.astype(xp.float32) + r for g, r in zip(grads, residuals)]
        codes, levels = self.encoding.encode(values)
        if self.error_feedback:
            mine = self.encoding.split(self.encoding.decode(codes, levels))
            for r, v, q in zip(residuals, values, mine):
                xp.subtract(v, q, out=r)
        all_codes = self.comm.allgather(codes, 'quantized gradient exchange (codes)')
        all_levels = self.comm.allgather(levels, 'quantized gradient exchange (levels)') \
            if levels.size else [levels] * self.comm.size
        total = self.encoding.decode(all_codes[0], all_levels[0])
        buffer = xp.empty_like(total)
        for rank in range(1, self.comm.size):
            total += self.encoding.decode(all_codes[rank], all_levels[rank], out=buffer)
        total /= numpy.float32(self.comm.size)
        for p, avg in zip(params, self.encoding.split(total)):
            p.grad[...] = avg
        self._count(start, (self.comm.size - 1) * self.encoding.payload_bytes)

    def _start(self):
        self.residuals = None       # the warm start averaged exactly: nothing owed

    def local_state(self):
        if self.residuals is None:
            return {self._key(p): numpy.zeros(p.shape, numpy.float32) for p in self.params}
        return {self._key(p): chainer.backend.CpuDevice().send(r)
                for p, r in zip(self.params, self.residuals)}

    def _key(self, p):
        return 'residual' + self.names[id(p)]

    def _apply_local_state(self, state):
        xp = chainer.backend.get_array_module(self.params[0].array) if self.params else numpy
        self.residuals = [xp.asarray(state[self._key(p)], xp.float32) for p in self.params]

    def _foreign(self, state):
        return {k: numpy.zeros_like(v) for k, v in state.items()}

    def _shared_state(self, serializer):
        scale = serializer('residual_scale', self._scale or 0.0)
        self._scale = float(scale) or None
        self.fallback_steps = int(serializer('fallback_steps', self.fallback_steps))


MOMENTUM_RULES = ('MomentumSGDRule', 'NesterovAGRule', 'CorrectedMomentumSGDRule')


class BlockMomentum(Learner):
    """Block-wise model-update filtering (BMUF; Chen and Huo, 2016; CNTK's
    block-momentum distributed learner).

    Each rank trains alone (its own optimizer, no exchange) for
    ``block_size`` of its own samples, from the block's start model ``S``.
    Then the ranks average their models (one allreduce of the weights and
    the persistent statistics) and, with ``W`` the global model and ``D``
    the filtered block update (both zero-initialised from the first
    block's start)::

        D = block_momentum * D + block_lr * (mean of the ranks' models - S)
        W = W + D
        S = W + block_momentum * D     (nesterov=True: the look-ahead)
            W                          (nesterov=False)

    and every rank goes on from ``S``. (CNTK's implementation filters with
    the gain ``(1 - block_momentum) * block_lr`` and goes on from
    ``S + ...``; this is the paper's form, whose gain ``block_lr / (1 -
    block_momentum)`` is ``N`` with the defaults: the sum of the ranks'
    progress, not their mean.)

    Args:
        block_size (int): samples each rank trains on between two
            exchanges (CNTK's ``block_size`` counts all workers' samples:
            N times this).
        block_momentum (float): in [0, 1); default ``1 - 1/N`` for N ranks
            (CNTK's default).
        block_lr (float): the block learning rate (CNTK's default 1.0).
        nesterov (bool): start each block from the look-ahead model
            (CNTK's default True).
        reset_local_momentum (bool): zero the momentum buffers of the
            ranks' optimizers (MomentumSGD, NesterovAG,
            CorrectedMomentumSGD) after each exchange, CNTK's default; other
            optimizers' state stays each rank's own.

    Batch normalization's running statistics (and any persistent float
    array) are averaged at each exchange. With block momentum 0 and block
    learning rate 1 the new model is exactly the ranks' mean
    (:class:`ModelAveraging`). fp16 models with fp32 master weights are
    averaged on the masters.
    """

    name = 'block momentum'
    per_rank_state = True

    def __init__(self, block_size, block_momentum=None, block_lr=1.0, nesterov=True,
                 reset_local_momentum=True):
        super().__init__()
        if isinstance(block_size, bool) or not isinstance(block_size, (int, numpy.integer)) \
                or block_size < 1:
            raise ValueError('block_size must be a number of samples >= 1 (each rank\'s, '
                             'between two exchanges), got {!r}'.format(block_size))
        if block_momentum is not None and not 0 <= block_momentum < 1:
            raise ValueError('block_momentum must be in [0, 1), got {!r}'.format(
                block_momentum))
        if not block_lr > 0:
            raise ValueError('block_lr must be > 0, got {!r}'.format(block_lr))
        self.block_size = int(block_size)
        self._block_momentum = block_momentum
        self.block_lr = float(block_lr)
        self.nesterov = bool(nesterov)
        self.reset_local_momentum = bool(reset_local_momentum)
        self.block_samples = 0          # this rank's, in the current block
        self.blocks = 0
        self.global_model = None        # W: host or device arrays, float32
        self.delta = None               # D

    @property
    def block_momentum(self):
        if self._block_momentum is not None:
            return float(self._block_momentum)
        return 1.0 - 1.0 / self.comm.size if self.comm is not None else None

    def describe(self):
        text = '{} (block {} samples/rank, momentum {:.3g}, lr {:g}{})'.format(
            self.name, self.block_size, self.block_momentum, self.block_lr,
            ', nesterov' if self.nesterov and self.block_momentum else '')
        if self.distributed_after:
            text += ' after {} samples'.format(self.distributed_after)
        return text

    def _counts_samples(self):
        return True

    # The model as the learner sees it: fp32 masters where the optimizer has
    # them, else the parameters; and the persistent float arrays.

    def _weights(self):
        out = []
        for p in self.params:
            rule = getattr(p, 'update_rule', None)
            master = getattr(rule, '_fp32_param', None)
            out.append(master.array if master is not None and master.array is not None
                       else p.array)
        return out

    def _persistents(self):
        out = []
        for path, link in sorted(self.optimizer.target.namedlinks()):
            for name in sorted(link._persistent):
                value = getattr(link, name)
                if hasattr(value, 'dtype') and getattr(value, 'ndim', 0) > 0 and \
                        value.dtype.kind == 'f':
                    out.append((path + '/' + name, value))
        return out

    def _write_weights(self, arrays):
        for p, w, new in zip(self.params, self._weights(), arrays):
            if w is not p.array:
                w[...] = new
                p.array[...] = new.astype(p.dtype)
            else:
                p.array[...] = new

    def _block_start(self, w, d):
        """The model a block starts from: W, or its look-ahead W + momentum D."""
        eta = self.block_momentum
        return w + numpy.float32(eta) * d if self.nesterov and eta else w

    def _start(self):
        xp = chainer.backend.get_array_module(self.params[0].array) if self.params else numpy
        self.global_model = [xp.array(w, xp.float32) for w in self._weights()]
        self.delta = [xp.zeros_like(w) for w in self.global_model]
        self.block_samples = 0

    def _local_step(self, batch):
        if not self.started:
            return          # warm start: averaged exactly every step
        self.block_samples += batch
        if self.block_samples >= self.block_size:
            self._exchange()

    def _exchange(self):
        start = time.perf_counter()
        weights = self._weights()
        persistents = [v for _, v in self._persistents()]
        arrays = [w.astype(numpy.float32) if w.dtype != numpy.float32 else w
                  for w in weights] + persistents
        mean, nbytes = _average(self.comm, arrays, 'block momentum: averaging the models')
        for v, m in zip(persistents, mean[len(weights):]):
            v[...] = m
        eta, zeta = self.block_momentum, self.block_lr
        new = []
        for w, d, m in zip(self.global_model, self.delta, mean[:len(weights)]):
            if eta == 0 and zeta == 1:
                w[...] = m              # model averaging: the mean itself, exactly
                d[...] = 0
            else:
                block_update = m - self._block_start(w, d)
                d *= numpy.float32(eta)
                d += numpy.float32(zeta) * block_update
                w += d
            new.append(self._block_start(w, d))
        self._write_weights(new)
        if self.reset_local_momentum:
            for p in self.params:
                rule = getattr(p, 'update_rule', None)
                if type(rule).__name__ in MOMENTUM_RULES:
                    for value in rule.state.values():
                        if value is not None:
                            value.fill(0)
        self.block_samples = 0
        self.blocks += 1
        self._count(start, nbytes)

    # -- state ---------------------------------------------------------------

    def local_state(self):
        host = chainer.backend.CpuDevice()
        state = {}
        for p, w in zip(self.params, self._weights()):
            name = self.names[id(p)]
            state['weight' + name] = host.send(w)
            rule = getattr(p, 'update_rule', None)
            for key, value in sorted((getattr(rule, 'state', None) or {}).items()):
                if value is not None:
                    state['rule' + name + '/' + key] = host.send(value)
        for name, value in self._persistents():
            state['persistent' + name] = host.send(value)
        return state

    def _apply_local_state(self, state):
        xp = chainer.backend.get_array_module(self.params[0].array) if self.params else numpy
        for p, w in zip(self.params, self._weights()):
            name = self.names[id(p)]
            new = xp.asarray(state['weight' + name])
            if w is not p.array:
                w[...] = new
            p.array[...] = new.astype(p.dtype)
            rule = getattr(p, 'update_rule', None)
            for key, value in (getattr(rule, 'state', None) or {}).items():
                if value is not None and 'rule' + name + '/' + key in state:
                    value[...] = xp.asarray(state['rule' + name + '/' + key])
        for name, value in self._persistents():
            value[...] = xp.asarray(state['persistent' + name])

    def _shared_state(self, serializer):
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        self.block_samples = int(serializer('block_samples', self.block_samples))
        self.blocks = int(serializer('blocks', self.blocks))
        has = bool(serializer('has_global', self.global_model is not None))
        if not has:
            self.global_model = self.delta = None
            return
        if loading and self.global_model is None:
            xp = chainer.backend.get_array_module(self.params[0].array)
            self.global_model = [xp.zeros(p.shape, xp.float32) for p in self.params]
            self.delta = [xp.zeros(p.shape, xp.float32) for p in self.params]
        for p, g, d in zip(self.params, self.global_model, self.delta):
            name = self.names[id(p)]
            for prefix, array in (('global', g), ('delta', d)):
                if loading:
                    array[...] = chainer.backend.get_array_module(array).asarray(
                        serializer[prefix](name.lstrip('/'), None))
                else:
                    serializer[prefix](name.lstrip('/'), array)


class ModelAveraging(BlockMomentum):
    """The ranks' models averaged every ``block_size`` samples of each rank
    (block momentum 0, block learning rate 1: the new model is exactly
    their mean)."""

    name = 'model averaging'

    def __init__(self, block_size, reset_local_momentum=True):
        super().__init__(block_size, block_momentum=0.0, block_lr=1.0, nesterov=False,
                         reset_local_momentum=reset_local_momentum)

    def describe(self):
        text = '{} (every {} samples/rank)'.format(self.name, self.block_size)
        if self.distributed_after:
            text += ' after {} samples'.format(self.distributed_after)
        return text


# -- choosing one ---------------------------------------------------------------

NAMES = {'allreduce': AllReduce, '1bit': lambda: QuantizedSGD(1)}


def make_learner(spec):
    """``None`` or ``'allreduce'``, ``'1bit'``, or a :class:`Learner`."""
    if spec is None:
        return AllReduce()
    if isinstance(spec, Learner):
        return spec
    if isinstance(spec, str) and spec in NAMES:
        return NAMES[spec]()
    if isinstance(spec, type) and issubclass(spec, Learner):
        raise TypeError('learner={0}: give an instance, e.g. learner=distributed.{0}(...)'
                        .format(spec.__name__))
    raise ValueError(
        "learner must be 'allreduce', '1bit', or one of distributed.AllReduce(), "
        "QuantizedSGD(bits, error_feedback), BlockMomentum(block_size, ...), "
        "ModelAveraging(block_size); got {!r}".format(spec))


# -- helpers --------------------------------------------------------------------


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
