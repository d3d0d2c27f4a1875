"""BatchNormalization through PyTorch's CPU kernels (the ``onednn`` option).

Training: ``BatchNormalization`` chooses its implementation through its
``_impl_selector``; the ``onednn`` layer on its ``forward`` gives the node a
selector that returns :class:`_TorchImpl` where Chainer would take its
general (NumPy) implementation and the call qualifies (float32, statistics
over every axis but axis 1, more than one value per channel). Chainer's
backward and double backward are unchanged: they get the batch mean and
inverse standard deviation as Chainer's own forward gives them. The running
statistics are updated in place by PyTorch's kernel, with Chainer's decay
and its unbiased variance (PyTorch's ``momentum`` is ``1 - decay``).

Inference: ``FixedBatchNormalization.forward`` computes what Chainer's
backward needs as Chainer does (per channel, cheap) and the output with
PyTorch's kernel.
"""

import numpy

from chainer.functions.normalization import batch_normalization as _bn

from fastchain._fixed_bn import keep_for_backward
from fastchain.kernels import _onednn


def _standard(x, gamma, axis):
    """Statistics over every axis but the channel axis 1."""
    return gamma.ndim == 1 and x.ndim >= 2 and tuple(axis) == (0,) + tuple(range(2, x.ndim))


def _statistics_ok(*arrays):
    return all(a is None or (type(a) is numpy.ndarray and a.dtype == numpy.float32
                             and a.flags.c_contiguous and a.flags.writeable)
               for a in arrays)


class _TorchImpl(_bn.GeneralBatchNormalizationImpl):

    def forward(self, axis, gamma, x, x_layout, xp, expander, beta, eps, decay,
                running_mean, running_var):
        torch = _onednn._module()
        _onednn._count('batch normalization')
        stats = [None if a is None else torch.from_numpy(a) for a in (running_mean, running_var)]
        y, mean, inv_std = torch.native_batch_norm(
            _onednn._tensor(x), _onednn._tensor(gamma), _onednn._tensor(beta),
            stats[0], stats[1], True, 1.0 - decay, eps)
        return y.numpy(), x_layout, running_mean, running_var, mean.numpy(), None, \
            inv_std.numpy(), None

    def backward(self, axis, gamma, gy, x, x_layout, xp, expander, mean, inv_std, eps,
                 var, forward_data):
        # Chainer's where the option is off now (a graph built while it was
        # on keeps this implementation) or the arrays do not qualify.
        if not _onednn.enabled or not _onednn._float32(gy, mean, inv_std):
            return super().backward(axis, gamma, gy, x, x_layout, xp, expander, mean,
                                    inv_std, eps, var, forward_data)
        torch = _onednn._module()
        _onednn._count('batch normalization backward')
        gx, ggamma, gbeta = torch.ops.aten.native_batch_norm_backward(
            _onednn._tensor(gy), _onednn._tensor(x), _onednn._tensor(gamma), None, None,
            _onednn._tensor(mean), _onednn._tensor(inv_std), True, eps, [True, True, True])
        return gx.numpy(), None, ggamma.numpy(), gbeta.numpy()


_IMPL = _TorchImpl()


def _select(func, inputs):
    impl = _bn._impl_selector(func, inputs)
    if not _onednn.enabled or type(impl) is not _bn.GeneralBatchNormalizationImpl:
        return impl
    x, gamma, beta = inputs
    layouts = getattr(func, 'input_layouts', None) or (None,)
    if (_onednn._float32(x, gamma, beta) and _standard(x, gamma, func.axis)
            and layouts[0] is None and x.size // gamma.size > 1
            and _statistics_ok(func.running_mean, func.running_var)
            and (func.running_mean is None) == (func.running_var is None)):
        return _IMPL
    return impl


def training_layer(next_, node, inputs):
    """The ``onednn`` layer of ``BatchNormalization.forward``: the node selects
    PyTorch's kernels where they apply."""
    if node._impl_selector is _bn._impl_selector:
        node._impl_selector = _select
    return next_(node, inputs)


def inference_layer(next_, node, inputs):
    """The ``onednn`` layer of ``FixedBatchNormalization.forward``."""
    x, gamma, beta, mean, var = inputs
    axis = node.axis if node.axis is not None else (0,) + tuple(range(2, x.ndim))
    if not (_onednn._float32(x, gamma, beta, mean, var) and _standard(x, gamma, axis)
            and mean.ndim == 1 and var.ndim == 1):
        return next_(node, inputs)

    keep_for_backward(node, x, var, axis)
    torch = _onednn._module()
    _onednn._count('batch normalization inference')
    y, _, _ = torch.native_batch_norm(
        _onednn._tensor(x), _onednn._tensor(gamma), _onednn._tensor(beta),
        _onednn._tensor(mean), _onednn._tensor(var), False, 0.0, node.eps)
    return y.numpy(),


def functions():
    """(class, method, layer) of the BatchNormalization functions."""
    return ((_bn.BatchNormalization, 'forward', training_layer),
            (_bn.FixedBatchNormalization, 'forward', inference_layer))
