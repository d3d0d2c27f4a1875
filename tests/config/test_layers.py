"""enable() as layers: one owner of Chainer's patch points, undo that removes
only its own layer, nesting that means one thing, a report that is the truth.

The data-parallel case with real MPI ranks is in
tests/distributed/test_layers_mpi.py.
"""

import contextlib
import copy
import os
import pickle
import warnings

import numpy
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import chainer
import chainer.functions as F
import chainer.links as L
from chainer.optimizer import GradientMethod

import fastchain
from fastchain import distributed
from fastchain.config import FastchainWarning, _patches
from fastchain.data import DevicePrefetcher, MultiprocessIterator
from fastchain.kernels import _conv, _update
from fastchain.nvtx import annotator
from fastchain.precision import scaler_of
from fastchain.static import cache_static_graph, is_cached

from tests.config.test_enable import snapshot
from tests.helpers import OneRank


class BNNet(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(2, 4, 3, pad=1)
            self.bn = L.BatchNormalization(4)
            self.fc = L.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))))


class Small(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.fc = L.Linear(2, 2)

    def forward(self, x):
        return self.fc(x)


@contextlib.contextmanager
def quiet():
    """fp16 on a CPU says it is slower there: not what these tests look at."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FastchainWarning)
        yield


# -- the cases of the issue ---------------------------------------------------------

def test_a_chain_cached_directly_keeps_chainers_fixes_after_the_handle_goes(capfd):
    numpy.random.seed(0)
    plain, cached = BNNet(), BNNet()
    cached.copyparams(plain)
    with fastchain.enable(static_graph=True, loader_workers=0):
        fastchain.static_graph(cached)
    assert is_cached(cached)
    opts = [chainer.optimizers.SGD(0.1).setup(m) for m in (plain, cached)]
    rng = numpy.random.RandomState(1)
    for step in range(4):
        x = rng.randn(5, 2, 6, 6).astype(numpy.float32)
        t = rng.randint(0, 3, 5).astype(numpy.int32)
        for model, opt in zip((plain, cached), opts):
            model.cleargrads()
            F.softmax_cross_entropy(model(x), t).backward()
            opt.update()
        for (name, p), (_, q) in zip(sorted(plain.namedparams()),
                                     sorted(cached.namedparams())):
            numpy.testing.assert_allclose(q.array, p.array, rtol=1e-5, atol=1e-6,
                                          err_msg='step {} {}'.format(step, name))
        numpy.testing.assert_allclose(cached.bn.avg_mean, plain.bn.avg_mean, atol=1e-6)
    assert 'schedule' not in capfd.readouterr().out     # Chainer's prints stay quiet


def test_an_inner_handle_overrides_every_option_in_its_scope_only():
    with quiet():
        outer = fastchain.enable(fp16=True, static_graph=True, loader_workers=0)
    try:
        assert chainer.get_dtype() == numpy.float16
        with fastchain.enable(fp16=False, static_graph=False) as inner:
            assert chainer.get_dtype() == numpy.float32
            model = L.Classifier(BNNet())
            opt = chainer.optimizers.MomentumSGD().setup(model)
            assert scaler_of(opt) is None and not is_cached(model.predictor)
            assert model.predictor.fc.W.dtype == numpy.float32
            states = inner.states
            assert not states['fp16'].active and not states['static_graph'].active
            assert not outer.states['fp16'].active       # the truth, not the request
            assert fastchain.report()['accelerators']['fp16']['active'] is False
        assert chainer.global_config.dtype is chainer.mixed16
        with quiet():
            model = L.Classifier(BNNet())
            opt = chainer.optimizers.MomentumSGD().setup(model)
        assert scaler_of(opt) is not None and is_cached(model.predictor)
        assert outer.states['fp16'].active and outer.states['static_graph'].active
    finally:
        outer.disable()
    assert scaler_of(opt) is None and not is_cached(model.predictor)


def test_an_outer_optimizer_keeps_what_it_got_inside_an_inner_scope():
    with quiet():
        outer = fastchain.enable(fp16=True, loader_workers=0)
        opt = chainer.optimizers.SGD().setup(BNNet())
    try:
        with fastchain.enable(fp16=False):
            assert scaler_of(opt) is not None       # set up outside: left as it was
    finally:
        outer.disable()
    assert scaler_of(opt) is None


def test_prefetch_without_workers_is_refused_with_the_fix():
    with pytest.raises(ValueError, match='loader_workers >= 1'):
        fastchain.enable(prefetch_to_device=True, loader_workers=0)
    assert not fastchain.active_handles()


def test_prefetch_and_no_workers_from_two_handles_reports_the_truth():
    with fastchain.enable(prefetch_to_device=True, loader_workers=2):
        with fastchain.enable(loader_workers=0) as inner:
            state = inner.states['prefetch_to_device']
            assert not state.active and 'no loader workers' in state.why
            from chainer.training.updaters import StandardUpdater
            assert 'loader' not in _patches.layers(StandardUpdater, '__init__')


def test_an_option_asked_for_but_kept_out_by_another_handle_warns_with_the_fix():
    with fastchain.enable(loader_workers=0):
        with pytest.warns(FastchainWarning, match='prefetch_to_device is not in force: no '
                          'loader workers.*To get it: loader_workers >= 1'):
            h = fastchain.enable(prefetch_to_device=True)
        report = h.report()['prefetch_to_device']
        assert report['requested'] and not report['active']
        h.disable()


def test_a_timeline_path_that_cannot_be_written_fails_at_enable(tmp_path):
    with pytest.raises(ValueError, match='timeline.*does not exist'):
        fastchain.enable(timeline=str(tmp_path / 'missing' / 'x.json'))
    with pytest.raises(ValueError, match=r"'/proc/trace.json' cannot be written \(.*\)"):
        fastchain.enable(timeline='/proc/trace.json')     # refused to root too
    assert not fastchain.active_handles()


def test_a_failing_undo_does_not_stop_the_others(tmp_path):
    before = snapshot()
    folder = tmp_path / 'gone'
    folder.mkdir()
    with quiet():
        h = fastchain.enable(fp16=True, timeline=str(folder / 'trace.json'),
                             loader_workers=0)
    inner = fastchain.enable(static_graph=True)
    folder.rmdir()                  # the trace can no longer be written
    with pytest.raises(RuntimeError, match='timeline.*trace.json'):
        h.disable()
    assert not h.active and inner.active
    assert chainer.global_config.dtype is not chainer.mixed16
    inner.disable()
    assert snapshot() == before


# -- users' own patches -----------------------------------------------------------

def test_a_users_patch_made_while_enabled_survives_the_disable():
    original = GradientMethod.__dict__['setup']
    with quiet():
        h = fastchain.enable(fp16=True, loader_workers=0)
    seen = []
    theirs = GradientMethod.setup

    def users_setup(self, link):
        seen.append(link)
        return theirs(self, link)
    GradientMethod.setup = users_setup
    try:
        h.disable()
        assert GradientMethod.__dict__['setup'] is users_setup
        opt = chainer.optimizers.SGD().setup(L.Linear(2, 2))
        assert len(seen) == 1 and scaler_of(opt) is None    # theirs runs, ours is gone
    finally:
        GradientMethod.setup = theirs       # how users undo: put back what they saw
    fastchain.enable(loader_workers=0, fused_update=False).disable()   # tidies up
    assert GradientMethod.__dict__['setup'] is original


def test_a_users_patch_made_before_is_wrapped_and_given_back():
    original = GradientMethod.__dict__['setup']
    calls = []

    def users_setup(self, link):
        calls.append(link)
        return original(self, link)
    GradientMethod.setup = users_setup
    try:
        with quiet(), fastchain.enable(fp16=True, loader_workers=0):
            opt = chainer.optimizers.SGD().setup(L.Linear(2, 2))
            assert calls and scaler_of(opt) is not None
        assert GradientMethod.__dict__['setup'] is users_setup
    finally:
        GradientMethod.setup = original


def test_layers_run_in_the_documented_order():
    with quiet(), fastchain.enable(fp16=True, static_graph=True, nvtx=True,
                                   loader_workers=1):
        assert _patches.layers(GradientMethod, 'setup') == \
            ['nvtx', 'static_graph', 'fused_update', 'fp16']
        from chainer.dataset import convert
        assert _patches.layers(convert, '_call_converter') == ['nvtx', 'fp16']
        from chainer.training.updaters import StandardUpdater
        assert _patches.layers(StandardUpdater, '__init__') == ['nvtx', 'loader']


# -- the property: any order of enables, disables and everything in between -----------

OPTIONS = {
    'fp16': st.sampled_from([True, False]),
    'static_graph': st.sampled_from([True, False]),
    'cpu_conv': st.sampled_from([True, False]),
    'fused_update': st.sampled_from([True, False]),
    'loader_workers': st.sampled_from([0, 1]),
    'prefetch_to_device': st.sampled_from([True, False]),
    'nvtx': st.sampled_from([True, False]),
    'cudnn': st.sampled_from(['always', 'never']),
    'timeline': st.just('TIMELINE'),
}

STEPS = st.lists(st.one_of(
    st.tuples(st.just('enable'), st.fixed_dictionaries({}, optional=OPTIONS)),
    st.tuples(st.just('disable'), st.integers(0, 5)),
    st.tuples(st.just('data_parallel'), st.none()),
    st.tuples(st.just('static_graph'), st.none()),
    st.tuples(st.just('user_patch'), st.none()),
    st.tuples(st.just('user_unpatch'), st.none()),
), min_size=1, max_size=8)


def probe(tmp):
    """What is really in force, found by using Chainer the way a script does."""
    from chainer.training.updaters import StandardUpdater
    with quiet():
        model = L.Classifier(Small())
        opt = chainer.optimizers.MomentumSGD().setup(model)
    # A dataset that computes its examples (arrays in memory keep their
    # SerialIterator unless workers are asked for: tests/data/test_group.py).
    it = chainer.iterators.SerialIterator(chainer.datasets.TransformDataset(
        chainer.datasets.TupleDataset(numpy.zeros((4, 2), numpy.float32),
                                      numpy.zeros(4, numpy.int32)), lambda e: e), 2)
    updater = StandardUpdater(it, opt)
    main = updater.get_iterator('main')
    inner = main.iterator if isinstance(main, DevicePrefetcher) else main
    found = {
        'fp16': chainer.get_dtype() == numpy.float16 and scaler_of(opt) is not None,
        'static_graph': is_cached(model.predictor),
        'fused_update': _update.is_fused(model.predictor.fc.W.update_rule),
        'cpu_conv': all(vars(cls)['_forward_cpu_core'] is not CHAINERS[cls]
                        for cls, _ in _conv.functions()),
        'loader': isinstance(inner, MultiprocessIterator) and inner.n_workers > 0,
        'prefetch_to_device': isinstance(main, DevicePrefetcher),
        'nvtx': 'nvtx' in _patches.layers(opt, 'update'),
        'cudnn': chainer.config.use_cudnn != 'never' and chainer.backends.cuda.cudnn_enabled,
    }
    if hasattr(main, 'finalize'):
        main.finalize()
    return found


CHAINERS = {cls: vars(cls)['_forward_cpu_core'] for cls, _ in _conv.functions()}


@settings(max_examples=int(os.environ.get("FC_EXAMPLES", 25)), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(steps=STEPS)
def test_any_sequence_leaves_the_truth_in_the_report_and_chainer_as_it_was(steps, tmp_path):
    before = snapshot()
    handles, user = [], {}
    numpy.random.seed(0)
    dp_model = BNNet()
    dp_opt = chainer.optimizers.MomentumSGD()
    cached, undo_cache = BNNet(), None
    dp_state = None
    try:
        for i, (kind, arg) in enumerate(steps):
            if kind == 'enable':
                options = dict(arg)
                if 'timeline' in options:
                    options['timeline'] = str(tmp_path / 'trace{}.json'.format(i))
                    if options.get('nvtx') is False:
                        del options['nvtx']
                if options.get('prefetch_to_device') and options.get('loader_workers') == 0:
                    with pytest.raises(ValueError, match='prefetch_to_device'):
                        fastchain.enable(**options)
                    continue
                with quiet():
                    handles.append(fastchain.enable(**options))
            elif kind == 'disable' and handles:
                handles.pop(arg % len(handles)).disable()
            elif kind == 'data_parallel' and dp_state is None:
                distributed.create_multi_node_optimizer(dp_opt, OneRank())
                with quiet():
                    dp_opt.setup(dp_model)
                dp_state = ('update', 'reallocate_cleared_grads')
            elif kind == 'static_graph' and undo_cache is None:
                undo_cache = cache_static_graph(cached)
            elif kind == 'user_patch' and not user:
                user['theirs'] = GradientMethod.setup

                def users_setup(self, link, _theirs=user['theirs']):
                    return _theirs(self, link)
                GradientMethod.setup = users_setup
            elif kind == 'user_unpatch' and user:
                GradientMethod.setup = user.pop('theirs')

            report = fastchain.report()['accelerators']
            real = probe(tmp_path)
            for name, on in real.items():
                assert report[name]['active'] == on, (name, report[name], steps[:i + 1])
            if dp_state is not None:
                assert 'distributed' in _patches.layers(dp_opt, 'update')
                assert 'distributed' in _patches.layers(dp_opt, 'reallocate_cleared_grads')
            if undo_cache is not None:
                assert is_cached(cached)
                from chainer.functions.normalization import batch_normalization as bn
                assert 'static_graph' in _patches.layers(bn.BatchNormalization, 'backward')
        while handles:
            handles.pop().disable()
        if dp_state is not None:     # the optimizer's own layers, and only those
            assert {n: _patches.layers(dp_opt, n) for n in dp_state} == \
                {n: ['distributed'] for n in dp_state}
            assert all(_patches.layers(dp_opt, n) == [] for n in
                       ('check_nan_in_grads', 'call_hooks', 'update_loss_scale'))
        if undo_cache is not None:
            undo_cache()
        assert not is_cached(cached) and 'forward' not in vars(cached)
        if user:
            GradientMethod.setup = user.pop('theirs')
        fastchain.enable(loader_workers=0).disable()     # tidies dormant dispatchers
        assert snapshot() == before
    finally:
        for h in handles:
            h.disable()
        if user:
            GradientMethod.setup = user['theirs']
        if undo_cache is not None:
            undo_cache()
        fastchain.enable(loader_workers=0).disable()
        if os.path.exists(tmp_path):
            for name in os.listdir(tmp_path):
                os.remove(os.path.join(tmp_path, name))
    assert annotator().timeline is None


class _Counter:
    """An object a point is put on (module level: pickle finds it)."""

    def __init__(self):
        self.n = 1

    def value(self):
        return self.n


def test_a_copy_of_an_object_with_a_point_on_it_is_a_plain_object():
    """The point's dispatcher sits in the object's __dict__, bound to that
    object: a copy carried it and called the original's method."""
    thing = _Counter()
    _patches.wrap(thing, 'value', 'nvtx', lambda next_: next_() + 100)
    assert thing.value() == 101
    for dup in (copy.copy(thing), copy.deepcopy(thing), pickle.loads(pickle.dumps(thing))):
        dup.n = 2
        assert dup.value() == 2 and vars(dup) == {'n': 2}
    assert thing.value() == 101
    _patches.unwrap(thing, 'value', 'nvtx')
    assert vars(thing) == {'n': 1}


@pytest.mark.parametrize('static', [False, True])
def test_a_deep_copy_of_a_model_updates_with_its_own_rules_state(static):
    """Chainer's ParallelUpdater deep-copies the model, its parameters' update
    rules with it: a copied rule's fused update ran the original rule's
    (its momentum) on the copy's parameter (silently: every weight off); a
    model cached by static_graph could not be deep-copied once called."""
    models = []
    for options in ({'fused_update': True, 'static_graph': static}, {}):
        numpy.random.seed(0)
        model = Small()
        handle = fastchain.enable(**options) if options else contextlib.nullcontext()
        with handle:
            optimizer = chainer.optimizers.MomentumSGD(0.1).setup(model)
            x = numpy.random.rand(3, 2).astype(numpy.float32)
            for _ in range(3):
                optimizer.update(lambda: F.sum(model(x) ** 2))
            dup = copy.deepcopy(model)
            for _ in range(3):
                dup.cleargrads()
                F.sum(dup(x) ** 3).backward()
                for p in dup.params():
                    p.update()
            if options:
                assert _update.is_fused(model.fc.W.update_rule)
                assert is_cached(model) == static and not is_cached(dup)
        models.append((model, dup))
    (fast, fast_dup), (plain, plain_dup) = models
    for (_, p), (_, q) in zip(sorted(plain.namedparams()), sorted(fast.namedparams())):
        numpy.testing.assert_array_equal(q.array, p.array)
    for (_, p), (_, q) in zip(sorted(plain_dup.namedparams()), sorted(fast_dup.namedparams())):
        numpy.testing.assert_array_equal(q.array, p.array)
        numpy.testing.assert_array_equal(q.update_rule.state['v'], p.update_rule.state['v'])


class _Nesting(_Counter):
    """State nested one level down (as MultiprocessIterator's __getstate__)."""

    def __getstate__(self):
        return {'init': dict(vars(self))}

    def __setstate__(self, state):
        vars(self).update(state['init'])


def test_a_copy_leaves_the_dispatchers_out_of_a_nested_state():
    thing = _Nesting()
    _patches.wrap(thing, 'value', 'nvtx', lambda next_: next_() + 100)
    for dup in (copy.copy(thing), copy.deepcopy(thing), pickle.loads(pickle.dumps(thing))):
        dup.n = 2
        assert dup.value() == 2 and vars(dup) == {'n': 2}
    _patches.unwrap(thing, 'value', 'nvtx')


class _OwnDeepCopy(_Counter):
    """A class with a __deepcopy__ of its own that copies __dict__."""

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        vars(new).update(copy.deepcopy(vars(self), memo))
        return new


def test_a_deep_copy_through_the_classs_own_deepcopy_is_a_plain_object():
    """copy.deepcopy looks ``__deepcopy__`` up before ``__reduce_ex__``: a
    class's own carried the dispatcher bound to the original (the copy's
    value() was the original's, 101 where 2 was right)."""
    thing = _OwnDeepCopy()
    _patches.wrap(thing, 'value', 'nvtx', lambda next_: next_() + 100)
    dup = copy.deepcopy(thing)
    dup.n = 2
    assert dup.value() == 2 and vars(dup) == {'n': 2}
    assert thing.value() == 101             # the original keeps its layer
    _patches.unwrap(thing, 'value', 'nvtx')
    assert vars(thing) == {'n': 1}
