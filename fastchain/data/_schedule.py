"""The loading schedule: which examples make each batch, and each example's
seed.

Both depend only on the seed, the epoch and the position in the epoch, so
the iterator, its worker pool and a resumed run all agree on them.
"""

import numpy


class Schedule:
    """The order of a dataset's examples over epochs, cut into batches.

    Batches are walked as Chainer's SerialIterator walks them: a batch that
    reaches the end of an epoch is completed from the next one (with
    ``repeat``) or ends short (without).

    Args:
        n (int): examples in the dataset.
        batch_size (int): examples per batch.
        shuffle (bool): a new permutation each epoch.
        repeat (bool): loop over epochs, or stop after the first.
        seed (int): the permutations' and the examples' seed.
    """

    def __init__(self, n, batch_size, shuffle, repeat, seed):
        self.n = n
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.repeat = repeat
        self.seed = seed
        self._orders = {}       # epoch -> order (a loaded snapshot may set one)

    def order(self, epoch):
        """The examples of ``epoch``, in order (cached for two epochs)."""
        order = self._orders.get(epoch)
        if order is None:
            if self.shuffle:
                order = numpy.random.default_rng([self.seed, epoch]).permutation(self.n)
            else:
                order = numpy.arange(self.n)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return order

    def set_order(self, epoch, order):
        """Use ``order`` for ``epoch`` (a snapshot's) and forget the others."""
        self._orders = {epoch: order}

    def forget_orders(self):
        self._orders = {}

    def batch(self, epoch, position):
        """``(indices, next_epoch, next_position)`` of the batch that starts
        at ``(epoch, position)``."""
        indices = []
        while len(indices) < self.batch_size:
            take = self.order(epoch)[position:position + self.batch_size - len(indices)]
            indices.extend(int(i) for i in take)
            position += len(take)
            if position >= self.n:
                epoch, position = epoch + 1, 0
                if not self.repeat:
                    break
        return indices, epoch, position

    def seeds(self, epoch, position, count):
        """The ``numpy.random`` seed of each example of the batch at
        ``(epoch, position)``."""
        rng = numpy.random.default_rng([self.seed, epoch, position])
        return rng.integers(0, 2**32, count, dtype=numpy.uint64).tolist()

    def plan(self, epoch, position):
        """What a worker pool loads: ``(indices, seeds, next_epoch,
        next_position)`` for the batch at ``(epoch, position)``, or ``None``
        where there is none (after the only epoch, without ``repeat``)."""
        if not self.repeat and epoch > 0:
            return None
        indices, next_epoch, next_position = self.batch(epoch, position)
        return (indices, self.seeds(epoch, position, len(indices)),
                next_epoch, next_position)
