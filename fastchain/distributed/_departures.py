"""Learning that a peer has ended its process while this one waits for it.

A rank that leaves by ``sys.exit()`` (or ``raise SystemExit``, or the end
of its script, while the others still train) raises nothing that the job's
excepthook sees: Python exits normally, and the ranks still waiting for it
in a collective would wait until the collective timeout. So every
communicator of more than one process keeps a receive posted on a
duplicate of its MPI communicator, and a process that exits with a live
communicator (the atexit hook in ``_faults``) sends its rank to every peer
there first. A rank waiting in a collective checks for such a message, and
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
        from mpi4py import MPI
        self._comm = mpi_comm.Dup()
        self._rank, self._size = mpi_comm.rank, mpi_comm.size
        self._buf = numpy.full(1, -1, numpy.int32)
        self._request = self._comm.Irecv(self._buf, source=MPI.ANY_SOURCE, tag=TAG)
        self._lock = threading.Lock()
        self._closed = False
        self.left = None        # (rank, time.monotonic() when this process learnt it)

    def check(self):
        """``(rank, noticed_at)`` of a peer that has ended its process, or None."""
        with self._lock:
            if self.left is None and self._request is not None and self._request.Test():
                self.left = (int(self._buf[0]), time.monotonic())
                self._request = None
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
            if self._closed:
                return
            self._close_receive()
            message = numpy.array([self._rank], numpy.int32)
            try:
                sends = [self._comm.Isend(message, dest=r, tag=TAG)
                         for r in range(self._size) if r != self._rank]
                deadline = time.monotonic() + PATIENCE
                while not MPI.Request.Testall(sends) and time.monotonic() < deadline:
                    time.sleep(1e-3)
            except MPI.Exception:
                pass        # a peer already gone: there is no one to tell
            self._closed = True

    def close(self):
        """At ``finalize()``: stop listening (nothing is announced)."""
        with self._lock:
            if not self._closed:
                self._close_receive()
                self._comm.Free()
                self._closed = True

    def _close_receive(self):
        if self._request is not None:
            self._request.Cancel()
            self._request.Wait()
            self._request = None
