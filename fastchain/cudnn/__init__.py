"""The cuDNN accelerator group of ``fastchain.enable``.

Options: ``cudnn`` (Chainer's ``use_cudnn``), ``tensor_cores`` (Chainer's
``use_cudnn_tensor_core``) and ``workspace_size`` (bytes cuDNN may use).
``autotune`` (cuDNN's algorithm search among others) is
:mod:`fastchain.tune`'s.
"""
