"""The ``cudnn`` layers on Chainer's GPU code: convolutions and
BatchNormalization through cuDNN graphs where CuPy has no cuDNN.

Convolutions: a layer on ``forward_gpu`` of ``Convolution2DFunction`` (the
forward), ``Deconvolution2DFunction`` (the convolution's input gradient, and
Chainer's deconvolution) and ``Convolution2DGradW`` (the weight gradient).
Chainer decides there whether cuDNN runs (``chainer.should_use_cudnn``,
False on CuPy 14 whatever ``use_cudnn`` says); the layer decides the same
way on the graph backend's terms: ``use_cudnn`` 'always' or 'auto', and the
call qualifies (:func:`fastchain.cudnn._keys.conv_refusal`). Otherwise, and
for a key cuDNN has no engine for, Chainer's own code runs, and the reason
is counted (:mod:`fastchain.cudnn._paths`). Chainer's backward is unchanged:
it builds the same function nodes, whose ``forward_gpu`` lands here again.
The bias is added outside the graph, by the same CuPy broadcast add as
Chainer's.

BatchNormalization (training): the node's ``_impl_selector`` returns
:class:`GraphImpl` where Chainer would take its general (elementwise)
implementation (a key cuDNN refuses then runs Chainer's with the batch
statistics and backward sums of :mod:`fastchain.cudnn._bn_stats`, path
``'statistics'``); its
forward updates the running statistics as Chainer does (``decay``, unbiased
variance) and returns the batch mean and inverse standard deviation
Chainer's backward and double backward use; its backward is a graph too.
``FixedBatchNormalization`` (inference) stays Chainer's (``BN_INFERENCE``
says why); a layer on ``forward`` counts it. Statistics and gamma/beta stay
in their dtype (float32 under ``mixed16``), as Chainer's cuDNN path did. Off unless
``FASTCHAIN_CUDNN_BN=1`` (``BN_OFF`` says why): every call then stays
Chainer's with that reason. ``FASTCHAIN_CUDNN_BN=stats`` takes no graph and
runs :class:`StatsOnlyImpl` for every call it qualifies for (both not yet
run on a GPU; the next GPU run measures which, if either, to turn on).
"""

import os

import chainer
from chainer.functions.connection import convolution_2d as _conv2d
from chainer.functions.connection import deconvolution_2d as _deconv2d
from chainer.functions.normalization import batch_normalization as _bn
from chainer.utils import conv as _conv_utils

from fastchain.cudnn import _bn_graphs, _bn_stats, _graphs, _keys, _paths


def _setting():
    """Chainer's ``use_cudnn`` ('always', 'auto', 'never') in force here."""
    return chainer.config.use_cudnn


def _device_id(array):
    return array.device.id


def _left_to_chainer(op, node, arrays, w_dtype=None):
    """The reason the call does not take a graph (counted), or None."""
    reason = "use_cudnn='never'" if _setting() == 'never' else \
        _keys.conv_refusal(op, node, arrays, w_dtype)
    if reason is not None:
        _paths.record(op, 'chainer', reason)
    return reason


def _through_graph(next_, node, inputs, op, a, b, out, key_shapes, bias=None):
    """``out`` from the graph of the call's key (``key_shapes``: x, W, y in
    the forward convolution's terms), Chainer's inputs retained as its
    ``forward_gpu`` does and the bias added as Chainer adds it; Chainer's
    code where cuDNN has no plan for the key."""
    key = _key(op, node, *key_shapes, a.dtype, _device_id(a))
    if not _run_conv(op, node, key, a, b, out):
        return next_(node, inputs)
    node.retain_inputs((0, 1))
    if bias is not None:
        out += bias.reshape(1, bias.size, 1, 1)
    return out,


def _run_conv(op, node, key, a, b, out):
    """The graph for ``key`` into ``out``; False (counted) where cuDNN has
    no engine for it (a refusal kept raises at once), and Chainer's code is
    to run."""
    try:
        _graphs.conv(key, a, b, out)
    except _graphs.Unsupported as e:
        _paths.record(op, 'chainer', e.reason)
        return False
    _paths.record(op, 'graph')
    return True


def _key(op, node, x_shape, w_shape, y_shape, dtype, device):
    config = chainer.config
    return _keys.conv_key(op, node, x_shape, w_shape, y_shape, dtype,
                          _keys.tensor_cores_allowed(dtype, config.use_cudnn_tensor_core),
                          config.cudnn_deterministic, device, _keys.workspace_limit)


def forward_layer(next_, node, inputs):
    """``Convolution2DFunction.forward_gpu``."""
    x, W = inputs[:2]
    b = inputs[2] if len(inputs) == 3 else None
    op = 'conv forward'
    if _left_to_chainer(op, node, (x, W)) is not None:
        return next_(node, inputs)
    import cupy
    n, _, h, w = x.shape
    out_c, _, kh, kw = W.shape
    out_h = _conv_utils.get_conv_outsize(h, kh, node.sy, node.ph, d=node.dy)
    out_w = _conv_utils.get_conv_outsize(w, kw, node.sx, node.pw, d=node.dx)
    if out_h <= 0 or out_w <= 0:
        _paths.record(op, 'chainer', 'an empty output')
        return next_(node, inputs)
    y = cupy.empty((n, out_c, out_h, out_w), dtype=x.dtype)
    return _through_graph(next_, node, inputs, op, x, W, y, (x.shape, W.shape, y.shape), b)


def input_gradient_layer(next_, node, inputs):
    """``Deconvolution2DFunction.forward_gpu``: the convolution's input
    gradient (x is the output gradient, W the convolution's weight)."""
    x, W = inputs[:2]
    b = inputs[2] if len(inputs) == 3 else None
    op = 'conv input gradient'
    node._calc_out_size(x.shape, W.shape)
    node._set_cover_all(x.shape, W.shape)
    # An outsize the convolution would not map back onto x sets cover_all
    # (Chainer's _set_cover_all), which the graphs refuse.
    if _left_to_chainer(op, node, (x, W)) is not None:
        return next_(node, inputs)
    import cupy
    y = cupy.empty((x.shape[0], W.shape[1] * node.groups, node.outh, node.outw),
                   dtype=x.dtype)
    # The key in the forward convolution's terms: its x is our output.
    return _through_graph(next_, node, inputs, op, x, W, y, (y.shape, W.shape, x.shape), b)


def weight_gradient_layer(next_, node, inputs):
    """``Convolution2DGradW.forward_gpu``."""
    x, gy = inputs
    op = 'conv weight gradient'
    if _left_to_chainer(op, node, (x, gy), node.W_dtype) is not None:
        return next_(node, inputs)
    import cupy
    w_shape = (gy.shape[1], x.shape[1] // node.groups, node.kh, node.kw)
    gW = cupy.empty(w_shape, dtype=node.W_dtype)
    return _through_graph(next_, node, inputs, op, x, gy, gW, (x.shape, w_shape, gy.shape))


def conv_functions():
    """(class, method, layer) of the convolution layers."""
    return ((_conv2d.Convolution2DFunction, 'forward_gpu', forward_layer),
            (_deconv2d.Deconvolution2DFunction, 'forward_gpu', input_gradient_layer),
            (_conv2d.Convolution2DGradW, 'forward_gpu', weight_gradient_layer))


# BatchNormalization ----------------------------------------------------------

# BatchNormalization's graphs stay off until a GPU run shows them equal to
# Chainer's: a result changed without a word is worse than a slow step.
BN_ENV = 'FASTCHAIN_CUDNN_BN'
BN_OFF = ("BatchNormalization's cuDNN graphs are off until proven on a GPU (on an H200, "
          '2026-11-28, cuDNN 9.19 built the training graphs of every generated key with a '
          'multiple of 8 channels and refused the others; each built one then failed on how '
          'fastchain passed eps, since fixed and not yet run there); {}=1 turns them '
          'on'.format(BN_ENV))


BN_STATS = ('{}=stats: Chainer\'s implementation with the batch statistics and the '
            "backward's sums reduced in two levels by CuPy (fastchain/cudnn/_bn_stats.py), "
            'no cuDNN graph'.format(BN_ENV))


def bn_mode():
    """What ``FASTCHAIN_CUDNN_BN`` asks for: 'graphs' (1), 'stats', or None
    (unset, 0, or a value ``fastchain doctor`` names as wrong)."""
    return {'1': 'graphs', 'stats': 'stats'}.get(os.environ.get(BN_ENV))


def _bn_refusal(x, gamma, axis, layouts, running, beta):
    if _setting() == 'never':
        return "use_cudnn='never'"
    if bn_mode() != 'graphs':
        return BN_OFF
    return _keys.bn_refusal(x, gamma, axis, layouts, running, beta)


class StatsImpl(_bn.GeneralBatchNormalizationImpl):
    """Chainer's general implementation with the batch statistics and the
    backward's sums reduced in two levels (:mod:`fastchain.cudnn._bn_stats`):
    where cuDNN refuses a key while BatchNormalization's graphs are on, and
    for every call with ``FASTCHAIN_CUDNN_BN=stats``."""

    def get_mean_and_var(self, axis, gamma, x, xp, interm_dtype):
        if not _is_cupy(x) or not _bn_stats.usable(x, axis):
            return super().get_mean_and_var(axis, gamma, x, xp, interm_dtype)
        return _bn_stats.mean_and_var(x, interm_dtype)

    def get_ggamma_and_gbeta(self, axis, gamma, gy, x_hat, xp):
        if not _is_cupy(gy) or not _bn_stats.usable(gy, axis):
            return super().get_ggamma_and_gbeta(axis, gamma, gy, x_hat, xp)
        return _bn_stats.gbeta_and_ggamma(gy, x_hat, gamma.dtype)


class StatsOnlyImpl(StatsImpl):
    """:class:`StatsImpl` for every call (``FASTCHAIN_CUDNN_BN=stats``), counted."""

    def forward(self, *args, **kwargs):     # (Chainer passes them by name)
        _paths.record('batchnorm forward', 'statistics', BN_STATS)
        return super().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        _paths.record('batchnorm backward', 'statistics', BN_STATS)
        return super().backward(*args, **kwargs)


class GraphImpl(StatsImpl):
    """Chainer's BatchNormalization implementation interface, on graphs; a
    key cuDNN refuses runs :class:`StatsImpl` (path ``'statistics'``)."""

    def forward(self, axis, gamma, x, x_layout, xp, expander, beta, eps, decay,
                running_mean, running_var):
        op = 'batchnorm forward'
        key = _keys.bn_key(op, x, gamma, eps, running_mean is not None, _device_id(x))
        reason = _graphs.refused(key)
        if reason is None:
            try:
                y, mean, inv_std = _bn_graphs.bn_forward(key, x, gamma, beta, running_mean,
                                                      running_var, eps, decay)
                _paths.record(op, 'graph')
                return y, x_layout, running_mean, running_var, mean, None, inv_std, None
            except _graphs.Unsupported as e:
                reason = e.reason
        path = 'statistics' if _bn_stats.usable(x, axis) else 'chainer'
        _paths.record(op, path, reason)
        return super().forward(axis, gamma, x, x_layout, xp, expander, beta, eps, decay,
                               running_mean, running_var)

    def backward(self, axis, gamma, gy, x, x_layout, xp, expander, mean, inv_std, eps,
                 var, forward_data):
        op = 'batchnorm backward'
        reason = None
        if _setting() == 'never':
            reason = "use_cudnn='never'"
        elif gy.dtype != x.dtype or not gy.flags.c_contiguous or not _keys.aligned(gy):
            reason = 'an output gradient of another dtype or layout than x, or not 16-byte ' \
                'aligned'
        if reason is None:
            key = _keys.bn_key(op, x, gamma, eps, False, _device_id(x))
            reason = _graphs.refused(key)
            if reason is None:
                try:
                    gx, ggamma, gbeta = _bn_graphs.bn_backward(key, x, gamma, gy, mean, inv_std)
                    _paths.record(op, 'graph')
                    return gx, None, ggamma, gbeta
                except _graphs.Unsupported as e:
                    reason = e.reason
        _paths.record(op, 'statistics' if _bn_stats.usable(gy, axis) else 'chainer', reason)
        return super().backward(axis, gamma, gy, x, x_layout, xp, expander, mean, inv_std,
                                eps, var, forward_data)


_IMPL = GraphImpl()
_STATS = StatsOnlyImpl()


def _select(func, inputs, base=_bn._impl_selector):
    impl = base(func, inputs)
    if type(impl) is not _bn.GeneralBatchNormalizationImpl:
        return impl
    x, gamma, beta = inputs
    if not _is_cupy(x):
        return impl
    if bn_mode() == 'stats' and _setting() != 'never' and _bn_stats.usable(x, func.axis):
        return _STATS
    reason = _bn_refusal(x, gamma, func.axis, getattr(func, 'input_layouts', None),
                         (func.running_mean, func.running_var), beta)
    if reason is not None:
        _paths.record('batchnorm forward', 'chainer', reason)
        return impl
    return _IMPL


def _is_cupy(x):
    return type(x).__module__.split('.')[0] == 'cupy'


def training_layer(next_, node, inputs):
    """``BatchNormalization.forward``: the node selects the graph
    implementation where the selector it has (Chainer's, or the onednn
    layer's, which keeps GPU arrays on Chainer's) gives Chainer's general one."""
    base = node._impl_selector
    if not getattr(base, 'cudnn_graphs', False):
        def select(func, inputs):
            return _select(func, inputs, base)
        select.cudnn_graphs = True
        node._impl_selector = select
    return next_(node, inputs)


BN_INFERENCE = ("cuDNN has no engine for BatchNormalization's inference on its own (9.19 refused "
                'every key of ResNet-50 in both layouts, an H200, 2026-11-28): Chainer\'s one '
                'elementwise kernel runs it')


def inference_layer(next_, node, inputs):
    """``FixedBatchNormalization.forward``: Chainer's, the reason counted."""
    if _is_cupy(inputs[0]):
        reason = "use_cudnn='never'" if _setting() == 'never' else BN_INFERENCE
        _paths.record('batchnorm inference', 'chainer', reason)
    return next_(node, inputs)


def bn_functions():
    """(class, method, layer) of the BatchNormalization layers."""
    return ((_bn.BatchNormalization, 'forward', training_layer),
            (_bn.FixedBatchNormalization, 'forward', inference_layer))


def functions():
    return conv_functions() + bn_functions()
