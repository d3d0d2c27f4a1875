"""The cuDNN accelerator group of ``fastchain.enable``.

Options: ``cudnn`` (Chainer's ``use_cudnn``), ``autotune`` (search the
fastest convolution algorithm on first call), ``tensor_cores`` (Chainer's
``use_cudnn_tensor_core``) and ``workspace_size`` (bytes cuDNN may use).
"""
