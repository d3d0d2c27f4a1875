"""The flat program replays a schedule exactly as Chainer's ScheduleInfo loop does."""

import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from fastchain.models import ResNet
from fastchain.static import StaticGraphFallback, _flat, cache_static_graph

from tests.helpers import copies, schedules, train

pytestmark = pytest.mark.usefixtures('fresh_fixes')


def test_flat_replay_is_bitwise_chainers_replay():
    """ResNet-50 (BatchNormalization, ReLU, pooling, residual adds, the final
    Linear with Chainer's output-list kernels) over 6 steps with new data,
    one of them a smaller (last, partial) batch with its own schedule."""
    flat, chainers = copies(lambda: ResNet(50, 5, width=4))
    cache_static_graph(flat)
    cache_static_graph(chainers)
    opts = [chainer.optimizers.MomentumSGD(0.05).setup(m) for m in (flat, chainers)]
    rng = numpy.random.RandomState(5)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphFallback)
        for i, batch in enumerate((4, 4, 4, 3, 4, 4)):
            x = rng.randn(batch, 3, 32, 32).astype(numpy.float32)
            t = rng.randint(0, 5, batch).astype(numpy.int32)
            _flat.enabled = True            # read when a schedule is built
            train(flat, opts[0], x, t)
            _flat.enabled = False
            train(chainers, opts[1], x, t)
            for (name, p), (_, q) in zip(sorted(flat.namedparams()),
                                         sorted(chainers.namedparams())):
                numpy.testing.assert_array_equal(p.grad, q.grad, err_msg='grad ' + name)
                numpy.testing.assert_array_equal(p.array, q.array, err_msg=name)
            for a, b in zip(flat.links(), chainers.links()):
                if isinstance(a, L.BatchNormalization):
                    numpy.testing.assert_array_equal(a.avg_mean, b.avg_mean)
                    numpy.testing.assert_array_equal(a.avg_var, b.avg_var)
    flat_schedules = list(schedules(flat))
    assert len(flat_schedules) == 4         # batch 4 and batch 3, forward and backward
    for s in flat_schedules:
        compiled = s.forward.fastchain_flat
        # Chainer's static Linear kernels write into output lists: they keep
        # their ScheduleInfo (two entries in each forward schedule).
        kept = 2 if s.pass_depth == 0 else 0
        assert compiled == len(s.schedule_info_list) - kept
    for s in schedules(chainers):
        assert 'forward' not in vars(s)     # Chainer's replay
    # The same arrays are released (Chainer's delete hooks) and kept.
    for a, b in zip(flat_schedules, schedules(chainers)):
        assert [u is None for u in a.unique_arrays] == [u is None for u in b.unique_arrays]


def test_flat_replay_in_evaluation_after_training_matches_define_by_run():
    numpy.random.seed(0)
    ordinary, cached = copies(lambda: ResNet(50, 5, width=4))
    cache_static_graph(cached)
    opts = [chainer.optimizers.MomentumSGD(0.05).setup(m) for m in (ordinary, cached)]
    rng = numpy.random.RandomState(6)
    for _ in range(4):
        x = rng.randn(4, 3, 32, 32).astype(numpy.float32)
        t = rng.randint(0, 5, 4).astype(numpy.int32)
        for m, o in zip((ordinary, cached), opts):
            train(m, o, x, t)
    for (name, p), (_, q) in zip(sorted(ordinary.namedparams()), sorted(cached.namedparams())):
        numpy.testing.assert_allclose(q.array, p.array, rtol=1e-4, atol=1e-5, err_msg=name)
    assert all(s.forward.fastchain_flat for s in schedules(cached))
    x = rng.randn(4, 3, 32, 32).astype(numpy.float32)
    with chainer.using_config('train', False):
        numpy.testing.assert_allclose(cached(x).array, ordinary(x).array, rtol=1e-4, atol=1e-5)


def test_a_gradient_chainer_would_reject_gets_chainers_error():
    p = chainer.Parameter(numpy.zeros((2, 3), numpy.float32))
    g = numpy.ones((2, 3), numpy.float32)
    _flat._attach(p, g)
    assert p.grad is g
    _flat._attach(p, None)
    assert p.grad is None
    with pytest.raises(ValueError, match='(?i)shape'):
        _flat._attach(p, numpy.ones((3, 2), numpy.float32))
    with pytest.raises(TypeError, match='(?i)type'):
        _flat._attach(p, numpy.ones((2, 3), numpy.float64))


class TwoLayers(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.bn = L.BatchNormalization(4)

    def forward(self, x):
        return F.relu(self.bn(self.l1(x)))


def test_chainers_debug_verbosity_keeps_chainers_replay(capsys):
    model = TwoLayers()
    cache_static_graph(model, verbosity=2)
    x = numpy.ones((2, 3), numpy.float32)
    for _ in range(3):
        model.cleargrads()
        F.sum(model(x)).backward()
    assert all('forward' not in vars(s) for s in schedules(model))
    assert capsys.readouterr().out        # Chainer's debug prints, as asked


class FullyConvolutional(chainer.Chain):
    """Ends with a convolution: Chainer's CPU convolution outputs a
    channels-last view (tensordot, then rollaxis)."""

    def __init__(self, k, s, p, c):
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, c, k, stride=s, pad=p)
            self.c2 = L.Convolution2D(c, 2, 3, pad=1)

    def forward(self, x):
        return self.c2(F.relu(self.c1(x)))


@pytest.mark.parametrize('cpu_conv', [True, False])
@pytest.mark.parametrize('k, s, p, c, n, loss', [
    (3, 2, 1, 4, 2, 'square'), (1, 1, 0, 5, 1, 'square'), (3, 1, 1, 3, 3, 'mse'),
    (5, 2, 2, 4, 1, 'mse')])
def test_a_chain_ending_in_a_convolution_returns_chainers_layout(cpu_conv, k, s, p, c, n,
                                                                   loss):
    """The replay's outputs are copied in their memory order: a C-ordered
    copy of the channels-last output gave a loss like sum(y * y) another
    layout of gradient, and the convolution's weight and bias gradients
    summed it in another order (not bitwise, silently: a review)."""
    from fastchain.kernels import _bind
    plain, cached = copies(lambda: FullyConvolutional(k, s, p, c))
    cache_static_graph(cached)
    opts = [chainer.optimizers.SGD(0.05).setup(m) for m in (plain, cached)]
    rng = numpy.random.RandomState(k * 10 + n)
    _bind.enabled = cpu_conv        # read when a schedule is built (reset by the fixture)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphFallback)
        for step in range(4):
            x = rng.randn(n, 3, 9, 9).astype(numpy.float32)
            outs = []
            for model, opt in zip((plain, cached), opts):
                def lossfun():
                    y = model(x)
                    outs.append(y.array)
                    return F.sum(y * y) if loss == 'square' else \
                        F.mean_squared_error(y, numpy.zeros_like(y.array))
                opt.update(lossfun)
            assert outs[0].strides == outs[1].strides
            for (name, a), (_, b) in zip(sorted(plain.namedparams()),
                                         sorted(cached.namedparams())):
                numpy.testing.assert_array_equal(b.array, a.array,
                                                 err_msg='{} step {}'.format(name, step))
