"""BatchNormalization's two-level batch statistics (fastchain/cudnn/_bn_stats.py)
on the CPU: the arithmetic against float64 and against Chainer's, over
generated shapes and dtypes, and the graph implementation's fallback to them
where cuDNN refuses a key. The CuPy kernel itself runs in test_graphs_gpu.py."""

import numpy
import pytest
from hypothesis import given, settings, strategies as st

import chainer
from chainer.functions.normalization import batch_normalization as _bn

from fastchain.cudnn import _bn_stats, _graphs, _layers, _paths

from . import standin
from .standin import dev

# float32 sums of up to a few hundred values: relative to the data's scale
TOL = {'float32': 2.0 ** -18, 'float16': 2.0 ** -18}


@pytest.fixture(autouse=True)
def clean():
    yield
    _graphs.forget()
    _paths.forget()


shapes = st.tuples(st.integers(1, 6), st.integers(1, 9),
                   st.lists(st.integers(1, 7), min_size=0, max_size=2))


@settings(max_examples=60, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(['float32', 'float16']),
       loc=st.floats(-50, 50), scale=st.floats(0.01, 20), seed=st.integers(0, 2 ** 16))
def test_statistics_equal_float64_and_chainers_within_tolerance(shape, dtype, loc, scale, seed):
    n, c, spatial = shape
    x = numpy.random.RandomState(seed).normal(loc, scale, (n, c) + tuple(spatial)).astype(dtype)
    axis = (0,) + tuple(range(2, x.ndim))
    assert _bn_stats.usable(x, axis)
    mean, var = _bn_stats.mean_and_var(x, numpy.float32)
    assert mean.dtype == var.dtype == numpy.float32 and mean.shape == var.shape == (c,)
    x64 = x.astype(numpy.float64)
    want_mean, want_var = x64.mean(axis=axis), x64.var(axis=axis)
    size = float(numpy.abs(x64).max()) + 1e-30
    assert numpy.abs(mean - want_mean).max() <= TOL[dtype] * size * 4
    # the variance's error follows the mean's: (x - mean)**2 summed
    assert numpy.abs(var - want_var).max() <= TOL[dtype] * size * size * 8
    chainers = _bn.GeneralBatchNormalizationImpl().get_mean_and_var(
        axis, None, x, numpy, numpy.float32)
    numpy.testing.assert_allclose(mean, chainers[0], rtol=0, atol=TOL[dtype] * size * 8)
    numpy.testing.assert_allclose(var, chainers[1], rtol=0, atol=TOL[dtype] * size * size * 16)


def test_a_channels_last_view_is_read_as_its_nchw_values():
    """Chainer's im2col convolution outputs an NCHW view of NHWC memory."""
    nhwc = numpy.random.RandomState(0).standard_normal((4, 5, 6, 3)).astype('f')
    x = nhwc.transpose(0, 3, 1, 2)
    mean, var = _bn_stats.mean_and_var(x, numpy.float32)
    numpy.testing.assert_allclose(mean, x.mean(axis=(0, 2, 3)), rtol=0, atol=1e-6)
    numpy.testing.assert_allclose(var, x.var(axis=(0, 2, 3)), rtol=0, atol=1e-5)


def test_only_the_per_channel_reduction_is_taken():
    x = numpy.zeros((2, 3, 4, 4), 'f')
    assert _bn_stats.usable(x, (0, 2, 3))
    assert not _bn_stats.usable(x, (0,))            # per position: Chainer's
    assert not _bn_stats.usable(x, (0, 1, 2))
    assert _bn_stats.usable(numpy.zeros((2, 3), 'f'), (0,))


def test_a_key_cuDNN_refuses_runs_chainers_code_with_these_statistics(monkeypatch):
    fe = standin.install(monkeypatch)
    fe.unsupported.update({'nchw', 'nhwc'})
    monkeypatch.setattr(_layers, '_is_cupy', lambda x: True)
    taken = []
    real = _bn_stats.mean_and_var

    def spy(x, dtype):
        taken.append(x.shape)
        return real(numpy.asarray(x), dtype)
    monkeypatch.setattr(_bn_stats, 'mean_and_var', spy)
    rng = numpy.random.RandomState(1)
    x = dev(rng.normal(2, 3, (4, 6, 5, 5)).astype('f'))
    gamma, beta = dev(rng.uniform(0.5, 1.5, 6).astype('f')), dev(rng.uniform(-1, 1, 6)
                                                                  .astype('f'))
    axis, expander = (0, 2, 3), (None, Ellipsis, None, None)
    args = (axis, gamma, x, None, numpy, expander, beta, 2e-5, 0.9)
    mean, var = numpy.zeros(6, 'f'), numpy.ones(6, 'f')
    with chainer.using_config('use_cudnn', 'auto'):
        got = _layers._IMPL.forward(*args, mean, var)
    want_mean, want_var = numpy.zeros(6, 'f'), numpy.ones(6, 'f')
    want = _bn.GeneralBatchNormalizationImpl().forward(*args, want_mean, want_var)
    assert taken == [(4, 6, 5, 5)]
    for name, g, w in (('y', got[0], want[0]), ('running mean', mean, want_mean),
                       ('running var', var, want_var), ('mean', got[4], want[4]),
                       ('inv_std', got[6], want[6])):
        numpy.testing.assert_allclose(numpy.asarray(g), numpy.asarray(w), rtol=2e-6,
                                      atol=2e-6, err_msg=name)
    (entry,) = [v for k, v in _paths.summary().items() if k == 'batchnorm forward']
    assert entry['paths'] == {'statistics': 1}
    (reason,) = entry['reasons']
    assert reason.startswith('no cuDNN engine for NCHW')


def test_float16_statistics_are_added_up_in_float32():
    """A float16 intermediate dtype (float16 x and gamma): more values than
    float16 counts (65504) and sums it could not hold, returned in float16."""
    x = numpy.random.RandomState(3).normal(3, 2, (8, 3, 100, 100)).astype('e')
    mean, var = _bn_stats.mean_and_var(x, numpy.float16)
    assert mean.dtype == var.dtype == numpy.float16
    x64 = x.astype(numpy.float64)
    numpy.testing.assert_allclose(mean, x64.mean(axis=(0, 2, 3)), rtol=2 ** -10)
    numpy.testing.assert_allclose(var, x64.var(axis=(0, 2, 3)), rtol=2 ** -10)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(['float32', 'float16']),
       scale=st.floats(0.01, 20), seed=st.integers(0, 2 ** 16))
def test_the_backwards_sums_equal_float64_and_chainers_within_tolerance(shape, dtype, scale,
                                                                          seed):
    """gbeta = sum(gy) and ggamma = sum(gy * x_hat) per channel, float16 gy
    (mixed16) with float32 x_hat and sums, as Chainer's get_ggamma_and_gbeta."""
    n, c, spatial = shape
    rng = numpy.random.RandomState(seed)
    full = (n, c) + tuple(spatial)
    gy = rng.normal(0, scale, full).astype(dtype)
    x_hat = rng.standard_normal(full).astype(numpy.float32)
    axis = (0,) + tuple(range(2, gy.ndim))
    gbeta, ggamma = _bn_stats.gbeta_and_ggamma(gy, x_hat, numpy.float32)
    assert gbeta.dtype == ggamma.dtype == numpy.float32 and gbeta.shape == (c,)
    gy64, x64 = gy.astype(numpy.float64), x_hat.astype(numpy.float64)
    size = float(numpy.abs(gy64).max()) + 1e-30
    count = gy.size // c
    atol = 2.0 ** -22 * size * count        # float32 sums of `count` terms
    numpy.testing.assert_allclose(gbeta, gy64.sum(axis=axis), rtol=0, atol=atol)
    numpy.testing.assert_allclose(ggamma, (gy64 * x64).sum(axis=axis), rtol=0,
                                  atol=atol * float(numpy.abs(x64).max()))
    want_gbeta, want_ggamma = _bn.GeneralBatchNormalizationImpl().get_ggamma_and_gbeta(
        axis, numpy.ones(c, numpy.float32), gy, x_hat, numpy)
    numpy.testing.assert_allclose(gbeta, want_gbeta, rtol=0, atol=2 * atol)
    numpy.testing.assert_allclose(ggamma, want_ggamma, rtol=0,
                                  atol=2 * atol * float(numpy.abs(x64).max()))


def _node(selector, mean, var):
    node = _bn.BatchNormalization(eps=2e-5, mean=mean, var=var, decay=0.9)
    if selector is not None:
        node._impl_selector = selector
    return node


@pytest.mark.parametrize('mode, path', [('stats', 'statistics'), (None, 'chainer'),
                                        ('0', 'chainer'), ('yes', 'chainer')])
def test_stats_mode_takes_every_call_forward_and_backward(monkeypatch, mode, path):
    """FASTCHAIN_CUDNN_BN=stats: no graph; Chainer's implementation with the
    two-level statistics and sums, for the forward and the backward, counted
    with the reason; the same training step as Chainer's within float32
    rounding. Unset, 0 or a wrong value: Chainer's own."""
    standin.install(monkeypatch)
    if mode is None:
        monkeypatch.delenv(_layers.BN_ENV, raising=False)
    else:
        monkeypatch.setenv(_layers.BN_ENV, mode)
    monkeypatch.setattr(_layers, '_is_cupy', lambda x: True)
    taken = []
    for name in ('mean_and_var', 'gbeta_and_ggamma'):
        real = getattr(_bn_stats, name)
        monkeypatch.setattr(_bn_stats, name, lambda *a, real=real, name=name: (
            taken.append(name), real(*a))[1])
    rng = numpy.random.RandomState(2)
    x = rng.normal(1, 2, (4, 6, 5, 5)).astype('f')
    gamma, beta = rng.uniform(0.5, 1.5, 6).astype('f'), rng.uniform(-1, 1, 6).astype('f')
    gy = rng.standard_normal(x.shape).astype('f')
    results = []
    for selector in (_layers._select, None):
        stats = numpy.zeros(6, 'f'), numpy.ones(6, 'f')
        xs = [chainer.Variable(a.copy()) for a in (x, gamma, beta)]
        with chainer.using_config('use_cudnn', 'auto'):
            (y,) = _node(selector, *stats).apply(xs)
            y.grad = gy.copy()
            y.backward()
        results.append([y.array, *stats] + [v.grad for v in xs])
    for got, want, name in zip(*results, ('y', 'running mean', 'running var', 'gx',
                                          'ggamma', 'gbeta')):
        numpy.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
    summary = _paths.summary()
    if path == 'statistics':
        assert taken == ['mean_and_var', 'gbeta_and_ggamma']
        for op in ('batchnorm forward', 'batchnorm backward'):
            assert summary[op]['paths'] == {'statistics': 1}, op
            assert list(summary[op]['reasons']) == [_layers.BN_STATS]
    else:
        assert taken == []
        assert summary['batchnorm forward']['paths'] == {'chainer': 1}
        assert list(summary['batchnorm forward']['reasons']) == [_layers.BN_OFF]


class _Plan:
    def __init__(self):
        self.wrapped = []

    def wrap(self, owner, name, layer, fn):
        self.wrapped.append((owner.__name__, name))

    def config(self, *args):
        pass

    def value(self, *args):
        pass


@pytest.mark.parametrize('mode, wrapped', [
    ('stats', [('BatchNormalization', 'forward'), ('FixedBatchNormalization', 'forward')]),
    ('1', []), (None, [])])
def test_stats_mode_needs_no_cudnn_graphs(monkeypatch, mode, wrapped):
    """On a GPU whose CuPy has no cuDNN and no frontend (no graphs), the
    two-level reductions are CuPy's alone: FASTCHAIN_CUDNN_BN=stats still
    puts BatchNormalization's layers on (it did nothing there, silently)."""
    from fastchain.backends import cuda
    from fastchain.backends._status import Status
    from fastchain.cudnn import _group
    monkeypatch.setattr(_group, 'graph_status', lambda: Status(False, why='no frontend'))
    monkeypatch.setattr(cuda, 'available', lambda: True)
    monkeypatch.setattr(cuda, 'cudnn_status', lambda: Status(False, why='CuPy 14'))
    if mode is None:
        monkeypatch.delenv(_layers.BN_ENV, raising=False)
    else:
        monkeypatch.setenv(_layers.BN_ENV, mode)
    plan = _Plan()
    _group.GROUP.plan({'cudnn': 'auto', 'tensor_cores': None, 'workspace_size': None},
                      set(), plan)
    assert plan.wrapped == wrapped
    plan = _Plan()
    _group.GROUP.plan({'cudnn': 'never', 'tensor_cores': None, 'workspace_size': None},
                      set(), plan)
    assert plan.wrapped == []
