"""The device prefetcher's GPU edge: the side stream a batch is copied on,
and the events that order the copies against the steps that read them (a
no-op edge on the CPU)."""

import contextlib
import threading

import numpy


@contextlib.contextmanager
def _no_edge():
    yield _Done()


class _Done:
    event = None


def cuda_edge(device):
    """The GPU edge for ``device``, or a no-op one on the CPU."""
    if device is None or device.xp is numpy or device.xp is not _cupy():
        return _no_edge
    import cupy
    return CudaEdge(cupy, device.device.id)


class CudaEdge:
    """A prefetcher's GPU edge (not run on a GPU yet: tested with a stand-in).

    - The copies run on a side stream made on the target device (each
      data-parallel rank has its own, ``@cupy:<local rank>``), under that
      device, and each batch's copy ends with an event that the training
      stream waits on before using the arrays (:meth:`consume`).
    - A batch's memory comes from CuPy's pool for the side stream, so once
      freed it goes to the next copy with no ordering against the steps that
      read it. So the arrays of each batch handed out are held here until the
      side stream has waited on an event of the training stream recorded
      after that batch's step was enqueued: when batch k is consumed, an
      event is recorded (step k-1 is enqueued by then) and batch k-1 is
      retired with it; before its next copy, the side stream waits on the
      newest retirement event and only then lets go of those arrays.
    """

    def __init__(self, cupy, device_id):
        self.cupy = cupy
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._held = None           # the arrays of the batch in use
        self._retired = []          # (event, arrays) the side stream has not waited on
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self):
        """In the prefetch thread: convert and copy one batch."""
        done = _Done()
        with self.cupy.cuda.Device(self.device_id), self.stream:
            with self._lock:
                retired, self._retired = self._retired, []
            if retired:
                self.stream.wait_event(retired[-1][0])
            del retired                 # their memory may be reused from here on
            yield done
            done.event = self.stream.record()

    def consume(self, batch):
        """In the training loop, on its stream: wait for ``batch``'s copy."""
        stream = self.cupy.cuda.get_current_stream()
        stream.wait_event(batch.event)
        event = stream.record()
        with self._lock:
            if self._held is not None:
                self._retired.append((event, self._held))
            self._held = batch.arrays


def _cupy():
    from chainer.backends import cuda
    return cuda.cupy if cuda.available else None
