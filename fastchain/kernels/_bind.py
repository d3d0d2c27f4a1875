"""Kernels bound once per schedule entry: the lean part of the replay.

Chainer's replay of a static schedule still calls each function the way
define-by-run does: ``FunctionNode.forward`` checks layouts, backends and
iDeep, and the CPU convolution then pads its input with ``numpy.pad`` (a
general-purpose routine with ~20 us of Python per call), fills an im2col
array, has ``numpy.tensordot`` copy it again into the matrix it multiplies,
and ``numpy.dot`` zero-fills its output before BLAS overwrites it. In a
schedule the shapes, strides and parameters of every call are fixed, so the
planning can be done once. For the functions that dominate a CPU step of a
convolutional network, this module replaces the schedule entry's callable
with a kernel planned for its call:

- ``Convolution2DFunction`` (forward) and ``Convolution2DGradW`` (the weight
  gradient): the padded input lives in a buffer allocated once, whose zero
  border is never written again; the im2col columns are a strided view of it,
  copied once into the matrix Chainer's ``tensordot`` builds;
- ``Deconvolution2DFunction`` (the input gradient): the same matrix product
  and Chainer's col2im accumulation with its slices computed once;
- the products go through ``numpy.matmul``, which calls the same BLAS routine
  on the same operands without the zero fill (and, where this NumPy's ``dot``
  raises no floating-point warnings, as NumPy 1.x's does not, without
  matmul's either: an fp16 overflow warns no more than under Chainer).

The arithmetic is Chainer's: the same BLAS products of equal operands and
the same accumulation order, so a bound replay is bitwise equal to Chainer's
replay (tested on ResNet-50 and on every convolution setting planned for),
which is itself checked against define-by-run. Anything else (grouped,
``cover_all``, iDeep or GPU arrays, non-standard layouts, an input whose
shape or dtype differs from the first call's) runs Chainer's code unchanged.
The same planners serve define-by-run, planned per call
(:mod:`fastchain.kernels._conv`, ``enable(cpu_conv=...)``, which also decides
whether schedules are bound).

Bound kernels keep no array that escapes: every output is freshly allocated,
and the padded buffers are shared by the entries of one schedule that pad the
same shape and dtype with the same padding, i.e. write the same interior and
leave the same zero border (the schedule runs its entries one at a time).
"""

import numpy
from numpy.lib.stride_tricks import as_strided

from fastchain.kernels import _onednn
from fastchain.kernels._keys import call_key, describe
from fastchain.tune import _tuner

_dot_warns = None     # does this NumPy's dot report floating-point errors?


def _quiet_matmul(a, b):
    with numpy.errstate(all='ignore'):
        return numpy.matmul(a, b)


def _product():
    """numpy.matmul, quiet where numpy.dot (what Chainer calls) is quiet."""
    global _dot_warns
    if _dot_warns is None:
        import warnings
        with warnings.catch_warnings(record=True) as caught, numpy.errstate(invalid='warn'):
            warnings.simplefilter('always')
            numpy.dot(numpy.array([[numpy.inf]]), numpy.array([[0.0]]))
        _dot_warns = bool(caught)
    matmul = numpy.matmul if _dot_warns else _quiet_matmul

    def product(a, b):
        if _blasable(a) and _blasable(b):
            return matmul(a, b)
        # What BLAS cannot take as it is (a broadcast output gradient, F.sum(y)'s:
        # zero strides): numpy.dot copies it for BLAS, numpy.matmul runs its own
        # loop, which rounds otherwise. Chainer's call, then.
        return numpy.dot(a, b)
    return product


def _blasable(a):
    """A 2-d array BLAS takes in place: one unit stride, the other at least
    a row or column long (NumPy's own test, for positive strides)."""
    item = a.itemsize
    (rows, cols), (s0, s1) = a.shape, a.strides
    return (s1 == item and s0 >= max(cols, 1) * item) or \
        (s0 == item and s1 >= max(rows, 1) * item)


# Whether schedules built from now on are bound (enable(cpu_conv=False) clears it).
enabled = True


def bind_schedule(schedule):
    """Bind the supported entries of a built ``StaticScheduleFunction``.

    Returns the number of entries bound.
    """
    if not enabled:
        return 0
    buffers = {}
    bound = 0
    makers = planners()
    for info in schedule.schedule_info_list:
        node = info.function_node
        if node is None or info.kwargs.get('inputs') is None:
            continue
        make = makers.get(type(node))
        if (make is None or not _plain_node(node)
                or getattr(info.func, '__name__', None) != 'generic_static_forward'):
            continue
        info.func = _Lazy(make, node, info.func, buffers)
        bound += 1
    return bound


def _plain(arrays):
    return all(type(a) is numpy.ndarray for a in arrays)


def _plain_node(node):
    if getattr(node, 'groups', 1) != 1 or getattr(node, 'cover_all', False):
        return False
    if getattr(node, '_use_ideep', False):
        return False
    layouts = getattr(node, 'input_layouts', None)
    return layouts is None or all(layout is None for layout in layouts)


class _Lazy:
    """The entry's callable: plans on the first call (with the real arrays),
    then runs the plan; Chainer's callable whenever the plan does not fit."""

    __slots__ = ('make', 'node', 'original', 'buffers', 'plan', 'key', 'tune_key', 'pick')

    def __init__(self, make, node, original, buffers):
        self.make, self.node, self.original, self.buffers = make, node, original, buffers
        self.plan = None
        self.key = None
        self.tune_key = None
        self.pick = None        # autotune's decided alternative: (generation, name)

    def __call__(self, func, inputs):
        key = tuple((type(a), a.shape, a.dtype) for a in inputs)
        if self.plan is None and self.key is None:
            self.key = key
            if _plain(inputs):
                try:
                    self.plan = self.make(self.node, inputs, self.buffers)
                except Exception:       # an input this planner did not foresee
                    self.plan = None
        if self.plan is not None and key == self.key:
            onednn = _onednn.convolution_kernel(self.node, inputs)
            if onednn is not None:
                return onednn()     # the onednn option: oneDNN's kernel, not measured
            if not _tuner.enabled:
                return self.plan(inputs)
            # autotune: the bound kernel or Chainer's, whichever is faster
            # for this call (the same bits either way); once decided, run
            # directly (a cached step makes ~160 of these calls).
            pick = self.pick
            if pick is not None and pick[0] == _tuner.generation and not _tuner.forced:
                if pick[1] == 'fastchain':
                    return self.plan(inputs)
                return _chainers(self.original, func, inputs)
            if self.tune_key is None:
                self.tune_key = call_key(self.node, inputs)
            generation = _tuner.generation      # before the pick: a forget() between
            out = _tuner.call('cpu_conv_bound', self.tune_key, (
                ('fastchain', lambda: self.plan(inputs)),
                ('chainer', lambda: _chainers(self.original, func, inputs))),
                label=self._label)
            picked = _tuner.pick('cpu_conv_bound', self.tune_key)
            if picked is not None:
                self.pick = (generation, picked)
            return out
        return self.original(func, inputs=inputs)

    def _label(self):
        return describe(self.tune_key)


# True while a bound entry runs Chainer's own kernel: the cpu_conv layer on
# _forward_cpu_core then steps aside (the schedule runs one entry at a time).
chainers_kernel = False


def _chainers(original, func, inputs):
    """The entry's original callable with Chainer's kernel inside, not the
    ``cpu_conv`` layer's choice."""
    global chainers_kernel
    chainers_kernel = True
    try:
        return original(func, inputs=inputs)
    finally:
        chainers_kernel = False


def _buffer(buffers, shape, dtype, interior):
    """A zero-bordered buffer whose ``interior`` (the region each call
    overwrites) is the only part ever written: entries share one only if
    everything its contents depend on is the same (shape, dtype and interior;
    a same-shaped buffer padded differently has non-zero border cells)."""
    key = (shape, numpy.dtype(dtype), interior)
    buf = buffers.get(key)
    if buf is None:
        buf = buffers[key] = numpy.zeros(shape, dtype)
    return buf


def _columns(node, x, kh, kw, buffers):
    """A function x -> the im2col view of x as (n, oh, ow, c, kh, kw).

    Chainer pads with (ph, ph + sy - 1) rows and (pw, pw + sx - 1) columns;
    without cover_all the extra sy - 1 rows are never read, so an unpadded
    input is viewed in place.
    """
    from chainer.utils import conv
    n, c, h, w = x.shape
    sy, sx, ph, pw, dy, dx = node.sy, node.sx, node.ph, node.pw, node.dy, node.dx
    oh = conv.get_conv_outsize(h, kh, sy, ph, False, dy)
    ow = conv.get_conv_outsize(w, kw, sx, pw, False, dx)
    shape = (n, oh, ow, c, kh, kw)
    if oh <= 0 or ow <= 0:
        return None, (oh, ow)       # (the planners leave it to Chainer's code, which raises)

    def view(a):
        s0, s1, s2, s3 = a.strides
        return as_strided(a, shape, (s0, s2 * sy, s3 * sx, s1, s2 * dy, s3 * dx),
                          writeable=False)

    if ph == 0 and pw == 0:
        return view, (oh, ow)
    padded = _buffer(buffers, (n, c, h + 2 * ph + sy - 1, w + 2 * pw + sx - 1), x.dtype,
                     ((ph, ph + h), (pw, pw + w)))
    interior = padded[:, :, ph:ph + h, pw:pw + w]
    padded_view = view(padded)

    def fill_and_view(a):
        interior[...] = a
        return padded_view
    return fill_and_view, (oh, ow)


def _matrix(columns, n, rows, k):
    """The (rows, k) im2col matrix in the memory layout Chainer's
    ``tensordot`` hands BLAS, so that BLAS takes the same path and rounds the
    same: Chainer's col is (n, c, kh, kw, oh, ow) C-contiguous, and tensordot
    reshapes its (n, oh, ow, c, kh, kw) transpose, which NumPy copies into a
    C-contiguous matrix for a batch of several, but views in place for a
    batch of 1: a transposed (k, rows) C-contiguous array. (Made contiguous
    for a batch of 1 it gave other bits in 116 of 384 convolutions: a trial.)"""
    if n == 1 and rows > 1 and k > 1:
        cols = columns.transpose(0, 3, 4, 5, 1, 2).reshape(k, rows)
        return numpy.ascontiguousarray(cols).T
    return numpy.ascontiguousarray(columns.reshape(rows, k))


def _convolution(node, inputs, buffers):
    # Chainer: col = im2col(x); y = tensordot(col, W, ((1, 2, 3), (1, 2, 3)))
    # .astype(x.dtype); y += b; rollaxis(y, 3, 1).
    x, W = inputs[0], inputs[1]
    with_bias = len(inputs) == 3
    o, c, kh, kw = W.shape
    columns, (oh, ow) = _columns(node, x, kh, kw, buffers)
    if oh <= 0 or ow <= 0:
        return None     # a kernel larger than the padded input: Chainer's code raises
    n = x.shape[0]
    rows, k = n * oh * ow, c * kh * kw
    dtype = x.dtype
    product = _product()

    def run(inputs):
        x, W = inputs[0], inputs[1]
        cols = _matrix(columns(x), n, rows, k)
        y = product(cols, W.transpose(1, 2, 3, 0).reshape(k, o))
        y = y.reshape(n, oh, ow, o).astype(dtype, copy=False)
        if with_bias:
            y += inputs[2]
        return y.transpose(0, 3, 1, 2),
    return run


def _convolution_grad_w(node, inputs, buffers):
    # Chainer: gW = tensordot(gy, im2col(x), ((0, 2, 3), (0, 4, 5))).astype(W_dtype)
    x, gy = inputs
    columns, (oh, ow) = _columns(node, x, node.kh, node.kw, buffers)
    if oh <= 0 or ow <= 0:
        return None
    n, c = x.shape[:2]
    o = gy.shape[1]
    rows, k = n * oh * ow, c * node.kh * node.kw
    shape = (o, c, node.kh, node.kw)
    w_dtype = node.W_dtype
    product = _product()

    def run(inputs):
        x, gy = inputs
        if not (gy.flags.c_contiguous or gy.flags.f_contiguous) and 1 in gy.shape:
            gy = numpy.ascontiguousarray(gy)        # as Chainer does (its issue 2744)
        cols = _matrix(columns(x), n, rows, k)
        gw = product(gy.transpose(1, 0, 2, 3).reshape(o, rows), cols)
        return gw.reshape(shape).astype(w_dtype, copy=False),
    return run


def _deconvolution(node, inputs, buffers):
    # Chainer: gcol = rollaxis(tensordot(W, x, (0, 1)).astype(x.dtype), 3);
    # y = col2im(gcol); y += b.
    x, W = inputs[0], inputs[1]
    if node.outh is None or node.outw is None:
        return None
    with_bias = len(inputs) == 3
    n, o, ih, iw = x.shape
    _, c, kh, kw = W.shape
    sy, sx, ph, pw, dy, dx = node.sy, node.sx, node.ph, node.pw, node.dy, node.dx
    h, w = node.outh, node.outw
    k, rows = c * kh * kw, n * ih * iw
    dtype = x.dtype
    padded_shape = (n, c, h + 2 * ph + sy - 1, w + 2 * pw + sx - 1)
    windows = [(j, i, (slice(None), slice(None), slice(j * dy, j * dy + sy * ih, sy),
                       slice(i * dx, i * dx + sx * iw, sx)))
               for j in range(kh) for i in range(kw)]
    crop = (slice(None), slice(None), slice(ph, ph + h), slice(pw, pw + w))
    product = _product()

    def run(inputs):
        x, W = inputs[0], inputs[1]
        gcol = product(W.transpose(1, 2, 3, 0).reshape(k, o),
                         x.transpose(1, 0, 2, 3).reshape(o, rows))
        gcol = gcol.reshape(c, kh, kw, n, ih, iw).astype(dtype, copy=False)
        gcol = numpy.rollaxis(gcol, 3)
        img = numpy.zeros(padded_shape, dtype)
        for j, i, window in windows:
            img[window] += gcol[:, :, j, i]
        y = img[crop]
        if with_bias:
            y += inputs[2].reshape((1, -1, 1, 1))
        return y,
    return run


def planners():
    """{Chainer function class: its planner}: the functions this module plans."""
    from chainer.functions.connection import convolution_2d, deconvolution_2d
    return {
        convolution_2d.Convolution2DFunction: _convolution,
        convolution_2d.Convolution2DGradW: _convolution_grad_w,
        deconvolution_2d.Deconvolution2DFunction: _deconvolution,
    }
