"""Communicators: one interface, an MPI strategy for CPU arrays and a NCCL one
for GPU arrays.

===========  ================================  ===================================
name         arrays                            use it for
===========  ================================  ===================================
``mpi``      NumPy (MPI through mpi4py)        CPU training, the tests, debugging
``nccl``     CuPy (NCCL through CuPy; the      GPUs: one process per GPU, within a
             unique id broadcast over MPI)     node and across nodes
``auto``     ``nccl`` when a GPU is usable,
             else ``mpi``
===========  ================================  ===================================

Processes are started by MPI (``mpiexec -n N python train.py``, or
``fastchain-run -n N train.py``). Every collective waits at most ``timeout``
seconds: past that, the process says which rank and which operation did not
complete, and aborts the whole job rather than hang.
"""

import abc
import contextlib
import os
import pickle
import sys
import threading
import time

import numpy

DEFAULT_TIMEOUT = float(os.environ.get('FASTCHAIN_COLLECTIVE_TIMEOUT', 300))


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time (a peer crashed or hangs)."""


class CommunicatorBase(abc.ABC):
    """What the data-parallel optimizer needs from a communicator.

    Attributes:
        rank, size: this process and the job's process count.
        intra_rank, intra_size: the same within this node (picks the GPU).
        timeout (float): seconds any collective may take.
        progresses_in_background (bool): a started allreduce moves on its own
            (NCCL on its stream), so overlapping it with backward pays.
        prefers_buckets (bool): pack gradients into buckets rather than
            reducing each array where it lies.
    """

    progresses_in_background = False
    prefers_buckets = True

    def __init__(self, mpi_comm, timeout):
        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.rank
        self.size = mpi_comm.size
        from mpi4py import MPI
        node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.intra_rank = node.rank
        self.intra_size = node.size
        node.Free()
        self.timeout = timeout

    # -- objects (pickled; small: shapes, metrics, seeds) --------------------

    # Pickles travel as bytes through non-blocking collectives (mpi4py's
    # object collectives block, and a blocked rank could not time out).

    def bcast_obj(self, obj, root=0, what='bcast_obj'):
        data = numpy.frombuffer(pickle.dumps(obj), numpy.uint8) if self.rank == root \
            else None
        size = numpy.array([0 if data is None else data.size], numpy.int64)
        self._wait(self.mpi_comm.Ibcast(size, root=root), what)
        if data is None:
            data = numpy.empty(int(size[0]), numpy.uint8)
        self._wait(self.mpi_comm.Ibcast(data, root=root), what)
        return pickle.loads(data.tobytes())

    def send_obj(self, obj, dest, what='send_obj'):
        data = numpy.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
                                numpy.uint8)
        self._wait(self.mpi_comm.Isend(numpy.array([data.size], numpy.int64), dest,
                                       tag=71), what)
        self._wait(self.mpi_comm.Isend(data, dest, tag=72), what)

    def recv_obj(self, source, what='recv_obj'):
        size = numpy.zeros(1, numpy.int64)
        self._wait(self.mpi_comm.Irecv(size, source, tag=71), what)
        data = numpy.empty(int(size[0]), numpy.uint8)
        self._wait(self.mpi_comm.Irecv(data, source, tag=72), what)
        return pickle.loads(data.tobytes())

    def allgather_obj(self, obj, what='allgather_obj'):
        from mpi4py import MPI
        data = numpy.frombuffer(pickle.dumps(obj), numpy.uint8)
        sizes = numpy.zeros(self.size, numpy.int64)
        self._wait(self.mpi_comm.Iallgather(numpy.array([data.size], numpy.int64), sizes),
                   what)
        out = numpy.empty(int(sizes.sum()), numpy.uint8)
        offsets = numpy.concatenate([[0], numpy.cumsum(sizes)[:-1]])
        self._wait(self.mpi_comm.Iallgatherv(
            data, [out, (sizes, offsets), MPI.BYTE]), what)
        return [pickle.loads(out[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]

    def allreduce_obj(self, obj, op='sum', what='allreduce_obj'):
        values = self.allgather_obj(obj, what=what)
        if op == 'sum':
            total = values[0]
            for v in values[1:]:
                total = total + v
            return total
        if op == 'max':
            return max(values)
        if op == 'any':
            return any(values)
        raise ValueError('op must be sum, max or any, got {!r}'.format(op))

    def barrier(self, what='barrier'):
        self._wait(self.mpi_comm.Ibarrier(), what)

    def any(self, flag, what='agreement'):
        """True on every rank if ``flag`` is true on any rank (one tiny MPI
        allreduce, whatever the array backend)."""
        if self.size == 1:
            return bool(flag)
        from mpi4py import MPI
        buf = numpy.array([1 if flag else 0], numpy.int32)
        self._wait(self.mpi_comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.MAX), what)
        return bool(buf[0])

    # -- arrays --------------------------------------------------------------

    @abc.abstractmethod
    def bcast(self, array, root=0, what='bcast'):
        """Broadcast ``array`` in place from ``root``."""

    @abc.abstractmethod
    def allreduce_start(self, array, what):
        """Start an in-place sum of ``array`` over ranks; returns a handle
        for :meth:`allreduce_wait`. Ranks must start collectives in the same
        order."""

    @abc.abstractmethod
    def allreduce_wait(self, handle):
        """Wait for a started allreduce (at most ``timeout`` seconds)."""

    @abc.abstractmethod
    def device(self):
        """The Chainer device this process should train on."""

    def allreduce(self, array, what='allreduce'):
        self.allreduce_wait(self.allreduce_start(array, what))
        return array

    # -- waiting and giving up -----------------------------------------------

    def _wait(self, request, what):
        """Wait for an mpi4py request for at most ``timeout`` seconds.

        Polls without sleeping: MPI moves a non-blocking collective forward
        only inside MPI calls, so every Test is progress (a blocking MPI wait
        spins the same way). After a second it backs off to 1 ms naps, which
        a stuck peer cannot tell from a blocking wait.
        """
        start = time.monotonic()
        deadline = start + self.timeout
        while not request.Test():
            now = time.monotonic()
            if now > deadline:
                self.abort_timeout(what)
            if now - start > 1.0:
                time.sleep(1e-3)

    def abort_timeout(self, what):
        message = ('fastchain: rank {} of {}: {} did not complete within {:g} s: another '
                   'rank has crashed or hangs. Aborting the job (raise '
                   'FASTCHAIN_COLLECTIVE_TIMEOUT if steps are this slow).'.format(
                       self.rank, self.size, what, self.timeout))
        print(message, file=sys.stderr, flush=True)
        self.abort(1)
        raise CollectiveTimeout(message)     # reached only if abort returned

    def abort(self, code=1):
        """End every process of the job (MPI_Abort).

        Waits half a second first: mpiexec forwards a process's output through
        pipes, and what is still in them when the job is killed is lost
        (measured: the error message was missing about one run in four).
        """
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(0.5)
        self.mpi_comm.Abort(code)


class _Watchdog:
    """Bounds blocking MPI calls: a thread that aborts the job when a guarded
    call outlives the timeout (MPI_Abort may be called from any thread:
    mpi4py initialises MPI with MPI_THREAD_MULTIPLE)."""

    def __init__(self, comm):
        self.comm = comm
        self.deadline = None
        self.what = None
        self.thread = None

    @contextlib.contextmanager
    def guard(self, what):
        if self.thread is None:
            self.thread = threading.Thread(target=self._watch, daemon=True,
                                           name='fastchain-collective-watchdog')
            self.thread.start()
        self.what = what
        self.deadline = time.monotonic() + self.comm.timeout
        try:
            yield
        finally:
            self.deadline = None

    def _watch(self):
        while True:
            time.sleep(min(0.25, self.comm.timeout / 4))
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                self.comm.abort_timeout(self.what)


class MpiCommunicator(CommunicatorBase):
    """Sums NumPy arrays with MPI.

    MPI on the CPU makes progress only inside MPI calls, so starting a
    bucket during backward gains nothing; gradients are averaged after
    backward, each array in place (no packing: on shared memory, per-array
    allreduces run at the speed of one large buffer), with MPI's blocking
    Allreduce (its shared-memory algorithms are faster than the
    non-blocking schedule), bounded by a watchdog thread.
    """

    name = 'mpi'
    progresses_in_background = False
    prefers_buckets = False

    def __init__(self, mpi_comm, timeout):
        super().__init__(mpi_comm, timeout)
        self._watchdog = _Watchdog(self)

    def bcast(self, array, root=0, what='bcast'):
        self._wait(self.mpi_comm.Ibcast(_contiguous(array), root=root), what)
        return array

    def allreduce_start(self, array, what):
        from mpi4py import MPI
        if self.size > 1:
            with self._watchdog.guard(what):
                self.mpi_comm.Allreduce(MPI.IN_PLACE, _contiguous(array), op=MPI.SUM)
        return None

    def allreduce_wait(self, handle):
        pass        # allreduce_start completed it

    def device(self):
        import chainer
        return chainer.get_device('@numpy')


def _contiguous(array):
    if not isinstance(array, numpy.ndarray) or not array.flags.c_contiguous:
        raise TypeError('the mpi communicator needs C-contiguous NumPy arrays '
                        '(use the nccl communicator for GPU arrays)')
    return array


def create_communicator(name='auto', mpi_comm=None, timeout=None):
    """Make a communicator over ``mpi_comm`` (default: MPI.COMM_WORLD).

    Args:
        name (str): ``'auto'``, ``'mpi'`` or ``'nccl'`` (see the table above).
        timeout (float): seconds a collective may take before the job is
            aborted (default: ``FASTCHAIN_COLLECTIVE_TIMEOUT`` or 300).
    """
    from fastchain.backends import mpi as mpi_backend
    status = mpi_backend.mpi_status()
    if not status.available:
        raise RuntimeError('fastchain.distributed needs MPI: {}. Fix: {}'.format(
            status.why, status.fix))
    from mpi4py import MPI
    mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    if name == 'auto':
        from fastchain.backends import cuda
        name = 'nccl' if cuda.available() else 'mpi'
    if name == 'mpi':
        comm = MpiCommunicator(mpi_comm, timeout)
    elif name == 'nccl':
        from fastchain.distributed._nccl import NcclCommunicator
        comm = NcclCommunicator(mpi_comm, timeout)
    else:
        raise ValueError("communicator name must be 'auto', 'mpi' or 'nccl', got {!r}"
                         .format(name))
    from fastchain.distributed import _faults
    _faults.install_abort_on_error(comm)
    return comm
