"""The NVTX edge: the ``nvtx`` package (a no-op unless a tool is attached)."""

import functools
import os

from fastchain.backends._status import Status


@functools.lru_cache(maxsize=None)
def nvtx_status():
    try:
        import nvtx
    except ImportError:
        return Status(False, why='the nvtx package is not installed',
                      fix='pip install nvtx')
    version = getattr(nvtx, '__version__', None)
    if version is None:
        try:
            import importlib.metadata
            version = importlib.metadata.version('nvtx')
        except Exception:
            pass
    return Status(True, version=version,
                  detail={'profiler_attached': profiler_attached()})


def profiler_attached():
    """True when an NVTX tool is injected (Nsight Systems sets this variable)."""
    return bool(os.environ.get('NVTX_INJECTION64_PATH'))
