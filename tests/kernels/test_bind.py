"""Kernels bound into a schedule compute exactly what Chainer's replay does."""

import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from fastchain.models import ResNet
from fastchain.kernels import _bind
from fastchain.static import StaticGraphFallback, cache_static_graph

from tests.helpers import ConvZoo, bound_entries, copies, train


pytestmark = pytest.mark.usefixtures('fresh_fixes')


def run_pair(make, inputs, steps=5, variable_input=False):
    """Train a bound and an unbound cached copy side by side; return them.
    ``variable_input``: the image is a variable that requires a gradient (its
    gradient compared too; an array's is not computed)."""
    bound, chainers = copies(make)
    cache_static_graph(bound)
    cache_static_graph(chainers)
    opts = [chainer.optimizers.MomentumSGD(0.05).setup(m) for m in (bound, chainers)]
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphFallback)
        for i in range(steps):
            x, t = inputs(i)
            xs = [chainer.Variable(x.copy()) if variable_input else x for _ in range(2)]
            _bind.enabled = True
            train(bound, opts[0], xs[0], t)
            _bind.enabled = False           # read when a schedule is built
            train(chainers, opts[1], xs[1], t)
            if variable_input:
                numpy.testing.assert_array_equal(xs[0].grad, xs[1].grad, err_msg='input')
            for (name, p), (_, q) in zip(sorted(bound.namedparams()),
                                         sorted(chainers.namedparams())):
                numpy.testing.assert_array_equal(p.grad, q.grad, err_msg='grad ' + name)
                numpy.testing.assert_array_equal(p.array, q.array, err_msg=name)
    return bound, chainers


def test_resnet_bound_replay_is_bitwise_chainers_replay():
    rng = numpy.random.RandomState(1)

    def inputs(i):
        return (rng.randn(4, 3, 32, 32).astype(numpy.float32),
                rng.randint(0, 5, 4).astype(numpy.int32))
    bound, chainers = run_pair(lambda: ResNet(50, 5, width=4), inputs)
    for a, b in zip(bound.links(), chainers.links()):
        if isinstance(a, L.BatchNormalization):
            numpy.testing.assert_array_equal(a.avg_mean, b.avg_mean)
            numpy.testing.assert_array_equal(a.avg_var, b.avg_var)
    lazies = bound_entries(bound)
    # 53 convolutions: forward, weight gradient and input gradient, but the
    # first's input gradient: the chain's input is an array, whose gradient
    # nobody reads (Chainer's backward schedule computed it: the cache leaves
    # it out, fastchain/static/_fixes.py item 5).
    assert len(lazies) == 53 * 3 - 1
    assert all(lazy.plan is not None for lazy in lazies)
    assert bound_entries(chainers) == []


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_every_planned_convolution_setting_is_bitwise_chainers(dtype):
    rng = numpy.random.RandomState(2)

    def inputs(i):
        return (rng.randn(3, 3, 19, 17).astype(dtype), rng.randint(0, 4, 3).astype(numpy.int32))
    # the image a variable that requires its gradient: the first layer's
    # input gradient (7x7, stride 2, pad 3) is computed and compared too
    bound, _ = run_pair(lambda: ConvZoo(dtype), inputs, variable_input=True)
    planned = {type(lazy.node).__name__ for lazy in bound_entries(bound) if lazy.plan}
    assert planned == {'Convolution2DFunction', 'Convolution2DGradW',
                       'Deconvolution2DFunction'}
    # groups > 1 and cover_all stay Chainer's: six layers are bound, each with
    # forward, weight and input gradients, and the cover_all layer's input
    # gradient (a plain deconvolution).
    assert len(bound_entries(bound)) == 6 * 3 + 1


def test_bound_replay_matches_define_by_run():
    numpy.random.seed(0)
    ordinary, cached = copies(ConvZoo)
    cache_static_graph(cached)
    rng = numpy.random.RandomState(3)
    for _ in range(4):
        x = rng.randn(2, 3, 19, 17).astype(numpy.float32)
        for m in (ordinary, cached):
            m.cleargrads()
            F.sum(m(x) ** 2).backward()
        for (name, p), (_, q) in zip(sorted(ordinary.namedparams()),
                                     sorted(cached.namedparams())):
            numpy.testing.assert_allclose(q.grad, p.grad, rtol=1e-5, atol=1e-6,
                                          err_msg=name)
    assert bound_entries(cached)


def test_an_input_unlike_the_plans_runs_chainers_code():
    from chainer.functions.connection.convolution_2d import Convolution2DFunction
    node = Convolution2DFunction(stride=1, pad=1)
    calls = []

    def chainers(func, inputs):
        calls.append(inputs)
        return tuple(v.array for v in Convolution2DFunction(stride=1, pad=1).apply(inputs))
    lazy = _bind._Lazy(_bind._convolution, node, chainers, {})
    rng = numpy.random.RandomState(4)
    W = rng.randn(4, 3, 3, 3).astype(numpy.float32)
    x = rng.randn(2, 3, 5, 5).astype(numpy.float32)
    y, = lazy(node, inputs=[x, W])
    assert lazy.plan is not None and not calls
    numpy.testing.assert_array_equal(y, F.convolution_2d(x, W, pad=1).array)
    other = rng.randn(1, 3, 6, 6).astype(numpy.float32)    # another shape
    y2, = lazy(node, inputs=[other, W])
    assert len(calls) == 1
    numpy.testing.assert_array_equal(y2, F.convolution_2d(other, W, pad=1).array)
    y3, = lazy(node, inputs=[x * 2, W])                      # the plan again
    assert len(calls) == 1
    numpy.testing.assert_array_equal(y3, F.convolution_2d(x * 2, W, pad=1).array)


def test_padded_buffers_are_shared_only_by_convolutions_padded_alike():
    """3x3 pad 1 on 16 px and 5x5 pad 2 on 14 px both pad to 18 px: one
    buffer would leave the first one's interior in the second one's border."""
    from chainer.functions.connection.convolution_2d import Convolution2DFunction
    rng = numpy.random.RandomState(5)
    x16, x14 = (rng.randn(2, 4, n, n).astype(numpy.float32) for n in (16, 14))
    W3, W5 = (rng.randn(4, 4, k, k).astype(numpy.float32) for k in (3, 5))
    buffers = {}
    calls = [(1, x16, W3), (2, x14, W5), (1, x16 * 2, W3)]
    plans = [_bind._convolution(Convolution2DFunction(pad=pad), (x, W), buffers)
             for pad, x, W in calls]
    assert len(buffers) == 2        # the third shares the first one's buffer
    for _ in range(2):
        for plan, (pad, x, W) in zip(plans, calls):
            y, = plan((x, W))
            numpy.testing.assert_array_equal(y, F.convolution_2d(x, W, pad=pad).array)
