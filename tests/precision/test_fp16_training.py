"""enable(fp16=True) on a plain Chainer Trainer script, on the CPU."""

import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
from chainer.training import extensions

import fastchain
from fastchain.config import FastchainWarning
from fastchain.precision import scaler_of


@pytest.fixture(autouse=True)
def no_handle_left():
    yield
    for h in fastchain.active_handles():
        h.disable()
    assert chainer.config.dtype == numpy.float32


def fp16_enable(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FastchainWarning)   # "slower on CPU"
        return fastchain.enable(fp16=True, **kwargs)


class CNN(chainer.Chain):
    def __init__(self, n_out=3):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(1, 8, 3, pad=1)
            self.bn = L.BatchNormalization(8)
            self.fc = L.Linear(8 * 4 * 4, n_out)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(h)


def dataset(n, seed):
    """Three classes of 8x8 fp32 images: a faint bar in one of 3 places, in
    enough noise that accuracy stays well below 100% (measured: fp32 0.87,
    fp16 0.87 after 4 epochs), so that the comparison can tell them apart."""
    rng = numpy.random.RandomState(seed)
    t = rng.randint(0, 3, n).astype(numpy.int32)
    x = rng.normal(0, 1.0, (n, 1, 8, 8)).astype(numpy.float32)
    for i, c in enumerate(t):
        x[i, 0, :, 2 * c + 1: 2 * c + 3] += 0.5
    return chainer.datasets.TupleDataset(x, t)


def train(out, epochs=4, seed=0, extra=()):
    """The plain script: nothing fastchain-specific in it."""
    numpy.random.seed(seed)
    model = L.Classifier(CNN())
    optimizer = chainer.optimizers.MomentumSGD(lr=0.05).setup(model)
    train_it = chainer.iterators.SerialIterator(dataset(600, seed), 32, shuffle=False)
    test_it = chainer.iterators.SerialIterator(dataset(300, seed + 1), 100,
                                               repeat=False, shuffle=False)
    updater = training.StandardUpdater(train_it, optimizer)
    trainer = training.Trainer(updater, (epochs, 'epoch'), out=str(out))
    trainer.extend(extensions.Evaluator(test_it, model))
    log = extensions.LogReport()
    trainer.extend(log)
    for ext, trigger in extra:
        trainer.extend(ext, trigger=trigger)
    trainer.run()
    return model, optimizer, log.log


def test_fp16_accuracy_matches_fp32_within_tolerance(tmp_path):
    _, _, log32 = train(tmp_path / 'fp32')
    with fp16_enable():
        model, optimizer, log16 = train(tmp_path / 'fp16')
        acc32 = log32[-1]['validation/main/accuracy']
        acc16 = log16[-1]['validation/main/accuracy']
        # Stated tolerance: within 3 points of fp32, and both learned the task
        # (chance is 0.33).
        assert acc32 > 0.8 and acc16 > 0.8
        assert abs(acc16 - acc32) <= 0.03

        cnn = model.predictor
        assert cnn.conv.W.dtype == numpy.float16 and cnn.fc.W.dtype == numpy.float16
        assert cnn.conv.W.update_rule._fp32_param.dtype == numpy.float32
        assert cnn.fc.b.update_rule._fp32_param.dtype == numpy.float32
        assert cnn.bn.gamma.dtype == numpy.float32
        assert cnn.bn.avg_mean.dtype == numpy.float32
        assert cnn.bn.avg_var.dtype == numpy.float32
        assert 'main/loss_scale' in log16[-1]
        assert log16[-1]['main/skipped_steps'] == 0


class PoisonGrad(chainer.FunctionNode):
    """Identity whose backward yields inf or NaN when told to."""

    def __init__(self, value):
        self.value = value

    def forward(self, inputs):
        return inputs[0].copy(),

    def backward(self, indexes, grad_outputs):
        gy, = grad_outputs
        if self.value is None:
            return gy,
        return gy * gy.dtype.type(self.value),


class Poisoned(chainer.Chain):
    def __init__(self):
        super().__init__()
        self.poison = None
        with self.init_scope():
            self.cnn = CNN()

    def forward(self, x):
        h = self.cnn.conv(x)
        h, = PoisonGrad(self.poison).apply((h,))     # reaches conv's W and b
        h = F.max_pooling_2d(F.relu(self.cnn.bn(h)), 2)
        return self.cnn.fc(h)


def weights(model):
    state = {}
    for name, p in model.namedparams():
        state[name] = p.array.copy()
        master = getattr(p.update_rule, '_fp32_param', None)
        if master is not None and master.array is not None:
            state[name + '@fp32'] = master.array.copy()
    return state


def test_inf_and_nan_gradients_never_change_a_weight():
    with fp16_enable(loss_scale={'init_scale': 1024.0, 'growth_interval': 2}):
        net = Poisoned()
        model = L.Classifier(net)
        optimizer = chainer.optimizers.MomentumSGD(lr=0.05).setup(model)
        scaler = scaler_of(optimizer)
        data = dataset(64, 0)
        x, t = chainer.dataset.concat_examples(data[:32])
        x = x.astype(numpy.float16)
        poison = {2: numpy.inf, 3: numpy.nan, 6: -numpy.inf}
        scales = []
        reporter = chainer.Reporter()
        reporter.add_observer('main', model)
        observations = []
        for step in range(9):
            net.poison = poison.get(step)
            before = weights(model)
            obs = {}
            with reporter.scope(obs):
                optimizer.update(model, x, t)
            observations.append(obs)
            scales.append(scaler.scale)
            after = weights(model)
            if step in poison:
                assert scaler.stepped is False
                for name in before:
                    numpy.testing.assert_array_equal(after[name], before[name], name)
                for p in model.params():
                    assert numpy.isfinite(p.array).all()
            else:
                assert scaler.stepped is True
                assert any((after[n] != before[n]).any() for n in before)
        # growth every 2 good steps, halving on each poisoned one
        assert scales == [1024, 2048, 1024, 512, 512, 1024, 512, 512, 1024]
        assert scaler.skipped_steps == 3 and scaler.steps == 6
        assert [float(o['main/skipped_steps']) for o in observations] == \
            [0, 0, 1, 2, 2, 2, 3, 3, 3]
        assert float(observations[-1]['main/loss_scale']) == 1024


def test_snapshot_and_resume_continue_the_scaler(tmp_path):
    with fp16_enable(loss_scale={'init_scale': 256.0, 'growth_interval': 7}):
        model, optimizer, _ = train(tmp_path / 'a', epochs=1)
        scaler = scaler_of(optimizer)
        assert scaler.steps == 19       # 600 / 32 iterations, none skipped
        chainer.serializers.save_npz(str(tmp_path / 'opt.npz'), optimizer)

        model2 = L.Classifier(CNN())
        optimizer2 = chainer.optimizers.MomentumSGD(lr=0.05).setup(model2)
        assert scaler_of(optimizer2).steps == 0
        chainer.serializers.load_npz(str(tmp_path / 'opt.npz'), optimizer2)
        s2 = scaler_of(optimizer2)
        assert s2.state_dict() == scaler.state_dict()
        assert s2.scale == 256.0 * 2 ** (19 // 7)
        assert optimizer2._loss_scale == s2.scale     # seeds the next backward


def test_trainer_snapshot_resume_mid_training(tmp_path):
    with fp16_enable(loss_scale={'init_scale': 64.0, 'growth_interval': 5}):
        snap = extensions.snapshot(filename='snap')
        model, optimizer, _ = train(tmp_path / 'run', epochs=1,
                                    extra=[(snap, (10, 'iteration'))])
        # Resume from the iteration-10 snapshot into a fresh trainer.
        numpy.random.seed(0)
        model2 = L.Classifier(CNN())
        optimizer2 = chainer.optimizers.MomentumSGD(lr=0.05).setup(model2)
        it = chainer.iterators.SerialIterator(dataset(600, 0), 32, shuffle=False)
        trainer = training.Trainer(training.StandardUpdater(it, optimizer2),
                                   (1, 'epoch'), out=str(tmp_path / 'run2'))
        chainer.serializers.load_npz(str(tmp_path / 'run' / 'snap'), trainer)
        s = scaler_of(optimizer2)
        assert (s.steps, s.scale) == (10, 64.0 * 2 ** 2)
        trainer.run()
        assert s.steps == scaler_of(optimizer).steps == 19
        assert s.scale == scaler_of(optimizer).scale


def test_disable_restores_the_plain_script():
    h = fp16_enable()
    h.disable()
    model = L.Classifier(CNN())
    optimizer = chainer.optimizers.MomentumSGD().setup(model)
    assert model.predictor.conv.W.dtype == numpy.float32
    assert scaler_of(optimizer) is None
    assert 'check_nan_in_grads' not in vars(optimizer)
    x, t = chainer.dataset.concat_examples(dataset(4, 0)[:4])
    from chainer.dataset import convert
    out = convert._call_converter(convert.concat_examples, dataset(4, 0)[:4], None)
    assert out[0].dtype == numpy.float32


def test_disable_detaches_an_optimizer_set_up_while_enabled():
    h = fp16_enable()
    model = L.Classifier(CNN())
    optimizer = chainer.optimizers.MomentumSGD().setup(model)
    assert vars(optimizer)['_loss_scale'] == 2.0 ** 15
    h.disable()
    assert '_loss_scale' not in vars(optimizer) and optimizer._loss_scale is None
    assert not any(p.update_rule._use_fp32_update for p in model.params())


@pytest.mark.parametrize('how, loop', [('deepcopy', 'update'), ('pickle', 'update'),
                                       ('copy', 'update'), ('deepcopy', 'own')])
def test_a_copy_of_an_fp16_optimizer_trains_on_as_the_original_would(how, loop):
    """A copy (deepcopy, pickle) was a plain optimizer with the scale frozen:
    an overflowing step put NaN in its weights where the original skipped
    it (a new-user trial). It carries the scaler, taken up at its first
    update: the two go on bit for bit, in ``optimizer.update(lossfun)`` and
    in a script's own loop (``backward(loss_scale=optimizer._loss_scale)``,
    then ``update()``: the copy seeds with the scale of the moment). A
    shallow copy gets a scaler of its own (sharing one, each would step it)."""
    import copy
    import pickle
    with fp16_enable(loss_scale={'init_scale': 2.0 ** 15, 'growth_interval': 2}):
        numpy.random.seed(0)
        model = L.Classifier(L.Linear(4, 3))
        opt = chainer.optimizers.Adam().setup(model)
        rng = numpy.random.RandomState(1)
        x, t = rng.randn(8, 4).astype(numpy.float16), rng.randint(0, 3, 8).astype(numpy.int32)
        big = numpy.full((8, 4), 3000, numpy.float16)  # its gradients overflow float16 scaled
        opt.update(model, x, t)
        if how == 'deepcopy':
            copied = copy.deepcopy((model, opt))
        elif how == 'pickle':
            copied = pickle.loads(pickle.dumps((model, opt)))
        else:
            copied = copy.deepcopy(model), copy.copy(opt)
            copied[1].target = copied[0]        # (a shallow copy shares the target)
        pairs = [(model, opt), copied]
        for batch in (x, big, x, x, x):
            for m, o in pairs:
                if loop == 'update':
                    o.update(m, batch, t)
                else:
                    m.cleargrads()
                    m(batch, t).backward(loss_scale=o._loss_scale)
                    o.update()
        scalers = [scaler_of(o) for _, o in pairs]
    assert scalers[1] is not scalers[0]
    assert scalers[1].state_dict() == scalers[0].state_dict()
    assert scalers[0].skipped_steps == 1 and scalers[0].steps == 5
    (mine, o1), (theirs, o2) = pairs
    for (name, p), (_, q) in zip(sorted(mine.namedparams()), sorted(theirs.namedparams())):
        numpy.testing.assert_array_equal(q.array, p.array, err_msg=name)
        numpy.testing.assert_array_equal(q.update_rule._fp32_param.array,
                                         p.update_rule._fp32_param.array, err_msg=name)
        for key in p.update_rule.state:
            numpy.testing.assert_array_equal(q.update_rule.state[key],
                                             p.update_rule.state[key], err_msg=name + key)
    assert o1.t == o2.t


@pytest.mark.parametrize('own', ['set_loss_scale', 'loss_scaling', 'loss_scaling_default'])
def test_a_copys_own_loss_scaling_is_replaced_saying_so_as_the_originals(own):
    """The script's own Chainer loss scaling set on a copy before its first
    update was dropped without a word, where on the original a warning says
    the scaler's replaces it: now the copy says so too, and the two go on
    alike (a lead of session 35)."""
    import copy
    # (the default: the scaler's growth interval is loss_scaling()'s, 1000, and
    # the copy's words were the set_loss_scale ones: a review)
    interval = {} if own == 'loss_scaling_default' else {'growth_interval': 2}
    with fp16_enable(loss_scale=dict(init_scale=2.0 ** 10, **interval)):
        numpy.random.seed(0)
        model = L.Classifier(L.Linear(4, 3))
        opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
        rng = numpy.random.RandomState(1)
        x, t = rng.randn(8, 4).astype(numpy.float16), rng.randint(0, 3, 8).astype(numpy.int32)
        opt.update(model, x, t)
        pairs = [(model, opt), copy.deepcopy((model, opt))]
        said = []
        for m, o in pairs:
            if own == 'set_loss_scale':
                o.set_loss_scale(64.0)
            else:
                o.loss_scaling(**({} if own == 'loss_scaling_default' else {'interval': 10}))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                for _ in range(3):
                    o.update(m, x, t)
            said.append([str(w.message) for w in caught if issubclass(
                w.category, FastchainWarning) and 'replaced' in str(w.message)])
            assert caught and all(w.filename == __file__ for w in caught
                                  if 'replaced' in str(w.message))
        assert len(said[0]) == 1 and said[1] == said[0]
        assert ('a loss scale of 64.0' if own == 'set_loss_scale' else
                'optimizer.loss_scaling()') in said[0][0]
        (mine, o1), (theirs, o2) = pairs
        assert scaler_of(o2).state_dict() == scaler_of(o1).state_dict()
        for (name, p), (_, q) in zip(sorted(mine.namedparams()), sorted(theirs.namedparams())):
            numpy.testing.assert_array_equal(q.array, p.array, err_msg=name)


def test_a_copy_loading_a_snapshot_before_its_first_update_takes_the_snapshots_state():
    """A copy took up what it carried at its first update, after a load that
    had read Chainer's keys only (the scaler's state and the masters were
    lost, silently). And masters loaded from a snapshot held in memory
    were its arrays: the first optimizer's updates moved the second's
    (reviews helper-65)."""
    import copy
    with fp16_enable(loss_scale={'init_scale': 2.0 ** 10, 'growth_interval': 2}):
        numpy.random.seed(0)
        model = L.Classifier(L.Linear(4, 3))
        opt = chainer.optimizers.SGD(0.3).setup(model)  # (no state Chainer loads as its own)
        rng = numpy.random.RandomState(1)
        x, t = rng.randn(8, 4).astype(numpy.float16), rng.randint(0, 3, 8).astype(numpy.int32)
        opt.update(model, x, t)
        early = copy.deepcopy(opt)
        for _ in range(4):
            opt.update(model, x, t)
        saved, weights = {}, {}
        chainer.serializers.DictionarySerializer(saved).save(opt)
        chainer.serializers.DictionarySerializer(weights).save(model)
        saved = {key: numpy.array(value) for key, value in saved.items()}   # (a copy)
        opt.update(model, x, t)
        want = [p.array.copy() for _, p in sorted(model.namedparams())]
        fresh = chainer.optimizers.SGD(0.3).setup(L.Classifier(L.Linear(4, 3)))
        for other in (fresh, early):
            chainer.serializers.NpzDeserializer(weights).load(other.target)
            chainer.serializers.NpzDeserializer(saved).load(other)
            assert scaler_of(other).state_dict() == {
                'scale': 2.0 ** 12, 'good_steps': 1, 'steps': 5, 'skipped_steps': 0}
            other.update(other.target, x, t)
            for (name, p), w in zip(sorted(other.target.namedparams()), want):
                numpy.testing.assert_array_equal(p.array, w, err_msg=name)


def test_a_copy_set_up_again_leaves_what_it_carried():
    """Its own setup makes it an fp16 optimizer anew: what it carried (with
    Chainer's dynamic loss scaling) is dropped, not taken for the script's
    own loss scaling (a warning said so, wrongly: a review)."""
    import copy
    with fp16_enable():
        model = L.Classifier(L.Linear(4, 3))
        opt = chainer.optimizers.SGD(0.1).setup(model)
        again = copy.deepcopy(opt).setup(copy.deepcopy(model))
        with warnings.catch_warnings():
            warnings.simplefilter('error', FastchainWarning)
            again.update(again.target, numpy.ones((2, 4), numpy.float16),
                         numpy.zeros(2, numpy.int32))
        assert not again._loss_scaling_is_dynamic and scaler_of(again).steps == 1


@pytest.mark.parametrize('where', ['loss_scale=False', 'no fp16'])
def test_a_copy_used_without_the_scaler_scales_as_plain_chainer(where):
    """Taken up where loss_scale=False is in force: fp32 masters only, the
    scaling left to Chainer; used where fp16 is not in force (after
    disable(), or a pickle loaded without fastchain): plain Chainer's own
    dynamic loss scaling at the scale of the moment, which skips an
    overflowing step (a frozen scale put NaN in the weights: a review)."""
    import pickle
    with fp16_enable():
        numpy.random.seed(0)
        model = L.Classifier(L.Linear(4, 3))
        opt = chainer.optimizers.SGD(0.1).setup(model)
        saved = pickle.dumps((model, opt))
        scale = opt._loss_scale
    assert b'fastchain' not in saved.replace(b'_fastchain_loss_scaler', b'')
    big = numpy.full((8, 4), 3000, numpy.float16)  # its gradients overflow float16 scaled
    t = (numpy.arange(8) % 3).astype(numpy.int32)
    handle = fp16_enable(loss_scale=False) if where == 'loss_scale=False' else None
    try:
        model, opt = pickle.loads(saved)
        before = model.predictor.W.array.copy()
        with pytest.warns(UserWarning, match='Non finite number found'):    # Chainer's
            opt.update(model, big, t)
        assert scaler_of(opt) is None and opt._loss_scaling_is_dynamic
        assert opt._loss_scale == scale / 2
        numpy.testing.assert_array_equal(model.predictor.W.array, before)   # skipped
        if handle is not None:
            assert all(p.update_rule._use_fp32_update for p in model.params())
    finally:
        if handle is not None:
            handle.disable()


def test_fp32_masters_only_when_loss_scale_is_false():
    with fp16_enable(loss_scale=False):
        model = L.Classifier(CNN())
        optimizer = chainer.optimizers.MomentumSGD().setup(model)
        assert scaler_of(optimizer) is None
        assert all(p.update_rule._use_fp32_update for p in model.params())


def test_model_built_before_enable_warns():
    model = L.Classifier(CNN())
    with fp16_enable():
        with pytest.warns(UserWarning, match='Build the model after'):
            chainer.optimizers.SGD().setup(model)


def test_a_dtype_this_thread_set_is_named_as_what_hides_fp16():
    """A script's own ``chainer.config.dtype = float32`` (thread-local) hides
    the mixed16 enable() sets in the global config: the report said fp16 was
    active and the warning blamed a model built before enable() (a new-user
    trial)."""
    chainer.config.dtype = numpy.float32
    try:
        with pytest.warns(FastchainWarning, match='fp16 is not in force: chainer.config.dtype '
                          'is float32 in this thread'):
            handle = fastchain.enable(fp16=True, loader_workers=0)
        try:
            state = handle.report()['fp16']
            assert not state['active'] and 'del chainer.config.dtype' in state['why']
            model = L.Classifier(CNN())
            with pytest.warns(FastchainWarning, match=r'no float16 parameters \(chainer.config'
                              r'.dtype is float32 in this thread') as caught:
                chainer.optimizers.SGD().setup(model)
            assert not any('built before' in str(w.message) for w in caught)
            del chainer.config.dtype
            assert handle.report()['fp16']['active']
        finally:
            handle.disable()
    finally:
        if 'dtype' in vars(chainer.config._local):
            del chainer.config.dtype


class _LazyWithBN(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.fc = L.Linear(None, 4, nobias=True)      # made at its first call
            self.bn = L.BatchNormalization(4)             # float32 under mixed16

    def forward(self, x):
        return self.bn(self.fc(x))


@pytest.mark.parametrize('built_before', [False, True])
def test_a_lazily_sized_model_is_not_said_to_train_in_float32(built_before):
    """Its only made parameters are BatchNormalization's, which mixed16 keeps
    in float32; the Linear is made in float16 at its first call either way
    (the warning said 'no float16 parameters' and asked to build it after
    enable(), which it was)."""
    model = L.Classifier(_LazyWithBN()) if built_before else None
    with fp16_enable():
        model = model or L.Classifier(_LazyWithBN())
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            optimizer = chainer.optimizers.SGD().setup(model)
            optimizer.update(model, numpy.ones((2, 3), numpy.float16),
                             numpy.zeros(2, numpy.int32))
        assert model.predictor.fc.W.dtype == numpy.float16


class _DirectConverterUpdater(training.updaters.StandardUpdater):
    """A custom updater calling its converter itself, as Chainer's DCGAN
    example does."""

    def update_core(self):
        x, t = self.converter(self.get_iterator('main').next(), self.device)
        self.get_optimizer('main').update(self.get_optimizer('main').target, x, t)


@pytest.mark.parametrize('how', ['updater', 'loop'])
def test_a_converter_called_directly_gives_fp16_batches_as_the_updater_does(how):
    """A custom updater's self.converter(batch, device) and a loop calling
    concat_examples met the float16 layers with float32 batches (Chainer's
    type error: 'float16 != float32'): they train as StandardUpdater does."""
    from chainer.dataset import concat_examples
    runs = []
    for direct in (False, True):
        with fp16_enable():
            numpy.random.seed(0)
            model = L.Classifier(CNN())
            optimizer = chainer.optimizers.MomentumSGD(lr=0.05).setup(model)
            it = chainer.iterators.SerialIterator(dataset(64, 0), 16, shuffle=False)
            if direct and how == 'loop':
                for _ in range(3):
                    x, t = concat_examples(it.next())
                    assert x.dtype == numpy.float16
                    optimizer.update(model, x, t)
            else:
                kind = _DirectConverterUpdater if direct else training.StandardUpdater
                updater = kind(it, optimizer)
                for _ in range(3):
                    updater.update()
            runs.append(weights(model))
    for name in runs[0]:
        numpy.testing.assert_array_equal(runs[1][name], runs[0][name], err_msg=name)


def test_fp16_on_cpu_warns_once_that_it_is_slower():
    with pytest.warns(FastchainWarning, match='slower') as record:
        h = fastchain.enable(fp16=True)
    h.disable()
    assert len([w for w in record if w.category is FastchainWarning]) == 1


@pytest.mark.gpu
def test_fp16_on_gpu_turns_on_tensor_cores_and_workspace():
    from fastchain.cudnn._group import workspace_accessors
    from fastchain.precision._group import FP16_WORKSPACE
    with fastchain.enable(fp16=True) as h:
        if h.states['cudnn'].available:     # CuPy 13's cuDNN, or the graphs on CuPy 14
            assert chainer.config.use_cudnn_tensor_core == 'auto'
            assert workspace_accessors()[0]() >= FP16_WORKSPACE


def test_a_converter_returning_a_named_tuple_keeps_it():
    """The cast rebuilt every tuple as a plain one: a converter returning a
    namedtuple lost its field names (batch.x raised)."""
    import collections
    from fastchain.precision._group import cast_floating
    Batch = collections.namedtuple('Batch', 'x t')
    cast = cast_floating(Batch(numpy.ones(2, numpy.float32), numpy.zeros(2, numpy.int32)),
                         numpy.float16)
    assert type(cast) is Batch and cast.x.dtype == numpy.float16 and cast.t.dtype == numpy.int32


@pytest.mark.parametrize('when', ['built before', 'set up before'])
def test_a_model_made_before_fp16_is_said_to_fail_at_its_first_step(when):
    """The warning said it 'trains in float32' (or that the optimizer was
    'unchanged'); the batches are cast to float16 all the same, and the
    first step failed with Chainer's type error (a new-user trial)."""
    model = L.Classifier(L.Linear(3, 2))
    optimizer = chainer.optimizers.SGD().setup(model) if when == 'set up before' else None
    with pytest.warns(FastchainWarning, match="first step (will fail|fails) with Chainer's "
                      "'float32 != float16' type error"):
        with fastchain.enable(fp16=True, loader_workers=0):
            optimizer = optimizer or chainer.optimizers.SGD().setup(model)
            batch = chainer.dataset.concat_examples(
                [(numpy.ones(3, numpy.float32), numpy.int32(0))] * 2)
            assert batch[0].dtype == numpy.float16        # cast by the converter
            with pytest.raises(chainer.utils.type_check.InvalidType,
                               match='float32 != float16|float16 != float32'):
                optimizer.update(model, *batch)


def test_a_float32_array_the_script_makes_gets_a_note_naming_the_fix():
    """A GAN's noise made in float32 under fp16: Chainer's type error, as it
    was, with a note on what fp16 changed and chainer.get_dtype(); a type
    error of another kind, or without fp16, gets none."""
    from chainer.utils.type_check import InvalidType
    from fastchain.precision._attach import DTYPE_NOTE

    def step(opt, model, z):
        opt.update(lambda: F.sum(model(z)))

    with fp16_enable():
        gen = L.Linear(4, 3)
        opt = chainer.optimizers.SGD().setup(gen)
        noise = numpy.random.randn(2, 4).astype(numpy.float32)
        with pytest.raises(InvalidType) as e:
            step(opt, gen, noise)
        assert 'float16 != float32' in str(e.value) and e.value.__notes__ == [DTYPE_NOTE]
        step(opt, gen, noise.astype(chainer.get_dtype()))       # the fix
        with pytest.raises(InvalidType) as e:                   # a shape error: no note
            step(opt, gen, numpy.zeros((2, 5), chainer.get_dtype()))
        assert not getattr(e.value, '__notes__', None)
    plain = L.Linear(4, 3)
    opt = chainer.optimizers.SGD().setup(plain)
    with pytest.raises(InvalidType) as e:
        step(opt, plain, numpy.zeros((2, 4), numpy.float16))
    assert not getattr(e.value, '__notes__', None)
