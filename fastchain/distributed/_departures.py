"""Learning that a peer has ended its process while this one waits for it.

A rank that leaves by ``sys.exit()`` (or ``raise SystemExit``, or the end
of its script, while the others still train) with its communicator alive
raises nothing that the job's excepthook sees: Python exits normally, and the ranks still waiting for it
in a collective would wait until the collective timeout. So every
communicator of more than one process listens (``Iprobe``) on a duplicate
of its MPI communicator, and a process that exits with a live communicator
(the atexit hook in ``_faults``) sends its rank to every peer there first. A rank waiting in a collective (or for that very rank in a
point-to-point wait) checks for such a message, and
if the collective has still not completed ``GRACE`` seconds after it knew
(a peer's last collective may complete here just after the peer left), it
aborts the job naming the rank that left.

A communicator finalised (``comm.finalize()``, the end of its ``with``
block) while its peers still use theirs says so the same way: the ranks'
scripts disagree (one ran fewer steps or epochs), and a collective waiting
for it could only end at the timeout, blamed on a crash.

A small message on the eager path: sending it completes locally, so an
exiting rank does not wait for its peers (at most ``PATIENCE`` seconds
where it does).

A rank that leaves a blocked call after Ctrl-C (``_faults.leave_blocked``)
says so (``LEFT_BLOCKED``) after its exit handlers, and waits for every
peer's message (:meth:`Departures.settle`), which each sends after its
own: by then no rank has cleaning up left to do.

Ranks waiting in different collectives (a collective called on some ranks
only: an extension registered under ``if comm.rank == 0``) wait for each
other for ever; the timeout would end the job after minutes, blamed on a
crash. So a rank that has waited ``STALL`` seconds in one of its MPI
collectives tells its peers which one (its number among the collectives
this communicator ran, the MPI operation, what it is for), or in a
message to or from which rank, and that the wait ended when it ends
(:meth:`Departures.stalled`, :meth:`unstalled`). When every rank is
stalled, no two wait for a message between them, and they are not all in
the same collective (``STALL_GRACE`` seconds after the last said so), none
of the waits can complete: the job is ended naming each rank's. A rank
stalled alone (its peers still computing, or one hung outside MPI) is the
timeout's to judge. NCCL's own collectives are not told (their waits are
on the GPU's stream).
"""

import pickle
import threading
import time

import numpy

TAG = 7301
STALL_TAG = 7302
GRACE = 1.0
PATIENCE = 1.0
SETTLE_LIMIT = 30.0     # seconds a peer's exit handlers may take after Ctrl-C (a save)
STALL = 5.0             # seconds in one collective before the peers are told
STALL_GRACE = 2.0       # every rank stalled, apart, this long: no collective can complete
EXITED, FINALIZED, LEFT_BLOCKED = 0, 1, 2      # what a departure message says
_serial = 0                     # the next Departures' serial, at least


class Departures:

    def __init__(self, mpi_comm):
        global _serial
        from mpi4py import MPI
        self._comm = mpi_comm.Dup()
        self._rank, self._size = mpi_comm.rank, mpi_comm.size
        # A number the ranks agree on, new for each Departures: a message to
        # one finalised earlier, still queued when MPI gives its context to a
        # new duplicate, is told apart by it (and dropped).
        self._serial = self._comm.allreduce(_serial, op=MPI.MAX)
        _serial = self._serial + 1
        self._lock = threading.Lock()
        self._closed = False
        self._freed = False
        # rank -> (when this process learnt it, EXITED, FINALIZED or LEFT_BLOCKED)
        self.left = {}
        self._stall = None      # (wait, when told) of this rank's stall the peers know
        self._ended = 0         # the last wait that ended
        self.stalls = {}        # rank -> (its wait, what, when learnt)

    def check(self, after_announcing=False):
        """``{rank: (noticed_at, how)}`` of the peers that have ended their
        process or finalised their communicator (empty if none);
        ``after_announcing``: still probes after this process announced its
        own exit (:meth:`settle`).

        Probes for the messages rather than keeping a receive posted: nothing
        is left pending if the script finalises MPI itself. Never raises: a
        message it cannot read is dropped.
        """
        from mpi4py import MPI
        with self._lock:
            if (self._closed and not after_announcing) or self._freed or MPI.Is_finalized():
                return dict(self.left)
            self._read_departures()
            # the peers' stalls read as they come, stalled here or not: none
            # is left queued when the duplicate is freed for MPI to reuse
            self._read_stalls()
            return dict(self.left)      # a copy: watchdog threads read it too

    def _read_departures(self):
        from mpi4py import MPI
        try:
            while self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG):
                # Any message of the tag (not the probed source's: on a
                # context MPI reused, a stale message may name a rank this
                # communicator does not have)
                buf = numpy.zeros(3, numpy.int64)
                self._comm.Recv(buf, source=MPI.ANY_SOURCE, tag=TAG)
                rank, how, serial = (int(v) for v in buf)
                if serial == self._serial and 0 <= rank < self._size \
                        and rank not in self.left:
                    self.left[rank] = (time.monotonic(), how)
        except MPI.Exception:
            pass

    settle_limit = SETTLE_LIMIT

    def running(self):
        """The peers that have not announced their departure."""
        left = self.check(after_announcing=True)
        return [r for r in range(self._size) if r != self._rank and r not in left]

    def settle(self, limit=None, stop=None):
        """After this rank announced ``LEFT_BLOCKED``: wait, at most ``limit``
        seconds (``settle_limit``), until every peer has announced its
        departure (after its exit handlers), or ``stop()``. True if they all
        did."""
        deadline = time.monotonic() + (self.settle_limit if limit is None else limit)
        while len(self.check(after_announcing=True)) < self._size - 1:
            if time.monotonic() > deadline or stop is not None and stop():
                return False
            time.sleep(0.005)
        return True

    def missing(self, waited):
        """Who a wait that timed out after ``waited`` seconds is for: the
        peers that have not said they wait in a collective (a rank waiting
        ``STALL`` seconds tells), where known (a review: every rank said
        'another rank', none which)."""
        self.check()
        absent = [r for r in range(self._size) if r != self._rank and r not in self.stalls]
        if not absent or waited < 2 * STALL:
            return 'another rank has crashed or hangs'
        return ('rank{} {} had not been waiting in a collective of this communicator for '
                "{:g} s: crashed, hangs, still computing, or waits in another communicator's "
                'or its own MPI call'.format(
                    's' if len(absent) > 1 else '', ', '.join(map(str, absent)), STALL))

    def overdue(self, waiting_since, peer=None):
        """``(rank, how)`` of a rank that left (``peer`` only, if given), if
        this wait has gone on ``GRACE`` seconds since both it began and this
        process learnt it; else None."""
        now = time.monotonic()
        for rank, (noticed, how) in sorted(self.check().items()):
            if (peer is None or rank == peer) and now - max(noticed, waiting_since) > GRACE:
                return rank, how
        return None

    def announce(self, how=EXITED):
        """Tell every peer this process is ending (at exit; MPI still up), or
        (``how=FINALIZED``) that its communicator is finalised; closes."""
        from mpi4py import MPI
        with self._lock:
            if self._closed or MPI.Is_finalized():     # the script finalised MPI itself
                self._closed = True
                return
            self._closed = True
            message = numpy.array([self._rank, how, self._serial], numpy.int64)
            try:
                sends = [self._comm.Isend(message, dest=r, tag=TAG)
                         for r in range(self._size) if r != self._rank]
                deadline = time.monotonic() + PATIENCE
                while not MPI.Request.Testall(sends) and time.monotonic() < deadline:
                    time.sleep(1e-3)
            except MPI.Exception:
                pass        # a peer already gone: there is no one to tell
            if how == FINALIZED:
                # What the peers sent and this rank has not read would reach
                # the next duplicate MPI gives this context to (a script's own):
                # read it, and the peers' own end when they end alike (at most
                # PATIENCE for it: a peer going on past this is said apart)
                deadline = time.monotonic() + PATIENCE
                while True:
                    self._read_departures()
                    self._read_stalls()
                    if len(self.left) >= self._size - 1 or time.monotonic() > deadline:
                        break
                    time.sleep(1e-3)
                self._comm.Free()       # the sends are complete, or given up on
                self._freed = True

    # -- stalls: waits in collectives that may not be the same -----------------

    def stalled(self, op, what, waiting_since):
        """While this rank waits (``op``: ``(wait, 'coll', number, MPI
        operation)`` or ``(wait, 'send' or 'recv', peer)``) for ``what``
        since ``waiting_since``: past ``STALL`` seconds the peers are told
        (once a wait). Returns ``{rank: (its wait, what)}`` of every rank
        when all of them are stalled, none of the waits can complete, and
        that has held ``STALL_GRACE`` seconds; else None."""
        now = time.monotonic()
        if now - waiting_since < STALL:
            return None
        with self._lock:
            if self._closed or self._freed or op[0] <= self._ended:
                return None     # a wait that ended while another thread looked at it
            if self._stall is None or self._stall[0] != op[0]:
                self._tell_stall((self._serial, 'begin', op[1:], what))
                self._stall = (op[0], now)
            self._read_stalls()
            if len(self.stalls) < self._size - 1 or any(r in self.left for r in self.stalls):
                return None     # (a rank that left: the departure says so)
            everyone = {r: (o, w) for r, (o, w, _) in self.stalls.items()}
            everyone[self._rank] = (op[1:], what)
            if not _none_can_complete({r: o for r, (o, _) in everyone.items()}):
                return None
            since = max([self._stall[1]] + [t for _, _, t in self.stalls.values()])
            # rank 0 says it; the others only if it has not after 5 s more
            grace = STALL_GRACE + (0 if self._rank == 0 else 5.0)
            return everyone if now - since > grace else None

    def unstalled(self, op):
        """The wait in collective ``op`` ended: peers told of it learn it."""
        with self._lock:
            self._ended = max(self._ended, op[0])
            if self._stall is not None and self._stall[0] <= op[0]:
                if not (self._closed or self._freed):
                    self._tell_stall((self._serial, 'end'))
                self._stall = None

    def _tell_stall(self, message):
        from mpi4py import MPI
        data = numpy.frombuffer(pickle.dumps(message), numpy.uint8)
        try:
            sends = [self._comm.Isend(data, dest=r, tag=STALL_TAG)
                     for r in range(self._size) if r != self._rank and r not in self.left]
            deadline = time.monotonic() + PATIENCE
            while not MPI.Request.Testall(sends) and time.monotonic() < deadline:
                time.sleep(1e-3)
            for request in sends:       # not completed: let MPI finish it alone
                if request:
                    request.Free()
        except MPI.Exception:
            pass        # a peer gone: the departure checks say so

    def _read_stalls(self):
        from mpi4py import MPI
        status = MPI.Status()
        try:
            while self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=STALL_TAG, status=status):
                data = numpy.empty(status.Get_count(MPI.BYTE), numpy.uint8)
                rank = status.Get_source()
                self._comm.Recv(data, source=rank, tag=STALL_TAG)
                try:
                    message = pickle.loads(data.tobytes())
                except Exception:
                    continue
                if message[0] != self._serial or not 0 <= rank < self._size:
                    continue
                if message[1] == 'begin':
                    self.stalls[rank] = (message[2], message[3], time.monotonic())
                else:
                    self.stalls.pop(rank, None)
        except MPI.Exception:
            pass


def _none_can_complete(waits):
    """Whether no wait of ``waits`` (``{rank: ('coll', number, operation)
    or ('send' or 'recv', peer)}``, every rank's) can complete: two ranks
    waiting for a message between them may be moving it, and ranks all in
    the same collective may be in a slow one."""
    for a_rank, a in waits.items():
        for b_rank, b in waits.items():
            if a[0] == 'send' and b[0] == 'recv' and a[1] == b_rank \
                    and (b[1] == a_rank or b[1] < 0):       # < 0: from any source
                return False
    return len(set(waits.values())) > 1
