"""Makes Chainer 7.8.1 import and train on today's Python stack.

Chainer 7.8.1 (the last release) breaks on a current machine in a handful of
measured places: NumPy 2 removed ``np.sctypes``; NumPy 1.24 removed
``np.float``; Python 3.12 and NumPy 2 have no ``numpy.distutils``;
setuptools 82 removed ``pkg_resources``; NumPy 2's ``meshgrid`` returns a
tuple, its integer assignment no longer wraps, and its ``copy=False`` means
"never copy".

Each fix is a :class:`~fastchain._compat._shims.Shim`: it names one Chainer
module, applies only when that module belongs to Chainer 7.8.1 *and* the
thing it works around is really missing here, and changes nothing outside
Chainer (NumPy, ``sys.modules`` and other packages see no difference).

The shims are applied by a meta-path finder that a ``.pth`` file installs at
interpreter start. Installing it costs one small import; it does nothing
until a shimmed Chainer module is first imported, so ``import chainer`` works
before or after ``import fastchain``.

:func:`applied` lists the shims that took effect in this process
(``fastchain doctor`` shows them).
"""

from fastchain._compat._finder import applied, install, installed

__all__ = ['applied', 'install', 'installed']
