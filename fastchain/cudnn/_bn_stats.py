"""BatchNormalization's batch statistics on CuPy, reduced in two levels.

Chainer's general implementation takes them as ``x.mean(axis=(0, 2, 3))``
and ``x.var(axis=(0, 2, 3))``: one CuPy reduction per channel over N x H x W
values, across the channel axis. On an H200 (2026-11-28, CuPy 14.2,
ResNet-50 at batch 32, ``benchmarks/results/gpu/breakdown-quick.*``) those
two kernels were the largest device cost of every step: the variance
(``cupy_var_core_float32``) 52.7 ms of a 95.7 ms fp16 step and 67.3 ms of a
140 ms fp32 step with cuDNN convolutions; PyTorch's whole step used 7.7 ms
of device time.

Here the array is seen as (N, C, H x W) and each level reduces a
contiguous run: the sums over H x W first (N x C outputs, each a contiguous
row), then over N (C outputs of N values). The variance is the mean of
squared deviations from the mean (two passes, as Chainer's), accumulated in
float32 at least and returned in ``dtype`` (float32 under mixed16, as
Chainer's). The backward's two sums per channel (``gbeta = sum(gy)``,
``ggamma = sum(gy * x_hat)``, Chainer's ``get_ggamma_and_gbeta``) are taken
the same way, the product inside the reduction. Not bitwise equal to
Chainer's (another order of additions); within the tolerances the GPU
tests state. Not yet measured on a GPU: ``benchmarks/bn_stats.py`` times it
against Chainer's reductions and cuDNN's graph.
"""

import numpy

import chainer

_kernel = None
_products = None


def usable(x, axis):
    """True for an (N, C, ...) array reduced over every axis but the
    channels' (1): the shape Chainer's BatchNormalization gives its CNNs."""
    return x.ndim >= 2 and tuple(axis) == (0,) + tuple(range(2, x.ndim))


def _squared_deviations():
    """The CuPy kernel summing (x - mean)**2 along the last axis, x cast to
    the mean's dtype before subtracting (float16 data, float32 sums)."""
    global _kernel
    if _kernel is None:
        import cupy
        _kernel = cupy.ReductionKernel(
            'T x, U mean', 'U out',
            '(static_cast<U>(x) - mean) * (static_cast<U>(x) - mean)',
            'a + b', 'out = a', '0', 'fastchain_bn_squared_deviations')
    return _kernel


def _levels(dtype, *arrays):
    """(array module, the accumulation dtype: ``dtype`` or float32 if wider,
    each (N, C, ...) array as a C-contiguous (N, C, rest))."""
    xp = chainer.backend.get_array_module(arrays[0])
    acc = numpy.promote_types(dtype, numpy.float32)
    return xp, acc, [xp.ascontiguousarray(a).reshape(a.shape[0], a.shape[1], -1)
                     for a in arrays]


def mean_and_var(x, dtype):
    """(mean, biased variance) per channel (axis 1) of ``x``, in ``dtype``;
    added up in float32 at least (a float16 ``dtype`` would overflow the
    count and the sums of a large layer: 32 x 112 x 112 values > 65504)."""
    xp, acc, (x3,) = _levels(dtype, x)
    n, c = x3.shape[:2]
    count = float(n * x3.shape[2])
    mean = x3.sum(axis=2, dtype=acc).sum(axis=0)
    mean /= count
    if xp is numpy:
        d = x3.astype(acc) - mean[:, None]
        squares = (d * d).sum(axis=2)
    else:
        squares = _squared_deviations()(x3, mean.reshape(1, c, 1), axis=2)
    var = squares.sum(axis=0)
    var /= count
    return mean.astype(dtype, copy=False), var.astype(dtype, copy=False)


def _product_sums():
    """The CuPy kernel summing gy * x_hat along the last axis, in x_hat's dtype."""
    global _products
    if _products is None:
        import cupy
        _products = cupy.ReductionKernel(
            'T gy, U x_hat', 'U out', 'static_cast<U>(gy) * x_hat', 'a + b', 'out = a', '0',
            'fastchain_bn_product_sums')
    return _products


def gbeta_and_ggamma(gy, x_hat, dtype):
    """(sum of ``gy``, sum of ``gy * x_hat``) per channel (axis 1), in
    ``dtype``, added up in float32 at least: Chainer's
    ``get_ggamma_and_gbeta`` in two levels."""
    xp, acc, (gy3, x3) = _levels(dtype, gy, x_hat)
    gbeta = gy3.sum(axis=2, dtype=acc).sum(axis=0)
    if xp is numpy:
        products = (gy3.astype(acc) * x3.astype(acc)).sum(axis=2)
    else:
        products = _product_sums()(gy3, x3.astype(acc, copy=False), axis=2)
    ggamma = products.sum(axis=0)
    return gbeta.astype(dtype, copy=False), ggamma.astype(dtype, copy=False)
