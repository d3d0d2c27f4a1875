"""A multiprocess prefetching iterator with exact, resumable order."""

import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import weakref

import numpy

import chainer
from chainer.dataset import iterator as iterator_module

from fastchain.data import _workers


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


class LoadedBatch(list):
    """A batch (list of examples) from the workers.

    ``stacked`` is, when every example came through shared memory, a tuple
    with one ``(batch, ...)`` array per array field (``None`` for the other
    fields): the examples are rows of these arrays.
    """

    stacked = None


class WorkerDiedError(RuntimeError):
    """A worker process ended without being asked to."""


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
    shared memory (sized from the first example), one slot per batch in
    flight; only labels and other small fields are pickled.

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
            reported as ``skipped_examples`` to Chainer's reporter).
        shared_memory (bool): pass arrays through /dev/shm (default) or
            pickle them through pipes.
        timeout (float): seconds to wait for one batch before raising
            ``TimeoutError`` (default: wait as long as the workers live).
        start_method (str): multiprocessing start method (default ``'fork'``
            where available: the dataset need not be picklable).
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
        self._repeat = repeat
        self._shuffle = shuffle
        self.n_workers = n_workers
        self.prefetch = prefetch
        self.on_error = on_error
        self.timeout = timeout
        self._seed = int(numpy.random.SeedSequence(seed).entropy % 2**63) \
            if seed is None else int(seed)
        self.skipped = []       # [{'index', 'path', 'error'}] with on_error='skip'
        self._orders = {}       # epoch -> order (a loaded snapshot may set one)
        self._pool = None
        self._reset_position()
        if n_workers > 0:
            self._pool = _Pool(self, shared_memory, start_method)
            self._pool.fill()

    # -- chainer.dataset.Iterator --------------------------------------------

    def __next__(self):
        if not self._repeat and self.epoch > 0:
            raise StopIteration
        indices, epoch, position = self._plan(self.epoch, self.current_position)
        if self._pool is not None:
            if self._pool.closed:
                raise RuntimeError('fastchain: this MultiprocessIterator was finalized '
                                   '(its workers are stopped); make a new one')
            batch = self._pool.take(indices)
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
        return self._repeat

    def reset(self):
        """Back to the start of epoch 0 (what Chainer's Evaluator calls)."""
        pool = self._live_pool()
        if pool is not None:
            pool.drain()
        self._reset_position()
        if pool is not None:
            pool.fill()

    def serialize(self, serializer):
        """Saves and restores the position, the seed and the epoch's order.

        The keys are SerialIterator's, so a snapshot moves between the two.
        """
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        pool = self._live_pool()
        if loading and pool is not None:
            pool.drain()
        self.current_position = int(serializer('current_position', self.current_position))
        self.epoch = int(serializer('epoch', self.epoch))
        self.is_new_epoch = bool(serializer('is_new_epoch', self.is_new_epoch))
        self._previous_epoch_detail = float(serializer(
            'previous_epoch_detail', self._previous_epoch_detail))
        try:
            self._seed = int(serializer('fastchain_seed', self._seed))
        except KeyError:
            pass        # a SerialIterator snapshot: its 'order' below is enough
        if self._shuffle:
            order = numpy.array(self._order(self.epoch))
            serializer('order', order)
            if loading:
                self._orders = {self.epoch: order}
        if loading and pool is not None:
            pool.fill()

    def _live_pool(self):
        pool = self._pool
        return pool if pool is not None and not pool.closed else None

    def finalize(self):
        """Stop the workers and free the shared memory (idempotent)."""
        if self._pool is not None:
            self._pool.close()

    def __del__(self):
        self.finalize()

    # -- order ---------------------------------------------------------------

    def _reset_position(self):
        self.epoch = 0
        self.current_position = 0
        self.is_new_epoch = False
        self._previous_epoch_detail = -1.0
        self._orders = {}

    def _order(self, epoch):
        order = self._orders.get(epoch)
        if order is None:
            n = len(self.dataset)
            if self._shuffle:
                order = numpy.random.default_rng([self._seed, epoch]).permutation(n)
            else:
                order = numpy.arange(n)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return order

    def _plan(self, epoch, position):
        """The indices of the batch starting at (epoch, position), and the
        position after it (as SerialIterator would walk)."""
        n = len(self.dataset)
        indices = []
        while len(indices) < self.batch_size:
            take = self._order(epoch)[position:position + self.batch_size - len(indices)]
            indices.extend(int(i) for i in take)
            position += len(take)
            if position >= n:
                epoch, position = epoch + 1, 0
                if not self._repeat:
                    break
        return indices, epoch, position

    # -- loading -------------------------------------------------------------

    def _load_here(self, indices):
        batch = []
        seeds = _seeds(self._seed, self.epoch, self.current_position, len(indices))
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
        if path is None and hasattr(self.dataset, 'path'):
            try:
                path = self.dataset.path(index)
            except Exception:
                path = None
        if self.on_error == 'raise':
            self.finalize()
            raise DataLoadError(index, path, kind, message, detail)
        self.skipped.append({'index': index, 'path': path,
                             'error': '{}: {}'.format(kind, message)})

    def _report_skipped(self):
        if self.on_error == 'skip':
            chainer.report({'skipped_examples': len(self.skipped)})


class _Pool:
    """The workers, their pipes, the shared slots and the batches in flight."""

    def __init__(self, it, shared_memory, start_method):
        self.it = it
        ctx = multiprocessing.get_context(start_method or (
            'fork' if 'fork' in multiprocessing.get_all_start_methods() else None))
        first = it.dataset[int(it._order(0)[0])]    # fails early, in this process
        self.layout = _workers.SlotLayout(first, it.batch_size)
        self.shm = None
        if shared_memory and any(self.layout.fields):
            self.shm = _workers.create_shared_memory(self.layout.slot_bytes * it.prefetch)
        self.free_slots = list(range(it.prefetch))
        self.in_flight = {}     # batch id -> (slot, indices, worker, cursor)
        self.results = {}
        self.next_id = 0
        self.next_cursor = (it.epoch, it.current_position)
        self.workers, self.task_conns, self.result_conns = [], [], []
        parent = os.getpid()
        for w in range(it.n_workers):
            task_r, task_w = ctx.Pipe(duplex=False)
            result_r, result_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_workers.worker_main, daemon=True,
                            name='fastchain-loader-{}'.format(w),
                            args=(it.dataset, task_r, result_w,
                                  self.shm.name if self.shm else None,
                                  self.layout, parent))
            p.start()
            task_r.close()
            result_w.close()
            self.workers.append(p)
            self.task_conns.append(task_w)
            self.result_conns.append(result_r)
        self._finalizer = weakref.finalize(
            self, _shutdown, self.workers, self.task_conns, self.result_conns, self.shm)

    def fill(self):
        """Send tasks for free slots, continuing after the last batch sent
        (or from the consumer's position after a drain)."""
        it = self.it
        if self.next_cursor is None:
            self.next_cursor = (it.epoch, it.current_position)
        while self.free_slots:
            epoch, position = self.next_cursor
            if not it._repeat and epoch > 0:
                break
            indices, epoch2, position2 = it._plan(epoch, position)
            slot = self.free_slots.pop()
            seeds = _seeds(it._seed, epoch, position, len(indices))
            worker = self.next_id % len(self.workers)
            self._send(worker, (self.next_id, slot, indices, seeds))
            self.in_flight[self.next_id] = (slot, indices, worker)
            self.next_id += 1
            self.next_cursor = (epoch2, position2)

    def take(self, indices):
        batch_id = min(self.in_flight)
        slot, planned, worker = self.in_flight[batch_id]
        assert planned == indices, 'prefetch out of step with the iterator'
        _, extras, errors = self._wait_for(batch_id)
        del self.in_flight[batch_id]
        try:
            batch = self._assemble(slot, indices, extras, errors)
        finally:
            self.free_slots.append(slot)
        self.fill()
        return batch

    def _assemble(self, slot, indices, extras, errors):
        it = self.it
        for j, index, kind, message, path, detail in errors:
            it._on_bad_example(index, kind, message, path, detail)
        views = None
        if self.shm is not None:
            # One copy out of the slot, so the slot can be reused at once.
            views = [None if v is None else v[:len(indices)].copy()
                     for v in self.layout.views(self.shm.buf, slot)]
        batch = LoadedBatch()
        for j in range(len(indices)):
            if j not in extras:
                continue        # skipped bad example
            whole, value = extras[j]
            if whole:
                batch.append(value)
                continue
            fields = tuple(v[j] if v is not None else x for v, x in zip(views, value))
            batch.append(fields if self.layout.is_tuple else fields[0])
        if views is not None and len(batch) == len(indices) and \
                all(not extras[j][0] for j in extras):
            # Every example is a row of the copied-out arrays: hand those
            # over too, so a converter need not stack them again.
            batch.stacked = tuple(views)
        it._report_skipped()
        return batch

    def _wait_for(self, batch_id):
        it = self.it
        deadline = None if it.timeout is None else time.monotonic() + it.timeout
        sentinels = {p.sentinel: w for w, p in enumerate(self.workers)}
        while batch_id not in self.results:
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            ready = multiprocessing.connection.wait(
                self.result_conns + list(sentinels), timeout=wait)
            for r in ready:
                if r in sentinels:
                    continue
                try:
                    message = r.recv()
                except (EOFError, OSError):
                    continue        # its sentinel will tell what happened
                self.results[message[0]] = message
            if batch_id in self.results:
                break
            for r in ready:
                if r in sentinels:
                    self._worker_died(sentinels[r], batch_id)
            if deadline is not None and time.monotonic() >= deadline:
                slot, indices, worker = self.in_flight[batch_id]
                self.close()
                raise TimeoutError(
                    'fastchain loader: batch {} (examples {}) not loaded within {}s '
                    'by worker {} (pid {}), which is still running: a dataset '
                    'call may hang. Raise timeout= or check the dataset.'.format(
                        batch_id, _short(indices), it.timeout, worker,
                        self.workers[worker].pid))
        return self.results.pop(batch_id)

    def _worker_died(self, w, batch_id):
        p = self.workers[w]
        p.join(0.1)
        code = p.exitcode
        lost = [b for b, (_, _, worker) in self.in_flight.items() if worker == w]
        if code is not None and code < 0:
            try:
                how = 'was killed by signal {}'.format(signal.Signals(-code).name)
            except ValueError:
                how = 'was killed by signal {}'.format(-code)
        else:
            how = 'exited with code {}'.format(code)
        self.close()
        raise WorkerDiedError(
            'fastchain loader: worker {} (pid {}) {} while loading batch(es) {}. '
            'The OS kills processes that run out of memory (check `dmesg`): '
            'use fewer workers (n_workers=), a smaller prefetch= or batch size. '
            'The iterator is closed; build a new one (or resume from a snapshot).'
            .format(w, p.pid, how, lost or [batch_id]))

    def _send(self, worker, task):
        try:
            self.task_conns[worker].send(task)
        except (BrokenPipeError, OSError):
            self._worker_died(worker, task[0])

    def drain(self):
        """Forget the batches in flight (their results are awaited, so the
        slots are free); the next fill starts from the consumer's position."""
        for batch_id in sorted(self.in_flight):
            self._wait_for(batch_id)
            self.free_slots.append(self.in_flight.pop(batch_id)[0])
        self.results.clear()
        self.next_cursor = None

    @property
    def closed(self):
        return not self._finalizer.alive

    def close(self):
        self._finalizer()


def _seeds(seed, epoch, position, n):
    rng = numpy.random.default_rng([seed, epoch, position])
    return rng.integers(0, 2**32, n, dtype=numpy.uint64).tolist()


def _short(indices, n=6):
    return indices if len(indices) <= n else indices[:n] + ['...']


def _shutdown(workers, task_conns, result_conns, shm):
    """Stop the workers (politely, then firmly) and free the shared memory."""
    for conn in task_conns:
        try:
            conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 2.0
    for p in workers:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in workers:
        if p.is_alive():
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for conn in task_conns + result_conns:
        conn.close()
    if shm is not None:
        shm.close()
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
