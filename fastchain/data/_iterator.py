"""A multiprocess prefetching iterator with exact, resumable order."""

import os

import numpy

import chainer
from chainer.dataset import iterator as iterator_module

from fastchain.data import _workers
from fastchain.data._pool import WorkerPool
from fastchain.data._schedule import Schedule

SIZING_TRIES = 16   # examples tried, in order, for one to lay out the shared memory


class DataLoadError(Exception):
    """An example could not be loaded.

    Attributes:
        index (int): the example's index in the dataset.
        path (str or None): its file, when the dataset has one.
    """

    def __init__(self, index, path, kind, message, detail=''):
        self.index = index
        self.path = path
        where = 'example {}'.format(index) + (' ({})'.format(path) if path else '')
        super().__init__('{}: {}: {}{}'.format(
            where, kind, message,
            ('\nIn the worker:\n' + detail) if detail else ''))


def available_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class MultiprocessIterator(iterator_module.Iterator):
    """Loads batches in worker processes, ahead of use, in a fixed order.

    The order of examples (and the seed of ``numpy.random`` for each
    example's augmentation) depends only on ``seed``, the epoch and the
    position, never on which worker ran what, so a run is reproducible and a
    snapshot resumes in the middle of an epoch exactly.

    Array fields of the examples are written by the workers straight into
    shared memory (laid out from the first example of the order that loads),
    one slot per batch in flight; only labels and other small fields are
    pickled.

    A :class:`~fastchain.data.DevicePrefetcher` can wrap it: it reads ahead
    and gives back what the training loop did not use through :meth:`seek`.

    Args:
        dataset: any Chainer dataset (indexable, ``len``).
        batch_size (int): examples per batch.
        repeat (bool): loop over epochs (training) or stop after one.
        shuffle (bool): a new permutation each epoch.
        seed (int): the order's and the augmentation's seed (default: drawn
            from the OS, and saved in snapshots).
        n_workers (int): worker processes (default: the cores available to
            this process). ``0`` loads in the calling process.
        prefetch (int): batches in flight (default: ``2 * n_workers``).
        on_error (str): ``'raise'`` (default): a bad example raises
            :class:`DataLoadError` naming its index and file. ``'skip'``: it
            is left out of its batch and counted in :attr:`skipped` (and
            reported as ``skipped_examples`` to Chainer's reporter). Either
            way this happens in :meth:`next`, for the batch the example is
            in, with or without workers.
        shared_memory (bool): pass arrays through /dev/shm (default) or
            pickle them through pipes.
        timeout (float): seconds to wait for one batch before raising
            ``TimeoutError`` (default: wait as long as the workers live).
        start_method (str): multiprocessing start method (default ``'fork'``
            where available: the dataset need not be picklable).

    .. note::
       With workers and shared memory, the first examples of the order are
       loaded here, at construction, until one loads: its arrays give the
       layout of the shared memory. If none of the first 16 loads, the
       constructor raises :class:`DataLoadError` for the first of them.
    """

    _pool = None

    def __init__(self, dataset, batch_size, repeat=True, shuffle=True, seed=None,
                 n_workers=None, prefetch=None, on_error='raise',
                 shared_memory=True, timeout=None, start_method=None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) \
                or batch_size < 1:
            raise ValueError('batch_size must be a positive int, got {!r}'.format(batch_size))
        if on_error not in ('raise', 'skip'):
            raise ValueError("on_error must be 'raise' or 'skip', got {!r}".format(on_error))
        n_workers = available_cores() if n_workers is None else n_workers
        if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 0:
            raise ValueError('n_workers must be an int >= 0, got {!r}'.format(n_workers))
        prefetch = max(2, 2 * n_workers) if prefetch is None else prefetch
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError('prefetch must be an int >= 1, got {!r}'.format(prefetch))
        if len(dataset) == 0:
            raise ValueError('the dataset is empty')
        self.dataset = dataset
        self.batch_size = batch_size
        self.n_workers = n_workers
        self.prefetch = prefetch
        self.on_error = on_error
        self._timeout = timeout
        seed = int(numpy.random.SeedSequence(seed).entropy % 2**63) \
            if seed is None else int(seed)
        self._schedule = Schedule(len(dataset), batch_size, shuffle, repeat, seed)
        self.skipped = []       # [{'index', 'path', 'error'}] with on_error='skip'
        self._pool = None
        self._reset_position()
        if n_workers > 0:
            sample = self._sample() if shared_memory else None
            self._pool = WorkerPool(dataset, self._schedule.plan, batch_size, n_workers,
                                    prefetch, sample, timeout, start_method)
            self._pool.seek(self.epoch, self.current_position)

    # -- chainer.dataset.Iterator --------------------------------------------

    def __next__(self):
        if not self.repeat and self.epoch > 0:
            raise StopIteration
        indices, epoch, position = self._schedule.batch(self.epoch, self.current_position)
        if self._pool is not None:
            batch = self._take(indices)
        else:
            batch = self._load_here(indices)
        self._previous_epoch_detail = self.epoch_detail
        self.is_new_epoch = epoch > self.epoch
        self.epoch, self.current_position = epoch, position
        return batch

    next = __next__

    @property
    def epoch_detail(self):
        return self.epoch + self.current_position / len(self.dataset)

    @property
    def previous_epoch_detail(self):
        if self._previous_epoch_detail < 0:
            return None
        return self._previous_epoch_detail

    @property
    def repeat(self):
        return self._schedule.repeat

    @property
    def timeout(self):
        """Seconds to wait for one batch (``None``: as long as the workers live)."""
        return self._timeout

    @timeout.setter
    def timeout(self, value):
        self._timeout = value
        if self._pool is not None:
            self._pool.timeout = value

    def reset(self):
        """Back to the start of epoch 0 (what Chainer's Evaluator calls)."""
        self._reset_position()
        self._restart_loading()

    def seek(self, epoch, current_position, is_new_epoch=False,
             previous_epoch_detail=None):
        """Move to ``(epoch, current_position)``: the next batch starts there.

        Batches loaded ahead are dropped (after waiting for those in flight:
        the workers may be writing into their slots) and loading restarts
        there. :class:`~fastchain.data.DevicePrefetcher` calls this to give
        back the batches it fetched but the training loop did not use; the
        last two arguments restore what :attr:`is_new_epoch` and
        :attr:`previous_epoch_detail` said at that point.
        """
        if not 0 <= current_position < len(self.dataset):
            raise ValueError('current_position must be in [0, {}), got {!r}'.format(
                len(self.dataset), current_position))
        self.epoch, self.current_position = int(epoch), int(current_position)
        self.is_new_epoch = bool(is_new_epoch)
        self._previous_epoch_detail = -1.0 if previous_epoch_detail is None \
            else float(previous_epoch_detail)
        self._restart_loading()

    def serialize(self, serializer):
        """Saves and restores the position, the seed and the epoch's order.

        The keys are SerialIterator's, so a snapshot moves between the two.
        """
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        schedule = self._schedule
        try:
            self.current_position = int(serializer('current_position', self.current_position))
            self.epoch = int(serializer('epoch', self.epoch))
            self.is_new_epoch = bool(serializer('is_new_epoch', self.is_new_epoch))
            self._previous_epoch_detail = float(serializer(
                'previous_epoch_detail', self._previous_epoch_detail))
            try:
                schedule.seed = int(serializer('fastchain_seed', schedule.seed))
            except KeyError:
                pass        # a SerialIterator snapshot: its 'order' below is enough
            if schedule.shuffle:
                order = numpy.array(schedule.order(self.epoch))
                serializer('order', order)
                if loading:
                    schedule.set_order(self.epoch, order)
        finally:
            if loading:     # what was loaded ahead was for the old position
                self._restart_loading()

    def finalize(self):
        """Stop the workers and free the shared memory (idempotent)."""
        if self._pool is not None:
            self._pool.close()

    def __del__(self):
        self.finalize()

    # -- position ------------------------------------------------------------

    def _reset_position(self):
        self.epoch = 0
        self.current_position = 0
        self.is_new_epoch = False
        self._previous_epoch_detail = -1.0
        self._schedule.forget_orders()

    def _restart_loading(self):
        pool = self._pool
        if pool is not None and not pool.closed:
            pool.seek(self.epoch, self.current_position)

    # -- loading -------------------------------------------------------------

    def _sample(self):
        """The first example of the order that loads, to lay out the shared
        memory. A bad one is not reported here but by the batch it is in,
        as without workers: a run resumed from a snapshot may never load it."""
        first = None
        for index in self._schedule.order(0)[:SIZING_TRIES]:
            try:
                return self.dataset[int(index)]
            except Exception as e:
                first = first or (int(index), e)
        index, error = first
        kind, message, path = _workers.describe_error(error)
        raise DataLoadError(index, self._path_of(index, path), kind, (
            '{} (and none of the first {} examples of the order loads: the '
            'shared memory is laid out from one that does. Check the dataset '
            'or pass shared_memory=False)').format(
                message, min(SIZING_TRIES, len(self.dataset)))) from error

    def _take(self, indices):
        pool = self._pool
        if pool.closed:
            raise RuntimeError('fastchain: this MultiprocessIterator was finalized '
                               '(its workers are stopped); make a new one')
        batch, errors = pool.take(indices)
        for index, kind, message, path, detail in errors:
            self._on_bad_example(index, kind, message, path, detail)
        self._report_skipped()
        pool.fill()
        return batch

    def _load_here(self, indices):
        batch = []
        seeds = self._schedule.seeds(self.epoch, self.current_position, len(indices))
        for index, seed in zip(indices, seeds):
            numpy.random.seed(seed)
            try:
                batch.append(self.dataset[index])
            except Exception as e:
                kind, message, path = _workers.describe_error(e)
                self._on_bad_example(index, kind, message, path, '')
        self._report_skipped()
        return batch

    def _on_bad_example(self, index, kind, message, path, detail):
        path = self._path_of(index, path)
        if self.on_error == 'raise':
            self.finalize()
            raise DataLoadError(index, path, kind, message, detail)
        self.skipped.append({'index': index, 'path': path,
                             'error': '{}: {}'.format(kind, message)})

    def _path_of(self, index, path):
        if path is None and hasattr(self.dataset, 'path'):
            try:
                path = self.dataset.path(index)
            except Exception:
                path = None
        return path

    def _report_skipped(self):
        if self.on_error == 'skip':
            chainer.report({'skipped_examples': len(self.skipped)})
