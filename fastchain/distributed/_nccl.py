"""The GPU edge: NCCL through CuPy, with the unique id broadcast over MPI.

NCCL is set up lazily, on the first collective, because a NCCL communicator
belongs to the device that is current when it is made: the script must first
pick its GPU (``comm.device().use()``, by local rank). Collectives run on a
side stream that first waits for the compute stream, so the allreduce of a
bucket overlaps the rest of backward. Waiting for one costs the host
nothing: the compute stream waits on the allreduce's event (a stream
dependency, no host synchronisation per bucket), and a watchdog thread
checks the events still pending against the timeout (and for a peer that
has left), aborting the job past it, since a stream stuck on a dead peer
would otherwise block the host at its next synchronisation for ever.

Since the host only launches an allreduce, its 'allreduce' NVTX range covers
the launch; while fastchain's timeline records, each allreduce is also timed
on the NCCL stream with CUDA events (:class:`~fastchain.nvtx._timeline.DeviceTrack`),
so the trace shows it on a device track and the summary reports the
allreduce time on the device per step. Under Nsight Systems the NCCL kernels
are in the report itself (``profiling/summarize.py`` reads them).

Not run here: these machines have no GPU. The logic above it (buckets,
ordering, averaging, loss-scale agreement) is the same code the MPI
communicator's tests run.
"""

import threading
import time

from fastchain.distributed._base import CommunicatorBase

TICK = 0.1      # seconds between the watchdog's looks at the pending events


class NcclCommunicator(CommunicatorBase):

    name = 'nccl'
    progresses_in_background = True
    prefers_buckets = True

    def __init__(self, mpi_comm, timeout):
        super().__init__(mpi_comm, timeout)
        from fastchain.backends import cuda
        status = cuda.nccl_status()
        if not status.available:
            raise RuntimeError('the nccl communicator needs NCCL: {}. Fix: {} (or use '
                               "create_communicator('mpi') on CPU)".format(status.why,
                                                                          status.fix))
        import cupy
        n_gpus = cupy.cuda.runtime.getDeviceCount()
        if self.intra_size > n_gpus:
            raise RuntimeError(
                '{} processes on this node but only {} GPU(s): start at most one '
                'process per GPU (mpiexec -n {} ...)'.format(self.intra_size, n_gpus, n_gpus))
        self._nccl = None
        self._stream = None
        self._pending = _Pending(self)
        self._track = None

    def device(self):
        import chainer
        return chainer.get_device('@cupy:{}'.format(self.intra_rank))

    def _finalize_core(self):
        self._pending.stop()
        if self._nccl is not None:
            self._poll(self._stream.record(), 'collectives in flight at finalize')
            self._nccl.destroy()
            self._nccl = None

    def _setup(self):
        if self._nccl is None:
            import cupy
            from cupy.cuda import nccl
            uid = nccl.get_unique_id() if self.rank == 0 else None
            uid = self.bcast_obj(uid, what='NCCL unique id')
            # on this rank's GPU whatever device is current (a script that
            # has not called comm.device().use() would put every rank on GPU 0)
            with cupy.cuda.Device(self.intra_rank):
                self._nccl = nccl.NcclCommunicator(self.size, uid, self.rank)
                self._stream = cupy.cuda.Stream(non_blocking=True)
        return self._nccl

    def _dtype(self, array):
        """NCCL's type of ``array``; an array not on the GPU, or of a type
        NCCL has not, is named with the fix."""
        if not hasattr(getattr(array, 'data', None), 'ptr'):
            raise TypeError(
                'the nccl communicator works on CuPy arrays on the GPU, not {} (move the model '
                'to comm.device() before its optimizer is made data-parallel, or give the '
                'updater device=comm.device())'.format(type(array).__name__))
        from cupy.cuda import nccl
        types = {name: getattr(nccl, 'NCCL_' + name.upper()) for name in (
            'float16', 'float32', 'float64', 'uint8', 'int8', 'int32', 'int64', 'uint32',
            'uint64') if hasattr(nccl, 'NCCL_' + name.upper())}
        if array.dtype.name not in types:
            raise TypeError('NCCL has no {} type (it has {})'.format(
                array.dtype.name, ', '.join(sorted(types))))
        return types[array.dtype.name]

    def bcast(self, array, root=0, what='bcast'):
        comm = self._setup()
        import cupy
        self._stream.wait_event(cupy.cuda.get_current_stream().record())
        comm.bcast(array.data.ptr, array.size, self._dtype(array), root, self._stream.ptr)
        self._poll(self._stream.record(), what)
        return array

    def allreduce_start(self, array, what):
        from cupy.cuda import nccl
        import cupy
        comm = self._setup()
        self._stream.wait_event(cupy.cuda.get_current_stream().record())
        track = self._device_track()
        token = track.begin() if track is not None else None
        comm.allReduce(array.data.ptr, array.data.ptr, array.size, self._dtype(array),
                       nccl.NCCL_SUM, self._stream.ptr)
        event = self._stream.record()
        if track is not None:
            track.end(token, what, 'allreduce', event)
        return event, what

    def _device_track(self):
        """The timeline's track for the NCCL stream while one records, else None."""
        from fastchain.nvtx import _annotator
        annotator = _annotator._annotator
        timeline = annotator.timeline if annotator is not None else None
        if timeline is None:
            return None
        if self._track is None or self._track.timeline is not timeline:
            from fastchain.nvtx._timeline import DeviceTrack
            self._track = DeviceTrack(timeline, 'NCCL stream (GPU {})'.format(self.intra_rank),
                                      self._stream)
        return self._track

    def allgather(self, array, what='allgather'):
        import cupy
        comm = self._setup()
        array = cupy.ascontiguousarray(array)
        out = cupy.empty((self.size,) + array.shape, array.dtype)
        self._stream.wait_event(cupy.cuda.get_current_stream().record())
        comm.allGather(array.data.ptr, out.data.ptr, array.size, self._dtype(array),
                       self._stream.ptr)
        self._poll(self._stream.record(), what)
        return out

    def allreduce_wait(self, handle):
        """The compute stream waits for the allreduce (no host wait); the
        watchdog keeps the deadline."""
        import cupy
        event, what = handle
        cupy.cuda.get_current_stream().wait_event(event)
        self._pending.add(event, what)

    def _poll(self, event, what):
        start = time.monotonic()
        deadline = start + self.timeout
        while not event.done:
            now = time.monotonic()
            if now > deadline:
                self.abort_timeout(what)
            if now - start > 0.01:
                self.check_peers(what, start)
            time.sleep(1e-4)


class _Pending:
    """Allreduce events the compute stream waits on, watched by a thread
    against the collective timeout (started with the first one)."""

    def __init__(self, comm):
        self.comm = comm
        self.events = []            # [(event, what, started)]
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = None

    def add(self, event, what):
        with self.lock:
            self.events.append((event, what, time.monotonic()))
            if self.thread is None:
                self.thread = threading.Thread(target=self._watch, daemon=True,
                                               name='fastchain-nccl-watchdog')
                self.thread.start()

    def stop(self):
        self.stopped.set()

    def look(self):
        """One look: drop completed events; abort past the deadline (or for a
        peer that has left). Returns how many are still pending."""
        now = time.monotonic()
        with self.lock:
            self.events = [e for e in self.events if not e[0].done]
            oldest = self.events[0] if self.events else None
            pending = len(self.events)
        if oldest is not None:
            event, what, started = oldest
            if now - started > self.comm.timeout:
                self.comm.abort_timeout(what)
            self.comm.check_peers(what, started)
        return pending

    def _watch(self):
        import cupy
        with cupy.cuda.Device(self.comm.intra_rank):     # the events' device
            while not self.stopped.wait(TICK):
                self.look()
