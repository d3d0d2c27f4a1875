"""What a cached schedule is reused for: the key (structure, types, shapes,
dtypes and devices of the inputs, and the configuration Chainer's functions
read), no reuse across caches of one chain, and no schedule at all for a
train-mode call without backprop."""

import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import fastchain
from fastchain.static import StaticGraphFallback, cache_state, cache_static_graph

from tests.helpers import assert_same, copies, side_by_side

pytestmark = pytest.mark.usefixtures('fresh_fixes')


class AnyDtype(chainer.Chain):
    """Takes a float16 or float32 input (through float64: Chainer's schedule
    cannot record a cast that returns its input)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(4, 5)
            self.bn = L.BatchNormalization(5)
            self.l2 = L.Linear(5, 3)

    def forward(self, x):
        return self.l2(F.relu(self.bn(self.l1(F.cast(F.cast(x, 'd'), 'f')))))


def batches(dtypes, n=4, seed=0):
    rng = numpy.random.RandomState(seed)
    return [(rng.randn(n, 4).astype(dtype), rng.randint(0, 3, n).astype(numpy.int32))
            for dtype in dtypes]


def test_same_shape_different_dtype_gets_its_own_schedule():
    ordinary, cached = copies(AnyDtype)
    cache_static_graph(cached)
    dtypes = [numpy.float32, numpy.float16, numpy.float32, numpy.float16, numpy.float16,
              numpy.float32]
    assert not side_by_side(ordinary, cached, batches(dtypes))
    state = cache_state(cached)
    assert len(state['sequences']) == 2 and state['fallback'] is None


def test_a_configuration_chainer_reads_gets_its_own_schedule():
    ordinary, cached = copies(AnyDtype)
    cache_static_graph(cached)
    data = batches([numpy.float32] * 4)
    assert not side_by_side(ordinary, cached, data[:2])
    with chainer.using_config('use_cudnn', 'never'):
        assert not side_by_side(ordinary, cached, data[2:])
    assert len(cache_state(cached)['sequences']) == 2


def test_a_train_mode_forward_without_backprop_runs_define_by_run():
    """Chainer would record it as a 'test' schedule outside fastchain's fixes
    and update the running statistics twice."""
    ordinary, cached = copies(AnyDtype)
    cache_static_graph(cached)
    data = batches([numpy.float32] * 5)
    assert not side_by_side(ordinary, cached, data[:2])
    for model in (ordinary, cached):
        with chainer.no_backprop_mode():
            model(data[2][0])                   # train mode: statistics updated once
    assert_same(ordinary, cached)
    assert not side_by_side(ordinary, cached, data[3:])
    assert len(cache_state(cached)['sequences']) == 1


def test_enabling_the_cache_again_on_a_model_cached_before_starts_afresh(recwarn):
    """enable, train, disable, enable again, train: no warning, and exactly
    what define-by-run gives."""
    ordinary, cached = copies(lambda: L.Classifier(AnyDtype()))
    data = batches([numpy.float32] * 6)
    for twice in range(2):
        optimizer = chainer.optimizers.MomentumSGD(0.05).setup(ordinary)
        with fastchain.enable(static_graph=True, loader_workers=0):
            cached_optimizer = chainer.optimizers.MomentumSGD(0.05).setup(cached)
            assert fastchain.static.is_cached(cached.predictor)
            for x, t in data[3 * twice:3 * twice + 3]:
                optimizer.update(ordinary, x, t)
                cached_optimizer.update(cached, x, t)
                assert_same(ordinary, cached)
        assert not fastchain.static.is_cached(cached.predictor)
        assert 'schedule_manager' not in vars(cached.predictor)     # its schedules freed
    assert not [w for w in recwarn if w.category is StaticGraphFallback]


def test_a_cached_chain_inside_another_is_recorded_as_part_of_it():
    class Outer(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.inner = AnyDtype()
                self.head = L.Linear(3, 3)

        def forward(self, x):
            return self.head(F.relu(self.inner(x)))
    ordinary, cached = copies(Outer)
    cache_static_graph(cached)
    cache_static_graph(cached.inner)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphFallback)
        assert not side_by_side(ordinary, cached, batches([numpy.float32] * 4))
    assert cache_state(cached.inner)['sequences'] == {}     # never ran on its own


def test_array_inputs_are_counted_in_chainers_flattened_order():
    from chainer.graph_optimizations.static_graph import _flatten_args
    from fastchain.static._keys import array_inputs
    a = numpy.zeros(2, numpy.float32)
    v = chainer.Variable(a)
    n = chainer.Variable(a, requires_grad=False)
    args = (a, [v, (a, v)], v, a, n)
    flat, _, _ = _flatten_args(args)
    assert array_inputs(args) == tuple(
        i for i, x in enumerate(flat) if not isinstance(x, chainer.Variable)
        or not x.requires_grad) == (0, 2, 5, 6)
