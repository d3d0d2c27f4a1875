"""The Chainer 7.8.1 shims: each fixes its breakage and nothing else."""

import sys

import numpy
import pytest

import chainer
import chainer.functions as F
from fastchain import _compat
from fastchain._compat import _shims

NUMPY2 = int(numpy.__version__.split('.')[0]) >= 2


def applied_names():
    return {(a['name'], a['module']) for a in _compat.applied()}


def test_every_needed_shim_of_an_imported_module_is_applied():
    import chainer.distributions  # noqa: F401
    import chainer.functions.array.pad_sequence  # noqa: F401
    for shim in _shims.SHIMS:
        if shim.module in sys.modules and shim.needed():
            assert (shim.name, shim.module) in applied_names()
        if not shim.needed():
            assert (shim.name, shim.module) not in applied_names()


def test_numpy_itself_is_left_unchanged():
    # The removed aliases stay removed for everyone but the shimmed modules.
    if NUMPY2:
        assert not hasattr(numpy, 'sctypes')
    assert not hasattr(numpy, 'float')
    assert 'numpy.distutils' not in sys.modules or \
        not _shims._missing_module('numpy.distutils')


def test_no_pkg_resources_appears_for_other_code():
    if _shims._missing_module('pkg_resources'):
        import chainer.testing  # noqa: F401  (its helper imports pkg_resources)
        assert 'pkg_resources' not in sys.modules


def test_resize_images_runs_on_cpu():
    # ResizeImages accepts float32 only.
    dtype = numpy.float32
    x = numpy.arange(16, dtype=dtype).reshape(1, 1, 4, 4)
    y = F.resize_images(x, (2, 2))
    numpy.testing.assert_allclose(y.array[0, 0], [[0, 3], [12, 15]])
    assert y.dtype == dtype


def test_as_strided_backward_on_float_and_index_table():
    x = chainer.Variable(numpy.arange(6, dtype=numpy.float32))
    y = F.as_strided(x, (2, 2), (1, 1))
    F.sum(y).backward()
    numpy.testing.assert_array_equal(x.grad, [1, 2, 1, 0, 0, 0])


def test_categorical_log_prob():
    p = numpy.array([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]], numpy.float32)
    d = chainer.distributions.Categorical(p)
    got = d.log_prob(numpy.array([2, 0])).array
    numpy.testing.assert_allclose(got, numpy.log([0.7, 0.5]), rtol=1e-6)


@pytest.mark.parametrize('dtype,padding,expected', [
    (numpy.uint8, -1, 255),         # wraps, as NumPy 1 did
    (numpy.int8, -1, -1),
    (numpy.float32, 0.5, 0.5),
])
def test_pad_sequence_pads_like_numpy1(dtype, padding, expected):
    xs = [numpy.ones(1, dtype), numpy.ones(3, dtype)]
    y = F.pad_sequence(xs, padding=padding).array
    assert y.dtype == dtype
    numpy.testing.assert_array_equal(y[0], numpy.array([1, expected, expected], dtype))
    numpy.testing.assert_array_equal(y[1], [1, 1, 1])


def test_chainermn_unpack_params_casts_and_writes_back():
    from chainermn.communicators import _memory_utility as mu

    class Buffer:
        def __init__(self):
            self.parts = []

        def to_device(self, array, size, offset, stream=None):
            self.parts.append((array.copy(), size, offset))

    link = chainer.links.Linear(3, 2)
    params = sorted(link.params(), key=lambda p: p.name)
    for p in params:
        p.grad = numpy.full(p.shape, 0.1, numpy.float32)
    buf = Buffer()
    mu.unpack_params(params, 'grad', buf, numpy.float16, zero_fill=False)
    sizes = [p.size * 2 for p in params]
    assert [(s, o) for _, s, o in buf.parts] == list(zip(sizes, [0, sizes[0]]))
    assert all(a.dtype == numpy.float16 for a, _, _ in buf.parts)
    # The grads are written back through the fp16 round trip.
    assert all(p.grad.dtype == numpy.float32 for p in params)
    numpy.testing.assert_array_equal(params[0].grad, numpy.float32(numpy.float16(0.1)))


def test_rewrite_refuses_a_source_it_was_not_written_for():
    shim = _shims.Shim('x', 'chainer.x', 'why', lambda: True,
                       rewrites=[('old', 'new', 2)])
    assert shim.rewrite('old old') == 'new new'
    with pytest.raises(ImportError, match='expected 2 occurrence.*found 1'):
        shim.rewrite('old')


# --- CuPy 14 (no CuPy here: the shim's parts are checked on Chainer's source
# and on a stand-in of the module as CuPy 14 leaves it) -------------------------

def _cupy14_shim():
    return next(s for s in _shims.SHIMS if s.name == 'cupy14-cudnn')


def test_cupy14_rewrite_matches_chainers_source_and_says_what_happened():
    import chainer.backends.cuda
    with open(chainer.backends.cuda.__file__) as f:
        source = f.read()
    rewritten = _cupy14_shim().rewrite(source)      # raises unless found exactly once
    compile(rewritten, chainer.backends.cuda.__file__, 'exec')
    assert 'Please reinstall CuPy after you install cudnn' not in rewritten
    assert 'CuPy 14 removed all cuDNN support' in rewritten


def test_cupy14_after_binds_cudnn_and_keeps_tensor_core_query_from_raising():
    import types
    module = types.ModuleType('stand_in')
    module.cudnn_enabled = False        # as Chainer leaves it when cupy.cudnn is gone

    def should_use_cudnn_tensor_core(dtype):
        return cudnn.is_tensor_core_available(dtype)    # noqa: F821 (unbound, as there)
    module.should_use_cudnn_tensor_core = should_use_cudnn_tensor_core
    with pytest.raises(NameError):
        module.should_use_cudnn_tensor_core(numpy.float16)
    _cupy14_shim().after(module)
    assert module.cudnn is None and 'CuPy 14' in module.cudnn_unavailable_reason
    assert module.should_use_cudnn_tensor_core(numpy.float16) is False


@pytest.mark.parametrize('installed, needed', [
    ({}, False), ({'cupy-cuda12x': '13.6.0'}, False), ({'cupy-cuda13x': '14.2.0'}, True),
    ({'cupy-cuda12x': '14.0.1'}, True),
])
def test_cupy14_shim_is_needed_exactly_from_cupy_14(monkeypatch, installed, needed):
    from tests.helpers import pretend_installed
    pretend_installed(monkeypatch, installed)
    assert _cupy14_shim().needed() is needed


def test_a_reloaded_module_keeps_its_fix(python):
    # importlib.reload runs the module's code again: its after-import fix was
    # kept to the first run, and NumPy 2's OverflowError came back.
    out = python('''
import importlib, numpy
import chainer.functions.array.pad_sequence as m
importlib.reload(m)
xs = [numpy.ones(1, numpy.uint8), numpy.ones(3, numpy.uint8)]
print(m.pad_sequence(xs, padding=-1).array[0].tolist())
''')
    assert out.stdout.split() == ['[1,', '255,', '255]'], out.stdout
