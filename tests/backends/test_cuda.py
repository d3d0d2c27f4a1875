"""The CUDA probes: truthful on this machine, and on the CuPy set-ups we
cannot install here (given as stand-in modules for CuPy's own API)."""

import sys
import types

import pytest

from fastchain.backends import cuda


@pytest.fixture(autouse=True)
def fresh_probes():
    for f in (cuda.cupy_status, cuda.gpus, cuda.cudnn_status, cuda.nccl_status,
              cuda.driver_cuda_version):
        f.cache_clear()
    yield
    for f in (cuda.cupy_status, cuda.gpus, cuda.cudnn_status, cuda.nccl_status):
        f.cache_clear()


def fake_cupy(monkeypatch, version, is_available, devices=(), cudnn=None, nccl=None):
    cupy = types.ModuleType('cupy')
    cupy.__path__ = []
    cupy.__version__ = version
    cupy.is_available = is_available
    runtime = types.SimpleNamespace(
        runtimeGetVersion=lambda: 12040, driverGetVersion=lambda: 12060,
        getDeviceCount=lambda: len(devices),
        getDeviceProperties=lambda i: devices[i])
    cupy.cuda = types.ModuleType('cupy.cuda')
    cupy.cuda.__path__ = []
    cupy.cuda.runtime = runtime
    monkeypatch.setitem(sys.modules, 'cupy', cupy)
    monkeypatch.setitem(sys.modules, 'cupy.cuda', cupy.cuda)
    for name, mod in (('cudnn', cudnn), ('nccl', nccl)):
        if mod is not None:
            monkeypatch.setitem(sys.modules, 'cupy.cuda.' + name, mod)
            setattr(cupy.cuda, name, mod)
        else:
            # CuPy 14 has no cupy.cuda.cudnn: importing it fails.
            monkeypatch.setitem(sys.modules, 'cupy.cuda.' + name, None)
    return cupy


def test_this_machine_without_cupy_says_so():
    try:
        import cupy  # noqa: F401
        pytest.skip('CuPy is installed here')
    except ImportError:
        pass
    s = cuda.cupy_status()
    assert not s.available and s.why == 'CuPy is not installed'
    assert s.fix == cuda.gpu_fix() and 'cupy-cuda1' in s.fix
    assert cuda.gpus() == []
    assert not cuda.cudnn_status().available
    assert not cuda.nccl_status().available


@pytest.mark.parametrize('driver, expected', [
    (None, 'pip install cupy-cuda13x (a CUDA 13 driver'),
    ((13, 0), 'pip install cupy-cuda13x (the driver offers CUDA 13.0)'),
    ((12, 8), 'pip install cupy-cuda12x (the driver offers CUDA 12.8)'),
    ((10, 2), 'the driver offers CUDA 10.2: update it'),
])
def test_the_fix_names_the_cupy_for_the_drivers_cuda(monkeypatch, driver, expected):
    monkeypatch.setattr(cuda, 'driver_cuda_version', lambda: driver)
    assert expected in cuda.gpu_fix()
    assert cuda._nccl_fix() == 'pip install nvidia-nccl-cu{}'.format(
        12 if driver == (12, 8) else 13)


def test_this_machine_has_no_driver_to_read():
    # No NVIDIA driver here: the probe says so instead of raising.
    if cuda.driver_cuda_version() is not None:
        pytest.skip('an NVIDIA driver is installed here')
    assert 'on a machine with an NVIDIA GPU' in cuda.gpu_fix()


@pytest.mark.parametrize('installed, expected', [
    ({}, (None, None)), ({'cupy-cuda13x': '14.2.0'}, ('cupy-cuda13x', '14.2.0')),
    ({'cupy-cuda12x': '13.6.0'}, ('cupy-cuda12x', '13.6.0')),
])
def test_either_cupy_package_is_recognised(monkeypatch, installed, expected):
    from tests.helpers import pretend_installed
    pretend_installed(monkeypatch, installed)
    assert cuda.cupy_package() == expected


def test_cupy13_without_a_driver_raises_in_is_available(monkeypatch):
    def boom():
        raise RuntimeError('CUDA driver version is insufficient')
    fake_cupy(monkeypatch, '13.6.0', boom)
    s = cuda.cupy_status()
    assert not s.available
    assert 'CUDA driver version is insufficient' in s.why
    assert s.detail['cuda_runtime'] == '12.4'


def test_cupy14_has_no_cudnn(monkeypatch):
    fake_cupy(monkeypatch, '14.2.0', lambda: True,
              devices=[{'name': b'Tesla V100', 'major': 7, 'minor': 0,
                        'totalGlobalMem': 16 << 30}])
    assert cuda.available()
    s = cuda.cudnn_status()
    assert not s.available and 'CuPy 14.2.0 has no cuDNN' in s.why
    # What brings cuDNN back: cuDNN 9's graphs for CuPy's CUDA (12 here), or CuPy 13.
    assert s.fix.startswith('pip install nvidia-cudnn-frontend nvidia-cudnn-cu12 ')
    assert 'cupy-cuda12x<14' in s.fix
    assert cuda.gpus() == [{'index': 0, 'name': 'Tesla V100', 'compute_capability': '7.0',
                            'memory_bytes': 16 << 30, 'tensor_cores': True}]
    assert cuda.tensor_cores_available()


def test_cupy13_with_cudnn_but_no_gpu(monkeypatch):
    cudnn = types.SimpleNamespace(getVersion=lambda: 8902)
    nccl = types.SimpleNamespace(available=True, get_version=lambda: 21903)
    fake_cupy(monkeypatch, '13.6.0', lambda: False, cudnn=cudnn, nccl=nccl)
    s = cuda.cudnn_status()
    assert not s.available and s.version == '8902'
    assert s.why == 'no CUDA device found by CuPy'
    n = cuda.nccl_status()
    assert not n.available and n.version == '21903'


def test_pre_volta_gpu_has_no_tensor_cores(monkeypatch):
    fake_cupy(monkeypatch, '13.6.0', lambda: True,
              devices=[{'name': 'Tesla P100', 'major': 6, 'minor': 0,
                        'totalGlobalMem': 16 << 30}])
    assert cuda.gpus()[0]['tensor_cores'] is False
    assert not cuda.tensor_cores_available()


@pytest.mark.gpu
def test_real_gpu_is_listed():
    found = cuda.gpus()
    assert found and all(g['memory_bytes'] > 0 for g in found)


def _with_compute_types(cupy):
    """CuPy's fp32 GEMM compute type, as _routines_linalg keeps it."""
    state = {'fp32': 1}                 # COMPUTE_TYPE_DEFAULT
    calls = []

    def set_compute_type(dtype, value):
        calls.append(value)
        state['fp32'] = value
    cupy._core = types.SimpleNamespace(get_compute_type=lambda dtype: state['fp32'],
                                       set_compute_type=set_compute_type)
    return state, calls


def test_tensor_cores_true_sets_tf32_on_cupy14_and_disable_restores_it(monkeypatch):
    import warnings
    import fastchain
    cupy = fake_cupy(monkeypatch, '14.2.0', lambda: True,
                     devices=[{'name': b'H100', 'major': 9, 'minor': 0,
                               'totalGlobalMem': 80 << 30}])
    state, calls = _with_compute_types(cupy)
    # CuPy 14 without cuDNN graphs (where the cuDNN frontend and cuDNN 9 are
    # installed, the graphs would be found and 'auto' would mean their fp16)
    from fastchain.backends._status import Status
    from fastchain.cudnn import _group
    monkeypatch.setattr(_group, 'graph_status',
                        lambda: Status(False, why='no cuDNN frontend', fix='-'))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with fastchain.enable(tensor_cores='auto', loader_workers=0) as h:
            assert calls == []          # 'auto' never changes fp32 results
            assert not h.report()['tensor_cores']['active']
        with fastchain.enable(tensor_cores=True, loader_workers=0) as h:
            assert state['fp32'] == 7   # COMPUTE_TYPE_TF32
            report = h.report()['tensor_cores']
            assert report['active'] and 'TF32' in report['note']
    assert state['fp32'] == 1 and calls == [7, 1]


def test_a_gpu_device_without_a_usable_gpu_names_why_and_the_fix(monkeypatch):
    import numpy
    fake_cupy(monkeypatch, '14.2.0', lambda: False)
    for spec in ('@cupy:0', '@cupy', 0):
        with pytest.raises(RuntimeError) as e:
            cuda.get_device(spec)
        assert str(e.value).startswith(
            'device {}: no CUDA device found by CuPy (fix: check `nvidia-smi`'.format(spec))
        assert str(e.value).endswith('; or run on the CPU: @numpy)')
    # the default and the CPU's names are the CPU
    assert cuda.get_device().xp is numpy
    assert cuda.get_device('@numpy').xp is numpy and cuda.get_device(-1).xp is numpy


def test_a_gpu_id_past_the_machines_gpus_is_refused(monkeypatch):
    fake_cupy(monkeypatch, '14.2.0', lambda: True,
              devices=[{'name': b'H100', 'major': 9, 'minor': 0, 'totalGlobalMem': 80 << 30}])
    for spec in ('@cupy:1', 1):
        with pytest.raises(RuntimeError, match=r'device {}: this machine has 1 GPU\(s\), '
                                               r'@cupy:0 to @cupy:0 \(fix: '.format(spec)):
            cuda.get_device(spec)


def test_a_gpu_named_without_its_index_is_gpu_0(monkeypatch):
    import chainer
    fake_cupy(monkeypatch, '14.2.0', lambda: True,
              devices=[{'name': b'H100', 'major': 9, 'minor': 0, 'totalGlobalMem': 80 << 30}])
    asked = []
    monkeypatch.setattr(chainer, 'get_device', lambda spec: asked.append(spec) or spec)
    for spec in ('@cupy', 0, '@cupy:0'):
        cuda.get_device(spec)
    assert asked == ['@cupy:0'] * 3        # Chainer refuses '@cupy' alone
