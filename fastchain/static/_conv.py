"""fastchain's CPU convolution kernels in define-by-run (``cpu_conv``).

The kernels of :mod:`fastchain.static._bind` are planned per call here: the
plan is made from the call's arrays and run at once. Define-by-run thus gets
what does not depend on a schedule (no ``numpy.pad``, the im2col columns
copied once instead of twice, ``numpy.matmul`` instead of ``numpy.dot``, which
zero-fills its output before BLAS writes it), and a cached schedule adds
planning once (its bound kernels). Results stay bitwise equal to Chainer's
(tested): the same BLAS products of equal operands, the same accumulation.

Only ``_forward_cpu_core`` of the three convolution functions is replaced,
so Chainer's type checks, layouts and dispatch (GPU, iDeep, grouped) stay
Chainer's; inside, anything the kernels do not plan for (iDeep, ``cover_all``,
non-NumPy arrays) goes to Chainer's code.
"""

import numpy

from fastchain.static import _bind


def _plain(arrays):
    return all(type(a) is numpy.ndarray for a in arrays)


def _convolution_core(original):
    def _forward_cpu_core(self, x, W, b):
        inputs = (x, W) if b is None else (x, W, b)
        if self._use_ideep or self.cover_all or not _plain(inputs):
            return original(self, x, W, b)
        return _bind._convolution(self, inputs, {})(inputs)
    _forward_cpu_core.__wrapped__ = original
    return _forward_cpu_core


def _convolution_grad_w_core(original):
    def _forward_cpu_core(self, x, gy):
        inputs = (x, gy)
        if self._use_ideep or self.cover_all or not _plain(inputs):
            return original(self, x, gy)
        return _bind._convolution_grad_w(self, inputs, {})(inputs)
    _forward_cpu_core.__wrapped__ = original
    return _forward_cpu_core


def _deconvolution_core(original):
    def _forward_cpu_core(self, x, W, b):
        inputs = (x, W) if b is None else (x, W, b)
        plan = None
        if not self._use_ideep and _plain(inputs):
            plan = _bind._deconvolution(self, inputs, {})
        if plan is None:
            return original(self, x, W, b)
        return plan(inputs)
    _forward_cpu_core.__wrapped__ = original
    return _forward_cpu_core


def _functions():
    from chainer.functions.connection import convolution_2d as c2
    from chainer.functions.connection import deconvolution_2d as d2
    return ((c2.Convolution2DFunction, _convolution_core),
            (c2.Convolution2DGradW, _convolution_grad_w_core),
            (d2.Deconvolution2DFunction, _deconvolution_core))


def install(recorder):
    """Give the three convolution functions fastchain's CPU kernels (and let
    schedules bind them); undone with ``recorder``."""
    for cls, wrap in _functions():
        core = cls._forward_cpu_core
        if getattr(core, 'fastchain_cpu_conv', False):
            continue            # an enclosing handle installed it already
        new = wrap(core)
        new.fastchain_cpu_conv = True
        recorder.set_attr(cls, '_forward_cpu_core', new,
                          label='{}._forward_cpu_core (cpu_conv)'.format(cls.__name__))
    recorder.set_attr(_bind, 'enabled', True, label='static schedules bind kernels (cpu_conv)')


def remove(recorder):
    """``cpu_conv=False``: Chainer's kernels, also where an enclosing handle
    installed fastchain's, and schedules built from now on replay Chainer's
    code; undone with ``recorder``."""
    for cls, _ in _functions():
        core = cls._forward_cpu_core
        if getattr(core, 'fastchain_cpu_conv', False):
            recorder.set_attr(cls, '_forward_cpu_core', core.__wrapped__,
                              label='{}._forward_cpu_core (cpu_conv=False)'.format(
                                  cls.__name__))
    recorder.set_attr(_bind, 'enabled', False,
                      label='static schedules bind kernels (cpu_conv=False)')
