"""The worker side of the multiprocess iterator, and its shared memory.

A worker receives ``(batch id, slot, indices, seeds)`` on its own pipe,
loads each example with ``numpy.random``, Python's ``random`` and the
dataset's own generators seeded per example
(:func:`fastchain.data._generators.seed_example`), writes the
example's arrays into its slot of the shared memory, and sends back one small
message: the non-array fields, any example that did not fit the slot layout,
and the errors (index, type, message). It ignores SIGINT (the main process
handles Ctrl-C and shuts it down) and exits on its own if the main process
disappears, unlinking the shared memory the killed process could not (under
an MPI launcher, in a process group of its own, so that mpiexec killing a
rank's group leaves it that moment).
"""

import _posixshmem
import errno
import os
import signal
import time
import traceback

import numpy

from fastchain.data._draws import DrawWatch
from fastchain.data._generators import find as find_generators, seed_example
from fastchain.data._images import ImageDecodeError

POLL_SECONDS = 1.0


class SlotLayout:
    """Where each array field of one example goes in a batch slot.

    Built from one example: array fields (numpy arrays) get a fixed region of
    ``batch_size`` rows; everything else (labels, scalars, objects) travels
    in the result message.
    """

    def __init__(self, example, batch_size):
        fields = example if isinstance(example, tuple) else (example,)
        # a namedtuple comes back as one (a tuple of another kind travels
        # whole); the workers compare its field names, the class stays here
        self.shape = _shape(example)
        self.made = type(example) if self.shape not in (None, ()) else None
        self.fields = []        # (offset, shape, dtype) or None
        offset = 0
        for value in fields:
            if isinstance(value, numpy.ndarray) and value.dtype != object:
                self.fields.append((offset, value.shape, value.dtype))
                offset += _aligned(batch_size * value.nbytes)
            else:
                self.fields.append(None)
        self.slot_bytes = max(offset, 1)
        self.batch_size = batch_size

    def __getstate__(self):     # (a namedtuple class pickle cannot find by name)
        return dict(vars(self), made=None)

    def fits(self, example):
        fields = example if isinstance(example, tuple) else (example,)
        if _shape(example) != self.shape or self.shape is False:
            return False
        return len(fields) == len(self.fields) and all(
            spec is None or (isinstance(v, numpy.ndarray) and v.shape == spec[1]
                             and v.dtype == spec[2])
            for v, spec in zip(fields, self.fields))

    def example(self, fields):
        """One example of the layout's kind from its ``fields`` (in the
        process that built the layout)."""
        if self.shape is None:
            return fields[0]
        return fields if self.shape == () else self.made._make(fields)

    def views(self, buf, slot):
        """The batch arrays of ``slot`` as numpy views of ``buf``."""
        base = slot * self.slot_bytes
        out = []
        for spec in self.fields:
            if spec is None:
                out.append(None)
                continue
            offset, shape, dtype = spec
            count = self.batch_size * int(numpy.prod(shape, dtype=numpy.int64))
            out.append(numpy.frombuffer(buf, dtype, count, base + offset)
                       .reshape((self.batch_size,) + shape))
        return out


def _shape(example):
    """None: not a tuple; (): a plain tuple; a namedtuple's field names
    (rebuilt from its fields by ``_make``; one class made per example
    matches by its names); False: a tuple of another kind."""
    kind = type(example)
    if not isinstance(example, tuple):
        return None
    if kind is tuple:
        return ()
    names = getattr(kind, '_fields', None)
    if callable(getattr(kind, '_make', None)) and isinstance(names, tuple) and names:
        return (kind.__name__,) + names
    return False


def _aligned(n, to=64):
    return (n + to - 1) // to * to


def create_shared_memory(nbytes):
    """A shared-memory block whose pages are reserved now.

    /dev/shm is a tmpfs: without reserving, a full /dev/shm shows up later as
    SIGBUS in a worker. ``posix_fallocate`` turns it into an error here.
    """
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    try:
        os.posix_fallocate(shm._fd, 0, nbytes)
    except OSError as e:
        shm.close()
        shm.unlink()
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            free = _shm_free_bytes()
            raise OSError(e.errno, (
                'fastchain loader: /dev/shm is full: {:.1f} MiB needed for the '
                'prefetched batches, {} free. Lower prefetch= or the batch size, '
                'pass shared_memory=False (slower: batches are pickled), or give '
                'the machine a larger /dev/shm (docker: --shm-size=2g).').format(
                    nbytes / 2**20, 'unknown' if free is None else
                    '{:.1f} MiB'.format(free / 2**20))) from None
        raise
    return shm


def _shm_free_bytes():
    try:
        st = os.statvfs('/dev/shm')
        return st.f_bavail * st.f_frsize
    except OSError:
        return None


def describe_error(error):
    """(type name, message, path or None) for an exception from a dataset."""
    path = error.path if isinstance(error, ImageDecodeError) else None
    message = error.reason if isinstance(error, ImageDecodeError) else str(error)
    return type(error).__name__, message, path


def worker_main(dataset, task_conn, result_conn, shm_name, layout, parent_pid):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if shm_name is not None and launched_by_mpi():
        # mpiexec ends an aborted job's ranks by killing their process groups
        # (SIGKILL): out of it, this worker outlives a killed main process by
        # the moment it needs to free the slots' memory, which that process
        # cannot (below). Only there: elsewhere the group is the user's to
        # stop (Ctrl-Z) or to signal as one (the benchmarks' SIGSTOP).
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
    shm = None
    if shm_name is not None:
        from multiprocessing import shared_memory
        # Attaching registers the name with the resource tracker the main
        # process shares with us (a set: no-op); the main process unlinks it.
        shm = shared_memory.SharedMemory(name=shm_name)
    own = find_generators(dataset)      # this process's copies
    watch = DrawWatch(own)
    orphaned = False
    try:
        while True:
            if not task_conn.poll(POLL_SECONDS):
                if not _alive(parent_pid):
                    orphaned = True     # the main process is gone
                    return
                continue
            task = task_conn.recv()
            if task is None:
                return
            result = _load(dataset, task, shm, layout, own, watch)
            try:
                result_conn.send(result)
            except Exception as e:      # (pickles before it sends: nothing went)
                try:
                    result_conn.send(_unsendable(result, task, e))
                except Exception as e:
                    result_conn.send(_unsent(task, e))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        # A killed main process's pipes close a moment before it is gone.
        deadline = time.monotonic() + 1.0
        while _alive(parent_pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        orphaned = not _alive(parent_pid)
        return
    finally:
        if shm is not None:
            shm.close()
            if orphaned:
                # The main process was killed (SIGKILL: the OOM killer, an MPI
                # job's other ranks ended by mpiexec) and cannot unlink the
                # slots' memory: the first worker to notice does. Not through
                # SharedMemory.unlink(), which tells a resource tracker that
                # may have died with the main process's group (and then
                # prints a traceback of its own).
                unlink_name(shm)


def _alive(pid):
    """Whether process ``pid`` (the main process) still runs. Not
    ``getppid()``: under the forkserver start method a worker's parent is the
    forkserver. A zombie is dead: a main process killed (SIGKILL, the
    out-of-memory killer) under MPI's process manager stays one until the
    manager reaps it, which it does once the pipes it reads from close, and
    its workers hold them: a rank whose workers waited on it held its job
    until the collective timeout (300 s)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid):
    try:
        with open('/proc/{}/stat'.format(pid), 'rb') as f:
            stat = f.read()
    except OSError:
        return False            # no /proc (not Linux): as before
    # "pid (comm) state ...": comm may hold spaces and parentheses
    return stat[stat.rfind(b')') + 2:stat.rfind(b')') + 3] in (b'Z', b'X')


def unlink_name(shm):
    """Remove the shared-memory block ``shm`` from /dev/shm (if still there),
    without SharedMemory.unlink()'s word to the resource tracker: for a
    process about to be killed, or whose main process was."""
    try:
        _posixshmem.shm_unlink(shm._name)
    except FileNotFoundError:
        pass


def _unsendable(result, task, error):
    """The message for a batch pickle cannot send back: each example that
    does not pickle is an error naming why and the fixes, the others go as
    they are, and the errors as text (a worker that raised here ended, and
    was said to have called sys.exit; a review). ``error``: the first try's."""
    from multiprocessing.reduction import ForkingPickler
    batch_id, extras, errors, drew = result
    indices, kept, bad = task[2], {}, []
    for j, value in extras.items():
        try:
            ForkingPickler.dumps(value)
            kept[j] = value
        except Exception as e:
            bad.append((j, int(indices[j]), 'PicklingError', UNSENDABLE.format(
                type(e).__name__, e), None, ''))
    try:
        ForkingPickler.dumps(drew)
    except Exception:
        drew = None
    return batch_id, kept, [tuple(None if v is None else v if isinstance(v, int) else str(v)
                                  for v in e) for e in errors] + bad, drew


def _unsent(task, error):
    """The last resort: every example of the batch an error, in text."""
    return task[0], {}, [(j, int(index), 'PicklingError', UNSENDABLE.format(
        type(error).__name__, error), None, '') for j, index in enumerate(task[2])], None


UNSENDABLE = (
    'the worker cannot send the example back to the training process ({}: {}): pickle finds '
    "an example's classes by name, and a class made inside get_example (a namedtuple made per "
    'call), a local class or a lambda has none. Fix: return arrays, numbers and tuples of them, '
    "or classes defined at a module's top level; or load in the training process: "
    'loader_workers=0')


def launched_by_mpi():
    from fastchain.backends.mpi import launch_rank
    return launch_rank()[0] is not None


def _load(dataset, task, shm, layout, own=(), watch=None):
    """One task: the batch's examples into its slot. With ``watching`` set
    in the task, the message also names the first example that drew random
    numbers and the generators it drew from (``(index, names)``), else
    ``None``."""
    batch_id, slot, indices, seeds, watching = task
    watching = watching and watch is not None
    views = layout.views(shm.buf, slot) if shm is not None else None
    extras, errors, drew = {}, [], None
    for j, (index, seed) in enumerate(zip(indices, seeds)):
        if watching and drew is None:
            watch.seed(seed)
        else:
            seed_example(seed, own)
        try:
            example = dataset[numpy.intp(index)]     # Chainer's index type
        except Exception as e:
            kind, message, path = describe_error(e)
            errors.append((j, int(index), kind, message, path,
                           traceback.format_exc(limit=4)))
            continue
        if watching and drew is None:
            try:
                names = watch.drew(lambda: dataset[numpy.intp(index)])
            except Exception:
                names = []      # (the example loaded: what the watch cannot tell is let be)
            drew = (int(index), names) if names else None
        fields = example if isinstance(example, tuple) else (example,)
        if views is not None and layout.fits(example):
            for value, view in zip(fields, views):
                if view is not None:
                    view[j] = value
            extras[j] = (False, tuple(None if view is not None else value
                                      for value, view in zip(fields, views)))
        else:
            extras[j] = (True, example)     # pickled whole
    return batch_id, extras, errors, drew
