"""Builds the machine/accelerator report shown by ``fastchain doctor``."""

import importlib.metadata
import os
import platform
import sys


def _dist_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model():
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def blas():
    """The BLAS NumPy was built with, as ``'name version'`` (OpenBLAS for
    PyPI's wheels; MKL for conda's and Intel's), or None if NumPy does not say."""
    import numpy
    try:
        info = numpy.show_config(mode='dicts')['Build Dependencies']['blas']
    except Exception:       # NumPy < 1.25, or a build that does not record it
        return None
    return ' '.join(str(info[k]) for k in ('name', 'version') if info.get(k)) or None


def nvidia_driver(path='/proc/driver/nvidia/version'):
    """The NVIDIA kernel driver's version (``'580.65.06'``), or None where
    there is none; not the CUDA version it offers (``cuda_driver``)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        parts = word.split('.')
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return word
    return None


def machine():
    """The machine description benchmarks record (BENCHMARKS.md)."""
    import numpy
    import chainer
    from fastchain.backends import cuda
    from fastchain.cudnn._group import graph_status
    cupy = cuda.cupy_status()
    cudnn = cuda.cudnn_status()
    graphs = graph_status() if not cudnn.available else None
    nccl = cuda.nccl_status()
    try:
        memory = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    except (ValueError, OSError, AttributeError):
        memory = None
    return {
        'cpu': _cpu_model(),
        'cores': len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity')
        else os.cpu_count(),
        'memory_bytes': memory,
        'gpus': cuda.gpus(),
        'nvidia_driver': nvidia_driver(),
        # the CUDA versions of CuPy's runtime and of what the driver offers
        'cuda_runtime': cupy.detail.get('cuda_runtime') if cupy.detail else None,
        'cuda_driver': cupy.detail.get('cuda_driver') if cupy.detail else None,
        'python': platform.python_version(),
        'numpy': numpy.__version__,
        'blas': blas(),
        'chainer': chainer.__version__,
        'cupy': cupy.version,
        # CuPy's own cuDNN, else cuDNN 9 through fastchain's graphs.
        'cudnn': cudnn.version or (
            'graphs: ' + graphs.version if graphs is not None and graphs.available else None),
        'nccl': nccl.version,
        'torch': _dist_version('torch'),    # (the peer rows'; not imported here)
        'platform': platform.platform(),
    }


def report(mpi=False, preview=False):
    """Everything ``fastchain doctor`` shows, as a dict.

    ``accelerators`` holds, for each accelerator, what is in force in this
    process now (``active``: in ``fastchain doctor``, where nothing is
    enabled, always false).

    Args:
        mpi (bool): also probe MPI. Importing ``mpi4py.MPI`` initialises MPI,
            so it is left out unless asked for (the CLI asks).
        preview (bool): also say, for each accelerator, what
            ``fastchain.enable()`` would do on this machine (the keys of
            :func:`fastchain.doctor._preview.preview`), found by enabling and
            disabling it here; only where no handle is enabled (the CLI asks).
    """
    import chainer  # noqa: F401  (applies the compat shims)
    from fastchain import __version__, _compat
    from fastchain.backends import cuda, nvtx
    from fastchain.backends import mpi as mpi_backend
    from fastchain.config import _enable, _patches
    from fastchain.cudnn._group import graph_status
    from fastchain.doctor._environment import variables

    deps = {
        'cupy': cuda.cupy_status().as_dict(),
        'cudnn': cuda.cudnn_status().as_dict(),
        # cuDNN 9 through the frontend's graphs (fastchain's backend on CuPy 14).
        'cudnn9': graph_status().as_dict(),
        'nccl': cuda.nccl_status().as_dict(),
        'nvtx': nvtx.nvtx_status().as_dict(),
    }
    if mpi:
        deps['mpi'] = mpi_backend.mpi_status().as_dict()
    accelerators = {name: s.as_dict()
                    for name, s in _enable.current_states().items()}
    if preview:
        from fastchain.doctor._preview import preview as enable_preview
        for name, entry in enable_preview().items():
            accelerators.setdefault(name, {'name': name}).update(entry)
    return {
        'fastchain': __version__,
        'python': sys.version.split()[0],
        'executable': sys.executable,
        'machine': machine(),
        'packages': {name: _dist_version(name) for name in
                     ('chainer', 'numpy', 'cupy-cuda13x', 'cupy-cuda12x', 'setuptools',
                      'mpi4py', 'mpich', 'nvtx', 'pillow', 'nvidia-cudnn-frontend',
                      'nvidia-cudnn-cu13', 'nvidia-cudnn-cu12')},
        'dependencies': deps,
        'shims': _compat.applied(),
        'compat_hook_installed': _compat.installed(),
        'accelerators': accelerators,
        'enabled_handles': len(_enable.active_handles()),
        # Chainer's entry points with fastchain layers on them now, outermost first.
        'patch_points': _patches.points(),
        'settings': _patches.value_labels(),
        'environment': variables(),
    }
