"""The CPU strategy: NumPy arrays summed with MPI, blocking calls bounded by a
watchdog thread."""

import contextlib
import threading
import time

import numpy

from fastchain.distributed import _faults
from fastchain.distributed._base import CommunicatorBase

# Seconds a blocking collective may go on after Ctrl-C before this rank
# leaves it: peers inside the same collective complete it within
# milliseconds; a peer that took the interrupt never joins.
INTERRUPT_GRACE = 1.0


class MpiCommunicator(CommunicatorBase):
    """Sums NumPy arrays with MPI.

    MPI on the CPU makes progress only inside MPI calls, so starting a
    bucket during backward gains nothing; gradients are averaged after
    backward, each array in place and scaled by 1/N as soon as its reduction
    returns (no packing: Chainer gives each parameter a gradient array of its
    own, and a copy into buckets and back cost more than it saved: ResNet-50
    on 2 ranks of an AMD EPYC, 34-40 ms in place against 73-84 ms packed,
    ``benchmarks/allreduce.py --quick``, results/allreduce-quick.*), with MPI's blocking
    Allreduce (its shared-memory algorithms are faster than the
    non-blocking schedule), bounded by a watchdog thread.
    """

    name = 'mpi'
    progresses_in_background = False
    prefers_buckets = False

    def __init__(self, mpi_comm, timeout):
        super().__init__(mpi_comm, timeout)
        self._watchdog = _Watchdog(self)
        if self.size > 1:
            self._watchdog.start()

    def bcast(self, array, root=0, what='bcast'):
        array = _contiguous(array)
        self._wait(self.mpi_comm.Ibcast(array, root=root), what,
                   op=self._op('Ibcast of {} bytes from rank {}'.format(array.nbytes, root)))
        return array

    def allreduce_start(self, array, what):
        from mpi4py import MPI
        if self.size > 1:
            array = _contiguous(array)
            with self._watchdog.guard(what, self._op('Allreduce of {} bytes'.format(
                    array.nbytes))):
                self.mpi_comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        return None

    def allreduce_wait(self, handle):
        pass        # allreduce_start completed it

    def allgather(self, array, what='allgather'):
        out = numpy.empty((self.size,) + array.shape, array.dtype)
        if self.size == 1:
            out[0] = array
            return out
        array = _contiguous(array)
        with self._watchdog.guard(what, self._op('Allgather of {} bytes'.format(array.nbytes))):
            self.mpi_comm.Allgather(array, out)
        return out

    def device(self):
        import chainer
        return chainer.get_device('@numpy')

    def _finalize_core(self):
        self._watchdog.stop()


def _contiguous(array):
    if not isinstance(array, numpy.ndarray) or not array.flags.c_contiguous:
        raise TypeError('the mpi communicator needs C-contiguous NumPy arrays '
                        '(use the nccl communicator for GPU arrays)')
    return array


class _Watchdog:
    """Bounds blocking MPI calls: a thread that aborts the job when a guarded
    call outlives the timeout (MPI_Abort may be called from any thread:
    mpi4py initialises MPI with MPI_THREAD_MULTIPLE), and ends this process
    when Ctrl-C came while the call is blocked (see ``_faults``)."""

    def __init__(self, comm):
        self.comm = comm
        self.current = None         # (what, started, deadline, op) of the guarded call
        self.stopped = threading.Event()

    def start(self):
        # From the start, so that it notices a Ctrl-C when it comes, not at
        # the first guarded call.
        threading.Thread(target=self._watch, daemon=True,
                         name='fastchain-collective-watchdog').start()

    @contextlib.contextmanager
    def guard(self, what, op=None):
        now = time.monotonic()
        self.current = (what, now, now + self.comm.timeout, op)
        try:
            yield
        finally:
            self.current = None
            if op is not None and self.comm.size > 1:
                # always: the watchdog thread may be telling the peers of it now
                self.comm.wait_ended(op)

    def stop(self):
        self.stopped.set()

    def _watch(self):
        while not self.stopped.wait(min(0.25, self.comm.timeout / 4)):
            interrupted = _faults.interrupted_at()     # read every tick: stays current
            current = self.current
            if current is None:
                continue
            what, started, deadline, op = current
            now = time.monotonic()
            if now > deadline:
                self.comm.abort_timeout(what)
            if interrupted is not None and interrupted >= started:
                # Ctrl-C: every rank leaves with 130 (a peer that took it
                # already left: no abort for that). Once a peer has said it
                # is ending, the call cannot complete: leave now, so that this
                # rank's exit handlers run before mpiexec, seeing the peer's
                # end, cleans up the ranks still running (with SIGKILL).
                departures = self.comm._departures
                gone = departures is not None and bool(departures.check())
                if gone or now - interrupted > INTERRUPT_GRACE:
                    _faults.leave_blocked(self.comm, what)
            elif self.current is current:       # still in the same call
                self.comm.check_peers(what, started, op=op)
