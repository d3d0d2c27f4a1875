"""What Chainer's ``FixedBatchNormalization.forward`` keeps for its backward,
for the layers that compute its output with other kernels (the ``onednn``
and ``cudnn`` options): the same attributes, computed as Chainer's generic
code does, on NumPy or CuPy arrays alike."""

import chainer


def keep_for_backward(node, x, var, axis):
    """Sets on ``node`` what ``FixedBatchNormalizationGrad`` reads:
    retained inputs, axes, expander, ``inv_var`` and ``inv_std``."""
    xp = chainer.backend.get_array_module(var)
    node.retain_inputs((0, 1, 3, 4))
    node.axis, node.key_axis = axis, (1,)
    node.expander = (None, slice(None)) + (None,) * (x.ndim - 2)
    node.inv_var = xp.reciprocal(var + node.eps)
    node.inv_std = xp.sqrt(node.inv_var, dtype=node.inv_var.dtype)
