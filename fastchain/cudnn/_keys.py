"""Keys of cuDNN graphs and the choice of path for each call.

A graph is built once per key: the operation, every shape, the dtypes, the
stride, padding, dilation and groups, the compute type, the math allowed
(TensorCores for float32 or not), determinism and the device. Two calls
with the same key run the same graph (and, once autotuned, the same plan).

The path of a call is one of ``'graph'`` (fastchain's cuDNN graph),
``'cupy-cudnn'`` (Chainer's own cuDNN code, on a CuPy that still has cuDNN)
or ``'chainer'`` (Chainer's im2col/GEMM or elementwise code), and when it is
not the graph, why (kept per operation for ``doctor`` and
``handle.report()``; :mod:`fastchain.cudnn._paths`).
"""

import collections

import numpy

CONV_OPS = ('conv forward', 'conv input gradient', 'conv weight gradient')
BN_OPS = ('batchnorm forward', 'batchnorm backward', 'batchnorm inference')

# The dtypes the graphs take (cuDNN 9 has no float64 convolution engines
# fastchain relies on; float64 stays Chainer's).
DTYPES = (numpy.dtype(numpy.float16), numpy.dtype(numpy.float32))

ConvKey = collections.namedtuple('ConvKey', (
    'op', 'x_shape', 'w_shape', 'y_shape', 'dtype', 'stride', 'pad', 'dilation',
    'groups', 'tensor_cores', 'deterministic', 'device', 'workspace'))

BNKey = collections.namedtuple('BNKey', (
    'op', 'x_shape', 'dtype', 'param_dtype', 'eps', 'running', 'device'))



# The most workspace a plan may take. Chainer's own setting answers 0 where
# CuPy has no cuDNN (and ignores a new value), so the graphs keep theirs:
# Chainer's default for cuDNN, 8 MiB, until ``enable(workspace_size=...)``
# or fp16 (512 MiB) sets another (``cudnn._group.workspace_accessors``; the
# key holds it, so another limit is another graph).
DEFAULT_WORKSPACE = 8 * 2 ** 20
workspace_limit = DEFAULT_WORKSPACE


def get_workspace_limit():
    return workspace_limit


def set_workspace_limit(size):
    global workspace_limit
    workspace_limit = int(size)

def compute_dtype(dtype):
    """Accumulation type: float32 for float16 and float32 inputs (fp16 on
    TensorCores with fp32 sums, as Chainer's cuDNN path did)."""
    return numpy.dtype(numpy.float32)


def conv_geometry(node):
    """(stride, pad, dilation) of a Chainer convolution node."""
    return (node.sy, node.sx), (node.ph, node.pw), (node.dy, node.dx)


def _standard_layouts(node):
    layouts = getattr(node, 'input_layouts', None)
    return not layouts or all(layout is None for layout in layouts)


def conv_refusal(op, node, arrays, w_dtype=None):
    """Why a convolution call cannot take a graph (None when it can).

    ``arrays``: the CuPy arrays of the call (x and W or gy; the bias is
    added outside the graph). ``w_dtype``: the weight gradient's dtype.
    """
    if getattr(node, 'cover_all', False):
        return 'cover_all=True (cuDNN has no cover_all; Chainer skips cuDNN too)'
    if not _standard_layouts(node):
        return 'a non-standard memory layout (chainer.memory_layouts) on an input'
    dtypes = {a.dtype for a in arrays}
    if w_dtype is not None:
        dtypes.add(numpy.dtype(w_dtype))
    if len(dtypes) != 1:
        return 'mixed dtypes ({}): cuDNN takes one'.format(
            ', '.join(sorted(d.name for d in dtypes)))
    dtype = dtypes.pop()
    if dtype not in DTYPES:
        return '{} (the graphs take float16 and float32)'.format(dtype.name)
    if any(not a.flags.c_contiguous for a in arrays):
        return 'a non-contiguous input'
    if not aligned(*arrays):
        return 'an input not 16-byte aligned (a view into another array)'
    return None


def aligned(*arrays):
    """Device pointers on 16 bytes, as cuDNN's tensors are described (a
    view at an offset, ``x[1:]``, may not be); arrays without one pass."""
    for a in arrays:
        ptr = getattr(getattr(a, 'data', None), 'ptr', None)
        if a is not None and isinstance(ptr, int) and ptr % 16:
            return False
    return True


def tensor_cores_allowed(dtype, setting):
    """TensorCore engines for a call: float16 unless ``use_cudnn_tensor_core``
    is 'never'; float32 (TF32: a 10-bit mantissa in the products, not the
    same training) only where it is 'always', asked for in so many words."""
    if numpy.dtype(dtype) == numpy.float16:
        return setting != 'never'
    return setting == 'always'


_NAMES = {}     # dtype -> its name (NumPy's ``dtype.name`` is a Python property)


def dtype_name(dtype):
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = numpy.dtype(dtype).name
    return name


def conv_key(op, node, x_shape, w_shape, y_shape, dtype, tensor_cores, deterministic,
             device, workspace=None):
    """``workspace``: the most bytes a plan may take (the graphs' limit,
    ``workspace_limit``, which ``enable(workspace_size=...)`` sets)."""
    stride, pad, dilation = conv_geometry(node)
    return ConvKey(op, tuple(x_shape), tuple(w_shape), tuple(y_shape),
                   dtype_name(dtype), stride, pad, dilation, int(node.groups),
                   bool(tensor_cores), bool(deterministic), int(device),
                   None if workspace is None else int(workspace))


def bn_refusal(x, gamma, axis, layouts=None, running=(None, None), beta=None):
    """Why a BatchNormalization call cannot take a graph (None when it can)."""
    if layouts and any(layout is not None for layout in layouts):
        return 'a non-standard memory layout (chainer.memory_layouts) on an input'
    if x.ndim != 4:
        return '{}-d input (the graphs take 4-d NCHW batches)'.format(x.ndim)
    if gamma.ndim != 1 or tuple(axis) != (0, 2, 3):
        return 'statistics over axes {} (the graphs take per-channel, axes (0, 2, 3))'.format(
            tuple(axis))
    if x.dtype not in DTYPES:
        return '{} input (the graphs take float16 and float32)'.format(x.dtype.name)
    if gamma.dtype != numpy.float32 and gamma.dtype != x.dtype:
        return 'gamma is {} and x {}'.format(gamma.dtype.name, x.dtype.name)
    if not x.flags.c_contiguous:
        return 'a non-contiguous input'
    if not aligned(x, gamma, beta, *running):
        return 'an input not 16-byte aligned (a view into another array)'
    if x.size // max(1, gamma.size) < 2:
        return 'one value per channel (the variance of one value)'
    mean, var = running
    if (mean is None) != (var is None):
        return 'one running statistic without the other'
    if mean is not None and (mean.dtype != gamma.dtype or not mean.flags.c_contiguous
                             or not var.flags.c_contiguous):
        return 'running statistics of another dtype than gamma, or non-contiguous'
    return None


def bn_key(op, x, gamma, eps, running, device):
    return BNKey(op, tuple(x.shape), dtype_name(x.dtype), dtype_name(gamma.dtype), float(eps),
                 bool(running), int(device))


def describe(key):
    """How a key reads in reports: 'conv forward 32x64x56x56 * 64x64x3x3 ->
    32x64x56x56 float16 s1 p1 d1 g1 tensor cores'."""
    if isinstance(key, ConvKey):
        return '{} {} * {} -> {} {} s{} p{} d{} g{}{}{}'.format(
            key.op, 'x'.join(map(str, key.x_shape)), 'x'.join(map(str, key.w_shape)),
            'x'.join(map(str, key.y_shape)), key.dtype, _pair(key.stride), _pair(key.pad),
            _pair(key.dilation), key.groups,
            ' tensor cores' if key.tensor_cores else '',
            ' deterministic' if key.deterministic else '')
    return '{} {} {} (params {})'.format(key.op, 'x'.join(map(str, key.x_shape)), key.dtype,
                                         key.param_dtype)


def _pair(p):
    return str(p[0]) if p[0] == p[1] else '{}x{}'.format(*p)
