"""Bucketed gradient averaging that overlaps backward.

Chainer writes a parameter's gradient only when the whole backward pass has
finished, so to start communicating early fastchain captures each
parameter's gradient when the function that consumed it returns from its
``backward`` (a FunctionHook wraps that one call). When every parameter of a
bucket has its gradient, the bucket is packed and its allreduce starts,
while backward goes on with the earlier layers.

On a communicator that does not progress in the background (MPI on the
CPU moves data only inside MPI calls) there is nothing to overlap: the
gradients are averaged after backward, each array in place (packed into
buckets, as on NCCL, where overlap is asked for).

Rules that keep it exact and deadlock-free:

- Buckets are fixed (each parameter once, in the reverse of Chainer's
  order, by link name; split at ``cap`` bytes and at dtype changes), so
  every rank has the same buckets. Chainer lists a parameter twice where
  two links hold it (tying by assignment): in two buckets its gradient
  would be reduced twice, and with overlap a bucket could leave with a
  partial gradient and overwrite the full one at the end (a fuzzer found
  it, 2026-12-02).
- Buckets start strictly in index order: MPI and NCCL need every rank to
  issue collectives in the same order. What a rank issues depends on the
  buckets and options only, never on its graph: in place, each parameter's
  gradient is one array of its own (one whose memory another gradient
  shares, a read-only or broadcast one, a transposed view: copied first), so that ranks whose
  graphs differ still pair their collectives, and nothing is averaged twice.
- Overlap needs the gradients to start empty (``cleargrads``, Chainer's
  default in ``update(lossfun)``) and to know how many functions consume
  each parameter, which the first step measures. A step whose graph differs
  (a parameter gets another contribution after its bucket started) is
  redone from the final gradients: slower, never wrong.
- Parameters that get no gradient are zero-filled (Chainer's
  ``reallocate_cleared_grads``) and averaged like the rest.
"""

import bisect

import numpy

import chainer

# Gradients with fewer values than this travel together, in place mode.
SMALL = 16384


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
        self.handles = []
        self.arrays = None      # reduced in place (no buffer), when not packed
        self.small = None       # small gradients sent together (last of arrays)

    def nbytes(self):
        return self.size * self.dtype.itemsize

    def pack(self, grads):
        """Copy each parameter's gradient (array) into the bucket buffer."""
        if self.buffer is None:
            xp = chainer.backend.get_array_module(grads[0])
            self.buffer = xp.empty(self.size, self.dtype)
        for g, offset in zip(grads, self.offsets):
            self.buffer[offset:offset + g.size] = g.ravel()
        self.arrays = None

    def scatter_small(self):
        """Copy the packed small gradients back where they came from."""
        if self.small:
            packed, offset = self.arrays[-1], 0
            for a in self.small:
                a[...] = packed[offset:offset + a.size].reshape(a.shape)
                offset += a.size
            self.small = None

    def unpack(self, scale):
        """Average, and leave the result in every param.grad."""
        if self.arrays is not None:
            return          # reduced in place, averaged as each one arrived
        self.buffer *= self.dtype.type(scale)
        for p, offset in zip(self.params, self.offsets):
            average = self.buffer[offset:offset + p.size].reshape(p.shape)
            if _writable(p.grad):
                p.grad[...] = average
            else:       # a read-only or broadcast gradient (F.sum(p) gives one)
                p.grad = average.astype(p.grad.dtype, copy=True)


class GradientSync:
    """Averages the gradients of ``params`` over ``comm``'s ranks.

    Args:
        comm: a fastchain communicator.
        params (list): the model's parameters, in registration order.
        cap_bytes (int): the largest bucket.
        allreduce_dtype: dtype on the wire (default: each gradient's own);
            ``numpy.float16`` halves the bytes.
        overlap (bool): start buckets during backward (default: when the
            communicator progresses in the background, i.e. NCCL).
    """

    def __init__(self, comm, params, cap_bytes=25 * 2 ** 20, allreduce_dtype=None,
                 overlap=None):
        self.comm = comm
        # Each parameter once: Chainer lists one twice where two links hold it
        # (weight tying by assignment, a link registered under two names).
        unique = {id(p): p for p in params if p.array is not None}
        self.params = list(unique.values())
        self.cap_bytes = cap_bytes
        self.allreduce_dtype = allreduce_dtype
        self.overlap_enabled = comm.progresses_in_background if overlap is None else overlap
        # In place where the communicator prefers it (MPI), except with
        # overlap: buckets started during backward are packed, and every
        # bucket must then be (a redo packs them all again from the
        # gradients, which must not be averaged already).
        self.in_place = not comm.prefers_buckets and allreduce_dtype is None and \
            not self.overlap_enabled
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
        self.agree = False
        self._reduced = []          # the bytes of the gradients to reduce in place

    def begin_step(self):
        """Before backward: may this step overlap?"""
        self._reset()
        # Whether the ranks agree on a redo at the end: from the options and
        # the step count only (the same on every rank), so that the
        # agreement's collective is issued by all or none; whether this
        # step overlaps also needs its gradients empty, which is the rank's.
        self.agree = self.overlap_enabled and self.uses is not None and self.comm.size > 1
        self.overlap = self.agree and all(p.grad is None for p in self.params)

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
            # Captured gradients may be shared with the rest of backward
            # (an Add passes one array to both inputs): always copy them.
            bucket.pack([self.captured[id(p)] for p in bucket.params])
            self._start(bucket)
            self.next_start += 1

    def _start(self, bucket, in_place=False):
        from fastchain.nvtx._annotator import annotator
        what = 'allreduce of gradient bucket {} ({})'.format(bucket.index,
                                                              size_text(bucket.nbytes()))
        with annotator().range('allreduce bucket {}'.format(bucket.index), 'allreduce'):
            if in_place:
                # The final gradients, reduced where they lie; the small ones
                # (biases, BN parameters: most of the arrays, little of the
                # bytes) together in one buffer, to pay the latency once.
                # One array per parameter (finish() made them so), whatever
                # this rank's graph made of them, so that every rank issues
                # the same collectives.
                arrays = [p.grad for p in bucket.params]
                small = [a for a in arrays if a.size < SMALL]
                bucket.arrays = [a for a in arrays if a.size >= SMALL]
                if small:
                    bucket.small = small
                    packed = numpy.concatenate([a.ravel() for a in small]) \
                        if len({a.dtype for a in small}) == 1 else None
                    if packed is None:      # mixed dtypes: one by one
                        bucket.arrays += small
                        bucket.small = None
                    else:
                        bucket.arrays.append(packed)
                bucket.handles = []
                for a in bucket.arrays:
                    handle = self.comm.allreduce_start(a, what)
                    if handle is None:
                        # Done already (MPI): average this array now, while
                        # the reduction has left part of it in cache (not
                        # after the whole bucket, when every byte must come
                        # from memory again).
                        a *= a.dtype.type(1.0 / self.comm.size)
                    else:
                        bucket.handles.append((handle, a))
                if not bucket.handles:
                    bucket.scatter_small()
            else:
                bucket.handles = [(self.comm.allreduce_start(bucket.buffer, what), None)]

    def _own_gradient(self, p):
        return own_gradient(p, self._reduced)

    def _wait(self, bucket):
        if not bucket.handles:
            return
        for handle, array in bucket.handles:
            self.comm.allreduce_wait(handle)
            if array is not None:
                array *= array.dtype.type(1.0 / self.comm.size)
        bucket.handles = []
        bucket.scatter_small()

    def finish(self):
        """After backward (grads set, missing ones zero-filled): start what
        has not started, wait for everything, write the averages back."""
        if self.comm.size == 1:
            self.uses = dict(self.seen)
            return
        early = self.next_start
        in_place = self.in_place
        if in_place:        # before any is reduced: a copy must be of the rank's own
            for bucket in self.buckets[self.next_start:]:
                for p in bucket.params:
                    self._own_gradient(p)
        for bucket in self.buckets[self.next_start:]:
            if not in_place:
                bucket.pack([p.grad for p in bucket.params])
            self._start(bucket, in_place)
        self.next_start = len(self.buckets)
        for bucket in self.buckets:
            self._wait(bucket)
        if self.agree:
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
                self._wait(bucket)
        elif early:
            self.overlapped_steps += 1
        scale = 1.0 / self.comm.size
        for bucket in self.buckets:
            bucket.unpack(scale)
        self.uses = dict(self.seen)
        self._reset()


def _writable(array):
    """Whether writing into ``array`` writes each element once: not
    read-only (NumPy's flag), no stride of 0 over more than one element (a
    broadcast, which CuPy does not mark read-only)."""
    if not getattr(array.flags, 'writeable', True):
        return False
    return all(stride != 0 or n <= 1 for stride, n in zip(array.strides, array.shape))


def own_gradient(p, claimed):
    """``p.grad``, made a C-contiguous writable array of its own where it is
    not one, for writing into in place: an array whose memory another
    parameter's gradient shares (p1 + p2 gives both the same gradient,
    reshape(p1) + p2 a view of it; reduced or written twice, it would be
    averaged twice or hold the second's value), a read-only or broadcast
    one, a transposed view. ``claimed``: the sorted memory spans of the
    gradients made own so far (this step's; updated)."""
    g = p.grad
    if g is None:       # no gradient: zero-filled, as Chainer's optimizer does
        p.grad = g = chainer.backend.get_array_module(p.array).zeros_like(p.array)
    span = _span(g)
    place = bisect.bisect_right(claimed, span) if span else 0
    shared = span is not None and (
        (place and claimed[place - 1][1] > span[0]) or
        (place < len(claimed) and claimed[place][0] < span[1]))
    if shared or not (g.flags.c_contiguous and _writable(g)):
        p.grad = g = g.copy()
        span = _span(g)
        place = bisect.bisect_right(claimed, span) if span else 0
    if span is not None:
        claimed.insert(place, span)
    return g


def _span(array):
    """The bytes ``array``'s elements lie in, [first, past the last), or
    None when it has none (two gradients share memory where theirs meet)."""
    if not array.size:
        return None
    if hasattr(array, 'data') and hasattr(array.data, 'ptr'):      # CuPy
        low = high = array.data.ptr
    else:
        low = high = array.__array_interface__['data'][0]
    for stride, n in zip(array.strides, array.shape):
        if stride < 0:
            low += stride * (n - 1)
        else:
            high += stride * (n - 1)
    return low, high + array.itemsize


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


def size_text(nbytes):
    """'25.0 MiB', '12.5 KiB', '96 bytes': a bucket's size as a message gives it."""
    if nbytes >= 2 ** 20:
        return '{:.1f} MiB'.format(nbytes / 2 ** 20)
    if nbytes >= 2 ** 10:
        return '{:.1f} KiB'.format(nbytes / 2 ** 10)
    return '{} bytes'.format(int(nbytes))
