"""One failing rank ends the whole job, with its error shown once.

An uncaught exception in any rank prints its traceback (prefixed with the
rank) and calls MPI_Abort, which makes mpiexec end every other rank; without
it the others would wait in their next collective until the timeout. A rank
killed by the OS is seen by mpiexec itself, which ends the job.
"""

import sys
import threading
import traceback

_installed = []


def install_abort_on_error(comm):
    """Install (once per process) the hooks that abort the job on an error."""
    if _installed or comm.size == 1:
        return
    _installed.append(comm)
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt) and comm.size == 1:
            return previous(kind, value, tb)
        text = ''.join(traceback.format_exception(kind, value, tb))
        sys.stderr.write(''.join('[rank {}] {}\n'.format(comm.rank, line)
                                 for line in text.rstrip('\n').split('\n')))
        sys.stderr.write('[rank {}] fastchain: aborting all {} ranks after this error\n'
                         .format(comm.rank, comm.size))
        sys.stderr.flush()
        comm.abort(1)

    def thread_excepthook(args):
        excepthook(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
