"""Block learners: block-momentum SGD (BMUF) and model averaging (see
``_learners`` for what every learner shares)."""

import time

import numpy

import chainer

from fastchain.distributed import _arguments, _finish
from fastchain.distributed._learners import Learner, _average

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

    and every rank goes on from ``S``. This is the paper's form. (CNTK's
    learner sums the ranks' block updates, an allreduce sum, and filters the
    sum with the gain ``(1 - block_momentum) * block_lr``: on their mean that
    is ``(1 - block_momentum) * block_lr * N``, which is ``block_lr`` at the
    default momentum ``1 - 1/N``, where the two forms agree, and differs at
    any other momentum. CNTK leaves the look-ahead in the model after its
    last exchange; :meth:`finish` leaves ``W``.)

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
        self.block_size = _arguments.count(
            'block_size', block_size, "a number of samples (each rank's, between two "
            'exchanges)', 1)
        if block_momentum is not None and not 0 <= _arguments.number(
                'block_momentum', block_momentum, 'a number in [0, 1)') < 1:
            raise ValueError('block_momentum must be in [0, 1), got {!r}'.format(
                block_momentum))
        self._block_momentum = block_momentum
        self.block_lr = _arguments.number('block_lr', block_lr, 'a number > 0')
        if not self.block_lr > 0:
            raise ValueError('block_lr must be > 0, got {!r}'.format(block_lr))
        self.nesterov = _arguments.flag('nesterov', nesterov)
        self.reset_local_momentum = _arguments.flag('reset_local_momentum',
                                                    reset_local_momentum)
        self.block_samples = 0          # this rank's, in the current block
        self.blocks = 0
        self.global_model = None        # W: host or device arrays (float32, float64)
        self.delta = None               # D

    @property
    def block_momentum(self):
        if self._block_momentum is not None:
            return float(self._block_momentum)
        return 1.0 - 1.0 / self.comm.size if self.comm is not None else None

    def _summary(self):
        return '{} (block {} samples/rank, momentum {:.3g}, lr {:g}{})'.format(
            self.name, self.block_size, self.block_momentum, self.block_lr,
            ', nesterov' if self.nesterov and self.block_momentum else '')

    def _counts_samples(self):
        return True

    def _prebind(self, optimizer, comm, distributed_after):
        super()._prebind(optimizer, comm, distributed_after)
        # here, not at _bind: a lazily shaped model binds inside the first
        # Trainer.run, which would have started without the layer
        _finish.acquire(self)

    def finish(self):
        """After the last update, on every rank (collective; a Trainer run
        that ends normally calls it, see ``_finish``): the current block ends
        (an exchange, if any sample was trained since the last) and every
        rank's links get the global model ``W``, not the look-ahead. ``D`` is
        zeroed: training that goes on starts its block filtering afresh
        from ``W``."""
        if self.params and (self._pending is not None or self._pending_shared is not None):
            self.before_step()      # a snapshot loaded, no update since: its state first
        if self.global_model is None:
            return          # in the warm start (the ranks agree) or never updated
        if self.block_samples:
            self._exchange()
        self._write_weights(self.global_model)
        for d in self.delta:
            d[...] = 0

    def settings(self):
        return dict(super().settings(), block_size=self.block_size,
                    block_momentum=self.block_momentum, block_lr=self.block_lr,
                    nesterov=self.nesterov, reset_local_momentum=self.reset_local_momentum)

    # The model as the learner sees it: fp32 masters where the optimizer has
    # them, else the parameters; and the persistent float arrays.

    def _weights(self):
        from fastchain.precision._snapshot import verify_masters
        verify_masters(self.optimizer)      # a master kept through a load, checked first
        out = []
        for p in self.params:
            rule = getattr(p, 'update_rule', None)
            master = getattr(rule, '_fp32_param', None)
            out.append(master.array if master is not None and master.array is not None
                       else p.array)
        return out

    def _persistents(self):
        out = []
        seen = set()        # a link held twice (tied) has its statistics once
        for path, link in sorted(self.optimizer.target.namedlinks(), key=lambda x: x[0]):
            if id(link) in seen:
                continue
            seen.add(id(link))
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
        return w + d.dtype.type(eta) * d if self.nesterov and eta else w

    def _start(self):
        xp = self._xp()
        self.global_model = [xp.array(w, _dtype(w)) for w in self._weights()]
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
        arrays = [w.astype(g.dtype, copy=False)
                  for w, g in zip(weights, self.global_model)] + persistents
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
                d *= d.dtype.type(eta)
                d += d.dtype.type(zeta) * block_update
                w += d
            new.append(self._block_start(w, d))
        self._write_weights(new)
        if self.reset_local_momentum:
            for p in self.params:
                rule = getattr(p, 'update_rule', None)
                if type(rule).__name__ in MOMENTUM_RULES:
                    # None until the rule's first update (a frozen link; a
                    # block whose steps the loss scaler all skipped)
                    for value in (rule.state or {}).values():
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
        xp = self._xp()
        self._write_weights([xp.asarray(state['weight' + self.names[id(p)]])
                             for p in self.params])
        for p in self.params:
            name = self.names[id(p)]
            rule = getattr(p, 'update_rule', None)
            states = getattr(rule, 'state', None) or {}
            for key, value in list(states.items()):
                saved = state.get('rule' + name + '/' + key)
                if value is None or saved is None:
                    continue
                if chainer.backend.get_array_module(value) is xp:
                    value[...] = xp.asarray(saved)
                else:       # a fresh optimizer loaded its state on the host
                    states[key] = xp.array(saved)
        for name, value in self._persistents():
            value[...] = xp.asarray(state['persistent' + name])

    def _shared_state(self, serializer):
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        self.block_samples = int(serializer('block_samples', self.block_samples))
        self.blocks = int(serializer('blocks', self.blocks))
        has = bool(serializer('has_global', self.global_model is not None))
        if not loading:
            if has:
                for p, w, d in zip(self.params, self.global_model, self.delta):
                    name = self.names[id(p)].lstrip('/')
                    serializer['global'](name, w)
                    serializer['delta'](name, d)
            return
        if not has:
            self.global_model = self.delta = None
            return
        self._pending_shared = {
            name: (numpy.asarray(serializer['global'](name.lstrip('/'), None)),
                   numpy.asarray(serializer['delta'](name.lstrip('/'), None)))
            for name in self._param_names()}

    def _apply_shared_state(self, state):
        xp = self._xp()
        dtypes = [_dtype(w) for w in self._weights()]
        # copies: an in-memory snapshot's arrays must not be trained in place
        self.global_model = [xp.array(state[self.names[id(p)]][0], t)
                             for p, t in zip(self.params, dtypes)]
        self.delta = [xp.array(state[self.names[id(p)]][1], t)
                      for p, t in zip(self.params, dtypes)]


def _dtype(weight):
    """The dtype ``W`` and ``D`` are kept in: float64 for a float64 model
    (its mean exact), float32 otherwise (fp16 parameters without masters
    too)."""
    return numpy.float64 if weight.dtype == numpy.float64 else numpy.float32


class ModelAveraging(BlockMomentum):
    """The ranks' models averaged every ``block_size`` samples of each rank
    (block momentum 0, block learning rate 1: the new model is exactly
    their mean)."""

    name = 'model averaging'

    def __init__(self, block_size, reset_local_momentum=True):
        super().__init__(block_size, block_momentum=0.0, block_lr=1.0, nesterov=False,
                         reset_local_momentum=reset_local_momentum)

    def _summary(self):
        return '{} (every {} samples/rank)'.format(self.name, self.block_size)
