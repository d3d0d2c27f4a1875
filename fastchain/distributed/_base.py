"""What every communicator does: pickled objects over MPI, waiting against a
deadline, aborting the job, and its lifetime.

The collective timeout: every collective waits at most ``timeout`` seconds
(``create_communicator(timeout=...)``, else the environment variable
``FASTCHAIN_COLLECTIVE_TIMEOUT``, else 300). Past that, the process prints
which rank and which operation did not complete and calls MPI_Abort, which
ends the whole job: a peer that crashed or hangs never leaves the others
waiting for ever. Raise it when one step (or one evaluation, or the first
step's set-up) can legitimately take longer than 5 minutes::

    FASTCHAIN_COLLECTIVE_TIMEOUT=900 mpiexec -n 4 python train.py

Lifetime: a communicator from :func:`create_communicator` holds the job's
process-wide hooks (see ``_faults``) until :meth:`CommunicatorBase.finalize`,
or the end of its ``with`` block::

    with distributed.create_communicator() as comm:
        ...   # train
"""

import abc
import math
import os
import pickle
import sys
import time

import numpy

from fastchain import _node
from fastchain.distributed import _departures, _faults

TIMEOUT_VARIABLE = 'FASTCHAIN_COLLECTIVE_TIMEOUT'


def default_timeout():
    """Seconds a collective may take: ``FASTCHAIN_COLLECTIVE_TIMEOUT`` or 300."""
    text = os.environ.get(TIMEOUT_VARIABLE, '300')
    try:
        value = float(text)
    except ValueError:
        value = float('nan')
    if not value > 0:
        raise ValueError('{}={!r} is not a positive number of seconds. Fix: set it to '
                         'the longest a collective may take, e.g. {}=900'.format(
                             TIMEOUT_VARIABLE, text, TIMEOUT_VARIABLE))
    return value


def check_timeout(timeout):
    """``create_communicator(timeout=...)``: a positive number of seconds
    (NaN, which no wait ever exceeds, would disable it silently)."""
    if timeout is None:
        return default_timeout()
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        value = math.nan
    if not value > 0:
        raise ValueError('timeout={!r} is not a positive number of seconds. Fix: give the '
                         'longest a collective may take, e.g. timeout=900 (default: {} or '
                         '300)'.format(timeout, TIMEOUT_VARIABLE))
    return value


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time (a peer crashed or hangs)."""


class _Finalized:
    """Stands in for the MPI communicator of a finalised communicator."""

    def __getattr__(self, name):
        raise RuntimeError('fastchain: this communicator was finalized; make a new one '
                           'with distributed.create_communicator()')


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
        own = _node.own_cores()
        # The CPU sets of this node's processes (at set-up, before any
        # collective that could time out: Split_type blocks the same way).
        self.node_cores = node.allgather(own) if self.size > 1 else [own]
        node.Free()
        self.timeout = timeout
        self.finalized = False
        self._departures = _departures.Departures(mpi_comm) if self.size > 1 else None
        self._collectives = 0   # MPI collectives started: the same sequence on every rank
        self._waits = 0         # waits begun (each one's identity for the stall checks)

    # -- lifetime ------------------------------------------------------------

    def finalize(self):
        """Give back what this communicator holds (idempotent), and tell the
        peers (a peer then waiting in a collective for this rank ends the job
        in seconds, naming it; see ``_departures``).

        The excepthooks and the signal wakeup fd go back when the last
        communicator holding them is finalised (each only if it is still
        fastchain's). Collectives after this raise ``RuntimeError``. The MPI
        communicator passed in is left as it is (MPI itself is finalised at
        interpreter exit).
        """
        if self.finalized:
            return
        self.finalized = True
        self._finalize_core()
        if self._departures is not None:
            self._departures.announce(_departures.FINALIZED)
        self.mpi_comm = _Finalized()
        _faults.release(self)

    def _finalize_core(self):
        """What a strategy frees at :meth:`finalize` (its watchdog, NCCL)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        # Leaving by an exception, the hooks stay until it is handled: an
        # uncaught one must still end the job (abort, or exit 130 on Ctrl-C).
        if kind is None:
            self.finalize()

    # -- objects (pickled; small: shapes, metrics, seeds) --------------------

    # Pickles travel as bytes through non-blocking collectives (mpi4py's
    # object collectives block, and a blocked rank could not time out).

    def bcast_obj(self, obj, root=0, what='bcast_obj'):
        data = numpy.frombuffer(pickle.dumps(obj), numpy.uint8) if self.rank == root \
            else None
        size = numpy.array([0 if data is None else data.size], numpy.int64)
        self._wait(self.mpi_comm.Ibcast(size, root=root), what,
                   op=self._op('Ibcast from rank {}'.format(root)))
        if data is None:
            data = numpy.empty(int(size[0]), numpy.uint8)
        self._wait(self.mpi_comm.Ibcast(data, root=root), what,
                   op=self._op('Ibcast from rank {}'.format(root)))
        return pickle.loads(data.tobytes())

    def send_obj(self, obj, dest, what='send_obj'):
        data = numpy.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
                                numpy.uint8)
        self._wait(self.mpi_comm.Isend(numpy.array([data.size], numpy.int64), dest,
                                       tag=71), what, peer=dest, op=self._p2p('send', dest))
        self._wait(self.mpi_comm.Isend(data, dest, tag=72), what, peer=dest,
                   op=self._p2p('send', dest))

    def recv_obj(self, source, what='recv_obj'):
        size = numpy.zeros(1, numpy.int64)
        self._wait(self.mpi_comm.Irecv(size, source, tag=71), what, peer=source,
                   op=self._p2p('recv', source))
        data = numpy.empty(int(size[0]), numpy.uint8)
        self._wait(self.mpi_comm.Irecv(data, source, tag=72), what, peer=source,
                   op=self._p2p('recv', source))
        return pickle.loads(data.tobytes())

    def allgather_obj(self, obj, what='allgather_obj'):
        from mpi4py import MPI
        data = numpy.frombuffer(pickle.dumps(obj), numpy.uint8)
        sizes = numpy.zeros(self.size, numpy.int64)
        self._wait(self.mpi_comm.Iallgather(numpy.array([data.size], numpy.int64), sizes),
                   what, op=self._op('Iallgather'))
        out = numpy.empty(int(sizes.sum()), numpy.uint8)
        offsets = numpy.concatenate([[0], numpy.cumsum(sizes)[:-1]])
        self._wait(self.mpi_comm.Iallgatherv(
            data, [out, (sizes, offsets), MPI.BYTE]), what, op=self._op('Iallgatherv'))
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
        self._wait(self.mpi_comm.Ibarrier(), what, op=self._op('Ibarrier'))

    def any(self, flag, what='agreement'):
        """True on every rank if ``flag`` is true on any rank (one tiny MPI
        allreduce, whatever the array backend)."""
        if self.size == 1:
            return bool(flag)
        from mpi4py import MPI
        buf = numpy.array([1 if flag else 0], numpy.int32)
        self._wait(self.mpi_comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.MAX), what,
                   op=self._op('Iallreduce'))
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
    def allgather(self, array, what='allgather'):
        """Every rank's ``array`` (the same shape and dtype on every rank),
        stacked in rank order: shape ``(size,) + array.shape``."""

    @abc.abstractmethod
    def device(self):
        """The Chainer device this process should train on."""

    def allreduce(self, array, what='allreduce'):
        self.allreduce_wait(self.allreduce_start(array, what))
        return array

    # -- waiting and giving up -----------------------------------------------

    def _op(self, operation):
        """The wait for the MPI collective started now: (wait, 'coll', its
        number among this communicator's collectives, the MPI operation)."""
        self._collectives += 1
        self._waits += 1
        return self._waits, 'coll', self._collectives, operation

    def _p2p(self, direction, peer):
        """The wait for a point-to-point message: (wait, 'send' or 'recv',
        the peer)."""
        self._waits += 1
        return self._waits, direction, peer

    def _wait(self, request, what, peer=None, op=None):
        """Wait for an mpi4py request for at most ``timeout`` seconds
        (``op``: what it waits for, :meth:`_op` or :meth:`_p2p`).

        Polls without sleeping: MPI moves a non-blocking collective forward
        only inside MPI calls, so every Test is progress (a blocking MPI wait
        spins the same way). After a second it backs off to 1 ms naps, which
        a stuck peer cannot tell from a blocking wait. Ctrl-C interrupts it
        (the loop returns to Python between Tests).
        """
        start = time.monotonic()
        deadline = start + self.timeout
        try:
            while not request.Test():
                now = time.monotonic()
                if now > deadline:
                    self.abort_timeout(what)
                if now - start > 0.01:
                    self.check_peers(what, start, peer, op)
                if now - start > 1.0:
                    time.sleep(1e-3)
        finally:        # (Ctrl-C too: the peers were told of this wait)
            if op is not None and time.monotonic() - start > _departures.STALL:
                self.wait_ended(op)

    def wait_ended(self, op):
        """The wait in collective ``op`` ended (the peers learn it if they
        were told of it)."""
        if self._departures is not None:
            self._departures.unstalled(op)

    def check_peers(self, what, waiting_since, peer=None, op=None):
        """Abort the job if a peer has ended its process while this rank
        has waited for it in ``what`` since ``waiting_since`` (see
        ``_departures``): any peer in a collective, ``peer`` in a
        point-to-point wait; or, given ``op`` (:meth:`_op`, :meth:`_p2p`), if
        every rank waits and none of the waits can complete (``_departures``)."""
        if self._departures is None:
            return
        if op is not None:
            apart = self._departures.stalled(op, what, waiting_since)
            if apart is not None:
                self._abort_apart(apart)
        left = self._departures.overdue(waiting_since, peer)
        if left is not None:
            rank, how = left
            if how == _departures.LEFT_BLOCKED:
                why = ('has left after Ctrl-C (interrupted while this rank waits for it in '
                       '{}; this rank did not get the interrupt). Aborting the job.'.format(what))
            elif how == _departures.FINALIZED:
                why = ('has finalized its communicator (comm.finalize(), or the end of its '
                       'with block) while this rank waits for it in {}: the ranks ran '
                       'different numbers of collectives (steps, epochs, evaluations). '
                       'Aborting the job.'.format(what))
            else:
                why = ('has ended its process (sys.exit() or the end of its script) while '
                       "this rank waits for it in {}. Aborting the job; rank {}'s own output "
                       'says why it ended (if it ended normally, the ranks ran different '
                       'numbers of steps: shards of unequal length? distributed.'
                       'scatter_dataset gives each rank the same number).'.format(what, rank))
            message = 'fastchain: rank {} of {}: rank {} {}'.format(self.rank, self.size,
                                                                   rank, why)
            print(message, file=sys.stderr, flush=True)
            self.abort(1)
            raise RuntimeError(message)     # reached only if abort returned

    def announce_exit(self, how=_departures.EXITED):
        """At exit with this communicator alive: tell the peers (see
        ``_departures``); ``how=LEFT_BLOCKED`` from a rank leaving a
        blocked call after Ctrl-C."""
        if self._departures is not None and not self.finalized:
            self._departures.announce(how)

    def _abort_apart(self, everyone):
        def wait(op, what):
            if op[0] == 'coll':
                return 'in its collective #{} ({}, MPI {})'.format(op[1], what, op[2])
            return '{} rank {} ({})'.format('sending to' if op[0] == 'send' else
                                            'receiving from', op[1], what)
        waits = '; '.join('rank {} {}'.format(rank, wait(op, what))
                          for rank, (op, what) in sorted(everyone.items()))
        message = ('fastchain: rank {} of {}: the ranks wait for each other in operations '
                   'that do not match, so none can complete: {} (collectives numbered among '
                   "this communicator's MPI operations). A collective or an exchange was "
                   'called on some ranks only: an extension registered on some ranks '
                   '(multi_node_snapshot and the multi-node evaluator go on every rank), a '
                   'collective in a branch that depends on the rank or on local data, or '
                   'ranks that ran different numbers of steps (shards of unequal length: '
                   'distributed.scatter_dataset gives each rank the same number). Aborting '
                   'the job.'.format(self.rank, self.size, waits))
        print(message, file=sys.stderr, flush=True)
        self.abort(1)
        raise RuntimeError(message)     # reached only if abort returned

    def abort_timeout(self, what):
        who = self._departures.missing(self.timeout) if self._departures is not None and \
            self.name == 'mpi' else 'another rank has crashed or hangs'   # (NCCL's tell not)
        message = ('fastchain: rank {} of {}: {} did not complete within {:g} s: {}. Aborting '
                   'the job (raise {} if steps are this slow).'.format(
                       self.rank, self.size, what, self.timeout, who, TIMEOUT_VARIABLE))
        print(message, file=sys.stderr, flush=True)
        self.abort(1)
        raise CollectiveTimeout(message)     # reached only if abort returned

    def abort(self, code=1):
        """End every process of the job (MPI_Abort).

        Waits half a second first: mpiexec forwards a process's output through
        pipes, and what is still in them when the job is killed is lost
        (measured: the error message was missing about one run in four).
        """
        # MPI_Abort runs no exit handler: the loaders' shared memory leaves
        # /dev/shm first (their workers, orphaned, exit by themselves).
        pools = sys.modules.get('fastchain.data._pool')
        if pools is not None:
            try:
                pools.unlink_all()
            except Exception:       # the abort must happen whatever this meets
                pass
        # and this rank's timeline up to here is written (the other ranks'
        # are lost: MPI_Abort ends them without their exit handlers)
        timelines = sys.modules.get('fastchain.nvtx._group')
        if timelines is not None:
            try:
                timelines.write_unwritten('before the job was aborted')
            except Exception:
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(0.5)
        self.mpi_comm.Abort(code)
        # MPI_Abort returned (a new-user trial saw it return when a side
        # thread called it): never go on, into a second traceback.
        os._exit(code)
