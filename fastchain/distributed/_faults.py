"""How a data-parallel job ends when a rank fails or is interrupted, and the
process-wide hooks that make it so.

The hooks are held while a communicator of more than one process is alive:
installed by the first one :func:`create_communicator` makes, given back
when the last one is finalised (``comm.finalize()``, or the end of its
``with`` block). Each is given back only if it is still fastchain's: one
replaced since (by the user, or another library) is left alone. A
communicator never finalised keeps them until the interpreter exits, where
an atexit hook gives them back (by then an uncaught exception has been
handled).

- ``sys.excepthook`` and ``threading.excepthook``: an uncaught error in any
  rank prints its traceback once, prefixed with the rank, and calls
  MPI_Abort, which makes mpiexec end every other rank (without it they would
  wait in their next collective until the timeout). A rank killed by the OS
  is seen by mpiexec itself, which ends the job.
- a signal wakeup fd (``signal.set_wakeup_fd``, where no one else holds it),
  so that a rank blocked in a collective learns of Ctrl-C.

Ctrl-C: mpiexec forwards SIGINT to every rank. A rank whose main thread
takes the KeyboardInterrupt prints one line and exits with status 130
through Python's normal exit: atexit and ``weakref.finalize`` run (the
loader stops its workers and frees its shared memory), then MPI is
finalised. A rank blocked in MPI's blocking Allreduce cannot raise: the
call returns only when every peer joins, and a peer that took the interrupt
never will. Its watchdog sees the SIGINT and, once a peer has said it is
ending or the call is still blocked ``INTERRUPT_GRACE`` (1 s) later, runs
the exit handlers and ends the process with 130 itself
(:func:`leave_blocked`): once every peer has said it is ending (after its
own exit handlers; ``_departures.Departures.settle``, 30 s at most, said
after a second, cut short by a second Ctrl-C), it calls
MPI_Abort with 130, which ends the peers waiting in their MPI_Finalize for
it. mpiexec then exits with 130 (MPICH adds its one line about the abort),
and no rank prints a traceback.

.. note:: This relies on the launcher delivering SIGINT to every rank
   (MPICH's mpiexec does: "Sending Ctrl-C to processes as requested"). A
   rank that never gets it goes on to its next collective, which the peers'
   departures end (an abort about a second after it learns of them; a
   blocked peer waits for it at most 30 s first). A rank that leaves a blocked Allreduce
   cannot finalise MPI, so MPICH leaves its own shared-memory file
   (``/dev/shm/mpich_shm_*``, 2 MiB for two ranks), as after any aborted job.
"""

import atexit
import os
import signal
import socket
import sys
import threading
import time
import traceback

INTERRUPTED = 130       # a shell's status for a job ended by Ctrl-C

_holders = []           # communicators holding the hooks, oldest first
_leaving_blocked = False    # leave_blocked() is running the exit handlers
_hooks = None           # the _Hooks in place, or None
_at_exit_registered = False


def hold(comm):
    """Make ``comm`` a holder of the job's hooks (installing them if it is
    the first). A world of one has nothing to abort: it holds nothing."""
    global _hooks, _at_exit_registered
    if comm.size == 1:
        return
    if _hooks is None:
        _hooks = _Hooks()
        if not _at_exit_registered:
            atexit.register(_release_all)
            _at_exit_registered = True
    _holders.append(comm)


def release(comm):
    """``comm`` no longer holds the hooks; the last holder gives them back."""
    if comm in _holders:
        _holders.remove(comm)
    if not _holders:
        _give_back()


def _release_all():
    # At exit: each live communicator tells its peers this process is ending
    # (a rank that leaves by sys.exit() must not leave them waiting for the
    # collective timeout: see _departures); the hooks go back; the
    # communicators free nothing else (the process ends, and waiting for
    # NCCL work in flight could outlast a peer).
    from fastchain.distributed import _departures
    how = _departures.LEFT_BLOCKED if _leaving_blocked else _departures.EXITED
    for comm in list(_holders):
        comm.announce_exit(how)
    del _holders[:]
    _give_back()


def _give_back():
    global _hooks
    if _hooks is not None:
        _hooks.uninstall()
        _hooks = None


def interrupted_at():
    """``time.monotonic()`` when a SIGINT was last noticed, or None."""
    hooks = _hooks
    return None if hooks is None else hooks.interrupted_at()


class _Hooks:
    """The hooks in place and what they replaced."""

    def __init__(self):
        self.previous_sys = sys.excepthook
        self.previous_thread = threading.excepthook
        self.sys_hook = lambda kind, value, tb: self._uncaught(kind, value, tb)
        self.thread_hook = lambda args: self._uncaught(
            args.exc_type, args.exc_value, args.exc_traceback, args)
        sys.excepthook = self.sys_hook
        threading.excepthook = self.thread_hook
        self.lock = threading.Lock()
        self.last_sigint = None
        self.leaving = False        # this rank is ending after Ctrl-C
        self.wakeup = _take_wakeup_fd()

    def uninstall(self):
        if sys.excepthook is self.sys_hook:
            sys.excepthook = self.previous_sys
        if threading.excepthook is self.thread_hook:
            threading.excepthook = self.previous_thread
        if self.wakeup is not None and \
                threading.current_thread() is threading.main_thread():
            current = signal.set_wakeup_fd(-1)
            if current != self.wakeup[1].fileno():
                signal.set_wakeup_fd(current)       # someone else's since
            for s in self.wakeup:
                s.close()
            self.wakeup = None

    def _uncaught(self, kind, value, tb, thread_args=None):
        if _hooks is not self or not _holders or self.leaving or (
                thread_args is not None and issubclass(kind, SystemExit)):
            # (SystemExit in a thread ends that thread only, as Python's own
            # hook has it: a review saw it abort the job)
            # A stale layer (someone installed a hook over it, and it was
            # given back), or an error in an exit handler after Ctrl-C (an
            # abort now would cut the other ranks' own exit short): pass
            # through.
            if thread_args is None:
                return self.previous_sys(kind, value, tb)
            return self.previous_thread(thread_args)
        comm = _holders[0]
        if thread_args is None and issubclass(kind, KeyboardInterrupt):
            sys.stderr.write('[rank {}] fastchain: interrupted\n'.format(comm.rank))
            sys.stderr.flush()
            self.leaving = True
            _clear_frames(tb)
            # Raised from sys.excepthook, SystemExit ends Python normally with
            # this status (otherwise Python ends itself by SIGINT after its
            # exit, which mpiexec reports as a crash of the job).
            raise SystemExit(INTERRUPTED)
        text = ''.join(traceback.format_exception(kind, value, tb))
        sys.stderr.write(''.join('[rank {}] {}\n'.format(comm.rank, line)
                                 for line in text.rstrip('\n').split('\n')))
        sys.stderr.write('[rank {}] fastchain: aborting all {} ranks after this error\n'
                         .format(comm.rank, comm.size))
        sys.stderr.flush()
        comm.abort(1)

    def interrupted_at(self):
        if self.wakeup is not None:
            with self.lock:
                while True:
                    try:
                        data = self.wakeup[0].recv(256)
                    except (BlockingIOError, OSError):
                        break
                    if not data:
                        break
                    if signal.SIGINT in data:
                        self.last_sigint = time.monotonic()
        return self.last_sigint


def _clear_frames(tb):
    """Clear the locals of a traceback's frames, innermost first.

    Python keeps the traceback of an uncaught exception until the process
    ends, and a batch being assembled holds views of the loader's shared
    memory, which its exit handler could then not close (BufferError, and
    the segment left behind). Innermost first: clearing an outer frame can
    free the iterator, whose finaliser then needs the views gone already.
    """
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        try:
            frame.clear()
        except RuntimeError:
            pass        # still executing: not a frame an uncaught exception left


def _take_wakeup_fd():
    """A socket pair whose write end receives a byte per signal (written by
    the C handler, so even while the main thread is blocked in MPI), or None
    where not possible: not the main thread, or someone (asyncio) holds it."""
    if threading.current_thread() is not threading.main_thread():
        return None
    pair = socket.socketpair()
    for s in pair:
        s.setblocking(False)
    previous = signal.set_wakeup_fd(pair[1].fileno(), warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)      # theirs again (warn_on_full_buffer reset)
        for s in pair:
            s.close()
        return None
    return pair


def _settle(comm, departures):
    """Wait for every peer to end, ``settle_limit`` seconds at most, said
    after a second; a second Ctrl-C ends the wait. Those cut short are named
    (a review: a peer saving its model on Ctrl-C was cut short after 5 s,
    silently)."""
    first = interrupted_at() or 0.0
    if departures.settle(limit=1.0):
        return
    sys.stderr.write('[rank {}] fastchain: waiting up to {:g} s for rank(s) {} to end (their '
                     'exit handlers may be saving); Ctrl-C again ends the job now\n'.format(
                         comm.rank, departures.settle_limit,
                         ', '.join(map(str, departures.running()))))
    sys.stderr.flush()
    if departures.settle(stop=lambda: (interrupted_at() or 0.0) > first + 0.5):
        return
    sys.stderr.write(
        '[rank {}] fastchain: ending the job with rank(s) {} still running (in their exit '
        'handlers, or hung): what they were writing may be cut short\n'.format(
            comm.rank, ', '.join(map(str, departures.running()))))


def leave_blocked(comm, what):
    """End the job from a side thread while this rank's main thread is
    blocked in ``what`` after Ctrl-C: the exit handlers (atexit,
    ``weakref.finalize``: the loader's workers and shared memory) run here,
    then, once every peer has said it is ending (after its own handlers),
    MPI_Abort with status 130.

    Not ``os._exit``: this process cannot finalise MPI (the blocked call holds
    it), and its peers' MPI_Finalize waits for it, so a process ending
    unfinalised was the only way out; hydra then kills every rank still
    running, and a peer killed before its finalize completed made mpiexec
    report status 9 (traced: about one run in a hundred). MPI_Abort ends the
    job with its own code: mpiexec exits 130."""
    global _leaving_blocked
    departures = comm._departures
    sys.stderr.write('[rank {}] fastchain: interrupted while blocked in {}{}; leaving\n'.format(
        comm.rank, what, ' (a peer has already stopped)' if departures is not None
        and departures.check() else ''))
    sys.stderr.flush()
    _leaving_blocked = True
    try:
        # The interpreter's exit handlers, run from here: the main thread
        # cannot unwind to run them itself (they announce LEFT_BLOCKED).
        atexit._run_exitfuncs()
        if departures is not None:      # the peers' exit handlers too (a model saved)
            _settle(comm, departures)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        try:
            comm.mpi_comm.Abort(INTERRUPTED)
        finally:
            os._exit(INTERRUPTED)       # if it returned
