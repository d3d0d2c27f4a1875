"""Cached static subgraphs give exactly what define-by-run gives."""

import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import fastchain
from fastchain.models import ResNet
from fastchain.static import StaticGraphFallback, cache_state, cache_static_graph


pytestmark = pytest.mark.usefixtures('fresh_fixes')


def pair(make):
    """The same model twice: one ordinary, one cached."""
    from tests.helpers import copies
    ordinary, cached = copies(make)
    undo = cache_static_graph(cached)
    return ordinary, cached, undo


def step(model, x, t):
    model.cleargrads()
    loss = F.softmax_cross_entropy(model(x), t)
    loss.backward()
    return float(loss.array)


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    for (name, p), (_, q) in zip(sorted(a.namedparams()), sorted(b.namedparams())):
        # A layer that did not run has no gradient (None) or a zero one.
        zero = numpy.zeros_like(p.array)
        numpy.testing.assert_allclose(zero if q.grad is None else q.grad,
                                      zero if p.grad is None else p.grad,
                                      rtol=rtol, atol=atol, err_msg='grad ' + name)
    for la, lb in zip(a.links(), b.links()):
        if isinstance(la, L.BatchNormalization):
            numpy.testing.assert_allclose(lb.avg_mean, la.avg_mean, rtol=rtol, atol=atol)
            numpy.testing.assert_allclose(lb.avg_var, la.avg_var, rtol=rtol, atol=atol)


def small_resnet():
    return ResNet(50, 5, width=4)


def data(rng, n, size=16):
    return (rng.randn(n, 3, size, size).astype(numpy.float32),
            rng.randint(0, 5, n).astype(numpy.int32))


def test_resnet_gradients_and_statistics_match_over_many_batches(capsys):
    ordinary, cached, _ = pair(small_resnet)
    rng = numpy.random.RandomState(1)
    opt_a = chainer.optimizers.MomentumSGD(0.05).setup(ordinary)
    opt_b = chainer.optimizers.MomentumSGD(0.05).setup(cached)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphFallback)
        for i in range(6):
            x, t = data(rng, 4)         # new data every iteration
            la, lb = step(ordinary, x, t), step(cached, x, t)
            assert la == pytest.approx(lb, rel=1e-5)
            assert_same(ordinary, cached)
            opt_a.update()
            opt_b.update()
    state = cache_state(cached)
    assert state['fallback'] is None and len(state['sequences']) == 1
    assert capsys.readouterr().out == ''        # no stray output


def test_last_partial_batch_and_train_eval_switches():
    ordinary, cached, _ = pair(small_resnet)
    rng = numpy.random.RandomState(2)
    for n in (4, 4, 3, 4, 3):
        x, t = data(rng, n)
        step(ordinary, x, t)
        step(cached, x, t)
        assert_same(ordinary, cached)
        with chainer.using_config('train', False), chainer.no_backprop_mode():
            xe, _ = data(rng, 2)
            numpy.testing.assert_allclose(cached(xe).array, ordinary(xe).array,
                                          rtol=1e-5, atol=1e-6)
    assert len(cache_state(cached)['sequences']) == 2     # batch 4 and 3


def test_several_models_in_one_process():
    a0, a1, _ = pair(small_resnet)
    b0, b1, _ = pair(lambda: ResNet(18, 5, width=4))
    rng = numpy.random.RandomState(3)
    for _ in range(4):
        x, t = data(rng, 4)
        for ordinary, cached in ((a0, a1), (b0, b1)):
            step(ordinary, x, t)
            step(cached, x, t)
            assert_same(ordinary, cached)


class Branchy(chainer.Chain):
    """Not static: which layer runs depends on the data."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.a = L.Linear(4, 3)
            self.b = L.Linear(4, 3)

    def forward(self, x):
        layer = self.a if float(numpy.mean(getattr(x, 'array', x))) > 0 else self.b
        return layer(x)


def test_a_model_that_is_not_static_falls_back_and_stays_correct():
    ordinary, cached, _ = pair(Branchy)
    t = numpy.zeros(2, numpy.int32)
    with pytest.warns(StaticGraphFallback, match='not static: the cached graph and '
                      'define-by-run give outputs that differ'):
        for sign in [1.0, 1.0, -1.0, 1.0]:
            x = numpy.full((2, 4), sign, numpy.float32)
            step(ordinary, x, t)
            step(cached, x, t)
            assert_same(ordinary, cached)       # never silently wrong
    assert cache_state(cached)['fallback']


def test_machinery_errors_fall_back_with_the_reason(monkeypatch):
    from chainer.graph_optimizations import static_graph as sg

    def broken(self, *args, **kwargs):
        raise RuntimeError('unsupported on purpose')
    monkeypatch.setattr(sg.StaticScheduleFunction, 'build_schedule', broken)
    ordinary, cached, _ = pair(lambda: Branchy())
    x, t = numpy.ones((2, 4), numpy.float32), numpy.zeros(2, numpy.int32)
    try:
        with pytest.warns(StaticGraphFallback,
                          match='could not be built.*unsupported on purpose'):
            step(cached, x, t)
        step(ordinary, x, t)
        assert_same(ordinary, cached)
    finally:
        # Take the fixes out while the broken method is still in place, so
        # they do not put it back after monkeypatch has restored the original.
        from fastchain.static import _fixes
        _fixes.uninstall()


def test_enable_caches_the_predictor_and_disable_restores(capsys, recwarn):
    from fastchain.static import _fixes
    from chainer.functions.normalization import batch_normalization as bn
    original_backward = bn.BatchNormalization.__dict__['backward']
    with fastchain.enable(static_graph=True, loader_workers=0) as h:
        assert h.states['static_graph'].active
        model = L.Classifier(small_resnet())
        optimizer = chainer.optimizers.SGD(0.1).setup(model)
        assert 'forward' in vars(model.predictor) and 'forward' not in vars(model)
        rng = numpy.random.RandomState(4)
        for _ in range(3):
            optimizer.update(model, *data(rng, 4))
    assert 'forward' not in vars(model.predictor)
    assert bn.BatchNormalization.__dict__['backward'] is original_backward
    assert not _fixes.installed()
    assert capsys.readouterr().out == ''
    assert not [w for w in recwarn if w.category is StaticGraphFallback]


def test_decorator_on_a_class():
    @fastchain.static_graph
    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.l = L.Linear(3, 2)

        def forward(self, x):
            return self.l(x)

    net = Net()
    assert 'forward' in vars(net)
    with pytest.raises(TypeError, match='marks a chainer.Chain'):
        fastchain.static_graph(42)
