"""The table of Chainer 7.8.1 shims.

Each shim concerns one module of Chainer 7.8.1 and one measured breakage.
A shim either rewrites an exact, counted piece of that module's source before
it is compiled, or wraps one function once the module has run (``after``).
Nothing outside the module changes: NumPy keeps its attributes, and no
``pkg_resources`` appears in ``sys.modules``.
"""

import numpy


_NUMPY2 = int(numpy.__version__.split('.')[0]) >= 2


def _missing_module(name):
    import importlib.util
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def _numpy_distutils_unusable():
    """True when ``import numpy.distutils.system_info`` would fail.

    It is absent on Python 3.12+, and also fails on Python 3.11 with NumPy
    1.26 when setuptools' own distutils (no ``msvccompiler``) stands in for
    the standard library's (measured with setuptools 81).
    """
    if _missing_module('numpy.distutils'):
        return True
    try:
        import numpy.distutils.system_info  # noqa: F401  (Chainer imports it next)
    except Warning:
        return False    # raised under -W error: Chainer would raise it too
    except Exception:
        return True
    return False


class Shim:
    """One fix for one Chainer module.

    Args:
        name (str): short identifier shown by ``fastchain doctor``.
        module (str): the Chainer module it concerns.
        why (str): the breakage it works around.
        needed (callable): ``() -> bool``, true when the breakage exists here.
        rewrites (tuple): ``(old, new, count)`` exact text replacements made
            in the module's source before it is compiled. ``count`` is how
            often ``old`` occurs in Chainer 7.8.1; any other count means the
            source is not what was measured, and the import fails loudly.
            Used where a module compares ``xp is numpy``, so that no stand-in
            for ``numpy`` can be given to it.
        inject (dict): names put in the module's namespace before it runs.
        after (callable): ``(module) -> None`` run once the module executed.
    """

    def __init__(self, name, module, why, needed, rewrites=(), inject=None,
                 after=None):
        self.name = name
        self.module = module
        self.why = why
        self._needed = needed
        self.rewrites = tuple(rewrites)
        self.inject = dict(inject or {})
        self._after = after

    def needed(self):
        return self._needed()

    def after(self, module):
        if self._after is not None:
            self._after(module)

    def rewrite(self, source):
        for old, new, count in self.rewrites:
            found = source.count(old)
            if found != count:
                raise ImportError(
                    'fastchain shim {!r} expected {} occurrence(s) of {!r} in '
                    '{} but found {}: this is not the Chainer 7.8.1 source it '
                    'was written for. Reinstall chainer==7.8.1.'.format(
                        self.name, count, old, self.module, found))
            source = source.replace(old, new)
        return source


# SCTYPES: np.sctypes as NumPy 1 defined it, for as_strided.
SCTYPES = {
    'int': [numpy.int8, numpy.int16, numpy.int32, numpy.int64],
    'uint': [numpy.uint8, numpy.uint16, numpy.uint32, numpy.uint64],
    'float': [numpy.float16, numpy.float32, numpy.float64, numpy.longdouble],
    'complex': [numpy.complex64, numpy.complex128, numpy.clongdouble],
    'others': [bool, object, bytes, str, numpy.void],
}


# --- NumPy 2 no longer wraps out-of-range Python ints (pad_sequence) -------

def _pad_sequence_after(module):
    cls = module.PadSequence
    forward = cls.forward

    def forward_with_cast_padding(self, xs):
        # NumPy 1 wrapped e.g. padding=-1 into a uint8 array (to 255); NumPy 2
        # raises OverflowError. Cast the padding the way NumPy 1 did.
        padding = self.padding
        self.padding = numpy.asarray(padding).astype(xs[0].dtype)[()]
        try:
            return forward(self, xs)
        finally:
            self.padding = padding

    forward_with_cast_padding.__wrapped__ = forward
    cls.forward = forward_with_cast_padding


# --- CuPy 14 removed cuDNN (chainer.backends.cuda) ----------------------------

def _cupy_major():
    """The installed CuPy's major version, read from the package metadata
    (without importing CuPy), or None."""
    from fastchain.backends.cuda import cupy_package
    _, version = cupy_package()
    try:
        return int(version.split('.')[0])
    except (AttributeError, ValueError):
        return None


CUPY14_CUDNN_WHY = ('CuPy 14 removed all cuDNN support (its upgrade guide): Chainer runs '
                    'convolutions as im2col + GEMM and BatchNormalization, pooling and '
                    'softmax with its own kernels')


def _cupy14_after(module):
    # Chainer's `import cupy.cudnn` failed inside a try: cudnn_enabled is False
    # and the name `cudnn` was never bound, so should_use_cudnn_tensor_core
    # (public, chainer.should_use_cudnn_tensor_core) raised NameError.
    module.cudnn = None
    module.cudnn_unavailable_reason = CUPY14_CUDNN_WHY
    original = module.should_use_cudnn_tensor_core

    def should_use_cudnn_tensor_core(dtype):
        if not module.cudnn_enabled:
            return False
        return original(dtype)
    should_use_cudnn_tensor_core.__wrapped__ = original
    should_use_cudnn_tensor_core.__doc__ = original.__doc__
    module.should_use_cudnn_tensor_core = should_use_cudnn_tensor_core


def _missing(attr):
    return lambda: not hasattr(numpy, attr)


_PKG_RESOURCES_IMPORT = 'from fastchain._compat import _pkg_resources as pkg_resources\n'

SHIMS = [
    Shim('numpy.sctypes', 'chainer.functions.array.as_strided',
         'NumPy 2 removed np.sctypes', _missing('sctypes'),
         rewrites=[("np.sctypes[", "_fastchain_sctypes[", 2)],
         inject={'_fastchain_sctypes': SCTYPES}),
    Shim('numpy.float', 'chainer.functions.array.resize_images',
         'NumPy 1.24 removed np.float (it meant float64)', _missing('float'),
         rewrites=[('dtype=numpy.float)', 'dtype=numpy.float64)', 6)]),
    # Chainer asks numpy.distutils for NumPy's BLAS only to warn about macOS's
    # Accelerate (on darwin); with no numpy.distutils there is nothing to ask.
    Shim('numpy.distutils', 'chainer._environment_check',
         'numpy.distutils is absent (Python 3.12+) or fails to import',
         _numpy_distutils_unusable,
         rewrites=[('import numpy.distutils.system_info\n', 'import numpy\n', 1),
                   ("numpy.distutils.system_info.get_info('blas_opt')", '{}', 1)]),
] + [
    Shim('pkg_resources', module, 'setuptools>=82 removed pkg_resources',
         lambda: _missing_module('pkg_resources'),
         rewrites=[('import pkg_resources\n', _PKG_RESOURCES_IMPORT, 1)])
    for module in ('chainer._environment_check', 'chainer.testing.helper',
                   'chainer.testing.doctest_helper')
] + [
    Shim('numpy.meshgrid-list', 'chainer.distributions.categorical',
         'NumPy 2 meshgrid returns a tuple (Categorical.log_prob adds a list)',
         lambda: _NUMPY2, rewrites=[('[mg + [', '[list(mg) + [', 2)]),
    Shim('pad_sequence-wrap', 'chainer.functions.array.pad_sequence',
         'NumPy 2 raises on out-of-range int padding (pad_sequence)',
         lambda: _NUMPY2, after=_pad_sequence_after),
    # Chainer's warning told a CuPy 14 user to reinstall CuPy after cuDNN,
    # which cannot help: say what happened instead.
    Shim('cupy14-cudnn', 'chainer.backends.cuda', CUPY14_CUDNN_WHY,
         lambda: (_cupy_major() or 0) >= 14,
         rewrites=[("            'cuDNN is not enabled.\\n'\n"
                    "            'Please reinstall CuPy after you install cudnn\\n'\n"
                    "            '(see https://docs-cupy.chainer.org/en/stable/install.html'\n"
                    "            '#install-cudnn).')\n",
                    "            'cuDNN is not enabled: CuPy 14 removed all cuDNN support, so '\n"
                    "            'Chainer runs convolutions as im2col + GEMM and its other '\n"
                    "            'cuDNN functions with its own kernels. `fastchain doctor` '\n"
                    "            'says what brings cuDNN back.')\n", 1)],
         after=_cupy14_after),
    Shim('array-copy-false', 'chainermn.communicators._memory_utility',
         'NumPy 2 array(copy=False) refuses to copy (chainermn unpack_params)',
         lambda: _NUMPY2,
         rewrites=[('xp.array(v, copy=False, dtype=transfer_dtype)',
                    'xp.asarray(v, dtype=transfer_dtype)', 1)]),
]
