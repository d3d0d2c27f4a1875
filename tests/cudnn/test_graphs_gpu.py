"""cuDNN graphs against Chainer's im2col code on a GPU (``gpu`` marker):
for generated shapes and settings (a seeded generator: the GPU node has no
hypothesis), every operation's output within the
stated tolerance per dtype, each key built once, and the graph path taken.

Tolerances. A convolution output adds up products in another order than
Chainer's GEMM: each element within ``CONV_TOL[dtype]`` times the sum of
the magnitudes of the products it adds (Chainer's own convolution of |x|
and |W|, |dy| and |W|, |x| and |dy|), plus one rounding of the output
dtype. float32 graphs run without TF32 (``tensor_cores`` not 'always').
BatchNormalization: within ``BN_TOL[dtype]`` of the largest magnitude of
that output (at least 1), statistics within ``BN_TOL['float32']``.
"""

import os

import numpy
import pytest

import chainer
import chainer.functions as F

pytestmark = pytest.mark.gpu

# The share of the generated cases that runs (FASTCHAIN_GPU_CASES, default 1):
# gpu_check.py --quick runs a third, within its ten minutes (a graph's first
# build can compile kernels for seconds).
SHARE = float(os.environ.get('FASTCHAIN_GPU_CASES', '1'))


def count(n):
    return max(1, int(round(n * SHARE)))


CONV_TOL = {'float32': 2.0 ** -16, 'float16': 2.0 ** -9}
BN_TOL = {'float32': 2.0 ** -14, 'float16': 2.0 ** -8}


@pytest.fixture
def graphs():
    import fastchain
    from fastchain.cudnn import _group
    status = _group.graph_status()
    if not status.available:
        pytest.skip('cuDNN graphs are not available here: {} (fix: {})'.format(
            status.why, status.fix))
    handle = fastchain.enable(cudnn='auto', autotune=False, loader_workers=0, nvtx=False)
    yield handle
    handle.disable()


def _chainer(fn):
    with chainer.using_config('use_cudnn', 'never'):
        return fn()


def _graph(fn):
    with chainer.using_config('use_cudnn', 'always'):
        return fn()


def conv_cases(n, seed=2026):
    """``n`` generated settings (the GPU node has no hypothesis: a seeded
    generator over the same space, reproducible by index)."""
    rng = numpy.random.RandomState(seed)
    for _ in range(n):
        yield {'n': int(rng.randint(1, 5)), 'groups': int(rng.choice([1, 2])),
               'c_per_group': int(rng.randint(1, 9)), 'k_per_group': int(rng.randint(1, 9)),
               'size': int(rng.randint(3, 13)), 'kernel': int(rng.choice([1, 3, 5])),
               'stride': int(rng.randint(1, 3)), 'pad': int(rng.randint(0, 3)),
               'dilate': int(rng.randint(1, 3)), 'bias': bool(rng.randint(2)),
               'dtype': str(rng.choice(['float32', 'float16'])),
               'seed': int(rng.randint(2 ** 16))}


def bn_cases(n, seed=2027):
    """Channels mostly multiples of 8 (on the first GPU run cuDNN refused
    every key with other counts, 9 of 9, and took the one with 8), some not."""
    rng = numpy.random.RandomState(seed)
    for _ in range(n):
        c = int(rng.choice([8, 16, 24, 32, 64])) if rng.randint(4) else int(rng.randint(1, 17))
        yield {'n': int(rng.randint(2, 9)), 'c': c,
               'size': int(rng.randint(1, 10)),
               'dtype': str(rng.choice(['float32', 'float16'])), 'seed': int(rng.randint(2 ** 16))}


CUDNN_REFUSALS = ('cudnnGraphNotSupportedError', 'CUDNN_STATUS_NOT_SUPPORTED',
                  'has been deselected', 'GRAPH_NOT_SUPPORTED')


def took_graphs(before, ops):
    """Each of ``ops`` ran once on a graph since ``before``; where cuDNN
    refused a key (no engine for it: a limit of cuDNN, not of fastchain, and
    its reason kept), the case is an expected failure naming the reason, so
    the run shows which generated keys cuDNN has no engine for.
    ``test_resnet50_runs_every_key_on_graphs`` allows no refusal."""
    from fastchain.cudnn import _paths
    after = _paths.summary()
    for op in ops:
        now = after.get(op, {'paths': {}, 'reasons': {}})
        was = before.get(op, {'paths': {}, 'reasons': {}})
        taken = now['paths'].get('graph', 0) - was['paths'].get('graph', 0)
        if taken == 1:
            continue
        new = {r: n - was['reasons'].get(r, 0) for r, n in now['reasons'].items()
               if n > was['reasons'].get(r, 0)}
        # cuDNN's own refusals only: an error of fastchain's (a TypeError, an
        # AttributeError) is wrapped in the same words and must fail here
        # at build time only: a failure to run a built graph must fail here
        refusals = [r for r in new if r.startswith('no cuDNN engine')
                    and any(sign in r for sign in CUDNN_REFUSALS)]
        if refusals and len(refusals) == len(new):
            pytest.xfail('{}: cuDNN refused the key: {}'.format(op, '; '.join(refusals)))
        assert taken == 1, (op, now)        # else both sides were Chainer's, for no reason


def _within(name, got, want, scale, tol, dtype):
    got, want, scale = (numpy.asarray(chainer.backends.cuda.to_cpu(a), numpy.float64)
                        for a in (got, want, scale))
    bound = tol * scale + numpy.finfo(dtype).eps * numpy.abs(want) + 1e-30
    excess = numpy.abs(got - want) - bound
    assert (excess <= 0).all(), '{}: {} elements beyond the bound, worst by {}'.format(
        name, int((excess > 0).sum()), float(excess.max()))


@pytest.mark.parametrize('case', list(conv_cases(count(40))),
                         ids=lambda c: 'c{seed}'.format(**c))
def test_convolution_graphs_match_im2col(graphs, case):
    import cupy
    from fastchain.cudnn import _paths
    c = case
    kernel_extent = c['dilate'] * (c['kernel'] - 1) + 1
    if kernel_extent > c['size'] + 2 * c['pad']:
        return
    rng = numpy.random.RandomState(c['seed'])
    dtype = c['dtype']
    C, K = c['c_per_group'] * c['groups'], c['k_per_group'] * c['groups']
    x = cupy.asarray(rng.uniform(-1, 1, (c['n'], C, c['size'], c['size'])).astype(dtype))
    W = cupy.asarray(rng.uniform(-1, 1, (K, c['c_per_group'], c['kernel'],
                                         c['kernel'])).astype(dtype))
    b = cupy.asarray(rng.uniform(-1, 1, K).astype(dtype)) if c['bias'] else None
    kw = dict(stride=c['stride'], pad=c['pad'], dilate=c['dilate'], groups=c['groups'])

    def run(x, W, b):
        xv, Wv = chainer.Variable(x), chainer.Variable(W)
        bv = chainer.Variable(b) if b is not None else None
        y = F.convolution_2d(xv, Wv, bv, **kw)
        gy = cupy.asarray(numpy.random.RandomState(c['seed'] + 1).uniform(
            -1, 1, y.shape).astype(dtype))
        y.grad = gy
        y.backward()
        return y.array, xv.grad, Wv.grad, gy

    before = _paths.summary()
    y, gx, gW, gy = _graph(lambda: run(x, W, b))
    took_graphs(before, ('conv forward', 'conv input gradient', 'conv weight gradient'))
    y0, gx0, gW0, _ = _chainer(lambda: run(x, W, b))
    ax, aW, agy = abs(x), abs(W), abs(gy)
    scale_y = _chainer(lambda: F.convolution_2d(ax, aW, **kw).array)
    if b is not None:
        scale_y = scale_y + abs(b).reshape(1, -1, 1, 1)
    scale_gx = _chainer(lambda: F.deconvolution_2d(agy, aW, stride=c['stride'], pad=c['pad'],
                                                   dilate=c['dilate'], groups=c['groups'],
                                                   outsize=x.shape[2:]).array)
    scale_gW = _chainer(lambda: _wgrad(ax, agy, W.shape, kw))
    tol = CONV_TOL[dtype]
    _within('forward', y, y0, scale_y, tol, dtype)
    _within('input gradient', gx, gx0, scale_gx, tol, dtype)
    _within('weight gradient', gW, gW0, scale_gW, tol, dtype)


def _wgrad(x, gy, w_shape, kw):
    from chainer.functions.connection import convolution_2d as _c
    node = _c.Convolution2DFunction(**kw)
    grad = _c.Convolution2DGradW(node, w_shape, x.dtype, None)
    return grad.apply((x, gy))[0].array


@pytest.mark.parametrize('case', list(bn_cases(count(30))),
                         ids=lambda c: 'b{seed}'.format(**c))
def test_batchnorm_graphs_match_chainer(graphs, case, monkeypatch):
    import cupy
    from fastchain.cudnn import _layers
    monkeypatch.setenv(_layers.BN_ENV, '1')     # off by default until this passes on a GPU
    n, c, size, dtype, seed = (case[k] for k in ('n', 'c', 'size', 'dtype', 'seed'))
    rng = numpy.random.RandomState(seed)
    x = cupy.asarray(rng.normal(0.5, 2, (n, c, size, size)).astype(dtype))
    param = 'float32'       # as under mixed16 (and float32)
    gamma = cupy.asarray(rng.uniform(0.5, 1.5, c).astype(param))
    beta = cupy.asarray(rng.uniform(-1, 1, c).astype(param))
    gy = cupy.asarray(rng.uniform(-1, 1, x.shape).astype(dtype))

    def run():
        mean, var = cupy.zeros(c, param), cupy.ones(c, param)
        xv, gv, bv = (chainer.Variable(a) for a in (x, gamma, beta))
        y = F.batch_normalization(xv, gv, bv, running_mean=mean, running_var=var,
                                  decay=0.9)
        y.grad = gy
        y.backward()
        fixed = F.fixed_batch_normalization(x, gamma, beta, mean, var).array
        return y.array, xv.grad, gv.grad, bv.grad, mean, var, fixed

    from fastchain.cudnn import _paths
    before = _paths.summary()
    got = _graph(run)
    took_graphs(before, ('batchnorm forward', 'batchnorm backward'))
    want = _chainer(run)
    names = ('y', 'gx', 'ggamma', 'gbeta', 'running mean', 'running var', 'inference y')
    for name, g, w in zip(names, got, want):
        tol = BN_TOL[dtype] if name in ('y', 'gx', 'inference y') else BN_TOL['float32']
        scale = max(1.0, float(abs(w).max()))
        _within(name, g, w, numpy.full(w.shape, scale), tol, w.dtype)


@pytest.mark.parametrize('case', list(bn_cases(count(10), seed=2029)),
                         ids=lambda c: 's{seed}'.format(**c))
def test_two_level_statistics_match_float64_and_chainers(case):
    """fastchain/cudnn/_bn_stats.py's CuPy kernels, on NCHW arrays and on the
    channels-last views Chainer's im2col convolution outputs: the statistics
    and the forward, the backward's sums and the input gradient."""
    import cupy
    from chainer.functions.normalization import batch_normalization as _bn
    from fastchain.cudnn import _bn_stats, _layers
    n, c, size, dtype, seed = (case[k] for k in ('n', 'c', 'size', 'dtype', 'seed'))
    rng = numpy.random.RandomState(seed)
    host = rng.normal(0.5, 2, (n, size, size, c)).astype(dtype)
    for x in (cupy.asarray(host.transpose(0, 3, 1, 2).copy()),
              cupy.asarray(host).transpose(0, 3, 1, 2)):
        mean, var = _bn_stats.mean_and_var(x, numpy.float32)
        x64 = cupy.asnumpy(x).astype(numpy.float64)
        scale = max(1.0, float(abs(x64).max()))
        _within('mean', mean, x64.mean(axis=(0, 2, 3)), numpy.full(c, scale),
                BN_TOL['float32'], 'float32')
        _within('var', var, x64.var(axis=(0, 2, 3)), numpy.full(c, scale * scale),
                BN_TOL['float32'], 'float32')
        if dtype == 'float16':      # float16 x and gamma: float16 statistics, float32 sums
            half = [cupy.asnumpy(a).astype(numpy.float64)
                    for a in _bn_stats.mean_and_var(x, numpy.float16)]
            numpy.testing.assert_allclose(half[0], x64.mean(axis=(0, 2, 3)), rtol=2 ** -10,
                                          atol=2 ** -14 * scale)
            numpy.testing.assert_allclose(half[1], x64.var(axis=(0, 2, 3)), rtol=2 ** -10,
                                          atol=2 ** -14 * scale * scale)
        gamma = cupy.asarray(rng.uniform(0.5, 1.5, c).astype('f'))
        beta = cupy.asarray(rng.uniform(-1, 1, c).astype('f'))
        args = ((0, 2, 3), gamma, x, None, cupy, (None, Ellipsis, None, None), beta, 2e-5, 0.9)
        got = _layers.StatsImpl().forward(*args, None, None)[0]
        want = _bn.GeneralBatchNormalizationImpl().forward(*args, None, None)[0]
        _within('y', got, cupy.asnumpy(want), numpy.full(want.shape, max(
            1.0, float(abs(cupy.asnumpy(want)).max()))), BN_TOL[dtype], dtype)
        # the backward's sums (FASTCHAIN_CUDNN_BN=stats), from Chainer's forward
        gy = cupy.asarray(rng.standard_normal(x.shape).astype(dtype))
        f = _bn.GeneralBatchNormalizationImpl().forward(*args, None, None)
        grads = [impl.backward((0, 2, 3), gamma, gy, x, None, cupy,
                               (None, Ellipsis, None, None), f[4], f[6], 2e-5, f[5], None)
                 for impl in (_layers.StatsImpl(), _bn.GeneralBatchNormalizationImpl())]
        gy64 = cupy.asnumpy(gy).astype(numpy.float64)
        x_hat = (x64 - x64.mean(axis=(0, 2, 3), keepdims=True)) / numpy.sqrt(
            x64.var(axis=(0, 2, 3), keepdims=True) + 2e-5)
        sums = {'gbeta': abs(gy64).sum(axis=(0, 2, 3)),
                'ggamma': abs(gy64 * x_hat).sum(axis=(0, 2, 3))}
        for name, g, w in zip(('gx', None, 'ggamma', 'gbeta'), *grads):
            if name is None:
                continue
            w = cupy.asnumpy(w)
            scale = sums[name] if name in sums else numpy.full(w.shape, max(
                1.0, float(abs(w).max())))
            _within(name, g, w, scale, BN_TOL[dtype if name == 'gx' else 'float32'],
                    str(w.dtype))


def test_each_key_is_built_once(graphs):
    import cupy
    from fastchain.cudnn import _graphs
    x = cupy.ones((2, 3, 8, 8), 'f')
    W = cupy.ones((4, 3, 3, 3), 'f')
    from fastchain.cudnn import _paths
    _graph(lambda: F.convolution_2d(x, W, pad=1))
    built = dict(_graphs.builds)
    graph_calls = _paths.summary()['conv forward']['paths'].get('graph', 0)
    for _ in range(3):
        _graph(lambda: F.convolution_2d(x, W, pad=1))
    assert dict(_graphs.builds) == built
    assert _paths.summary()['conv forward']['paths']['graph'] == graph_calls + 3


@pytest.mark.parametrize('case', list(conv_cases(count(8), seed=2028)),
                         ids=lambda c: 'a{seed}'.format(**c))
def test_autotuned_plans_match_im2col_and_are_reported(graphs, case):
    """With autotune every plan (and the NHWC copies) is timed on a key's
    first call; the call's result is the kept plan's, within the tolerance,
    and the choice is in the handle's report."""
    import cupy
    import fastchain
    from fastchain.tune import _tuner
    c = case
    if c['dilate'] * (c['kernel'] - 1) + 1 > c['size'] + 2 * c['pad']:
        return
    rng = numpy.random.RandomState(c['seed'])
    C, K = c['c_per_group'] * c['groups'], c['k_per_group'] * c['groups']
    x = cupy.asarray(rng.uniform(-1, 1, (c['n'], C, c['size'], c['size'])).astype(c['dtype']))
    W = cupy.asarray(rng.uniform(-1, 1, (K, c['c_per_group'], c['kernel'],
                                         c['kernel'])).astype(c['dtype']))
    kw = dict(stride=c['stride'], pad=c['pad'], dilate=c['dilate'], groups=c['groups'])
    with fastchain.enable(autotune=True) as h:
        first = _graph(lambda: F.convolution_2d(x, W, **kw).array)
        second = _graph(lambda: F.convolution_2d(x, W, **kw).array)
        report = h.report()['autotune']['choices'].get('cudnn_graph')
    assert report is not None and report['decided'] >= 1
    assert any(ch['picked'] for ch in _tuner.choices('cudnn_graph'))
    want = _chainer(lambda: F.convolution_2d(x, W, **kw).array)
    scale = _chainer(lambda: F.convolution_2d(abs(x), abs(W), **kw).array)
    _within('autotuned forward, first call', first, want, scale, CONV_TOL[c['dtype']],
            c['dtype'])
    assert bool((first == second).all())         # the kept plan from the first call on


@pytest.mark.parametrize('bn', [False, True], ids=['bn-default', 'bn-on'])
@pytest.mark.parametrize('dtype', ['float32', 'float16'])
def test_resnet50_runs_every_key_on_graphs(graphs, dtype, bn, monkeypatch):
    """Every convolution key of a ResNet-50 training step at 224 px (batch
    2) and of its evaluation runs on a cuDNN graph: none is refused (the
    reasons are named if one is). BatchNormalization's training keys too
    where its graphs are turned on; by default each stays Chainer's, saying
    why, as its inference always does (53 layers)."""
    import cupy
    import chainer.links as L
    from fastchain.cudnn import _layers, _paths
    from fastchain.models import ResNet
    if bn:
        monkeypatch.setenv(_layers.BN_ENV, '1')
    else:
        monkeypatch.delenv(_layers.BN_ENV, raising=False)
    config_dtype = numpy.float32 if dtype == 'float32' else chainer.mixed16
    with chainer.using_config('dtype', config_dtype):
        model = L.Classifier(ResNet(50, 10))
    model.to_device('@cupy:0')
    x = cupy.asarray(numpy.random.RandomState(0).standard_normal((2, 3, 224, 224)),
                     dtype=dtype)
    t = cupy.asarray([1, 2], dtype=numpy.int32)
    _paths.forget()
    with chainer.using_config('dtype', config_dtype):
        _graph(lambda: model(x, t).backward())
        with chainer.using_config('train', False):
            _graph(lambda: model(x, t))
    summary = _paths.summary()
    ops = ('conv forward', 'conv input gradient', 'conv weight gradient')
    # the inference stays Chainer's (no cuDNN engine for it alone), saying why
    assert summary['batchnorm inference'] == {
        'paths': {'chainer': 53}, 'reasons': {_layers.BN_INFERENCE: 53}}, summary
    if bn:
        ops += ('batchnorm forward', 'batchnorm backward')
    else:
        op = 'batchnorm forward'    # the backward follows the forward
        assert summary[op]['paths'] == {'chainer': summary[op]['paths']['chainer']}, summary
        assert set(summary[op]['reasons']) == {_layers.BN_OFF}, summary
    # any path but the graph's ('chainer', or 'statistics' where a key a
    # graph refused or failed fell to the two-level statistics)
    left = {op: summary.get(op, {}).get('reasons') for op in ops
            if set(summary.get(op, {'paths': {}})['paths']) - {'graph'}}
    assert not left, 'keys left to Chainer: {}'.format(left)
    assert all(summary[op]['paths'].get('graph', 0) > 0 for op in ops), summary
