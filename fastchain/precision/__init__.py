"""Mixed precision: fp16 compute, fp32 master weights, dynamic loss scaling.

``fastchain.enable(fp16=True)`` makes ``chainer.mixed16`` the default dtype
(fp16 convolutions and linears, fp32 BatchNormalization parameters and
statistics), gives every optimizer set up while enabled fp32 master weights
and a :class:`DynamicLossScaler`, and casts floating batches to fp16 on the
device after Chainer's converter. Build the model after ``enable``.
"""

from fastchain.precision._attach import scaler_of
from fastchain.precision._group import cast_floating
from fastchain.precision._scaler import DynamicLossScaler

__all__ = ['DynamicLossScaler', 'cast_floating', 'scaler_of']
