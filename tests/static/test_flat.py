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
