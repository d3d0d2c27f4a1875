"""A multiprocess prefetching iterator with exact, resumable order."""

import numpy
import chainer
from chainer.dataset import iterator as iterator_module

from fastchain import _node
from fastchain.data import _follow, _workers
from fastchain.data._draws import KeptGenerators, say_draws
from fastchain.data._generators import find as find_generators, seed_example
from fastchain.data._errors import (DataLoadError, FixedBatchSize, _whole, check_args,
                                    chainer_names, check_same_length, load_order)
from fastchain.data._pool import WorkerPool
from fastchain.data._schedule import Schedule, order_source, seed_from_global_rng

SIZING_TRIES = 16   # examples tried, in order, for one to lay out the shared memory


def available_cores():
    return len(_node.own_cores())


class MultiprocessIterator(iterator_module.Iterator):
    """Loads batches in worker processes, ahead of use, in a fixed order.

    Where its random numbers come from (``rng``):

    * ``'seed'`` (the default): the order of examples (and the seed of
      ``numpy.random`` for each example's augmentation) depends only on
      ``seed``, the epoch and the position, never on which worker ran what,
      so a run is reproducible and a snapshot resumes in the middle of an
      epoch exactly;
    * ``'global'``: it walks the dataset as Chainer's SerialIterator does,
      following NumPy's global RNG: the orders come from ``order_sampler``
      (by default ``ShuffleOrderSampler()``, which draws from that RNG;
      index order with ``shuffle=False``), drawn at SerialIterator's moments
      (at construction, in :meth:`reset`, and in the :meth:`next` that
      reaches the end of an epoch). Under ``numpy.random.seed`` a run gets
      SerialIterator's batches and leaves the global RNG where it would.
      The workers cannot load past the end of an epoch before that draw:
      the batch that crosses it is loaded while :meth:`next` waits.

    Array fields of the examples are written by the workers straight into
    shared memory (laid out from the first example of the order that loads),
    one slot per batch in flight; only labels and other small fields are
    pickled.

    A :class:`~fastchain.data.DevicePrefetcher` can wrap it (reading ahead
    where :meth:`may_fetch_ahead`; :meth:`seek` gives back what is unused).

    Args:
        dataset: any Chainer dataset (indexable, ``len``).
        batch_size (int): examples per batch.
        repeat (bool): loop over epochs (training) or stop after one.
        shuffle (bool): a new permutation each epoch (default ``True``; with
            ``order_sampler``, leave it ``None``).
        seed (int): the order's and the augmentation's seed (default: drawn
            from the OS; with ``rng='global'``, derived from the state of
            NumPy's global RNG without drawing from it), saved in snapshots.
        n_workers (int): worker processes (default: this process's cores; 0: none).
        prefetch (int): batches in flight (default: ``2 * n_workers``).
        on_error (str): ``'raise'`` (default): a bad example raises
            :class:`DataLoadError` naming its index and file. ``'skip'``: it
            is left out of its batch and listed in :attr:`skipped` (each
            :meth:`next` reports ``skipped_examples`` to Chainer's reporter:
            how many the batches it took left out, so LogReport's mean of it
            times the iterations is the count); a batch none of whose examples
            loads is left out as well (the next is taken, so the epoch ends a
            batch earlier: in a data-parallel job trigger what makes collective
            calls by iteration, not epoch; after a whole epoch's worth of
            examples none of which loads, :class:`DataLoadError`). Either way
            this happens in :meth:`next`, for the batch the example is in.
        shared_memory (bool): arrays through /dev/shm (default) or pickled.
        timeout (float): seconds to wait for one batch before raising
            ``TimeoutError`` (default: wait as long as the workers live).
        start_method (str): multiprocessing start method (default ``'fork'``
            where available: the dataset need not be picklable).
        rng (str): ``'seed'`` or ``'global'`` (default: ``'global'`` with ``order_sampler``).
        order_sampler (callable): with ``rng='global'``, a Chainer order
            sampler (``sampler(current_order, current_position)`` returns the
            next epoch's order), called as SerialIterator calls it.
        order: with an order sampler, the first epoch's order, already drawn
            (e.g. a SerialIterator's, to take its place); default: drawn here.
        warn_draws (bool): warn once at the first example a worker loads that
            draws random numbers, naming the generators (``fastchain.enable`` sets it).

    .. note::
       The batch size and the dataset's length are fixed (a change is refused,
       naming the fix); the workers hold the dataset as it was at their start.

    .. note::
       With workers and shared memory, the first examples of the order are
       loaded here, at construction, until one loads: its arrays give the
       layout of the shared memory. If none of the first 16 loads, the
       constructor raises :class:`DataLoadError` for the first of them.
       Any random numbers they draw leave NumPy's global RNG, Python's
       ``random`` and the dataset's own generators as they were.

    .. note::
       With ``rng='global'``, examples loaded here (``n_workers=0``) draw as
       SerialIterator's do; a worker's draw from ``numpy.random``, Python's
       ``random`` and the dataset's generators (``self.rng``, a transform's)
       seeded per example from ``seed``: the same for any number of workers
       under one ``numpy.random.seed``, but not SerialIterator's numbers.
    """

    _pool = None
    _drew = None
    _resync = False     # an interrupt came: the workers load again from the place kept
    batch_size = FixedBatchSize()

    def __init__(self, dataset, batch_size, repeat=True, shuffle=None, seed=None,
                 n_workers=None, prefetch=None, on_error='raise',
                 shared_memory=True, timeout=None, start_method=None,
                 rng=None, order_sampler=None, order=None, warn_draws=False, **chainer_args):
        chainer_names(chainer_args)
        n_workers = available_cores() if n_workers is None else n_workers
        if prefetch is None and _whole(n_workers, 0):
            prefetch = max(2, 2 * n_workers)
        batch_size, n_workers, prefetch = check_args(
            dataset, batch_size, n_workers, prefetch, on_error, timeout, seed, shared_memory)
        rng, sampler = order_source(rng, shuffle, order_sampler, order)
        self.dataset = dataset
        self._own = find_generators(dataset)     # the dataset's own generators
        self.batch_size = batch_size
        self.n_workers = n_workers
        self.prefetch = prefetch
        self.on_error = on_error
        self.rng = rng
        self._timeout = timeout
        self._schedule = Schedule(len(dataset), batch_size, shuffle is not False,
                                  repeat, None, sampler)
        self.skipped = []       # [{'index', 'path', 'error'}] with on_error='skip'
        self._pool = None
        self._worker_tuner = None
        self._reset_position(order)     # with a sampler: its first draw
        if seed is None:
            seed = seed_from_global_rng() if rng == 'global' \
                else numpy.random.SeedSequence().entropy % 2**63
        self._schedule.seed = int(seed)
        if n_workers > 0:
            sample = self._sample() if shared_memory else None
            self._pool = WorkerPool(dataset, self._schedule.plan, batch_size, n_workers,
                                    prefetch, sample, timeout, start_method)
            self._pool.watch = bool(warn_draws)
            self._pool.seek(self.epoch, self.current_position)

    # -- chainer.dataset.Iterator --------------------------------------------

    def __next__(self):
        # With on_error='skip', a batch none of whose examples loaded is left
        # out as they are (the next one is taken: an empty batch cannot be
        # converted); the epoch counters cover every batch taken.
        before, at_start, tried = self.epoch_detail, self.epoch, 0
        skipped_before = len(self.skipped)
        check_same_length(self, self._schedule.n)
        if self._pool is not None and self._worker_tuner is not None:
            self._worker_tuner.step(self._pool)         # once a step
        while True:
            if not self.repeat and self.epoch > 0:
                self._previous_epoch_detail = before    # as Chainer's iterators say
                raise StopIteration
            indices, epoch, position = self._schedule.batch(
                self.epoch, self.current_position, draw=True)
            try:
                batch, failed = self._take(indices) if self._pool is not None \
                    else self._load_here(indices), None
            except DataLoadError as e:  # past it, as Chainer's iterators stand
                batch, failed = None, e
            except BaseException:       # Ctrl-C, a dead worker: the place stays (the
                self._resync = True     # pool is not touched now: Ctrl-C may end the run)
                raise
            self._previous_epoch_detail, self.is_new_epoch = before, epoch > at_start
            self.epoch, self.current_position = epoch, position
            if failed is not None:      # (the script's iterator is handed back past it)
                self.finalize()
                raise failed
            if self._drew is not None:
                drew, self._drew = self._drew, None
                say_draws(*drew)    # (raised under -W error: the position moved on)
            if self.on_error == 'skip' and len(batch):
                chainer.report({'skipped_examples': len(self.skipped) - skipped_before})
            if len(batch) or self.on_error != 'skip':
                return batch
            tried += len(indices)
            if tried >= len(self.dataset):
                bad = self.skipped[-1]
                raise DataLoadError(bad['index'], bad['path'], 'no example loads', (
                    'on_error=\'skip\' left out the last {} examples taken, a whole '
                    "epoch's worth, and none loaded (the last: {}). Check the dataset"
                    .format(tried, bad['error'])))

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

    def may_fetch_ahead(self):
        """Whether the next batch may be fetched ahead of the training loop,
        on another thread, without changing the training.

        Not where the examples load in this process (``n_workers=0``: they
        draw from NumPy's global RNG, or seed it, which the training loop's
        thread draws from too), nor with ``rng='global'`` where fetching it
        draws from the order sampler (the batch reaches the end of an epoch):
        that must happen in the training loop's own ``next()``.
        """
        if not self.repeat and self.epoch > 0:
            return True     # only StopIteration is left
        if self._pool is None:
            return False    # loaded here, seeding NumPy's global RNG meanwhile
        # with on_error='skip', a batch left out takes the next one, which
        # may reach the end of the epoch: no fetching ahead under 'global'
        return self.rng == 'seed' or (self.on_error != 'skip' and not
                                      self._schedule.draws_in(self.epoch, self.current_position))

    def reset(self):
        """Back to the start of epoch 0 (what Chainer's Evaluator calls).
        With an order sampler, its first order is drawn again, as
        SerialIterator's ``reset()`` draws it."""
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
        if self._schedule.order(int(epoch)) is None:
            raise ValueError('epoch {}\'s order is not drawn yet (or forgotten): '
                             'with an order sampler, seek() goes back within the '
                             'epochs walked'.format(epoch))
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
                order = schedule.order(self.epoch)
                # None: loading where this epoch's order is not drawn (a buffer)
                order = numpy.array(numpy.arange(schedule.n) if order is None else order)
                load_order(serializer, order)
                if loading:
                    schedule.set_order(self.epoch, order)
        finally:
            if loading:     # what was loaded ahead was for the old position
                self._restart_loading()

    def finalize(self):
        """Stop the workers, free the shared memory, hand back (``_follow``); idempotent."""
        if self._pool is not None:
            self._pool.close()
        if callable(getattr(_follow, 'release', None)):     # (None at the exit)
            _follow.release(self)

    def __del__(self):
        self.finalize()

    # -- position ------------------------------------------------------------

    def _reset_position(self, order=None):
        self.epoch = 0
        self.current_position = 0
        self.is_new_epoch = False
        self._previous_epoch_detail = -1.0
        self._schedule.restart(order)

    def _restart_loading(self):
        pool = self._pool
        if pool is not None and not pool.closed:
            pool.seek(self.epoch, self.current_position)

    def tune_workers(self):
        """Let autotune choose how many of the workers load (:mod:`fastchain.data._tune`):
        the batches and their order are the same whatever it picks."""
        from fastchain.data._tune import tuner_for
        self._worker_tuner = tuner_for(self) or self._worker_tuner

    # -- loading -------------------------------------------------------------

    def _sample(self):
        """The first example of the order that loads, to lay out the shared
        memory. A bad one is not reported here but by the batch it is in,
        as without workers: a run resumed from a snapshot may never load it."""
        first = None
        with KeptGenerators(self._own):     # an example may draw from them
            for index in self._schedule.order(self.epoch)[:SIZING_TRIES]:
                try:
                    return self.dataset[numpy.intp(index)]
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
        if self._resync:
            self._resync = False
            pool.seek(self.epoch, self.current_position)
        pool.fill()         # the batch after a sampler's draw is not sent yet
        batch, errors, drew = pool.take(indices)
        for index, kind, message, path, detail in errors:
            self._on_bad_example(index, kind, message, path, detail)
        if drew is not None and pool.watch:
            pool.watch = False
            self._drew = drew       # said by __next__ once the batch is taken
        pool.fill()
        return batch

    def _load_here(self, indices):
        if self.rng == 'global':        # that RNG, as SerialIterator's examples
            return self._load_examples(indices, [None] * len(indices))
        # 'seed': each example seeded as in a worker; the global RNGs are left
        # as they were (dropout masks and the rest of the script draw from them).
        with KeptGenerators(self._own):
            return self._load_examples(indices, self._schedule.seeds(
                self.epoch, self.current_position, len(indices)))

    def _load_examples(self, indices, seeds):
        batch = []
        for index, seed in zip(indices, seeds):
            if seed is not None:
                seed_example(seed, self._own)
            try:
                batch.append(self.dataset[numpy.intp(index)])     # Chainer's index type
            except Exception as e:
                kind, message, path = _workers.describe_error(e)
                self._on_bad_example(index, kind, message, path, '')
        return batch

    def _on_bad_example(self, index, kind, message, path, detail):
        path = self._path_of(index, path)
        if self.on_error == 'raise':
            raise DataLoadError(index, path, kind, message, detail)
        self.skipped.append({'index': index, 'path': path, 'error': kind + ': ' + str(message)})

    def _path_of(self, index, path):
        if path is None and hasattr(self.dataset, 'path'):
            try:
                path = self.dataset.path(index)
            except Exception:
                path = None
        return path
