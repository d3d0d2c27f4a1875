"""Shared fixtures: GPU/MPI markers skip cleanly with the reason."""

import os
import subprocess
import sys

import pytest


def pytest_collection_modifyitems(config, items):
    gpu_reason = mpi_reason = None
    if any('gpu' in item.keywords for item in items):
        from fastchain.backends import cuda
        status = cuda.cupy_status()
        if not status.available:
            gpu_reason = 'needs a CUDA GPU: {}'.format(status.why)
    if any('mpi' in item.keywords for item in items):
        from fastchain.backends import mpi
        path = mpi.mpiexec_path()
        if path is None:
            mpi_reason = 'needs mpiexec: ' + mpi.MPI_EXTRA
    for item in items:
        if gpu_reason and 'gpu' in item.keywords:
            item.add_marker(pytest.mark.skip(reason=gpu_reason))
        if mpi_reason and 'mpi' in item.keywords:
            item.add_marker(pytest.mark.skip(reason=mpi_reason))


def run_python(code, *args, env=None, timeout=120, check=True):
    """Run ``code`` in a fresh interpreter of this venv; returns the result."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    result = subprocess.run([sys.executable, '-c', code, *args],
                            capture_output=True, text=True, env=full_env,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError('subprocess failed ({}):\n{}\n{}'.format(
            result.returncode, result.stdout, result.stderr))
    return result


@pytest.fixture
def python():
    return run_python


@pytest.fixture(autouse=True)
def no_handle_leaks_into_the_next_test():
    """A failing test must not leave fastchain enabled for the ones after it."""
    yield
    import sys
    enable_module = sys.modules.get('fastchain.config._enable')
    if enable_module is not None:
        for handle in reversed(enable_module.active_handles()):
            handle.disable()
    onednn = sys.modules.get('fastchain.kernels._onednn')
    if onednn is not None:
        # oneDNN having run loosens the static cache's verification for the
        # rest of the process (static/_verify.py): not into the next test.
        onednn.calls.clear()


@pytest.fixture(autouse=True)
def no_stand_in_cupy_answer_outlives_its_test(monkeypatch):
    """fastchain's GPU probes are cached per process (lru_cache): one asked
    while a test had a stand-in CuPy in sys.modules would go on answering
    for it after the stand-in is gone (a later test asking whether a GPU
    works would hear the stand-in's answer). Requesting ``monkeypatch``
    makes this teardown run before the test's own monkeypatch undoes the
    stand-in, while it can still be seen."""
    before = sys.modules.get('cupy')
    yield
    if sys.modules.get('cupy') is before:
        return
    probes = [m for name, m in list(sys.modules.items())
              if name.startswith('fastchain.backends.') and m is not None]
    for module in probes:
        for value in list(vars(module).values()):
            if callable(getattr(value, 'cache_clear', None)) and \
                    getattr(value, '__module__', None) == module.__name__:
                value.cache_clear()


@pytest.fixture
def fresh_fixes():
    """Chainer's static_graph without fastchain's fixes before and after a test,
    and the module flags that decide how later schedules are built at their
    defaults afterwards."""
    from fastchain.kernels import _bind
    from fastchain.static import _fixes, _flat
    _fixes.uninstall()
    yield
    _fixes.uninstall()
    _bind.enabled = True
    _flat.enabled = True


@pytest.fixture
def tuner(monkeypatch):
    """A clean tuner whose measured times are replaced by ``costs``
    ({alternative or (kind, alternative): seconds}; alternatives not named
    keep their real time)."""
    from fastchain.tune import _tuner
    monkeypatch.setattr(_tuner, 'TRIALS', 2)
    monkeypatch.setattr(_tuner, "forced", {})
    _tuner.forget()
    costs = {}
    record = _tuner.Choice.record
    monkeypatch.setattr(_tuner.Choice, 'record',
                        lambda self, name, s: record(self, name, costs.get(
                            (self.kind, name), costs.get(name, s))))
    yield costs
    _tuner.forget()
