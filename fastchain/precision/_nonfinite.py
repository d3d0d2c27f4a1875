"""One check for inf/NaN over many gradients, one host synchronisation.

On the CPU each gradient is summed (one pass, no temporary) and the sums
looked at: a NumPy call per array, no synchronisation to speak of; a sum
that is not finite is confirmed value by value (large finite values can
overflow a sum).

On a GPU a reduction per gradient would be a kernel launch per parameter
(161 for ResNet-50) before the one transfer of the result. Here one kernel
per dtype and device looks at every gradient of that dtype: a table of their
addresses and sizes goes to the device (from pinned memory, without a
synchronisation), each row of blocks walks one gradient, and a thread that
finds a value whose exponent bits are all ones (inf or NaN, in IEEE half,
single and double precision) sets the device's flag. The flags of all the
groups are read back with one synchronisation per device (one per step in a
one-GPU process). The bit test is exact: it flags inf and NaN only, where a
sum could also overflow on large finite values.
"""

import numpy

SOURCE = r'''
#define FASTCHAIN_NONFINITE(NAME, U, MASK)                                     \
extern "C" __global__ void NAME(const unsigned long long* ptrs,              \
                                const long long* sizes, int* found) {        \
    const U* p = (const U*)ptrs[blockIdx.y];                                 \
    long long size = sizes[blockIdx.y];                                      \
    long long stride = (long long)gridDim.x * blockDim.x;                    \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;     \
         i < size; i += stride) {                                            \
        if ((p[i] & MASK) == MASK) {                                         \
            found[0] = 1;                                                    \
            return;                                                          \
        }                                                                    \
    }                                                                        \
}
FASTCHAIN_NONFINITE(fastchain_nonfinite_2, unsigned short, (unsigned short)0x7C00u)
FASTCHAIN_NONFINITE(fastchain_nonfinite_4, unsigned int, 0x7F800000u)
FASTCHAIN_NONFINITE(fastchain_nonfinite_8, unsigned long long, 0x7FF0000000000000ull)
'''

KERNELS = {2: 'fastchain_nonfinite_2', 4: 'fastchain_nonfinite_4', 8: 'fastchain_nonfinite_8'}
THREADS = 256
MAX_BLOCKS_X = 256      # blocks along one gradient (each thread then strides)
MAX_ROWS = 65535        # CUDA's limit on gridDim.y: more gradients, more launches

_modules = {}           # device id -> cupy.RawModule


def any_nonfinite(grads):
    """True if any of ``grads`` (arrays; ``None`` skipped) holds inf or NaN."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return False
    if all(isinstance(g, (numpy.ndarray, numpy.generic)) for g in grads):    # 0-d: a scalar
        return any(_nonfinite_cpu(g) for g in grads)
    return _any_nonfinite_gpu(grads)


def _nonfinite_cpu(array):
    """A sum (fp16 in fp32) is non-finite if a value is; only then, since a
    sum of large finite values can overflow too, each value is looked at."""
    if array.dtype.kind != 'f':
        return False
    with numpy.errstate(over='ignore', invalid='ignore'):
        total = array.sum(dtype=numpy.promote_types(array.dtype, numpy.float32))
    return not numpy.isfinite(total) and not numpy.isfinite(array).all()


def groups(grads):
    """``{(device id, itemsize): [arrays]}``: what one launch looks at.
    Floating-point arrays only (an integer array cannot hold inf or NaN)."""
    out = {}
    for g in grads:
        if g.dtype.kind != 'f':
            continue
        out.setdefault((g.device.id, g.dtype.itemsize), []).append(g)
    return out


def launch_shape(sizes):
    """(blocks along a gradient, rows) for gradients of ``sizes``: enough
    blocks for the largest to give each thread at least 4 values, at most
    ``MAX_BLOCKS_X``."""
    largest = max(sizes)
    blocks = -(-largest // (THREADS * 4))
    return max(1, min(MAX_BLOCKS_X, blocks)), len(sizes)


def _any_nonfinite_gpu(grads):
    import cupy
    import cupyx
    flags = {}
    keep = []       # pinned tables and device copies, alive until the flags are read
    for (device, itemsize), arrays in groups(grads).items():
        with cupy.cuda.Device(device):
            flag = flags.get(device)
            if flag is None:
                flag = flags[device] = cupy.zeros(1, numpy.int32)
            kernel = _kernel(device, itemsize)
            arrays = [a if a.flags.c_contiguous else cupy.ascontiguousarray(a)
                      for a in arrays]
            keep.append(arrays)
            stream = cupy.cuda.get_current_stream()
            for start in range(0, len(arrays), MAX_ROWS):
                part = arrays[start:start + MAX_ROWS]
                table = cupyx.empty_pinned((2, len(part)), numpy.int64)
                table[0] = [a.data.ptr for a in part]
                table[1] = [a.size for a in part]
                on_device = cupy.empty_like(table)
                on_device.set(table, stream=stream)
                keep.append((table, on_device))
                blocks, rows = launch_shape([a.size for a in part])
                kernel((blocks, rows), (THREADS,), (on_device[0], on_device[1], flag))
    found = False
    for device, flag in flags.items():
        with cupy.cuda.Device(device):
            found = bool(flag.get()[0]) or found    # the synchronisation
    del keep
    return found


def _kernel(device, itemsize):
    import cupy
    module = _modules.get(device)
    if module is None:
        module = _modules[device] = cupy.RawModule(code=SOURCE)
    return module.get_function(KERNELS[itemsize])
