import pytest


@pytest.fixture
def fresh_fixes():
    """Chainer's static_graph without fastchain's fixes before and after a test,
    and the module flags that decide how later schedules are built at their
    defaults afterwards."""
    from fastchain.static import _bind, _fixes, _flat
    _fixes.uninstall()
    yield
    _fixes.uninstall()
    _bind.enabled = True
    _flat.enabled = True
