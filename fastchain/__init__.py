"""fastchain: fast Chainer training on one machine, scaled over its GPUs.

The public surface is small::

    import fastchain
    handle = fastchain.enable(autotune=True)   # returns a handle
    ...                                        # train as usual
    handle.disable()                           # or use `with fastchain.enable(...)`
    fastchain.report()                         # what is available and active

Importing fastchain does nothing beyond defining names: no device probing,
no configuration writes, and Chainer itself is imported only when a name
that needs it is first used. (This module is imported at every interpreter
start by the compat hook, so it must stay cheap.)

It does put the compat hook in place where the ``.pth`` file that does so
at start was not read (``python -S``, ``pip install --target`` on
``PYTHONPATH``, a zipapp): Chainer imported after fastchain then works there
too.
"""

from fastchain._compat import _finder

_finder.install()
del _finder

__version__ = '0.1.0'

# name -> module that defines it; resolved on first access (PEP 562).
_EXPORTS = {
    'enable': 'fastchain.config._enable',
    'Handle': 'fastchain.config._enable',
    'active_handles': 'fastchain.config._enable',
    'report': 'fastchain.doctor._report',
    'DynamicLossScaler': 'fastchain.precision._scaler',
    'static_graph': 'fastchain.static._mark',
    'FastchainWarning': 'fastchain.config._enable',
    'StaticGraphFallback': 'fastchain.static._cache',
    'StaticGraphOrder': 'fastchain.static._outside',
}

__all__ = sorted(_EXPORTS) + ['__version__']


def __getattr__(name):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(
            'module {!r} has no attribute {!r}'.format(__name__, name))
    import importlib
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
