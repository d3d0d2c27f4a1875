"""Bucketed gradient averaging that overlaps backward.

Chainer writes a parameter's gradient only when the whole backward pass has
finished, so to start communicating early fastchain captures each
parameter's gradient when the function that consumed it returns from its
``backward`` (a FunctionHook wraps that one call). When every parameter of a
bucket has its gradient, the bucket is packed and its allreduce starts,
while backward goes on with the earlier layers.

Rules that keep it exact and deadlock-free:

- Buckets are fixed (reverse registration order, split at ``cap`` bytes and
  at dtype changes), so every rank has the same buckets.
- Buckets start strictly in index order: MPI and NCCL need every rank to
  issue collectives in the same order.
- Overlap needs the gradients to start empty (``cleargrads``, Chainer's
  default in ``update(lossfun)``) and to know how many functions consume
  each parameter, which the first step measures. A step whose graph differs
  (a parameter gets another contribution after its bucket started) is
  redone from the final gradients: slower, never wrong.
- Parameters that get no gradient are zero-filled (Chainer's
  ``reallocate_cleared_grads``) and averaged like the rest.
"""

import numpy

import chainer


class _Bucket:
    def __init__(self, index, params, dtype):
        self.index = index
        self.params = params
        self.dtype = numpy.dtype(dtype)
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.size
        self.size = total
        self.buffer = None
        self.handle = None

    def nbytes(self):
        return self.size * self.dtype.itemsize

    def pack(self, grads):
        """Copy each parameter's gradient (array) into the bucket buffer."""
        if self.buffer is None:
            xp = chainer.backend.get_array_module(grads[0])
            self.buffer = xp.empty(self.size, self.dtype)
        for g, offset in zip(grads, self.offsets):
            self.buffer[offset:offset + g.size] = g.ravel()

    def unpack(self, scale):
        self.buffer *= self.dtype.type(scale)
        for p, offset in zip(self.params, self.offsets):
            p.grad[...] = self.buffer[offset:offset + p.size].reshape(p.shape)


class GradientSync:
    """Averages the gradients of ``params`` over ``comm``'s ranks.

    Args:
        comm: a fastchain communicator.
        params (list): the model's parameters, in registration order.
        cap_bytes (int): the largest bucket.
        allreduce_dtype: dtype on the wire (default: each gradient's own);
            ``numpy.float16`` halves the bytes.
    """

    def __init__(self, comm, params, cap_bytes=25 * 2 ** 20, allreduce_dtype=None):
        self.comm = comm
        self.params = [p for p in params if p.array is not None]
        self.cap_bytes = cap_bytes
        self.allreduce_dtype = allreduce_dtype
        self.buckets = self._make_buckets()
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.uses = None                    # id(param) -> consumers, learnt
        self.overlapped_steps = 0
        self.redone_steps = 0
        self._reset()

    def _make_buckets(self):
        buckets, current, size, dtype = [], [], 0, None
        for p in reversed(self.params):     # backward meets the last layers first
            wire = numpy.dtype(self.allreduce_dtype or p.dtype)
            nbytes = p.size * wire.itemsize
            if current and (wire != dtype or size + nbytes > self.cap_bytes):
                buckets.append(_Bucket(len(buckets), current, dtype))
                current, size = [], 0
            current.append(p)
            dtype = wire
            size += nbytes
        if current:
            buckets.append(_Bucket(len(buckets), current, dtype))
        return buckets

    # -- one step ----------------------------------------------------------

    def _reset(self):
        self.captured = {}          # id(param) -> summed contribution (array)
        self.seen = {}              # id(param) -> contributions this step
        self.next_start = 0
        self.dirty = False
        self.overlap = False

    def begin_step(self):
        """Before backward: may this step overlap?"""
        self._reset()
        self.overlap = self.uses is not None and self.comm.size > 1 and \
            all(p.grad is None for p in self.params)

    def contribution(self, param, gx):
        """A function's backward produced ``gx`` for ``param``."""
        key = id(param)
        self.seen[key] = self.seen.get(key, 0) + 1
        if not self.overlap:
            return
        bucket = self.bucket_of[key]
        if bucket.index < self.next_start:
            self.dirty = True       # its bucket already left: redo at finish
            return
        previous = self.captured.get(key)
        self.captured[key] = gx if previous is None else previous + gx
        if self.seen[key] == self.uses.get(key):
            self._start_ready()

    def _ready(self, bucket):
        return all(self.seen.get(id(p), 0) == self.uses.get(id(p), -1)
                   and id(p) in self.captured for p in bucket.params)

    def _start_ready(self):
        while self.next_start < len(self.buckets) and \
                self._ready(self.buckets[self.next_start]):
            bucket = self.buckets[self.next_start]
            bucket.pack([self.captured[id(p)] for p in bucket.params])
            self._start(bucket)
            self.next_start += 1

    def _start(self, bucket):
        from fastchain.nvtx._annotator import annotator
        with annotator().range('allreduce bucket {}'.format(bucket.index), 'allreduce'):
            bucket.handle = self.comm.allreduce_start(
                bucket.buffer, 'allreduce of gradient bucket {} ({:.1f} MB)'.format(
                    bucket.index, bucket.nbytes() / 2 ** 20))

    def finish(self):
        """After backward (grads set, missing ones zero-filled): start what
        has not started, wait for everything, write the averages back."""
        if self.comm.size == 1:
            self.uses = dict(self.seen)
            return
        early = self.next_start
        for bucket in self.buckets[self.next_start:]:
            bucket.pack([p.grad for p in bucket.params])
            self._start(bucket)
        self.next_start = len(self.buckets)
        for bucket in self.buckets:
            self.comm.allreduce_wait(bucket.handle)
            bucket.handle = None
        if self.overlap:
            # Every rank must make the same choice, or their collectives would
            # no longer pair up.
            self.dirty = self.comm.any(self.dirty, 'gradient-graph agreement')
        if self.dirty:
            # A bucket left with an incomplete gradient: average them all again
            # from the final gradients (all ranks saw the same graph change).
            self.redone_steps += 1
            for bucket in self.buckets:
                bucket.pack([p.grad for p in bucket.params])
                self._start(bucket)
            for bucket in self.buckets:
                self.comm.allreduce_wait(bucket.handle)
        elif early:
            self.overlapped_steps += 1
        scale = 1.0 / self.comm.size
        for bucket in self.buckets:
            bucket.unpack(scale)
        self.uses = dict(self.seen)
        self._reset()


class GradientCapture(chainer.FunctionHook):
    """Hands each parameter's gradient to the GradientSync as soon as the
    function consuming the parameter has computed it."""

    name = 'fastchain_gradient_capture'

    def __init__(self, sync):
        self.sync = sync
        self.by_node = {}

    def refresh(self):
        self.by_node = {id(p.node): p for p in self.sync.params}

    def backward_preprocess(self, function, in_data, out_grad):
        inputs = getattr(function, 'inputs', ())
        params = [(i, self.by_node.get(id(node))) for i, node in enumerate(inputs)]
        params = [(i, p) for i, p in params if p is not None]
        if not params:
            return
        backward = function.backward
        sync = self.sync
        n_inputs = len(inputs)

        def backward_capturing(target_input_indexes, grad_outputs):
            gxs = backward(target_input_indexes, grad_outputs)
            if len(gxs) == n_inputs and len(gxs) != len(target_input_indexes):
                gxs_by_index = dict(enumerate(gxs))
            else:
                gxs_by_index = dict(zip(target_input_indexes, gxs))
            for i, p in params:
                gx = gxs_by_index.get(i)
                if gx is not None:
                    sync.contribution(p, gx.array)
            return gxs
        function.backward = backward_capturing

    def backward_postprocess(self, function, in_data, out_grad):
        if 'backward' in getattr(function, '__dict__', {}):
            del function.backward
