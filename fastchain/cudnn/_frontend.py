"""cuDNN 9 through NVIDIA's cuDNN frontend (``nvidia-cudnn-frontend``, module
``cudnn``): what is here, why not, and how to get it.

CuPy 14, the only CuPy for CUDA 13, has no cuDNN at all, and Chainer 7.8.1
then runs every GPU convolution as im2col plus a GEMM without a word. The
frontend builds cuDNN 9 operation graphs from Python and runs them on raw
device pointers, so they work on CuPy's arrays and streams: fastchain's
graph backend (:mod:`fastchain.cudnn._graphs`) uses it where CuPy has no
cuDNN of its own. Where CuPy 13 still has cuDNN 8, Chainer's own cuDNN code
runs and the graphs are not used.

Nothing is imported at fastchain's import: :func:`status` loads the module
on first use (and caches the answer for the process).
"""

import functools
import importlib
import importlib.metadata
import threading

MODULE = 'cudnn'
PACKAGE = 'nvidia-cudnn-frontend'


def cudnn_wheel(cuda_major=None):
    """NVIDIA's cuDNN 9 wheel for the CUDA major version CuPy was built for."""
    if cuda_major is None:
        cuda_major = _cupy_cuda_major() or 13
    return 'nvidia-cudnn-cu{}'.format(12 if cuda_major == 12 else 13)


def fix(cuda_major=None):
    """The packages that bring cuDNN back on CuPy 14."""
    major = 12 if cudnn_wheel(cuda_major).endswith('12') else 13
    return ('pip install {} {} (cuDNN 9 through its graph API: fastchain runs Chainer\'s '
            'convolutions there, and BatchNormalization with FASTCHAIN_CUDNN_BN=1; the {} extra)'.format(
                PACKAGE, cudnn_wheel(cuda_major),
                'gpu-cudnn' if major == 13 else 'gpu-cudnn-cuda12'))


def _cupy_cuda_major():
    try:
        import cupy
        return cupy.cuda.runtime.runtimeGetVersion() // 1000
    except Exception:
        return None


_loaded = None      # the module, once status() found it usable


def installed_version():
    """The installed frontend distribution's version, or None."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def status():
    """``(available, version, why, fix)``: the frontend and the cuDNN 9 it
    loads, usable from CuPy here. ``version`` reads ``frontend X, cuDNN Y``."""
    global _loaded
    frontend_version = installed_version()
    try:
        module = importlib.import_module(MODULE)
    except ImportError as e:
        why = ('the cuDNN frontend is not installed ({} provides the {!r} module)'.format(
            PACKAGE, MODULE) if frontend_version is None else
            'the cuDNN frontend {} did not import: {}'.format(frontend_version, e))
        return False, None, why, fix()
    if not hasattr(module, 'pygraph'):
        return False, None, ('a module named {!r} that is not the cuDNN frontend ({})'.format(
            MODULE, getattr(module, '__file__', '?'))), fix()
    try:
        backend = module.backend_version()
    except Exception as e:      # libcudnn.so.9 missing or unloadable
        return False, frontend_version, (
            'the cuDNN frontend {} could not load cuDNN 9: {}'.format(
                frontend_version or '?', str(e).strip() or type(e).__name__)), fix()
    if backend < 90000:
        return False, frontend_version, (
            'cuDNN {} is older than 9 (the graph API fastchain builds needs cuDNN 9)'.format(
                _dotted(backend))), fix()
    _loaded = module
    return True, 'frontend {}, cuDNN {}'.format(
        frontend_version or getattr(module, '__version__', '?'), _dotted(backend)), None, None


def _dotted(number):
    """cuDNN's version number as text: 90300 -> '9.3.0' (cuDNN 9 numbers
    major * 10000), 8907 -> '8.9.7' (cuDNN 8, major * 1000)."""
    number = int(number)
    if number >= 90000:
        return '{}.{}.{}'.format(number // 10000, number // 100 % 100, number % 100)
    return '{}.{}.{}'.format(number // 1000, number // 100 % 10, number % 100)


def module():
    """The loaded ``cudnn`` module (after :func:`status` said available)."""
    if _loaded is None:
        available, _, why, how = status()
        if not available:
            raise RuntimeError('cuDNN graphs are not available: {} (fix: {})'.format(why, how))
    return _loaded


_handles = {}
_handles_lock = threading.Lock()


def handle(device_id):
    """This thread's cuDNN handle for a device (made once, under that device;
    cuDNN handles are not to be shared between threads)."""
    key = (device_id, threading.get_ident())
    h = _handles.get(key)
    if h is None:
        with _handles_lock:
            h = _handles.get(key)
            if h is None:
                import cupy
                with cupy.cuda.Device(device_id):
                    h = _handles[key] = module().create_handle()
    return h


_bound = {}     # (device, thread) -> the stream its handle was last set to


def bind_stream(device_id):
    """The device's handle, set to CuPy's current stream (graphs run there);
    set again only when that stream is another than the handle's last."""
    import cupy
    h = handle(device_id)
    key = (device_id, threading.get_ident())
    stream = cupy.cuda.get_current_stream().ptr
    if _bound.get(key) != stream:
        module().set_stream(handle=h, stream=stream)
        _bound[key] = stream
    return h


def forget():
    """Drops the cached status and handles (tests)."""
    global _loaded
    status.cache_clear()
    _loaded = None
    _handles.clear()
    _bound.clear()
