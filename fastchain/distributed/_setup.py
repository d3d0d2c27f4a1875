"""The communicator's set-up, bounded by the collective timeout.

MPI's initialisation and the node split block until every rank takes part,
so a rank that failed or ended before ``create_communicator()`` would leave
the others there for ever. :func:`setup_deadline` ends the job past the
timeout, saying that not every rank got there.
"""

import contextlib
import os
import sys
import threading
import time

from fastchain.distributed._base import TIMEOUT_VARIABLE


@contextlib.contextmanager
def setup_deadline(timeout):
    """Past ``timeout`` seconds of the set-up inside this block, this
    process says so and the job ends (see the module docstring). Yields a
    dict: call ``'initialised'(comm)`` once MPI is initialised, with the MPI
    communicator.

    Two watchers: MPI's initialisation (the import of ``mpi4py.MPI``) holds
    the GIL, so a forked process watches it (it kills this one, which mpiexec
    then sees end); after it, a thread (mpi4py lets go of the GIL in the
    blocking calls), which calls MPI_Abort.
    """
    from fastchain.backends import mpi
    rank, size = mpi.launch_rank()
    who = 'this process' if rank is None else 'rank {} of {}'.format(rank, size)
    message = ("fastchain: {}: the communicator's set-up did not complete within {:g} s: "
               "not every rank reached create_communicator() (one failed or ended before "
               "it, or is still busy: see the other ranks' output). Aborting the job (raise "
               "{} if set-up is this slow).\n".format(who, timeout, TIMEOUT_VARIABLE))
    state = {'comm': None, 'done': threading.Event()}
    if not timeout < threading.TIMEOUT_MAX:     # inf: no deadline
        state['initialised'] = lambda comm: None
        yield state
        return
    watcher = _fork_watcher(timeout, message) if 'mpi4py.MPI' not in sys.modules else None

    def initialised(comm):
        state['comm'] = comm
        if watcher is not None:
            watcher()

    def expire():
        if state['done'].wait(timeout):
            return
        if watcher is not None and state['comm'] is None:
            return      # the forked watcher's part
        sys.stderr.write(message)
        sys.stderr.flush()
        time.sleep(0.5)         # let mpiexec forward the message (see abort)
        state['comm'].Abort(1)
        os._exit(1)

    state['initialised'] = initialised
    try:
        threading.Thread(target=expire, name='fastchain-setup-deadline', daemon=True).start()
        yield state
    finally:
        state['done'].set()
        if watcher is not None:
            watcher()


def _fork_watcher(timeout, message):
    """A child process that kills this one unless the returned function is
    called within ``timeout`` seconds (it closes a pipe the child waits on).
    The child makes only system calls: locks another thread held at the fork
    stay held in it."""
    import select
    import signal
    read, write = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:                                    # the watcher
        try:
            os.close(write)
            ready, _, _ = select.select([read], [], [], timeout)
            if not ready:
                os.write(2, message.encode())
                time.sleep(0.5)
                os.kill(parent, signal.SIGKILL)
        finally:
            os._exit(0)
    os.close(read)
    closed = []

    def release():
        if not closed:
            closed.append(True)
            os.close(write)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass        # SIGCHLD ignored: the child was reaped already
    return release
