"""oneDNN's CPU kernels, from PyTorch's CPU build: the ``onednn`` option.

Chainer's own CPU accelerator was iDeep (oneDNN), which has no build for
today's Python. PyTorch's CPU wheel ships oneDNN's convolutions, and
``torch.from_numpy`` / ``Tensor.numpy()`` share memory with NumPy arrays,
so Chainer's arrays go in and out without a copy. This module offers:

- convolutions (``Convolution2DFunction``, its weight gradient
  ``Convolution2DGradW`` and ``Deconvolution2DFunction``, which is also the
  convolution's input gradient) through ``torch.conv2d``,
  ``aten::convolution_backward`` and ``torch.conv_transpose2d``, i.e.
  oneDNN's kernels;
- BatchNormalization (training forward and backward, and the inference
  forward of ``FixedBatchNormalization``) through PyTorch's
  ``native_batch_norm`` CPU kernels (ATen's vectorised loops: PyTorch calls
  oneDNN for BatchNormalization only on its own oneDNN tensors).

**Not bitwise equal to Chainer**: the kernels sum in another order, so
results differ by rounding: every convolution output within ``TOLERANCE``
times the sum of the magnitudes of the products it adds, every
BatchNormalization output within ``TOLERANCE`` of the largest magnitude of
that output (at least 1) (tests/kernels/test_onednn.py checks each operation
against float64, over generated shapes and settings),
and a training run within the differential suite's stated tolerance of
plain Chainer's (tests/differential). Hence an option of its own, off by
default, which says so when it is turned on.

Threads: PyTorch's OpenMP pool gets this process's share of the cores
(``torch.set_num_threads``), and while the option is in force NumPy's BLAS
runs on one thread. Two pools on the same cores cost more than they give:
OpenBLAS's idle threads spin (with ``sched_yield``) for a while after each
call, and so do OpenMP's, so each switch between a BLAS call and a oneDNN
call waited for the other pool's threads (measured on the project's 2-core
machine: 4 ms per switch, a ResNet-50 step at batch 16 twice as slow). With
one BLAS thread, what stays on NumPy (fully connected layers, the kernels
autotune may still pick) runs single-threaded; ``disable()`` gives the BLAS
its threads back (each library its own count). PyTorch's own thread
count stays as set. What stays Chainer's is then Chainer's code on one BLAS
thread: bitwise its results there, not those of a multi-threaded BLAS, which
splits a product's sums otherwise (a float64 convolution 4.3e-14 and
F.linear 4.6e-5 off, on 2 threads; a review).

Float32 only, and only where Chainer's CPU code would run the operation
(``groups`` 1, no ``cover_all``, standard layouts, NumPy arrays, BatchNorm
over every axis but the channel axis 1, outputs with rows and columns);
anything else stays Chainer's.
Autotune: oneDNN's kernels run for every call they qualify for; the
autotuner does not measure them against fastchain's and Chainer's per key
(it still chooses among those for the calls oneDNN leaves). Measured on the
project's machine (ResNet-50, batch 16, the ladder's rungs with the loader,
static cache and fused update, 3 windows each): per-key choices among the
three, 6.00 it/s; oneDNN for every call, 7.07 it/s; without onednn, 5.94.
A per-call time misses what a mix costs: each switch between oneDNN's
thread pool and the BLAS wakes the other's threads. The layers are in
:mod:`fastchain.kernels._conv`, :mod:`fastchain.kernels._bind` and
:mod:`fastchain.kernels._onednn_bn`.
"""

import importlib.metadata
import sys

import numpy

TOLERANCE = 2.0 ** -16      # of the sum of |products| an output element adds up

enabled = False             # set by enable(onednn=...)
calls = {}                  # operation -> calls that ran oneDNN/PyTorch (tests, reports)

_torch = None


def status(load=False):
    """(available, version, why, fix) of PyTorch's CPU kernels here. Without
    ``load``, PyTorch is not imported (a second's work) unless it is already:
    an installed PyTorch counts as available."""
    try:
        version = importlib.metadata.version('torch')
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None and 'torch' not in sys.modules:
        return False, None, 'PyTorch is not installed', FIX
    if not load and 'torch' not in sys.modules:
        return True, version, None, None
    try:
        import torch
    except ImportError as e:
        return False, version, 'PyTorch does not import ({})'.format(e), FIX
    if not torch.backends.mkldnn.is_available():
        return False, torch.__version__, 'this PyTorch build has no oneDNN (mkldnn)', FIX
    return True, torch.__version__, None, None


FIX = ('pip install "fastchain[onednn]" (PyTorch\'s CPU build: on Linux x86-64, '
       'pip install torch --index-url https://download.pytorch.org/whl/cpu)')


def _module():
    global _torch
    if _torch is None:
        import torch
        from fastchain import _node
        # A data-parallel process's share of the cores, as for its BLAS.
        torch.set_num_threads(_node.share_of_cores(torch.get_num_threads()))
        _torch = torch
    return _torch


def _blas():
    import threadpoolctl
    return [i for i in threadpoolctl.threadpool_info() if i['user_api'] == 'blas']


def blas_threads():
    """The threads of each BLAS library loaded (threadpoolctl), in order."""
    return tuple(i['num_threads'] for i in _blas())


def one_blas_thread():
    """:func:`blas_threads`'s value with every library on one thread."""
    return (1,) * len(_blas())


def set_blas_threads(threads):
    """Set each BLAS library's threads to the count at its place in ``threads``."""
    import threadpoolctl
    controller = threadpoolctl.ThreadpoolController()
    for info, n in zip(_blas(), threads):
        if info['num_threads'] != n:
            controller.select(filepath=info['filepath']).limit(limits=n)


def _tensor(a):
    """``a`` as a tensor sharing its memory (a copy where PyTorch cannot
    share: read-only or negatively strided arrays)."""
    if not a.flags.writeable or min(a.strides, default=0) < 0:
        a = numpy.array(a, order='C')
    return _torch.from_numpy(a)


def _count(op):
    calls[op] = calls.get(op, 0) + 1


def _float32(*arrays):
    return all(type(a) is numpy.ndarray and a.dtype == numpy.float32 for a in arrays)


# --- convolutions -------------------------------------------------------

def _convolution(node, inputs):
    torch = _module()
    x, W = inputs[0], inputs[1]
    b = _tensor(inputs[2]) if len(inputs) == 3 else None
    _count('convolution')
    return torch.conv2d(_tensor(x), _tensor(W), b, (node.sy, node.sx), (node.ph, node.pw),
                        (node.dy, node.dx), 1).numpy(),


def _convolution_grad_w(node, inputs):
    torch = _module()
    x, gy = inputs
    shape = (gy.shape[1], x.shape[1], node.kh, node.kw)
    _count('convolution weight gradient')
    # The weight only gives its shape to the weight gradient.
    _, gw, _ = torch.ops.aten.convolution_backward(
        _tensor(gy), _tensor(x), torch.empty(shape, dtype=torch.float32), None, [node.sy, node.sx],
        [node.ph, node.pw], [node.dy, node.dx], False, [0, 0], 1, [False, True, False])
    return gw.numpy(),


def _output_padding(node, x, W):
    """Deconvolution: PyTorch's output_padding for Chainer's outsize, or None
    where PyTorch has none that gives it."""
    if node.outh is None or node.outw is None or node.outh <= 0 or node.outw <= 0:
        return None
    (ih, iw), (kh, kw) = x.shape[2:], W.shape[2:]
    oph = node.outh - ((ih - 1) * node.sy - 2 * node.ph + node.dy * (kh - 1) + 1)
    opw = node.outw - ((iw - 1) * node.sx - 2 * node.pw + node.dx * (kw - 1) + 1)
    if 0 <= oph < max(node.sy, node.dy) and 0 <= opw < max(node.sx, node.dx):
        return oph, opw
    return None


def _deconvolution(node, inputs, padding):
    torch = _module()
    x, W = inputs[0], inputs[1]
    b = _tensor(inputs[2]) if len(inputs) == 3 else None
    _count('deconvolution')
    return torch.conv_transpose2d(_tensor(x), _tensor(W), b, (node.sy, node.sx),
                                  (node.ph, node.pw), padding, 1,
                                  (node.dy, node.dx)).numpy(),


def _positive(node, inputs):
    """The convolution's output has rows and columns."""
    from chainer.utils import conv
    h, w = inputs[0].shape[2:]
    kh, kw = inputs[1].shape[2:] if type(node).__name__ == 'Convolution2DFunction' else \
        (node.kh, node.kw)
    return (conv.get_conv_outsize(h, kh, node.sy, node.ph, False, node.dy) > 0
            and conv.get_conv_outsize(w, kw, node.sx, node.pw, False, node.dx) > 0)


def convolution_kernel(node, inputs):
    """A function () -> outputs computing this convolution call with oneDNN,
    or None where it does not apply (``onednn`` off, not float32, a
    deconvolution size PyTorch cannot give). ``node`` and ``inputs`` passed
    fastchain's own checks (groups 1, no cover_all, standard layouts, NumPy
    arrays)."""
    if not enabled or not _float32(*inputs):
        return None
    if any(0 in a.shape[2:] for a in inputs[:2]):
        return None     # no rows or columns: PyTorch raises where Chainer gives empty arrays
    name = type(node).__name__
    if name in ('Convolution2DFunction', 'Convolution2DGradW') and not _positive(node, inputs):
        return None     # a kernel larger than the padded input: Chainer's code raises
    if name == 'Convolution2DFunction':
        return lambda: _convolution(node, inputs)
    if name == 'Convolution2DGradW':
        if numpy.dtype(node.W_dtype) != numpy.float32:
            return None
        return lambda: _convolution_grad_w(node, inputs)
    if name == 'Deconvolution2DFunction':
        padding = _output_padding(node, inputs[0], inputs[1])
        if padding is None:
            return None
        return lambda: _deconvolution(node, inputs, padding)
    return None
