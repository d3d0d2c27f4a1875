"""The loader's worker pool: the processes, their pipes, the shared-memory
slots and the batches in flight.

The pool knows no order and no error policy. Its iterator gives it a
``plan`` callable (see :class:`WorkerPool`) and a position to load from, takes
the batches back in order, and decides what each bad example means.
"""

import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import weakref

from fastchain.data import _workers


class WorkerDiedError(RuntimeError):
    """A worker process ended without being asked to."""


def _death(code):
    """(how a worker with exit code ``code`` ended, the likely causes and fix)."""
    if code is None:
        return 'stopped answering (its pipe closed, the process still running)', ''
    if code >= 0:
        return 'exited with code {}'.format(code), (
            'The dataset (or a library it calls) ended the process (sys.exit, os._exit): '
            'a worker must return examples or raise.')
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = str(-code)
    why = {'SIGKILL': 'The OS kills processes that run out of memory with SIGKILL (check '
                      '`dmesg`): use fewer workers (n_workers=), a smaller prefetch= or batch '
                      'size; or a person or a job scheduler killed it.',
           'SIGSEGV': 'A crash in native code the dataset calls (an image decoder, an '
                      'extension): load that batch with n_workers=0 to see where.',
           'SIGBUS': 'Shared memory ran out (/dev/shm full: `df -h /dev/shm`) or a crash in '
                     'native code: free /dev/shm or pass shared_memory=False.'}.get(
        name, 'Another process (a person, a job scheduler, the system shutting down) '
              'sent it this signal.')
    return 'was killed by signal {}'.format(name), why


class LoadedBatch(list):
    """A batch (list of examples) from the workers.

    ``stacked`` is, when every example came through shared memory, a tuple
    with one ``(batch, ...)`` array per array field (``None`` for the other
    fields): the examples are rows of these arrays.
    """

    stacked = None


_live = weakref.WeakSet()       # pools, for unlink_all()


def unlink_all():
    """Remove every pool's shared memory from /dev/shm now, for a process
    about to be ended by MPI_Abort, which runs no exit handler. Only the
    names: the mappings stay valid (the main thread may be reading a batch
    while a watchdog thread aborts), and the workers, orphaned, exit."""
    for pool in list(_live):
        if pool.shm is not None:
            _workers.unlink_name(pool.shm)


class WorkerPool:
    """Worker processes that keep ``slots`` planned batches loading ahead.

    The interface with the iterator:

    * ``plan(epoch, position)`` (given here) returns the batch that starts
      there as ``(indices, seeds, next_epoch, next_position)``, or ``None``
      where there is none;
    * :meth:`seek` drops the batches in flight and loads from a position on;
    * :meth:`take` returns the next batch in order with the errors of its
      bad examples (left out of it), as ``(index, kind, message, path,
      detail)`` tuples; :meth:`fill` then sends the freed slot out again.

    Args:
        dataset: what the workers index (inherited by fork, or pickled).
        plan: as above.
        batch_size (int): the most examples in one batch.
        n_workers (int): processes.
        slots (int): batches in flight.
        sample: an example to lay out the shared memory from (its array
            fields get a region in each slot), or ``None``: examples are
            pickled through the pipes.
        timeout (float or None): seconds to wait for one batch.
        start_method (str or None): multiprocessing start method (default
            ``'fork'`` where available).
    """

    def __init__(self, dataset, plan, batch_size, n_workers, slots, sample=None,
                 timeout=None, start_method=None):
        ctx = multiprocessing.get_context(start_method or (
            'fork' if 'fork' in multiprocessing.get_all_start_methods() else None))
        self.plan = plan
        self.timeout = timeout
        layout = None if sample is None else _workers.SlotLayout(sample, batch_size)
        self.shm = None
        if layout is not None and any(layout.fields):
            self.shm = _workers.create_shared_memory(layout.slot_bytes * slots)
        self.layout = layout if self.shm is not None else None
        self.free_slots = list(range(slots))
        self.in_flight = {}     # batch id -> (slot, indices, worker)
        self.results = {}
        self.next_id = 0
        self.next_cursor = None     # (epoch, position) of the next batch to send
        self.workers, self.task_conns, self.result_conns = [], [], []
        self.active = n_workers     # workers batches are sent to (autotune may lower it)
        self.watch = False          # the workers tell which example drew random numbers
        self.depth = slots          # batches sent ahead at most (autotune may lower it)
        parent = os.getpid()
        own_groups = self.shm is not None and _workers.launched_by_mpi()
        # before the workers start: a start that fails frees what was made
        # (each failed construction left its shared memory until exit)
        self._finalizer = weakref.finalize(
            self, _shutdown, self.workers, self.task_conns, self.result_conns, self.shm)
        try:
            self._start(ctx, dataset, n_workers, parent, own_groups)
        except BaseException as e:
            self._finalizer()
            if ctx.get_start_method() != 'fork' and isinstance(e, (TypeError, AttributeError)) \
                    and 'pickle' in str(e):
                raise TypeError(
                    "the dataset cannot be sent to the workers: start method {!r} pickles it, "
                    "and {}. Fix: make the dataset picklable, or leave start_method to the "
                    "default 'fork'".format(ctx.get_start_method(), e)) from e
            raise
        _live.add(self)

    def _start(self, ctx, dataset, n_workers, parent, own_groups):
        for w in range(n_workers):
            task_r, task_w = ctx.Pipe(duplex=False)
            result_r, result_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_workers.worker_main, daemon=True,
                            name='fastchain-loader-{}'.format(w),
                            args=(dataset, task_r, result_w,
                                  self.shm.name if self.shm else None,
                                  self.layout, parent))
            p.start()
            if own_groups:
                # The worker does so too (whichever runs first; see
                # _workers.worker_main): its own process group from here on.
                try:
                    os.setpgid(p.pid, p.pid)
                except OSError:
                    pass
            task_r.close()
            result_w.close()
            self.workers.append(p)
            self.task_conns.append(task_w)
            self.result_conns.append(result_r)

    def seek(self, epoch, position):
        """Forget the batches in flight (after waiting for them: a worker may
        still be writing into their slots), then load from (epoch, position)."""
        for batch_id in sorted(self.in_flight):
            self._wait_for(batch_id)
            self.free_slots.append(self.in_flight.pop(batch_id)[0])
        self.results.clear()
        self.next_cursor = (epoch, position)
        self.fill()

    def fill(self):
        """Send planned batches to the free slots, after the last one sent,
        up to ``depth`` in flight."""
        while self.free_slots and len(self.in_flight) < self.depth and \
                self.next_cursor is not None:
            planned = self.plan(*self.next_cursor)
            if planned is None:
                break
            indices, seeds, epoch, position = planned
            slot = self.free_slots.pop()
            worker = self.next_id % self.active
            self._send(worker, (self.next_id, slot, indices, seeds, self.watch))
            self.in_flight[self.next_id] = (slot, indices, worker)
            self.next_id += 1
            self.next_cursor = (epoch, position)

    def take(self, indices):
        """``(batch, errors, drew)`` of the oldest batch in flight (which
        must be ``indices``), waiting for it; ``drew``: with :attr:`watch`
        on when it was sent, ``(index, generators)`` of its first example
        that drew random numbers, else None. Its slot is free again
        afterwards."""
        batch_id = min(self.in_flight)
        slot, planned, worker = self.in_flight[batch_id]
        assert planned == indices, 'prefetch out of step with the iterator'
        _, extras, errors, drew = self._wait_for(batch_id)
        del self.in_flight[batch_id]
        try:
            batch = self._assemble(slot, len(indices), extras)
        finally:
            self.free_slots.append(slot)
        return batch, [error[1:] for error in errors], drew

    def _assemble(self, slot, n, extras):
        views = None
        if self.shm is not None:
            # One copy out of the slot, so the slot can be reused at once.
            views = [None if v is None else v[:n].copy()
                     for v in self.layout.views(self.shm.buf, slot)]
        batch = LoadedBatch()
        for j in range(n):
            if j not in extras:
                continue        # bad example: reported in the errors
            whole, value = extras[j]
            if whole:
                batch.append(value)
                continue
            # (v[j, ...]: a 0-d field stays a 0-d array, as the dataset gave it)
            fields = tuple(v[j, ...] if v is not None else x for v, x in zip(views, value))
            batch.append(self.layout.example(fields))
        if views is not None and len(batch) == n and \
                all(not extras[j][0] for j in extras):
            # Every example is a row of the copied-out arrays: hand those
            # over too, so a converter need not stack them again.
            batch.stacked = tuple(views)
        return batch

    def _wait_for(self, batch_id):
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
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
                        batch_id, _short(indices), self.timeout, worker,
                        self.workers[worker].pid))
        return self.results.pop(batch_id)

    def _worker_died(self, w, batch_id):
        p = self.workers[w]
        p.join(0.1)
        code = p.exitcode
        lost = [b for b, (_, _, worker) in self.in_flight.items() if worker == w]
        how, why = _death(code)
        self.close()
        raise WorkerDiedError(
            'fastchain loader: worker {} (pid {}) {} while loading batch(es) {}. {} '
            'The iterator is closed; build a new one (or resume from a snapshot).'
            .format(w, p.pid, how, lost or [batch_id], why))

    def _send(self, worker, task):
        try:
            self.task_conns[worker].send(task)
            return
        except (BrokenPipeError, OSError):
            pass
        self._worker_died(worker, task[0])      # outside the except: one error, not two

    @property
    def closed(self):
        return not self._finalizer.alive

    def close(self):
        """Stop the workers and free the shared memory (idempotent)."""
        self._finalizer()


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
        # Unlink first: the name must go even if views of the slots are still
        # alive (a traceback holding a batch), which makes close() refuse.
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        try:
            shm.close()
        except BufferError:
            pass        # the mapping goes with the last view, or the process
