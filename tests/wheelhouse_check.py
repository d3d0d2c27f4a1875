"""Run by `make wheelhouse-check` in a venv installed from the wheelhouse alone
(not collected by pytest): the wheel's import hook applies Chainer's shims
whatever the import order, and enable() trains a step."""

import sys

import numpy

import chainer                      # first: the .pth hook must still apply the shims
import chainer.links as L

import fastchain
from fastchain._compat import _finder

assert fastchain.__file__.startswith(sys.prefix), \
    'fastchain imported from {}, not from the venv the wheel went into'.format(fastchain.__file__)
applied = _finder.applied()
assert applied, 'no Chainer shim applied'
with fastchain.enable() as handle:
    model = L.Classifier(L.Linear(4, 3))
    opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
    x = numpy.random.RandomState(0).rand(8, 4).astype(numpy.float32)
    opt.update(model, x, numpy.zeros(8, numpy.int32))
    active = sorted(k for k, v in handle.report().items() if v['active'])
# The cuDNN frontend, installed from the wheelhouse with --no-deps: it imports
# without the CUTLASS DSL and TVM FFI it asks for, and without cuDNN here the
# probe names what is missing.
import cudnn                        # noqa: E402
from fastchain.cudnn import _frontend  # noqa: E402
available, _, why, _ = _frontend.status()
assert hasattr(cudnn, 'pygraph') and (available or 'could not load cuDNN 9' in why), why
print('wheelhouse-check: Python {}, NumPy {}, Chainer {}, fastchain {} from {}; {} shims; '
      'active: {}; cuDNN frontend {}: {}'.format(
          sys.version.split()[0], numpy.__version__, chainer.__version__, fastchain.__version__,
          fastchain.__file__, len(applied), ', '.join(active), cudnn.__version__,
          'cuDNN 9 loads' if available else why))
