"""enable()/disable() restore exactly what they touched; bad options fail."""

import gc
import warnings

import chainer
import chainer.links as L
import chainer.backends.cuda as chainer_cuda
import pytest
from hypothesis import given, settings, strategies as st

import fastchain
from fastchain.backends import Status, cuda
from fastchain.config import FastchainWarning
from fastchain.config import _options, _patches


def snapshot():
    """Every global a handle may touch (see fastchain/config/_patches/).

    Collects garbage first: a chain cached with fastchain.static_graph holds
    Chainer's static-graph fixes until it is collected, and chains live in
    reference cycles, so when that happens is up to the collector; a
    data-parallel optimizer's learner (and the Trainer layer it holds) is
    freed by a later collection than the one that frees its optimizer, so
    collect until nothing more is freed."""
    while gc.collect():
        pass
    from chainer.dataset import convert
    from chainer.functions.normalization import batch_normalization as bn
    from chainer.graph_optimizations import static_graph as sg
    from chainer.optimizer import GradientMethod
    from chainer.training import trainer
    from chainer.training.updaters import StandardUpdater
    from fastchain.kernels import _bind, _conv
    from fastchain.nvtx import annotator
    from fastchain.tune import _tuner
    return (dict(chainer.global_config.__dict__), _tuner.enabled,
            chainer_cuda.get_max_workspace_size(),
            dict(GradientMethod.__dict__), dict(vars(convert)),
            dict(StandardUpdater.__dict__), dict(trainer.Trainer.__dict__),
            dict(bn.BatchNormalization.__dict__), dict(sg.StaticScheduleFunction.__dict__),
            dict(vars(sg)), [dict(vars(cls)) for cls, _ in _conv.functions()],
            _bind.enabled, annotator().timeline,
            dict(chainer._get_link_hooks()), dict(chainer.get_function_hooks()))


def chainer_config():
    """What the cuDNN group touches."""
    return dict(chainer.global_config.__dict__), chainer_cuda.get_max_workspace_size()


@pytest.fixture(params=['no-gpu', 'fake-cudnn'])
def device(request, monkeypatch):
    """Run each test as on this machine, and as if cuDNN were available
    (the probe is replaced; Chainer's config keys are the real ones)."""
    if request.param == 'fake-cudnn':
        monkeypatch.setattr(cuda, 'cudnn_status', lambda: Status(True, version='8902'))
        monkeypatch.setattr(cuda, 'tensor_cores_available', lambda: True)
    yield request.param
    assert not fastchain.active_handles(), 'a test left a handle enabled'


VALUES = {
    'cudnn': st.sampled_from(['always', 'auto', 'never', True, False, None]),
    'autotune': st.sampled_from([True, False, None]),
    'tensor_cores': st.sampled_from(['always', 'auto', 'never', True, False, None]),
    'workspace_size': st.one_of(st.none(), st.integers(0, 2**32)),
    'fp16': st.sampled_from([True, False, 'auto', None]),
    'loss_scale': st.sampled_from(['dynamic', False, {'init_scale': 1024.0}, None]),
    'loader_workers': st.sampled_from([None, 0, 1, 4]),
    'prefetch_to_device': st.sampled_from([True, False, None]),
    'static_graph': st.sampled_from([True, False, None]),
    'fused_update': st.sampled_from([True, False, None]),
    'cpu_conv': st.sampled_from([True, False, None]),
}


def option_sets():
    # prefetch_to_device=True with loader_workers=0 is refused (tests/config/test_layers.py).
    return st.fixed_dictionaries({}, optional=VALUES).filter(
        lambda o: not (o.get('prefetch_to_device') is True and o.get('loader_workers') == 0))


@settings(max_examples=60, deadline=None)
@given(first=option_sets(), second=option_sets(), lifo=st.booleans())
def test_enable_twice_then_disable_restores_everything(first, second, lifo):
    # Hypothesis and function-scoped fixtures do not mix; cover the fake
    # cuDNN case in the test below.
    before = snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FastchainWarning)
        h1 = fastchain.enable(**first)
        middle = snapshot()
        h2 = fastchain.enable(**second)
    if lifo:
        h2.disable()
        assert snapshot() == middle
        h1.disable()
    else:
        h1.disable()            # any order: h2 stays enabled, with its options
        assert h2.active and not h1.active
        h2.disable()
    assert snapshot() == before
    assert not fastchain.active_handles()


def test_each_option_is_applied_to_chainer_and_restored(device):
    before = snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FastchainWarning)
        with fastchain.enable(cudnn='always', autotune=True, tensor_cores='never',
                              workspace_size=1 << 20, loader_workers=0,
                              fused_update=False) as h:
            assert chainer.config.use_cudnn == 'always'
            assert chainer.config.autotune is True
            assert chainer.config.use_cudnn_tensor_core == 'never'
            if chainer_cuda.cudnn_enabled:    # a no-op in Chainer without cuDNN
                assert chainer_cuda.get_max_workspace_size() == 1 << 20
            assert _patches.value_labels() == [
                'chainer.backends.cuda.max_workspace_size', 'chainer.config.autotune',
                'chainer.config.use_cudnn', 'chainer.config.use_cudnn_tensor_core',
                'fastchain.tune._tuner.enabled']
            assert h.states['workspace_size'].setting == 1 << 20
    assert snapshot() == before


def test_defaults_turn_cudnn_autotune_on_only_where_cudnn_works(device):
    from fastchain.tune import _tuner
    before = snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter('error')      # defaults never warn
        # The cuDNN defaults only (the fused update and the CPU convolution
        # kernels are on by default too: tested in tests/static/).
        with fastchain.enable(loader_workers=0, fused_update=False) as h:
            # fastchain's own measure-and-choose is on everywhere by default.
            assert _tuner.enabled and h.states['autotune'].active
            if device == 'fake-cudnn':
                assert chainer.config.autotune is True
            else:
                assert chainer_config() == before[:1] + before[2:3]
    assert snapshot() == before


def test_autotune_false_turns_both_tuners_off(device):
    from fastchain.tune import _tuner
    with fastchain.enable(autotune=False, loader_workers=0) as h:
        assert not _tuner.enabled
        assert chainer.config.autotune is False
        state = h.states['autotune']
        assert not state.active and state.why == 'autotune=False'
    assert not _tuner.enabled


def test_autotune_on_a_gpu_without_cudnn_says_what_it_cannot_tune(monkeypatch):
    monkeypatch.setattr(cuda, 'available', lambda: True)
    monkeypatch.setattr(cuda, 'cudnn_status', lambda: Status(
        False, why='CuPy 14 has no cuDNN', fix='the cudnn extra'))
    from fastchain.cudnn import _frontend
    monkeypatch.setattr(_frontend, 'status', lambda: (
        False, None, 'the cuDNN frontend is not installed', 'pip install the frontend'))
    with pytest.warns(FastchainWarning) as record:
        h = fastchain.enable(autotune=True, loader_workers=0)
    try:
        msgs = [str(w.message) for w in record if w.category is FastchainWarning]
        assert any("cuDNN's algorithm search is not available here (CuPy 14 has no cuDNN, "
                   'and the cuDNN frontend is not installed; fix: pip install the frontend)'
                   in m for m in msgs), msgs
        assert h.states['autotune'].active      # the CPU choices still are tuned
    finally:
        h.disable()


def test_unavailable_option_warns_once_with_why_and_fix():
    with pytest.warns(FastchainWarning) as record:
        h = fastchain.enable(cudnn='always')
    try:
        msgs = [str(w.message) for w in record if w.category is FastchainWarning]
        assert len(msgs) == 1
        assert 'cudnn' in msgs[0] and 'To get it' in msgs[0]
        assert cuda.cudnn_status().why in msgs[0]
        state = h.report()['cudnn']
        assert state['requested'] and not state['active'] and state['fix']
    finally:
        h.disable()


def test_asking_for_off_never_warns():
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        fastchain.enable(cudnn='never', autotune=False, tensor_cores=False).disable()


def _fastchain_warnings(**options):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter('always')
        fastchain.enable(**options).disable()
    return [str(w.message) for w in record if w.category is FastchainWarning]


def test_an_option_of_an_accelerator_that_is_off_warns_naming_it(tmp_path):
    cache = str(tmp_path / 'tune.json')
    msgs = _fastchain_warnings(loss_scale=False, loader_workers=0)
    assert len(msgs) == 1 and 'loss_scale=False has no effect: fp16 is off' in msgs[0]
    msgs = _fastchain_warnings(tune_cache=cache, autotune=False, loader_workers=0)
    assert len(msgs) == 1 and 'tune_cache=' in msgs[0] and 'autotune=False' in msgs[0]
    # fp16='auto' off on this machine is a choice made per machine: no warning
    assert not _fastchain_warnings(fp16='auto', loss_scale={'init_scale': 2.0 ** 10},
                                   loader_workers=0)
    assert not _fastchain_warnings(tune_cache=cache, loader_workers=0)


def test_an_option_given_inside_the_scope_of_its_accelerator_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        outer = fastchain.enable(fp16=True, loader_workers=0)  # fp16 on a CPU warns
    try:
        assert not _fastchain_warnings(loss_scale=False)
    finally:
        outer.disable()


def test_unknown_option_is_a_type_error_naming_the_valid_ones():
    with pytest.raises(TypeError) as e:
        fastchain.enable(autotun=True)
    msg = str(e.value)
    assert "('autotun': did you mean 'autotune'?)" in msg
    for name in _options.all_options():
        assert name in msg
    assert not fastchain.active_handles()


@pytest.mark.parametrize('kwargs', [
    {'cudnn': 'sometimes'}, {'cudnn': 1}, {'autotune': 'yes'}, {'autotune': 1},
    {'tensor_cores': 'on'}, {'workspace_size': -1}, {'workspace_size': 1.5},
    {'workspace_size': True}, {'fp16': 'yes'}, {'loss_scale': 'static'},
    {'loss_scale': {'init_scale': -1}}, {'loss_scale': {'growth_interval': 0}},
    {'loader_workers': -1}, {'loader_workers': 2.0}, {'prefetch_to_device': 'on'},
])
def test_bad_value_is_a_value_error(kwargs):
    before = snapshot()
    with pytest.raises(ValueError) as e:
        fastchain.enable(**kwargs)
    assert next(iter(kwargs)) in str(e.value)
    assert snapshot() == before
    assert not fastchain.active_handles()


def test_numpys_scalars_are_taken_as_pythons():
    import numpy
    with fastchain.enable(fused_update=numpy.False_, autotune=numpy.True_,
                          loader_workers=numpy.int64(0), cudnn=numpy.str_('never')) as h:
        assert h.options['fused_update'] is False and h.options['autotune'] is True
        assert type(h.options['loader_workers']) is int and h.options['cudnn'] == 'never'
    with pytest.raises(ValueError):
        fastchain.enable(fused_update=numpy.int64(1))    # 1 is not True here either


def test_a_loss_scaler_argument_that_does_not_exist_lists_those_that_do():
    with pytest.raises(ValueError, match=r"DynamicLossScaler has no argument 'scale'; its "
                       r"arguments are init_scale, growth_factor, backoff_factor, "
                       r"growth_interval, min_scale, max_scale"):
        fastchain.enable(fp16=True, loss_scale={'scale': 1024})


def test_a_failing_group_undoes_what_was_already_applied(monkeypatch):
    before = snapshot()

    class Boom(_options.Group):
        name = 'boom'
        options = ()

        def probe(self):
            return []

        def states(self, values, explicit):
            return []

        def plan(self, values, explicit, plan):
            raise RuntimeError('boom')

    real_groups = _options.groups
    monkeypatch.setattr(_options, 'groups', lambda: real_groups() + [Boom()])
    with pytest.raises(RuntimeError, match='boom'):
        fastchain.enable(cudnn='never', workspace_size=123)
    assert snapshot() == before
    assert not fastchain.active_handles()


def test_a_warning_raised_as_an_error_takes_the_options_out_again(tmp_path):
    # -W error (or a suite's filterwarnings = error): enable() raised its
    # warning after the options were in force, and left them there, handle
    # and all, with nothing returned to disable them. Nothing is written for
    # the enable() that failed (no trace).
    before = snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter('error', FastchainWarning)
        with pytest.raises(FastchainWarning, match='fp16'):
            fastchain.enable(fp16=True, timeline=str(tmp_path / 'trace.json'))
    assert not fastchain.active_handles()
    assert snapshot() == before
    assert list(tmp_path.iterdir()) == []


def test_an_enable_that_failed_writes_no_autotune_cache_at_exit(python, tmp_path):
    # (the cache was saved at exit for it all the same)
    cache = tmp_path / 'tune.json'
    python('''
import sys, warnings
import fastchain
warnings.simplefilter('error', fastchain.FastchainWarning)
try:
    fastchain.enable(fp16=True, autotune=True, tune_cache=sys.argv[1],
                     timeline=sys.argv[1] + '.trace.json')
except fastchain.FastchainWarning:
    pass
else:
    raise SystemExit('no warning raised')
''', str(cache))
    assert list(tmp_path.iterdir()) == []


def test_disable_is_idempotent_and_the_handle_reports():
    h = fastchain.enable(cudnn='never', loader_workers=0, fused_update=False, cpu_conv=False,
                         autotune=False)
    try:
        assert 'active=[]' in repr(h) and 'enabled' in repr(h)
    finally:
        h.disable()
    h.disable()
    assert not h.active and not any(s['active'] for s in h.report().values())
    assert set(h.report()) >= {'cudnn', 'autotune', 'tensor_cores'}


def test_entering_a_disabled_handle_says_so():
    """`with h:` after h.disable() ran its block with none of the options,
    silently (a review found it)."""
    h = fastchain.enable(loader_workers=0, fp16=True)
    h.disable()
    with pytest.raises(RuntimeError, match='this handle was disabled.*with fastchain.enable'):
        with h:
            pass                                    # pragma: no cover
    with fastchain.enable(loader_workers=0) as again:   # an enabled one still enters
        assert again.active
    assert not again.active


class _SetUpBefore(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l = chainer.links.Linear(3, 2)

    def forward(self, x):
        return self.l(x)


class _SetUpAfter(_SetUpBefore):
    pass


class _Decorated(_SetUpBefore):
    @fastchain.static_graph
    def forward(self, x):
        return self.l(x)


def test_an_optimizer_set_up_before_fp16_or_static_graph_is_named():
    """Both act at optimizer.setup(): one set up before enable() asks for
    them is left as it was, and enable() says so (not one set up after, nor
    one whose forward is decorated with fastchain.static_graph)."""
    before = chainer.optimizers.SGD().setup(_SetUpBefore())
    decorated = chainer.optimizers.SGD().setup(_Decorated())
    with pytest.warns(FastchainWarning) as caught:
        handle = fastchain.enable(static_graph=True, fp16=True, loader_workers=0)
    try:
        messages = [str(w.message) for w in caught if 'acts when an optimizer' in
                    str(w.message)]
        assert [m.split(' acts')[0] for m in messages] == ['fastchain: fp16',
                                                          'fastchain: static_graph']
        assert {w.filename for w in caught} == {__file__}    # the script's enable() line
        assert all('SGD of _SetUpBefore' in m and 'Call fastchain.enable() before' in m
                   for m in messages), messages
        assert 'SGD of _Decorated' in messages[0] and 'SGD of _Decorated' not in messages[1]
        assert "'float32 != float16'" in messages[0] and 'float16' not in messages[1]
        after = chainer.optimizers.SGD().setup(_SetUpAfter())
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter('always')
            fastchain.enable(static_graph=True, loader_workers=0).disable()
        [message] = [str(w.message) for w in again if 'acts when an optimizer' in
                     str(w.message)]
        assert 'SGD of _SetUpBefore' in message and '_SetUpAfter' not in message
    finally:
        handle.disable()
    del before, after, decorated


def test_an_fp16_model_set_up_under_an_earlier_handle_is_named_as_float16():
    # it said the model "keeps its float32 weights" (a new-user trial)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        first = fastchain.enable(fp16=True, loader_workers=0)
        model = L.Classifier(L.Linear(4, 3))
        opt = chainer.optimizers.SGD().setup(model)
        first.disable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        fastchain.enable(fp16=True, loader_workers=0).disable()
    [message] = [str(w.message) for w in caught if 'acts when an optimizer' in str(w.message)]
    assert 'Its float16 model has neither fp32 master weights nor a loss scaler' in message
    assert 'float32 weights' not in message
    del opt, model


def test_fused_update_asked_for_names_an_optimizer_set_up_before():
    model = L.Classifier(L.Linear(3, 2))
    before = chainer.optimizers.MomentumSGD().setup(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        fastchain.enable(loader_workers=0).disable()        # the default: not named
        handle = fastchain.enable(fused_update=True, loader_workers=0)
    try:
        messages = [str(w.message) for w in caught if 'acts when an optimizer' in
                    str(w.message)]
        assert len(messages) == 1 and messages[0].startswith('fastchain: fused_update acts')
        assert 'MomentumSGD of Classifier' in messages[0]
        after = chainer.optimizers.MomentumSGD().setup(L.Classifier(L.Linear(3, 2)))
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter('always')
            fastchain.enable(fused_update=True, loader_workers=0).disable()
        [message] = [str(w.message) for w in again if 'acts when an optimizer' in
                     str(w.message)]
        assert 'an optimizer set up before' in message     # only `before`, not `after`
    finally:
        handle.disable()
    del before, after, model


def test_a_single_link_set_up_before_static_graph_is_named_as_after():
    """A model the cache cannot take (a single link), set up before enable():
    the same warning and report entry as one set up after (none before)."""
    from fastchain.static._cache import StaticGraphFallback
    single = L.Classifier(L.Linear(3, 2))
    opt = chainer.optimizers.SGD().setup(single)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        handle = fastchain.enable(static_graph=True, loader_workers=0)
    try:
        [warning] = [w for w in caught if w.category is StaticGraphFallback]
        message = str(warning.message)
        assert warning.filename == __file__
        assert 'Linear is a single link: wrap it in a Chain' in message
        assert 'trains define-by-run' in message
        assert not any('acts when an optimizer' in str(w.message) for w in caught)
        calls = handle.report()['static_graph']['calls']
        assert 'Linear is a single link' in calls['define_by_run']['Linear']
        with warnings.catch_warnings(record=True) as again:     # said once
            warnings.simplefilter('always')
            fastchain.enable(static_graph=True, loader_workers=0).disable()
        assert not [w for w in again if w.category is StaticGraphFallback]
    finally:
        handle.disable()
    del single, opt


@pytest.mark.parametrize('options', [
    {}, {'fused_update': True}, {'fp16': True}, {'static_graph': True}, {'nvtx': 'links'},
    {'autotune': True}, {'loader_workers': 2}],
    ids=['defaults', 'fused_update', 'fp16', 'static_graph', 'nvtx links', 'autotune',
         'loader workers'])
def test_a_model_and_optimizer_let_go_are_freed_while_the_handle_is_in_force(options):
    """The fused update's layer on each update rule held the rule strongly,
    and the rule's dispatch point kept it: every optimizer a process made
    and let go kept its rules and their state (MomentumSGD's velocity, the
    model's size) while fused_update was in force (a review: a sweep of
    models in one process grows by a model each)."""
    import weakref

    import numpy
    import chainer.functions as F
    from chainer import training

    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.c = L.Convolution2D(1, 4, 3)
                self.bn = L.BatchNormalization(4)
                self.fc = L.Linear(None, 3)

        def forward(self, x):
            return self.fc(F.relu(self.bn(self.c(x))))

    options = dict({'loader_workers': 0}, **options)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        handle = fastchain.enable(**options)
    try:
        x = numpy.random.RandomState(1).randn(16, 1, 6, 6).astype(chainer.get_dtype())
        t = numpy.arange(16, dtype=numpy.int32) % 3
        refs = []
        for _ in range(2):
            model = L.Classifier(Net())
            opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
            it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), 8)
            updater = training.StandardUpdater(it, opt)
            for _ in range(3):
                updater.update()
            refs += [('model', weakref.ref(model)), ('optimizer', weakref.ref(opt)),
                     ('update rule', weakref.ref(model.predictor.c.W.update_rule)),
                     ('updater', weakref.ref(updater))]
            if hasattr(it, 'finalize'):
                it.finalize()
            del model, opt, it, updater
        gc.collect()
        assert sorted({name for name, ref in refs if ref() is not None}) == []
    finally:
        handle.disable()
