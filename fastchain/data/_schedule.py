"""The loading schedule: which examples make each batch, and each example's
seed.

The orders come from one of two sources:

* a seed (the default): each epoch's permutation depends only on the seed
  and the epoch, so the iterator, its worker pool and a resumed run compute
  the same one, as far ahead as they like;
* a Chainer order sampler (``order_sampler(current_order, position)``, as
  SerialIterator takes): each epoch's order is drawn when the training loop
  reaches the end of the previous epoch, as SerialIterator draws it, so an
  order is only known from then on (:meth:`Schedule.plan` stops there).

The examples' seeds depend only on the seed, the epoch and the position.
"""

import hashlib

import numpy


class Schedule:
    """The order of a dataset's examples over epochs, cut into batches.

    Batches are walked as Chainer's SerialIterator walks them: a batch that
    reaches the end of an epoch is completed from the next one (with
    ``repeat``) or ends short (without).

    Args:
        n (int): examples in the dataset.
        batch_size (int): examples per batch.
        shuffle (bool): a new permutation each epoch (ignored with
            ``sampler``).
        repeat (bool): loop over epochs, or stop after the first.
        seed (int): the permutations' and the examples' seed.
        sampler (callable or None): a Chainer order sampler; the orders are
            then drawn from it (see :meth:`restart` and :meth:`batch`).
    """

    def __init__(self, n, batch_size, shuffle, repeat, seed, sampler=None):
        self.n = n
        self.batch_size = batch_size
        self.shuffle = shuffle or sampler is not None
        self.repeat = repeat
        self.seed = seed
        self.sampler = sampler
        self._orders = {}       # epoch -> order (a loaded snapshot may set one)

    def order(self, epoch):
        """The examples of ``epoch``, in order; ``None`` for a sampler's
        order not drawn yet."""
        order = self._orders.get(epoch)
        if order is None and self.sampler is None:
            if self.shuffle:
                order = numpy.random.default_rng([self.seed, epoch]).permutation(self.n)
            else:
                order = numpy.arange(self.n)
            self._keep(order, epoch)
        return order

    def set_order(self, epoch, order):
        """Use ``order`` for ``epoch`` (a snapshot's) and forget the others."""
        self._orders = {epoch: self._checked(order)}

    def restart(self, order=None):
        """Back to the start: the orders are forgotten. With a sampler, epoch
        0's order is ``order`` or, by default, drawn now, as SerialIterator
        draws it at construction and in ``reset()``."""
        self._orders = {}
        if self.sampler is not None:
            if order is None:
                order = self.sampler(numpy.arange(self.n), 0)
            self.set_order(0, order)

    def batch(self, epoch, position, draw=False):
        """``(indices, next_epoch, next_position)`` of the batch that starts
        at ``(epoch, position)``, or ``None`` where a sampler's order it needs
        is not drawn yet.

        With ``draw`` (the training loop's ``next()``), a sampler's next
        order is drawn at each end of an epoch the batch reaches, with the
        arguments and at the moment SerialIterator draws it (also where the
        batch ends exactly there, and at the end of the only epoch without
        ``repeat``), unless it was drawn before.
        """
        if draw and self.sampler is not None:      # the consumer has left these
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
        indices = []
        while len(indices) < self.batch_size:
            order = self.order(epoch)
            if order is None:
                return None
            start = position
            take = order[position:position + self.batch_size - len(indices)]
            indices.extend(int(i) for i in take)
            position += len(take)
            if position >= self.n:
                if draw and self.order(epoch + 1) is None:
                    self._orders[epoch + 1] = self._checked(self.sampler(order, start))
                epoch, position = epoch + 1, 0
                if not self.repeat:
                    break
        return indices, epoch, position

    def draws_in(self, epoch, position):
        """Whether the batch at ``(epoch, position)`` draws from the sampler
        (it reaches the end of the epoch)."""
        return self.sampler is not None and (self.repeat or epoch == 0) \
            and position + self.batch_size >= self.n

    def seeds(self, epoch, position, count):
        """The ``numpy.random`` seed of each example of the batch at
        ``(epoch, position)``."""
        rng = numpy.random.default_rng([self.seed, epoch, position])
        return rng.integers(0, 2**32, count, dtype=numpy.uint64).tolist()

    def plan(self, epoch, position):
        """What a worker pool loads: ``(indices, seeds, next_epoch,
        next_position)`` for the batch at ``(epoch, position)``, or ``None``
        where there is none (after the only epoch, without ``repeat``) or
        none yet (a sampler's order not drawn)."""
        if not self.repeat and epoch > 0:
            return None
        batch = self.batch(epoch, position)
        if batch is None:
            return None
        indices, next_epoch, next_position = batch
        return (indices, self.seeds(epoch, position, len(indices)),
                next_epoch, next_position)

    def _keep(self, order, epoch):
        """Remember a computed ``order`` for ``epoch``, and the one before."""
        self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
        self._orders[epoch] = order

    def _checked(self, order):
        order = numpy.asarray(order)
        if order.shape != (self.n,):
            raise ValueError('an order must hold one index per example ({}), got '
                             'shape {}'.format(self.n, order.shape))
        return order


def order_source(rng, shuffle, order_sampler, order):
    """``(rng, order sampler or None)``, checked as SerialIterator checks
    ``shuffle`` against ``order_sampler``."""
    rng = rng or ('global' if order_sampler is not None else 'seed')
    if rng not in ('seed', 'global'):
        raise ValueError("rng must be 'seed' or 'global', got {!r}".format(rng))
    if order_sampler is not None and (shuffle is not None or rng != 'global'):
        raise ValueError("an order_sampler gives the orders with rng='global' and "
                         "shuffle=None; got rng={!r}, shuffle={!r}".format(rng, shuffle))
    if rng == 'global' and order_sampler is None and shuffle is not False:
        from chainer.iterators import ShuffleOrderSampler
        order_sampler = ShuffleOrderSampler()
    if order is not None and order_sampler is None:
        raise ValueError("order (the first epoch's) needs rng='global' and an order "
                         "sampler to draw the next ones")
    return rng, order_sampler


def seed_from_global_rng():
    """A seed that depends only on the state of NumPy's global RNG, which it
    leaves as it is: ``numpy.random.seed(s)`` before makes it repeatable."""
    state = numpy.random.get_state(legacy=False)
    digest = hashlib.sha256(repr(_canonical(state)).encode()).digest()
    return int.from_bytes(digest[:8], 'little') % 2**63


def _canonical(value):
    if isinstance(value, dict):
        return tuple((k, _canonical(value[k])) for k in sorted(value))
    if isinstance(value, numpy.ndarray):
        return (str(value.dtype), value.shape, value.tobytes())
    return value
