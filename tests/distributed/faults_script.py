"""Run under `mpiexec -n 2`: how a job's process-wide hooks live and end.

    mpiexec -n 2 python faults_script.py SCENARIO OUTDIR

`hooks` checks its assertions on every rank and writes `OUTDIR/ok.<rank>`.
`ctrl_c_in_python` and `ctrl_c_in_allreduce` train until interrupted; each
rank prints `ready <pid> <loader pids,> <loader segments,> <MPICH segments,>`
once it is in the loop.
"""

import multiprocessing
import os
import signal
import sys
import threading

import numpy

from fastchain import data, distributed

SCENARIO, OUT = sys.argv[1], sys.argv[2]


def done(rank):
    with open(os.path.join(OUT, 'ok.{}'.format(rank)), 'w') as f:
        f.write('ok')


def hooks():
    calls = []

    def original(kind, value, tb):
        calls.append(('sys', kind))

    def original_thread(args):
        calls.append(('thread', args.exc_type))

    sys.excepthook, threading.excepthook = original, original_thread
    a = distributed.create_communicator('mpi')
    assert sys.excepthook is not original and threading.excepthook is not original_thread
    ours = sys.excepthook, threading.excepthook, wakeup_fd()
    assert ours[2] != -1
    b = distributed.create_communicator('mpi')
    a.finalize()
    a.finalize()                                    # idempotent
    assert (sys.excepthook, threading.excepthook, wakeup_fd()) == ours   # b holds them
    b.finalize()
    assert (sys.excepthook, threading.excepthook) == (original, original_thread)
    assert wakeup_fd() == -1

    # Given back in the other order too.
    a, b = (distributed.create_communicator('mpi') for _ in range(2))
    b.finalize()
    a.finalize()
    assert (sys.excepthook, threading.excepthook, wakeup_fd()) == (
        original, original_thread, -1)

    # A user's hook installed over fastchain's stays; the other is restored.
    with distributed.create_communicator('mpi') as comm:
        theirs = sys.excepthook

        def user(kind, value, tb):      # chains to the hook it replaced
            calls.append(('user', kind))
            theirs(kind, value, tb)
        sys.excepthook = user
    assert (sys.excepthook, threading.excepthook) == (user, original_thread)
    user(ValueError, ValueError('x'), None)         # fastchain's layer passes through
    assert calls == [('user', ValueError), ('sys', ValueError)], calls
    sys.excepthook = original

    try:
        comm.allreduce(numpy.zeros(2, 'f'), 'after finalize')
    except RuntimeError as e:
        assert 'finalized' in str(e) and 'create_communicator()' in str(e), e
    else:
        raise AssertionError('a finalized communicator still reduces')
    distributed.create_communicator('mpi')      # never finalised: given back at exit
    done(comm.rank)


def wakeup_fd():
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    return fd


def ctrl_c(in_allreduce):
    """A few steps (a batch and an allreduce each), then wait for Ctrl-C: both
    ranks loading batches (the interrupt meets Python), or, ``in_allreduce``,
    rank 0 blocked in MPI's Allreduce, which rank 1, loading, has not joined.
    """
    comm = distributed.create_communicator('mpi')
    x = numpy.random.RandomState(0).rand(64, 3, 8, 8).astype(numpy.float32)
    t = numpy.arange(64, dtype=numpy.int32) % 3
    it = data.MultiprocessIterator(list(zip(x, t)), 4, n_workers=2)
    buf = numpy.zeros(4, numpy.float32)
    for step in range(3):
        it.next()
        comm.allreduce(buf, 'allreduce of step {}'.format(step))
    if in_allreduce and comm.rank == 0:
        ready()
        comm.send_obj('entering', 1, what='marker')
        comm.allreduce(buf, 'allreduce of step 3')
    if in_allreduce and comm.rank == 1:
        comm.recv_obj(0, what='marker')     # rank 0 is in the allreduce now
    ready()
    while True:
        it.next()


def ctrl_c_saving(delay):
    """Rank 0 blocked in an allreduce, rank 1 in Python, whose exit handler
    takes ``delay`` seconds to save (a model written on Ctrl-C) before it
    writes ``saved.1``. Rank 0 waits for it, 4 s at most here."""
    import atexit
    import time
    from fastchain.distributed import _departures
    _departures.Departures.settle_limit = 4.0
    comm = distributed.create_communicator('mpi')
    buf = numpy.zeros(4, numpy.float32)
    comm.allreduce(buf, 'allreduce of step 0')
    if comm.rank == 1:
        def save():
            time.sleep(delay)
            with open(os.path.join(OUT, 'saved.1'), 'w') as f:
                f.write('saved')
        atexit.register(save)
        comm.recv_obj(0, what='marker')     # rank 0 is in the allreduce now
        ready()
        while True:
            time.sleep(0.01)
    ready()
    comm.send_obj('entering', 1, what='marker')
    comm.allreduce(buf, 'allreduce of step 1')


def thread_exit():
    """A thread of the script's ends with sys.exit(): that thread only ends,
    as in one process (a review: the job was aborted)."""
    comm = distributed.create_communicator('mpi')
    worker = threading.Thread(target=sys.exit, args=(0,))
    worker.start()
    worker.join()
    comm.allreduce(numpy.ones(3), what='after the thread')
    comm.finalize()
    done(comm.rank)


def raise_with_loader():
    """Both ranks load batches; rank 1 then raises. Its excepthook aborts the
    job (MPI_Abort runs no exit handler) and mpiexec kills rank 0: neither
    rank's loader may leave its workers or shared memory behind."""
    comm = distributed.create_communicator('mpi')
    x = numpy.random.RandomState(0).rand(64, 3, 8, 8).astype(numpy.float32)
    t = numpy.arange(64, dtype=numpy.int32) % 3
    it = data.MultiprocessIterator(list(zip(x, t)), 4, n_workers=2)
    buf = numpy.zeros(4, numpy.float32)
    it.next()
    ready()
    comm.barrier()
    if comm.rank == 1:
        raise ValueError('rank 1 fails with its loader running')
    while True:
        it.next()
        comm.allreduce(buf, 'allreduce')


def ready():
    # One write: mpiexec merges the ranks' output, and print() may write
    # its pieces apart (unbuffered, as under PYTHONUNBUFFERED).
    sys.stdout.write('ready {} {} {} {}\n'.format(
        os.getpid(), ','.join(str(p.pid) for p in multiprocessing.active_children()),
        ','.join(mapped('/dev/shm/psm_')), ','.join(mapped('/dev/shm/mpich_shm_'))))
    sys.stdout.flush()


def mapped(prefix):
    """The files under ``prefix`` this process has mapped: the loader's slots
    (psm_*), MPICH's shared memory (mpich_shm_*)."""
    with open('/proc/self/maps') as f:
        return sorted({line.split()[-1] for line in f if prefix in line})


def reuse():
    """Communicators made and finalised in turn, their ranks stalling in
    turn (told to the peers), then the script's own duplicate of the world,
    which MPI may give a freed context: nothing of fastchain's reaches it."""
    import time
    from mpi4py import MPI
    from fastchain.distributed import _departures
    _departures.STALL, _departures.STALL_GRACE = 0.5, 0.5
    for round_ in range(3):
        comm = distributed.create_communicator('mpi')
        for i in range(2):
            if comm.rank == (i + round_) % 2:
                time.sleep(0.8)
            comm.allreduce(numpy.ones(3), what='step')
            comm.allgather_obj(i, what='gather')
        comm.finalize()
    rank = MPI.COMM_WORLD.rank
    user = MPI.COMM_WORLD.Dup()
    time.sleep(0.5)
    status, stale = MPI.Status(), []
    while user.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
        buf = numpy.empty(status.Get_count(MPI.BYTE), numpy.uint8)
        user.Recv(buf, source=status.Get_source(), tag=status.Get_tag())
        stale.append(status.Get_tag())
    user.Free()
    assert stale == [], stale
    done(rank)


{'hooks': hooks, 'ctrl_c_in_python': lambda: ctrl_c(False),
 'ctrl_c_in_allreduce': lambda: ctrl_c(True), 'raise_with_loader': raise_with_loader,
 'reuse': reuse, 'thread_exit': thread_exit, 'ctrl_c_saving_short': lambda: ctrl_c_saving(2.0),
 'ctrl_c_saving_long': lambda: ctrl_c_saving(9.0)}[SCENARIO]()
