"""The one-kernel-per-dtype inf/NaN check of the loss scaler.

On the CPU it is NumPy's. The GPU path is tested three ways: its kernel
source compiles (NVRTC from CuPy's CUDA wheels, or nvcc, where either is
here), its host side (grouping, address tables, launches, one read of each
device's flag) runs against a stand-in of CuPy whose kernel applies the
same bit test in NumPy, and on a GPU (``gpu`` marker) against
``cupy.isfinite``.
"""

import contextlib
import itertools
import shutil
import subprocess
import sys
import types

import numpy
import pytest
from hypothesis import given, settings, strategies as st

from fastchain.precision import _nonfinite

MASKS = {2: 0x7C00, 4: 0x7F800000, 8: 0x7FF0000000000000}
UINTS = {2: numpy.uint16, 4: numpy.uint32, 8: numpy.uint64}
DTYPES = (numpy.float16, numpy.float32, numpy.float64)


# -- what every path must say ----------------------------------------------------

@st.composite
def gradient_sets(draw):
    """Arrays of fp16/fp32/fp64 (and an int one now and then), some with an
    inf or NaN planted, some with the largest finite values (a sum of them
    overflows; they are finite all the same)."""
    arrays = []
    for _ in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from(DTYPES))
        size = draw(st.integers(1, 3000))
        seed = draw(st.integers(0, 2 ** 16))
        a = numpy.random.RandomState(seed).standard_normal(size).astype(dtype)
        kind = draw(st.sampled_from(['plain', 'large', 'inf', '-inf', 'nan']))
        where = draw(st.integers(0, size - 1))
        if kind == 'large':
            a[:] = numpy.finfo(dtype).max
        elif kind != 'plain':
            a[where] = {'inf': numpy.inf, '-inf': -numpy.inf, 'nan': numpy.nan}[kind]
        arrays.append(a.reshape(draw(st.sampled_from([(size,), (1, size)]))))
    if draw(st.booleans()):
        arrays.append(numpy.arange(5, dtype=numpy.int32))
    return arrays


def truth(arrays):
    return any(not numpy.isfinite(a).all() for a in arrays if a.dtype.kind == 'f')


# -- the host side, against a stand-in of CuPy ----------------------------------

class _Pointer:
    def __init__(self, ptr):
        self.ptr = ptr


class _Array:
    """A CuPy-like array over a NumPy one, on a device, with an address."""
    registry = {}
    _next = itertools.count(0x1000, 0x1000)

    def __init__(self, a, device=0):
        self.a, self.device = a, types.SimpleNamespace(id=device)
        self.data = _Pointer(next(self._next))
        self.registry[self.data.ptr] = self
        self.reads = 0

    dtype = property(lambda self: self.a.dtype)
    size = property(lambda self: self.a.size)
    flags = property(lambda self: self.a.flags)

    def __getitem__(self, i):
        return _Array(self.a[i], self.device.id)

    def set(self, host, stream=None):
        assert stream is not None, 'the table must go in order on the stream, asynchronously'
        self.a[...] = host

    def get(self):
        self.reads += 1
        return self.a.copy()


class _FakeCupy:
    """What ``_any_nonfinite_gpu`` uses of CuPy: its kernel applies the bit
    test of the CUDA source to the arrays the address table names."""

    def __init__(self):
        self.launches = []      # (device, kernel name, grid, rows' sizes)
        self.current = 0
        self.flags = []
        fake = self

        class Device:
            def __init__(self, i):
                self.i = i

            def __enter__(self):
                self.before, fake.current = fake.current, self.i

            def __exit__(self, *exc):
                fake.current = self.before

        class RawModule:
            def __init__(self, code):
                assert code == _nonfinite.SOURCE

            def get_function(self, name):
                return functools_partial(fake._launch, name)

        self.cuda = types.SimpleNamespace(Device=Device, get_current_stream=lambda: 'stream')
        self.RawModule = RawModule

    def zeros(self, n, dtype):
        flag = _Array(numpy.zeros(n, dtype), self.current)
        self.flags.append(flag)
        return flag

    def empty_like(self, a):
        return _Array(numpy.empty_like(a), self.current)

    def ascontiguousarray(self, a):
        return _Array(numpy.ascontiguousarray(a.a), a.device.id)

    def _launch(self, name, grid, block, args):
        ptrs, sizes, flag = args
        assert flag.device.id == self.current and block == (_nonfinite.THREADS,)
        itemsize = {v: k for k, v in _nonfinite.KERNELS.items()}[name]
        rows = []
        for row in range(grid[1]):
            array = _Array.registry[int(ptrs.a[row])]
            assert array.device.id == self.current and array.dtype.itemsize == itemsize
            assert int(sizes.a[row]) == array.size
            bits = array.a.reshape(-1).view(UINTS[itemsize])
            if ((bits & UINTS[itemsize](MASKS[itemsize])) ==
                    UINTS[itemsize](MASKS[itemsize])).any():
                flag.a[0] = 1
            rows.append(array.size)
        self.launches.append((self.current, name, grid, rows))


def functools_partial(fn, name):
    return lambda grid, block, args: fn(name, grid, block, args)


@contextlib.contextmanager
def fake_cupy(monkeypatch):
    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, 'cupy', fake)
    monkeypatch.setitem(sys.modules, 'cupyx', types.SimpleNamespace(
        empty_pinned=lambda shape, dtype: numpy.empty(shape, dtype)))
    monkeypatch.setattr(_nonfinite, '_modules', {})
    yield fake


@settings(max_examples=150, deadline=None)
@given(arrays=gradient_sets(), devices=st.lists(st.integers(0, 1), min_size=7, max_size=7),
       rows=st.sampled_from([1, 2, 65535]))
def test_the_host_side_finds_what_isfinite_finds_with_one_read_per_device(arrays, devices,
                                                                          rows):
    with pytest.MonkeyPatch.context() as monkeypatch, fake_cupy(monkeypatch) as fake:
        monkeypatch.setattr(_nonfinite, 'MAX_ROWS', rows)
        on_gpu = [_Array(a, d) for a, d in zip(arrays, devices)]
        assert _nonfinite.any_nonfinite(on_gpu + [None]) == truth(arrays)
        floats = [g for g in on_gpu if g.dtype.kind == 'f']
        groups = {(g.device.id, g.dtype.itemsize) for g in floats}
        # one launch per (device, dtype) while the rows fit in one grid
        per_group = {}
        for device, name, grid, sizes in fake.launches:
            per_group.setdefault((device, name), []).extend(sizes)
            assert grid[1] == len(sizes) <= rows
            assert grid == _nonfinite.launch_shape(sizes)
        assert len(per_group) == len(groups)
        if rows == 65535:
            assert len(fake.launches) == len(groups)
        # every float gradient was looked at once, ints never
        assert sorted(s for sizes in per_group.values() for s in sizes) == \
            sorted(g.size for g in floats)
        # one flag per device, read once: the one synchronisation
        assert sorted(f.device.id for f in fake.flags) == sorted({d for d, _ in groups})
        assert all(f.reads == 1 for f in fake.flags)


def test_the_launch_shape():
    assert _nonfinite.launch_shape([1, 10]) == (1, 2)
    assert _nonfinite.launch_shape([256 * 4 * 3 + 1]) == (4, 1)
    assert _nonfinite.launch_shape([25_000_000, 3, 4]) == (_nonfinite.MAX_BLOCKS_X, 3)


# -- the CPU -------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(arrays=gradient_sets())
def test_the_cpu_check_finds_what_isfinite_finds(arrays):
    """Exactly: the largest finite values, whose sum overflows, are not an
    overflow."""
    assert _nonfinite.any_nonfinite(arrays) == truth(arrays)


def test_no_gradient_no_overflow():
    assert _nonfinite.any_nonfinite([None, None]) is False


# -- the kernel source ------------------------------------------------------------

def _nvrtc():
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception:
        return None


def test_the_kernel_source_compiles_for_every_dtype(tmp_path):
    """Compiled as CuPy's RawModule will (NVRTC), or with nvcc, to PTX for
    sm_90 (the reference node's H100); each kernel is in the PTX."""
    nvrtc = _nvrtc()
    if nvrtc is not None:
        prog = nvrtc.createProgram(_nonfinite.SOURCE, 'nonfinite.cu', [], [])
        nvrtc.compileProgram(prog, ['-arch=compute_90'])
        ptx = nvrtc.getPTX(prog).decode()
    elif shutil.which('nvcc'):
        src = tmp_path / 'nonfinite.cu'
        src.write_text(_nonfinite.SOURCE)
        subprocess.run(['nvcc', '--ptx', '-arch=sm_90', '-o', str(tmp_path / 'k.ptx'),
                        str(src)], check=True, capture_output=True)
        ptx = (tmp_path / 'k.ptx').read_text()
    else:
        pytest.skip('neither NVRTC (CuPy with its CUDA wheels) nor nvcc is here')
    for name in _nonfinite.KERNELS.values():
        assert '.entry {}('.format(name) in ptx


# -- on a GPU --------------------------------------------------------------------

@pytest.mark.gpu
@settings(max_examples=60, deadline=None)
@given(arrays=gradient_sets())
def test_on_the_gpu_it_finds_what_isfinite_finds(arrays):
    import cupy
    on_gpu = [cupy.asarray(a) for a in arrays]
    assert _nonfinite.any_nonfinite(on_gpu) == truth(arrays)
    # a non-contiguous view is looked at too
    assert _nonfinite.any_nonfinite([g[..., ::2] for g in on_gpu if g.shape[-1] > 1]) == \
        truth([a[..., ::2] for a in arrays if a.shape[-1] > 1])
