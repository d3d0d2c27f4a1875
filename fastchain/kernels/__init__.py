"""fastchain's CPU kernels: convolutions and the SGD/MomentumSGD update.

Both compute what Chainer's CPU code computes, bitwise (the same BLAS
products of equal operands; the same elementwise operations in the same
order), with less Python and memory traffic around it:

- ``cpu_conv`` (:mod:`fastchain.kernels._conv`): the forward, weight and
  input gradients of ``Convolution2D``/``Deconvolution2D`` through planners
  (:mod:`fastchain.kernels._bind`) that pad into a zero-bordered buffer, copy
  the im2col columns once and multiply with ``numpy.matmul``; a cached static
  schedule binds each convolution entry to a plan made once;
- ``fused_update`` (:mod:`fastchain.kernels._update`): the SGD/MomentumSGD
  parameter update on cache-sized blocks with one reused temporary.

GPU arrays, grouped convolutions, ``cover_all`` and iDeep go to Chainer.

One provider is not bitwise equal, so it is an option of its own, off by
default: ``onednn`` (:mod:`fastchain.kernels._onednn`,
:mod:`fastchain.kernels._onednn_bn`), oneDNN's float32 convolutions and
PyTorch's BatchNormalization kernels from PyTorch's CPU build, within a
stated tolerance of Chainer's results.
"""
