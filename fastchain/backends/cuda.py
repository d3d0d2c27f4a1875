"""The CUDA edge: CuPy, the GPUs, cuDNN and NCCL.

Every function here is safe to call with no CuPy, with CuPy but no driver, and
with CuPy 14 (which has no cuDNN). Results are cached for the process.
"""

import ctypes
import functools

from fastchain.backends._status import Status

# CuPy's wheels per CUDA major version (CuPy 14 is the only CuPy for CUDA 13).
CUPY_PACKAGES = {13: 'cupy-cuda13x', 12: 'cupy-cuda12x', 11: 'cupy-cuda11x'}
CUDNN_FIX = ('cuDNN needs CuPy 13 (CuPy 14 removed cuDNN support): pip install '
             '"cupy-cuda12x<14" "nvidia-cudnn-cu12<9" (CUDA 12 builds, which CUDA 12 and 13 '
             'drivers run)')


@functools.lru_cache(maxsize=None)
def driver_cuda_version():
    """The CUDA version the NVIDIA driver offers, as ``(major, minor)``, read
    from the driver library itself (no CuPy needed); None without a driver."""
    try:
        libcuda = ctypes.CDLL('libcuda.so.1')
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or not version.value:
            return None
    except (OSError, AttributeError):
        return None
    return version.value // 1000, (version.value % 1000) // 10


def cupy_package():
    """``(distribution, version)`` of the installed CuPy, or ``(None, None)``."""
    import importlib.metadata
    for dist in list(CUPY_PACKAGES.values()) + ['cupy']:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def gpu_fix():
    """How to get CuPy here: the package for the CUDA the driver offers."""
    driver = driver_cuda_version()
    if driver is None:
        return ('on a machine with an NVIDIA GPU: pip install cupy-cuda13x (a CUDA 13 '
                'driver, 580 or newer; the gpu extra) or cupy-cuda12x (a CUDA 12 driver)')
    package = CUPY_PACKAGES.get(driver[0])
    if package is None:
        return 'the driver offers CUDA {}.{}: update it to a CUDA 12 or 13 driver'.format(
            *driver)
    return 'pip install {} (the driver offers CUDA {}.{})'.format(package, *driver)


def _nccl_fix():
    driver = driver_cuda_version()
    major = driver[0] if driver is not None and driver[0] in (12, 13) else 13
    return 'pip install nvidia-nccl-cu{}'.format(major)


def _cupy_module():
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install
        return None, e
    return cupy, None


@functools.lru_cache(maxsize=None)
def cupy_status():
    """CuPy importable and a CUDA device usable (``cupy.is_available()``)."""
    cupy, error = _cupy_module()
    if cupy is None:
        missing = isinstance(error, ModuleNotFoundError)
        return Status(False, why='CuPy is not installed' if missing else
                      'CuPy failed to import: {}'.format(error), fix=gpu_fix())
    version = getattr(cupy, '__version__', None)    # (a module named cupy that is not CuPy)
    try:
        # On CuPy 13 without a driver this raises instead of returning False.
        ok = bool(cupy.is_available())
        why = None if ok else 'no CUDA device found by CuPy'
    except Exception as e:
        ok, why = False, 'CUDA is not usable: {}'.format(e)
    detail = {}
    for key, getter in (('cuda_runtime', 'runtimeGetVersion'),
                        ('cuda_driver', 'driverGetVersion')):
        try:
            detail[key] = _cuda_version(getattr(cupy.cuda.runtime, getter)())
        except Exception as e:
            detail[key] = None
            detail[key + '_error'] = str(e)
    return Status(ok, version=version, why=why,
                  fix=None if ok else 'check `nvidia-smi`; then ' + gpu_fix(),
                  detail=detail)


def _cuda_version(number):
    # CUDA encodes 12.4 as 12040.
    return '{}.{}'.format(number // 1000, (number % 1000) // 10) if number else None


def available():
    """True when a CUDA GPU can be used through CuPy."""
    return cupy_status().available


def get_device(spec=None):
    """Chainer's device for ``spec`` (``'@numpy'``, ``'@cupy:N'``, a GPU id;
    default: GPU 0 where one is usable, else the CPU). A GPU that cannot be
    used raises RuntimeError naming why and the fix, instead of CUDA's own
    error at the first use ("CUDA driver version is insufficient" where
    there is no GPU at all)."""
    import chainer
    if spec is None:
        spec = '@cupy:0' if available() else '@numpy'
    index = _gpu_index(spec)
    if index is not None:
        status = cupy_status()
        if not status.available:
            raise RuntimeError('device {}: {} (fix: {}; or run on the CPU: @numpy)'.format(
                spec, status.why, status.fix))
        count = len(gpus())
        if index >= count:
            raise RuntimeError('device {}: this machine has {} GPU(s), @cupy:0 to @cupy:{} '
                               '(fix: name one of those, or set CUDA_VISIBLE_DEVICES to show '
                               'more)'.format(spec, count, count - 1))
        spec = '@cupy:{}'.format(index)     # Chainer's own name ('@cupy' alone it refuses)
    return chainer.get_device(spec)


def _gpu_index(spec):
    """The GPU id ``spec`` names for CuPy, or None for another device."""
    if isinstance(spec, bool):
        return None
    if isinstance(spec, int):
        return spec if spec >= 0 else None      # Chainer's old integer ids: -1 is the CPU
    if isinstance(spec, str) and spec.startswith('@cupy'):
        _, _, number = spec.partition(':')
        return int(number) if number.isdigit() else 0
    return None


@functools.lru_cache(maxsize=None)
def gpus():
    """One dict per visible GPU: name, compute capability, memory, TensorCores."""
    if not available():
        return []
    import cupy
    found = []
    for i in range(cupy.cuda.runtime.getDeviceCount()):
        props = cupy.cuda.runtime.getDeviceProperties(i)
        name = props.get('name', b'')
        major, minor = props.get('major', 0), props.get('minor', 0)
        found.append({
            'index': i,
            'name': name.decode() if isinstance(name, bytes) else str(name),
            'compute_capability': '{}.{}'.format(major, minor),
            'memory_bytes': int(props.get('totalGlobalMem', 0)),
            # TensorCores arrived with Volta (sm_70).
            'tensor_cores': major >= 7,
        })
    return found


@functools.lru_cache(maxsize=None)
def cudnn_status():
    """cuDNN usable by Chainer (needs a GPU and CuPy 13's cuDNN bindings)."""
    cupy, _ = _cupy_module()
    if cupy is None:
        return Status(False, why='CuPy is not installed', fix=gpu_fix())
    major = int(cupy.__version__.split('.')[0])
    try:
        import cupy.cuda.cudnn as libcudnn
        version = str(libcudnn.getVersion())
    except Exception as e:
        if major >= 14:
            # What brings cuDNN back on CuPy 14: cuDNN 9 through its graph API.
            from fastchain.cudnn import _frontend
            return Status(False, why='CuPy {} has no cuDNN (removed in CuPy 14)'.format(
                cupy.__version__), fix=_frontend.fix() + '; or ' + CUDNN_FIX)
        return Status(False, why='cuDNN did not load: {}'.format(e), fix=CUDNN_FIX)
    if not available():
        return Status(False, version=version, why=cupy_status().why,
                      fix=cupy_status().fix)
    import chainer.backends.cuda
    if not chainer.backends.cuda.cudnn_enabled:
        return Status(False, version=version,
                      why='Chainer has cuDNN disabled (CHAINER_CUDNN=0?)',
                      fix='unset CHAINER_CUDNN or set it to 1')
    return Status(True, version=version)


@functools.lru_cache(maxsize=None)
def nccl_status():
    """NCCL through CuPy's bindings."""
    cupy, _ = _cupy_module()
    if cupy is None:
        return Status(False, why='CuPy is not installed', fix=gpu_fix())
    try:
        from cupy.cuda import nccl
        if not getattr(nccl, 'available', True):
            # CuPy's wheels load libnccl.so.2 at run time, from NVIDIA's
            # nvidia-nccl-cu* package (seen with CuPy 14.2 and no such package)
            raise ImportError('CuPy {} could not load the NCCL library '
                              '(libnccl.so.2)'.format(cupy.__version__))
        version = str(nccl.get_version())
    except Exception as e:
        return Status(False, why='NCCL is not usable: {}'.format(e),
                      fix=_nccl_fix())
    if not available():
        return Status(False, version=version, why=cupy_status().why,
                      fix=cupy_status().fix)
    return Status(True, version=version)


def tensor_cores_available():
    """True when every visible GPU has TensorCores (compute capability >= 7.0)."""
    found = gpus()
    return bool(found) and all(g['tensor_cores'] for g in found)
