"""Backward nodes that read their forward node's state when they run.

Chainer's replay runs the forward nodes of the first step again, and they
recompute their state (BatchNormalization's batch mean and inverse std,
FixedBatchNormalization's inverse std); but the backward schedule holds the
grad nodes made by the first step's ``backward``, which copied that state
then. The layers here make the grad node with properties that read the
forward node at the time the grad node runs. In define-by-run that is the
same array the copy would have been (the forward node ran once), so results
there are unchanged, bitwise.
"""


def batch_normalization_backward(next_, node, indexes, grad_outputs):
    """Layer on ``BatchNormalization.backward``."""
    x, gamma = node.get_retained_inputs()
    gy, = grad_outputs
    return _classes()[0](node).apply((x, gamma, gy))


def fixed_batch_normalization_backward(next_, node, indexes, grad_outputs):
    """Layer on ``FixedBatchNormalization.backward``."""
    x, gamma, mean, var = node.get_retained_inputs()
    gy, = grad_outputs
    return _classes()[1](node).apply((x, gamma, mean, var, gy))


_made = []


def _classes():
    if not _made:
        _made.extend(_make_classes())
    return _made


def _make_classes():
    from chainer.functions.normalization import batch_normalization as bn

    def live(name):
        # Chainer's __init__ sets these as attributes; here they are read live.
        return property(lambda self: getattr(self._forward, name), lambda self, v: None)

    class LiveStatisticsGrad(bn.BatchNormalizationGrad):
        """BatchNormalizationGrad that takes the batch statistics from its
        forward node at the time it runs, not when it was made."""

        def __init__(self, forward_node):
            self._forward = forward_node
            self.eps = forward_node.eps
            self.expander = forward_node.expander
            self.axis = forward_node.axis
            self.key_axis = forward_node.key_axis
            self._impl = forward_node._impl

        mean = live('mean')
        inv_std = live('inv_std')
        forward_data = live('forward_data')

        @property
        def var(self):
            # Only iDeep's implementation keeps var (as Chainer's backward).
            if isinstance(self._forward._impl, bn._IDeepBatchNormalizationImpl):
                return self._forward.var
            return None

        @var.setter
        def var(self, value):
            pass

    def own_or_live(name):
        # The forward node's value when it computed one (the generic kernel);
        # else the one this node computes from ``var`` in this call (cuDNN,
        # iDeep), as Chainer's grad node does, but not kept to the next call.
        return property(lambda self: self._own.get(name, getattr(self._forward, name)),
                        lambda self, value: self._own.__setitem__(name, value))

    class LiveFixedGrad(bn.FixedBatchNormalizationGrad):
        """FixedBatchNormalizationGrad that takes the inverse std from its
        forward node at the time it runs, not when it was made."""

        def __init__(self, forward_node):
            self._forward = forward_node
            self._own = {}
            self.eps = forward_node.eps
            self.expander = forward_node.expander
            self.axis = forward_node.axis

        def forward(self, inputs):
            self._own = {}
            return super().forward(inputs)

        inv_std = own_or_live('inv_std')
        inv_var = own_or_live('inv_var')

    return LiveStatisticsGrad, LiveFixedGrad
