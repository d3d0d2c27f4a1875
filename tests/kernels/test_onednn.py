"""onednn: oneDNN's convolutions and PyTorch's BatchNormalization kernels.

Not bitwise equal to Chainer, so every operation is checked against the
exact result (Chainer's code in float64 on the same float32 values): each
output within ``_onednn.TOLERANCE`` of the sum of the magnitudes it adds up
(convolutions: the same convolution of |x|, |W|, |b|; BatchNormalization:
the normalised magnitudes), over generated shapes and settings. Chainer's own
float32 result is held to the same bound, so the bound is float32 rounding,
not a loose one. Each check also asserts that oneDNN really ran.
"""

import warnings

import numpy
import pytest
from hypothesis import assume, given, settings, strategies as st

import chainer
import chainer.functions as F
import chainer.links as L

import fastchain
from fastchain.config import FastchainWarning
from fastchain.kernels import _onednn

from tests.conftest import run_python

pytest.importorskip('torch', reason='the onednn kernels come from PyTorch (bench extra)')

TOL = _onednn.TOLERANCE


def enabled(**options):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FastchainWarning)
        return fastchain.enable(**dict({'loader_workers': 0, 'onednn': True}, **options))


def conv_run(kind, x, W, b, gy, geometry):
    """(y, gx, gW, gb) of one convolution or deconvolution."""
    stride, pad, dilate = geometry
    xv, Wv = chainer.Variable(x), chainer.Variable(W)
    bv = None if b is None else chainer.Variable(b)
    if kind == 'conv':
        y = F.convolution_2d(xv, Wv, bv, stride, pad, dilate=dilate)
    else:
        y = F.deconvolution_2d(xv, Wv, bv, stride, pad, dilate=dilate)
    y.grad = gy.astype(y.dtype) if gy is not None else None
    if gy is None:
        return (y.array,)
    y.backward()
    return y.array, xv.grad, Wv.grad, None if bv is None else bv.grad


@st.composite
def convolutions(draw):
    kind = draw(st.sampled_from(['conv', 'deconv']))
    n, c, o = draw(st.integers(1, 3)), draw(st.integers(1, 8)), draw(st.integers(1, 8))
    k = draw(st.integers(1, 4))
    stride, pad = draw(st.integers(1, 3)), draw(st.integers(0, 2))
    dilate = draw(st.integers(1, 2))
    h, w = draw(st.integers(k * dilate, 12)), draw(st.integers(k * dilate, 12))
    bias = draw(st.booleans())
    seed = draw(st.integers(0, 2 ** 16))
    return kind, (n, c, h, w), o, k, (stride, pad, dilate), bias, seed


@settings(max_examples=40, deadline=None)
@given(convolutions())
def test_convolutions_are_within_the_stated_tolerance_of_the_exact_result(case):
    kind, shape, o, k, geometry, bias, seed = case
    rng = numpy.random.RandomState(seed)
    n, c, h, w = shape
    x = rng.randn(*shape).astype(numpy.float32)
    W = rng.randn(*((o, c, k, k) if kind == 'conv' else (c, o, k, k))).astype(numpy.float32)
    b = rng.randn(o).astype(numpy.float32) if bias else None
    try:
        out_shape = conv_run(kind, x, W, b, None, geometry)[0].shape
    except Exception:
        assume(False)       # a geometry Chainer itself rejects
    assume(0 not in out_shape)
    gy = rng.randn(*out_shape).astype(numpy.float32)
    f64 = [None if a is None else a.astype(numpy.float64) for a in (x, W, b, gy)]
    exact = conv_run(kind, *f64, geometry)
    magnitude = conv_run(kind, *[None if a is None else abs(a) for a in f64], geometry)
    chainers = conv_run(kind, x, W, b, gy, geometry)
    before = sum(_onednn.calls.values())
    with enabled(cpu_conv=False, autotune=False):
        got = conv_run(kind, x, W, b, gy, geometry)
    # forward, and both gradients (a deconvolution's input gradient is a convolution)
    assert sum(_onednn.calls.values()) - before >= 3
    names = ('y', 'gx', 'gW', 'gb')
    for name, g, ch, e, m in zip(names, got, chainers, exact, magnitude):
        if e is None:
            continue
        assert g.dtype == numpy.float32 and g.shape == e.shape, name
        assert numpy.all(numpy.abs(g - e) <= TOL * m + 1e-30), (name, case)
        assert numpy.all(numpy.abs(ch - e) <= TOL * m + 1e-30), (name, 'chainer', case)


def bn_run(x, gamma, beta, gy, mean, var, train):
    xv, gv, bv = chainer.Variable(x), chainer.Variable(gamma), chainer.Variable(beta)
    if train:
        y = F.batch_normalization(xv, gv, bv, running_mean=mean, running_var=var,
                                  decay=0.8)
    else:
        y = F.fixed_batch_normalization(xv, gv, bv, mean, var)
    y.grad = gy
    y.backward()
    return y.array, xv.grad, gv.grad, bv.grad, mean, var


@settings(max_examples=30, deadline=None)
@given(shape=st.tuples(st.integers(2, 5), st.integers(1, 9), st.integers(1, 6),
                       st.integers(1, 6)),
       train=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_batch_normalization_is_within_the_stated_tolerance(shape, train, seed):
    rng = numpy.random.RandomState(seed)
    c = shape[1]
    arrays = [rng.randn(*shape) * 3 + 1, rng.rand(c) + 0.5, rng.randn(c), rng.randn(*shape),
              rng.randn(c), rng.rand(c) + 0.5]
    f32 = [a.astype(numpy.float32) for a in arrays]
    exact = bn_run(*arrays, train=train)
    before = dict(_onednn.calls)
    with enabled(autotune=False):
        got = bn_run(*[a.copy() for a in f32], train=train)
    ran = {k for k, v in _onednn.calls.items() if v > before.get(k, 0)}
    assert ran == ({'batch normalization', 'batch normalization backward'} if train
                   else {'batch normalization inference'})
    chainers = bn_run(*[a.copy() for a in f32], train=train)
    for name, g, ch, e in zip(('y', 'gx', 'ggamma', 'gbeta', 'running mean',
                               'running var'), got, chainers, exact):
        bound = TOL * max(1.0, float(numpy.abs(e).max()))
        assert float(numpy.abs(g - e).max()) <= bound, (name, shape, train)
        assert float(numpy.abs(ch - e).max()) <= bound, (name, 'chainer')


def test_what_onednn_leaves_to_chainer_is_chainers_own_code_on_one_blas_thread():
    """float64, grouped convolutions, an input too small for statistics, an
    output with no columns (PyTorch raised where Chainer gives an empty
    array; a review) and a fully connected layer are Chainer's own code: oneDNN
    does not run, and the results are bitwise those of Chainer on one BLAS
    thread, the count the option sets (a multi-threaded BLAS splits the sums
    otherwise: a float64 convolution 4.3e-14 off, F.linear 4.6e-5 on the
    project's machine, a review; shapes that large are here)."""
    rng = numpy.random.RandomState(0)
    x64 = rng.randn(1, 64, 11, 21)
    W64 = rng.randn(6, 64, 3, 3)
    Wg = rng.randn(6, 2, 3, 3).astype(numpy.float32)
    x = rng.randn(2, 4, 6, 6).astype(numpy.float32)
    xl = rng.randn(64, 512).astype(numpy.float32)
    Wl = rng.randn(1000, 512).astype(numpy.float32)
    xd = rng.randn(1, 3, 2, 2).astype(numpy.float32)
    Wd = rng.randn(3, 4, 3, 1).astype(numpy.float32)
    cases = [lambda: F.convolution_2d(x64, W64, stride=(3, 1), pad=(3, 1),
                                      dilate=(2, 1)).array,
             lambda: F.convolution_2d(x, Wg, pad=1, groups=2).array,
             lambda: F.batch_normalization(x[:1, :, :1, :1], numpy.ones(4, numpy.float32),
                                           numpy.zeros(4, numpy.float32)).array,
             lambda: F.deconvolution_2d(xd, Wd, stride=(2, 3), pad=(3, 2), dilate=(2, 3),
                                        outsize=(2, 0)).array,
             lambda: F.linear(xl, Wl).array]
    threads = _onednn.blas_threads()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')     # Chainer's one-value-per-channel warning
        _onednn.set_blas_threads(_onednn.one_blas_thread())
        try:
            expected = [f() for f in cases]
        finally:
            _onednn.set_blas_threads(threads)
        before = dict(_onednn.calls)
        with enabled(autotune=False):
            got = [f() for f in cases]
    assert _onednn.calls == before
    assert expected[3].shape == (1, 4, 2, 0)
    for e, g in zip(expected, got):
        numpy.testing.assert_array_equal(g, e)


class Net(chainer.Chain):
    def __init__(self):
        super().__init__()
        init = chainer.initializers.Normal(0.3)
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 8, 3, 1, 1, initialW=init)
            self.bn = L.BatchNormalization(8)
            self.c2 = L.Convolution2D(8, 8, 3, 2, 1, initialW=init)
            self.fc = L.Linear(8, 3, initialW=init)

    def forward(self, x):
        h = F.relu(self.bn(self.c1(x)))
        return self.fc(F.mean(self.c2(h), axis=(2, 3)))


def train(steps, options=None, seed=0):
    numpy.random.seed(seed)
    model = Net()
    opt = chainer.optimizers.MomentumSGD(0.05)
    opt.setup(model)
    rng = numpy.random.RandomState(1)
    data = [(rng.randn(4, 3, 8, 8).astype(numpy.float32),
             rng.randint(0, 3, 4).astype(numpy.int32)) for _ in range(steps)]
    handle = None if options is None else enabled(**options)
    try:
        for x, t in data:
            opt.update(lambda: F.softmax_cross_entropy(model(x), t))
    finally:
        if handle is not None:
            handle.disable()
    return model


def close(a, b, rel):
    """Weights within ``rel`` of the largest weight (a convolution's bias
    before BatchNormalization has a zero gradient: its updates are rounding
    noise of the larger values around it), statistics of the largest one."""
    scale = max(float(numpy.abs(p.array).max()) for p in a.params())
    for (name, p), (_, q) in zip(sorted(a.namedparams()), sorted(b.namedparams())):
        numpy.testing.assert_allclose(q.array, p.array, rtol=0, atol=rel * scale, err_msg=name)
    for name in ('avg_mean', 'avg_var'):
        numpy.testing.assert_allclose(getattr(b.bn, name), getattr(a.bn, name), rtol=0,
                                      atol=rel * float(numpy.abs(getattr(a.bn, name)).max()))


@pytest.mark.parametrize('options', [{'autotune': False}, {'autotune': False, 'cpu_conv': False},
                                     {'static_graph': True}, {}])
def test_training_with_onednn_stays_close_to_plain_chainer(options):
    expected = train(6)
    before = dict(_onednn.calls)
    got = train(6, options)
    assert sum(_onednn.calls.values()) > sum(before.values())
    close(expected, got, 1e-4)


def test_a_static_cache_verifies_and_replays_with_onednn_kernels():
    from fastchain.static import cache_state
    numpy.random.seed(0)
    x = numpy.random.RandomState(1).randn(4, 3, 8, 8).astype(numpy.float32)
    t = numpy.array([0, 1, 2, 0], numpy.int32)
    handle = enabled(static_graph=True)
    model = Net()
    opt = chainer.optimizers.MomentumSGD(0.05)
    opt.setup(model)
    for _ in range(12):
        opt.update(lambda: F.softmax_cross_entropy(model(x), t))
    state = cache_state(model)
    assert state['fallback'] is None, state['fallback']
    assert sum(state['verified'].values()) >= 1
    assert _onednn.calls.get('batch normalization backward', 0) >= 12
    assert _onednn.calls.get('convolution', 0) >= 24
    # Turned off with the cache kept (another handle keeps static_graph): the
    # cached steps run Chainer's kernels only.
    keep = fastchain.enable(static_graph=True, loader_workers=0)
    handle.disable()
    try:
        before = dict(_onednn.calls)
        for _ in range(3):
            opt.update(lambda: F.softmax_cross_entropy(model(x), t))
        assert _onednn.calls == before
    finally:
        keep.disable()


def test_a_backward_after_disable_is_chainers():
    """A graph built with onednn on and differentiated after disable(): the
    BatchNormalization backward is Chainer's (the node keeps the implementation
    its forward chose)."""
    rng = numpy.random.RandomState(0)
    x = chainer.Variable(rng.randn(4, 3, 5, 5).astype(numpy.float32))
    gamma = chainer.Variable(numpy.ones(3, numpy.float32))
    beta = chainer.Variable(numpy.zeros(3, numpy.float32))
    with enabled(autotune=False):
        y = F.batch_normalization(x, gamma, beta)
    before = dict(_onednn.calls)
    F.sum(y * y).backward()
    assert _onednn.calls == before


def test_arrays_torch_cannot_share_are_copied_and_cover_all_stays_chainers():
    rng = numpy.random.RandomState(0)
    x = rng.randn(2, 3, 7, 7).astype(numpy.float32)
    W = rng.randn(4, 3, 3, 3).astype(numpy.float32)
    flipped = x[:, :, ::-1, :]                  # negative strides
    readonly = x.copy()
    readonly.flags.writeable = False
    expected = [F.convolution_2d(a, W, pad=1).array for a in (flipped, readonly)]
    expected_cover = F.convolution_2d(x, W, stride=2, cover_all=True).array
    with enabled(autotune=False, cpu_conv=False):
        before = _onednn.calls.get('convolution', 0)
        got = [F.convolution_2d(a, W, pad=1).array for a in (flipped, readonly)]
        assert _onednn.calls.get('convolution', 0) == before + 2
        cover = F.convolution_2d(x, W, stride=2, cover_all=True).array
        assert _onednn.calls.get('convolution', 0) == before + 2
    for g, e in zip(got, expected):
        numpy.testing.assert_allclose(g, e, rtol=0, atol=1e-5 * float(numpy.abs(e).max()))
    numpy.testing.assert_array_equal(cover, expected_cover)
    assert readonly.flags.writeable is False


def test_autotune_does_not_mix_onednn_with_the_blas_kernels(tuner):
    """With onednn on, every qualifying call runs oneDNN (not measured: a
    per-call time misses what switching thread pools costs); the autotuner
    still chooses for the calls oneDNN leaves (here float64 ones)."""
    from fastchain.tune import _tuner
    tuner.update({'chainer': 1e-3, 'fastchain': 1e-2})
    before = dict(_onednn.calls)
    train(12, {})
    assert sum(_onednn.calls.values()) > sum(before.values())
    assert _tuner.choices('cpu_conv') == []
    x = numpy.random.RandomState(0).randn(2, 3, 6, 6)
    W = numpy.random.RandomState(1).randn(4, 3, 3, 3)
    with enabled():
        for _ in range(6):
            F.convolution_2d(x, W, pad=1)
    (choice,) = _tuner.choices('cpu_conv')
    assert 'float64' in choice['key'] and choice['picked'] == 'chainer'
    assert set(choice['median_ms']) == {'fastchain', 'chainer'}


def test_the_option_says_it_is_not_bitwise_and_gives_blas_threads_back():
    import threadpoolctl
    threads = tuple(i['num_threads'] for i in threadpoolctl.threadpool_info()
                    if i['user_api'] == 'blas')
    with pytest.warns(FastchainWarning, match='NOT bitwise equal'):
        handle = fastchain.enable(onednn=True, loader_workers=0)
    state = handle.report()['onednn']
    assert state['active'] and state['setting'] is True
    assert 'kernels are in force' in state['note']
    assert set(_onednn.blas_threads()) == {1}
    handle.disable()
    assert _onednn.blas_threads() == threads
    assert not fastchain.report()['accelerators']['onednn']['active']


def test_off_by_default_and_says_why():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FastchainWarning)
        with fastchain.enable(loader_workers=0) as handle:
            state = handle.report()['onednn']
    assert not state['active'] and 'not bitwise' in state['why']
    # the note says what the option would do, not that it is doing it
    assert 'in force' not in state['note'] and 'with onednn=True (not now)' in state['note']


def test_without_pytorch_the_option_names_the_fix():
    result = run_python(
        "import sys, warnings; sys.modules['torch'] = None\n"
        "import fastchain\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    h = fastchain.enable(onednn=True)\n"
        "print([str(x.message) for x in w])\n"
        "print(h.report()['onednn']['active'])\n")
    out = result.stdout
    assert 'onednn cannot take effect here: PyTorch does not import' in out
    assert 'fastchain[onednn]' in out
    assert out.strip().endswith('False')
