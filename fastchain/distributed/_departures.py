"""Learning that a peer has ended its process while this one waits for it.

A rank that leaves by ``sys.exit()`` (or ``raise SystemExit``, or the end
of its script, while the others still train) with its communicator alive
raises nothing that the job's excepthook sees: Python exits normally, and the ranks still waiting for it
in a collective would wait until the collective timeout. (A communicator
finalised first, as a ``with`` block does, says nothing: its rank left
deliberately, and the others' next collective times out.) So every
communicator of more than one process listens (``Iprobe``) on a duplicate
of its MPI communicator, and a process that exits with a live communicator
(the atexit hook in ``_faults``) sends its rank to every peer there first. A rank waiting in a collective (or for that very rank in a
point-to-point wait) checks for such a message, and
if the collective has still not completed ``GRACE`` seconds after it knew
(a peer's last collective may complete here just after the peer left), it
aborts the job naming the rank that left.

A small message on the eager path: sending it completes locally, so an
exiting rank does not wait for its peers (at most ``PATIENCE`` seconds
where it does).
"""

import threading
import time

import numpy

TAG = 7301
GRACE = 1.0
PATIENCE = 1.0


class Departures:

    def __init__(self, mpi_comm):
        self._comm = mpi_comm.Dup()
        self._rank, self._size = mpi_comm.rank, mpi_comm.size
        self._lock = threading.Lock()
        self._closed = False
        self.left = None        # (rank, time.monotonic() when this process learnt it)

    def check(self):
        """``(rank, noticed_at)`` of a peer that has ended its process, or None.

        Probes for the message rather than keeping a receive posted: nothing
        is left pending if the script finalises MPI itself.
        """
        from mpi4py import MPI
        with self._lock:
            if self.left is None and not self._closed and not MPI.Is_finalized():
                status = MPI.Status()
                if self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG, status=status):
                    buf = numpy.zeros(1, numpy.int32)
                    self._comm.Recv(buf, source=status.Get_source(), tag=TAG)
                    self.left = (int(buf[0]), time.monotonic())
            return self.left

    def overdue(self, waiting_since):
        """The rank that left, if it left and this wait has gone on ``GRACE``
        seconds since both it began and this process learnt it; else None."""
        left = self.check()
        if left is not None and time.monotonic() - max(left[1], waiting_since) > GRACE:
            return left[0]
        return None

    def announce(self):
        """Tell every peer this process is ending (at exit; MPI still up)."""
        from mpi4py import MPI
        with self._lock:
            if self._closed or MPI.Is_finalized():     # the script finalised MPI itself
                self._closed = True
                return
            self._closed = True
            message = numpy.array([self._rank], numpy.int32)
            try:
                sends = [self._comm.Isend(message, dest=r, tag=TAG)
                         for r in range(self._size) if r != self._rank]
                deadline = time.monotonic() + PATIENCE
                while not MPI.Request.Testall(sends) and time.monotonic() < deadline:
                    time.sleep(1e-3)
            except MPI.Exception:
                pass        # a peer already gone: there is no one to tell

    def close(self):
        """At ``finalize()``: stop listening (nothing is announced)."""
        from mpi4py import MPI
        with self._lock:
            if not self._closed and not MPI.Is_finalized():
                self._comm.Free()
            self._closed = True
