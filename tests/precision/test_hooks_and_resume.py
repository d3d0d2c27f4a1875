"""fp16 with loss scaling: optimizer hooks see unscaled gradients, and a run
resumed from a snapshot continues bit for bit (issue #17, cases 5 and 6)."""

import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
from chainer import optimizer_hooks, serializers

import fastchain
from fastchain.config import FastchainWarning
from fastchain.precision import scaler_of

from tests.precision.test_fp16_training import CNN

# fp16 has 11 significant bits: two runs whose gradients differ only by
# rounding in fp16 agree to a few units of 2**-10 relative to the model's
# largest weight (measured here: at most 2.1 units after 6 steps).
FP16_ULPS = 4 * 2.0 ** -10


def fp16_enable(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FastchainWarning)   # "slower on CPU"
        return fastchain.enable(fp16=True, loader_workers=0, **kwargs)


def batches(n, seed=0):
    rng = numpy.random.RandomState(seed)
    for _ in range(n):
        x = rng.normal(0, 1, (8, 1, 8, 8)).astype(numpy.float32)
        t = rng.randint(0, 3, 8).astype(numpy.int32)
        yield x, t


def step(model, optimizer, x, t):
    dtype = model.conv.W.dtype
    optimizer.update(lambda: F.softmax_cross_entropy(model(x.astype(dtype)), t))


class Seen:
    """An optimizer hook that records the gradient norm it is given."""

    name = 'seen'
    timing = 'pre'
    call_for_each_param = False

    def __init__(self):
        self.norms = []

    def __call__(self, optimizer):
        sq = sum(float(numpy.sum(numpy.square(p.grad.astype(numpy.float64))))
                 for p in optimizer.target.params())
        self.norms.append(sq ** 0.5)


def reference_fp16(hooks, steps, lr=0.1):
    """Plain Chainer, the same fp16 model and fp32 masters, no loss scaling:
    what the hooks should see (gradients in their own scale)."""
    numpy.random.seed(0)
    with chainer.using_config('dtype', chainer.mixed16):
        model = CNN()
    opt = chainer.optimizers.MomentumSGD(lr).setup(model)
    opt.use_fp32_update()
    for hook in hooks:
        opt.add_hook(hook)
    for x, t in batches(steps):
        step(model, opt, x, t)
    return model, opt


@pytest.mark.parametrize('make_hook', [
    lambda: optimizer_hooks.GradientClipping(0.5),
    lambda: optimizer_hooks.WeightDecay(1e-2),
])
def test_hooks_see_unscaled_gradients_and_training_goes_on(make_hook):
    seen_ref = Seen()
    ref, _ = reference_fp16([make_hook(), seen_ref], steps=6)
    seen = Seen()
    with fp16_enable():
        numpy.random.seed(0)
        model = CNN()
        opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
        opt.add_hook(make_hook())
        opt.add_hook(seen)
        initial = {n: p.array.copy() for n, p in model.namedparams()}
        for x, t in batches(6):
            step(model, opt, x, t)
        scaler = scaler_of(opt)
    assert scaler.skipped_steps == 0 and scaler.steps == 6
    # The hook saw the gradients in their own scale, not x2**15 (or inf).
    numpy.testing.assert_allclose(seen.norms, seen_ref.norms, rtol=0.05)
    scale = max(float(numpy.abs(q.array).max()) for q in ref.params())
    for name, p in model.namedparams():
        assert not numpy.array_equal(p.array, initial[name]), name + ' never moved'
        q = dict(ref.namedparams())[name]
        numpy.testing.assert_allclose(p.array.astype(numpy.float32),
                                      q.array.astype(numpy.float32), rtol=0,
                                      atol=FP16_ULPS * scale, err_msg=name)


def test_without_hooks_the_update_is_bitwise_chainers_own_unscaling():
    """Unscaling early is the arithmetic Chainer's UpdateRule does later:
    with the same scale, the weights are the same bits."""
    def run(early):
        numpy.random.seed(0)
        with chainer.using_config('dtype', chainer.mixed16):
            model = CNN()
        if early:
            with fp16_enable(loss_scale={'init_scale': 1024.0, 'growth_interval': 10**6}):
                opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
                for x, t in batches(5):
                    step(model, opt, x, t)
                assert scaler_of(opt).skipped_steps == 0
        else:
            opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
            opt.use_fp32_update()
            opt.set_loss_scale(1024.0)       # Chainer's static loss scaling
            for x, t in batches(5):
                step(model, opt, x, t)
        return {n: (p.array, p.update_rule._fp32_param.array
                    if p.update_rule._fp32_param is not None else None)
                for n, p in model.namedparams()}
    ours, chainers = run(True), run(False)
    for name in chainers:
        numpy.testing.assert_array_equal(ours[name][0], chainers[name][0], err_msg=name)
        if chainers[name][1] is not None:
            numpy.testing.assert_array_equal(ours[name][1], chainers[name][1],
                                             err_msg=name + ' (master)')


class LazyCNN(CNN):
    """Its fully connected layer is made on its first call (``L.Linear(None, n)``)."""

    def __init__(self):
        chainer.Chain.__init__(self)
        with self.init_scope():
            self.conv = chainer.links.Convolution2D(1, 8, 3, pad=1)
            self.bn = chainer.links.BatchNormalization(8)
            self.fc = chainer.links.Linear(None, 3)


@pytest.mark.parametrize('make, optimizer_first, loss_scale', [
    (CNN, False, 'dynamic'), (LazyCNN, False, 'dynamic'), (LazyCNN, True, 'dynamic'),
    (CNN, False, False)],
    ids=['sized', 'lazy, the model loaded first', 'lazy, the optimizer loaded first',
         'loss_scale=False'])
def test_a_resumed_fp16_run_continues_bit_for_bit(tmp_path, make, optimizer_first,
                                                  loss_scale):
    """The optimizer loaded first, as StandardUpdater.serialize does, meets
    the lazy layer's parameters not made yet: their masters in the snapshot
    were left unread, and made anew from the fp16 weights (a new-user trial).
    With loss_scale=False (fp32 masters only) the snapshot held no masters:
    the resumed run made them from the fp16 weights, 1.9e-4 off after 3
    steps, nothing said (a review)."""
    def fresh():
        numpy.random.seed(0)
        model = make()
        return model, chainer.optimizers.MomentumSGD(0.1).setup(model)

    data = list(batches(8, seed=3))
    with fp16_enable(loss_scale=loss_scale):
        model, opt = fresh()
        for x, t in data:
            step(model, opt, x, t)
        straight = {n: p.array.copy() for n, p in model.namedparams()}
        masters = {n: p.update_rule._fp32_param.array.copy()
                   for n, p in model.namedparams() if p.update_rule._fp32_param is not None}

        model, opt = fresh()
        for x, t in data[:4]:
            step(model, opt, x, t)
        serializers.save_npz(str(tmp_path / 'model.npz'), model)
        serializers.save_npz(str(tmp_path / 'opt.npz'), opt)

        model, opt = fresh()
        for target, name in sorted([(model, 'model.npz'), (opt, 'opt.npz')],
                                   key=lambda pair: (pair[1] == 'model.npz') == optimizer_first):
            serializers.load_npz(str(tmp_path / name), target)
        for x, t in data[4:]:
            step(model, opt, x, t)
    assert 'fc/W' in ''.join(masters), 'fp16 parameters should have fp32 masters'
    for name, p in model.namedparams():
        numpy.testing.assert_array_equal(p.array, straight[name], err_msg=name)
        if name in masters:
            numpy.testing.assert_array_equal(p.update_rule._fp32_param.array, masters[name],
                                             err_msg=name + ' (master)')


@pytest.mark.parametrize('make_optimizer', [chainer.optimizers.Adam,
                                            lambda: chainer.optimizers.MomentumSGD(0.1)])
def test_a_snapshot_before_the_first_step_taken_loads_and_goes_on_bit_for_bit(tmp_path,
                                                                          make_optimizer):
    """The scaler skipped every step before the snapshot: the update rules
    had no state to save, and Chainer's load looked for it (KeyError 'W/m is
    not a file in the archive', where the same run in fp32 loads; a fuzzer)."""
    def fresh():
        numpy.random.seed(0)
        model = CNN()
        return model, make_optimizer().setup(model)

    def overflowing(model, optimizer, x, t):    # a gradient beyond float16
        optimizer.update(lambda: F.softmax_cross_entropy(
            model(x.astype(numpy.float16)), t) * numpy.float16(6e4))

    data = list(batches(4, seed=5))
    with fp16_enable():
        model, opt = fresh()
        overflowing(model, opt, *data[0])
        for x, t in data[1:]:
            step(model, opt, x, t)
        assert scaler_of(opt).skipped_steps == 1
        straight = {n: p.array.copy() for n, p in model.namedparams()}

        model, opt = fresh()
        overflowing(model, opt, *data[0])
        assert not scaler_of(opt).stepped and model.conv.W.update_rule.state is None
        serializers.save_npz(str(tmp_path / 'model.npz'), model)
        serializers.save_npz(str(tmp_path / 'opt.npz'), opt)

        model, opt = fresh()
        with warnings.catch_warnings():
            warnings.simplefilter('error', FastchainWarning)    # nothing is missing
            serializers.load_npz(str(tmp_path / 'opt.npz'), opt)
        serializers.load_npz(str(tmp_path / 'model.npz'), model)
        assert model.conv.W.update_rule.enabled             # as it was
        for x, t in data[1:]:
            step(model, opt, x, t)
        for name, p in model.namedparams():
            numpy.testing.assert_array_equal(p.array, straight[name], err_msg=name)
        # Going back to it, the rules' state made since is dropped, as the
        # run saved had none (a review: KeyError after the rules had state)
        serializers.load_npz(str(tmp_path / 'opt.npz'), opt)
        serializers.load_npz(str(tmp_path / 'model.npz'), model)
        assert model.conv.W.update_rule.state is None
        for x, t in data[1:]:
            step(model, opt, x, t)
    for name, p in model.namedparams():
        numpy.testing.assert_array_equal(p.array, straight[name], err_msg=name)
    with numpy.load(str(tmp_path / 'opt.npz')) as f:       # none was saved
        assert not any(k.endswith('/m') or k.endswith('/v') for k in f.files)
    # A rule updated before the snapshot whose state is not in the file is
    # still Chainer's KeyError (a damaged snapshot is not taken for this).
    with fp16_enable():
        model, opt = fresh()
        for x, t in data[:2]:
            step(model, opt, x, t)
        serializers.save_npz(str(tmp_path / 'later.npz'), opt)
        with numpy.load(str(tmp_path / 'later.npz')) as f:
            kept = {k: f[k] for k in f.files if not k.startswith('conv/W/')
                    or k.endswith('/t')}
        numpy.savez(str(tmp_path / 'damaged.npz'), **kept)
        model, opt = fresh()
        with pytest.raises(KeyError, match='conv/W/'):
            serializers.load_npz(str(tmp_path / 'damaged.npz'), opt)


def plain_fp16_snapshot(path):
    """An fp16 model and plain Chainer's optimizer snapshot after one step
    (fp32 masters, no fastchain state); returns (model, x, t)."""
    numpy.random.seed(0)
    with chainer.using_config('dtype', chainer.mixed16):
        model = CNN()
    plain = chainer.optimizers.MomentumSGD(0.1).setup(model)
    plain.use_fp32_update()
    x, t = next(batches(1))
    step(model, plain, x, t)
    serializers.save_npz(path, plain)
    return model, x, t


def test_a_snapshot_without_masters_warns_and_starts_them_from_the_weights(tmp_path):
    model, _, _ = plain_fp16_snapshot(str(tmp_path / 'opt.npz'))
    with fp16_enable():
        opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
        with pytest.warns(UserWarning, match='no loss-scaler state .* and no fp32 master'):
            serializers.load_npz(str(tmp_path / 'opt.npz'), opt)


def _sgd_step_moves_by_lr_times_grad(model, optimizer, backward):
    """One step of a script's own loop; returns (step taken, lr * gradient)."""
    x, t = next(batches(1))
    model.cleargrads()
    loss = F.softmax_cross_entropy(model(x.astype(model.fc.W.dtype)), t)
    backward(loss)
    grad = model.fc.b.grad.astype(numpy.float64)
    scale = optimizer._loss_scale if getattr(backward, 'scaled', False) else 1.0
    before = model.fc.b.array.astype(numpy.float64)
    optimizer.update()
    return model.fc.b.array.astype(numpy.float64) - before, -0.5 * grad / scale


@pytest.mark.parametrize('cached', [False, True])
def test_a_scripts_own_loop_is_unscaled_by_the_scale_its_backward_used(cached):
    """loss.backward(); optimizer.update(): the gradients carry no scale, and
    must not be divided by one (they were, by 2**15: no learning, no warning)."""
    with fp16_enable():
        numpy.random.seed(0)
        model = CNN()
        if cached:
            fastchain.static_graph(model)
        opt = chainer.optimizers.SGD(0.5).setup(model)

        def plain(loss):
            loss.backward()

        def scaled(loss):
            loss.backward(loss_scale=opt._loss_scale)
        scaled.scaled = True
        with pytest.warns(fastchain.FastchainWarning, match='not loss-scaled'):
            moved, expected = _sgd_step_moves_by_lr_times_grad(model, opt, plain)
        numpy.testing.assert_allclose(moved, expected, rtol=0.01, atol=1e-3)
        moved, expected = _sgd_step_moves_by_lr_times_grad(model, opt, scaled)
        numpy.testing.assert_allclose(moved, expected, rtol=0.01, atol=1e-3)


def test_a_non_strict_load_of_a_snapshot_without_masters_keeps_them_and_says_so(tmp_path):
    model, x, t = plain_fp16_snapshot(str(tmp_path / 'opt.npz'))
    with fp16_enable():
        opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
        step(model, opt, x, t)
        masters = {n: p.update_rule._fp32_param.array.copy() for n, p in model.namedparams()
                   if p.update_rule._fp32_param is not None}
        with pytest.warns(UserWarning) as record:
            serializers.load_npz(str(tmp_path / 'opt.npz'), opt, strict=False)
        text = ' '.join(str(w.message) for w in record)
        assert 'fp32 master weights' in text and 'loss-scaler' not in text
        for name, p in model.namedparams():
            if name in masters:
                numpy.testing.assert_array_equal(p.update_rule._fp32_param.array,
                                                 masters[name], err_msg=name)


def _one_weight(seed_value=0.0):
    import chainer.links as L
    link = L.Linear(1, 1, nobias=True, initialW=numpy.full((1, 1), seed_value, 'f'))
    link.to_device('@numpy')
    return link


@pytest.mark.parametrize('between', [None, 'unrelated'])
def test_each_optimizers_gradients_are_unscaled_by_their_own_backwards_scale(between):
    """Two optimizers' backwards first (scales 1024 and 256), then their
    updates; or an unrelated unscaled backward before the update. The scale
    of the last backward in the thread was applied to every parameter: one
    optimizer's gradients were divided by the other's scale (a 4x step) and
    the unrelated backward cancelled the unscaling (a 1024x step)."""
    with fp16_enable(loss_scale={'init_scale': 1024.0}) as handle:
        g, d = _one_weight(), _one_weight()
        og = chainer.optimizers.SGD(1.0).setup(g)
        od = chainer.optimizers.SGD(1.0).setup(d)
        scaler_of(od).scale = od._loss_scale = 256.0
        x = numpy.full((1, 1), 2.0, numpy.float16)      # d sum(W x) / dW = 2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            for link, opt in ((g, og), (d, od)):
                link.cleargrads()
                F.sum(link(x)).backward(loss_scale=opt._loss_scale)
            if between == 'unrelated':
                v = chainer.Variable(numpy.ones(1, numpy.float16))
                F.sum(v * v).backward()         # a monitoring gradient, not the model's
            og.update()
            od.update()
        assert not [w for w in caught if 'not loss-scaled' in str(w.message)]
        assert g.W.array.item() == -2.0 and d.W.array.item() == -2.0
    assert not handle.active


def test_the_scale_does_not_grow_past_what_a_float16_loss_can_carry():
    """A float16 loss seeds its backward with ones * scale in float16: 2**16
    is inf, so every growth past 2**15 was a skipped step."""
    from tests.precision.test_fp16_training import CNN
    with fp16_enable(loss_scale={'growth_interval': 2}):
        numpy.random.seed(0)
        model = chainer.links.Classifier(CNN())
        opt = chainer.optimizers.SGD(0.01).setup(model)
        for x, t in batches(7):
            opt.update(model, x.astype(numpy.float16), t)
        scaler = scaler_of(opt)
        assert (scaler.scale, scaler.skipped_steps) == (2.0 ** 15, 0)
    # a float32 loss carries more: the scale grows past 2**15 there
    with fp16_enable(loss_scale={'growth_interval': 2}):
        numpy.random.seed(0)
        model = CNN()
        opt = chainer.optimizers.SGD(0.01).setup(model)
        scales = []
        for x, t in batches(5):
            model.cleargrads()
            loss = F.softmax_cross_entropy(F.cast(model(x.astype(numpy.float16)), 'f'), t)
            loss.backward(loss_scale=opt._loss_scale)
            opt.update()
            scales.append(opt._loss_scale)
        assert max(scales) > 2.0 ** 15, scales


def test_a_skipped_step_that_left_nan_in_running_statistics_says_so():
    import chainer.links as L

    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.l = L.Linear(4, 8)
                self.bn = L.BatchNormalization(8)
                self.o = L.Linear(8, 3)

        def forward(self, x):
            return self.o(F.relu(self.bn(self.l(x))))
    with fp16_enable():
        numpy.random.seed(0)
        model = L.Classifier(Net())
        opt = chainer.optimizers.SGD(0.1).setup(model)
        x = numpy.random.randn(8, 4).astype(numpy.float16)
        t = numpy.zeros(8, numpy.int32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            opt.update(model, x, t)
            opt.update(model, x * numpy.float16(3e4), t)     # overflows: skipped
            opt.update(model, x * numpy.float16(3e4), t)     # said once
        said = [str(w.message) for w in caught if 'running statistics' in str(w.message)]
        assert not scaler_of(opt).stepped and len(said) == 1
        assert 'inf/NaN into /predictor/bn/avg_mean, /predictor/bn/avg_var' in said[0]


def test_a_fixed_scale_is_shown_as_the_dict_that_gives_it():
    with pytest.raises(ValueError, match=r"a fixed scale is the dict \{'init_scale': 128.0, "
                                         r"'min_scale': 128.0, 'max_scale': 128.0\}"):
        fastchain.enable(fp16=True, loss_scale=128.0)


@pytest.mark.parametrize('own', ['loss_scaling()', 'set_loss_scale(128)', '_loss_scale = 128'])
def test_the_scripts_own_loss_scaling_is_replaced_and_said_once(own):
    """Chainer's own loss scaling set on an optimizer the scaler scales was
    replaced without a word (a new-user trial)."""
    with fp16_enable():
        numpy.random.seed(0)
        model = CNN()
        opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
        data = list(batches(4))
        with warnings.catch_warnings():
            warnings.simplefilter('error', FastchainWarning)
            step(model, opt, *data[0])          # the scaler's own: nothing said
        if own == 'loss_scaling()':
            opt.loss_scaling()
        elif own == 'set_loss_scale(128)':
            opt.set_loss_scale(128)
        else:
            opt._loss_scale = 128
        with pytest.warns(FastchainWarning, match='replaced by its scale') as caught:
            for x, t in data[1:]:
                step(model, opt, x, t)
        assert opt._loss_scale == scaler_of(opt).scale and scaler_of(opt).steps == 4
    assert sum('replaced by its scale' in str(w.message) for w in caught) == 1


class Spy(optimizer_hooks.WeightDecay):
    """A weight decay that records the dtypes of the weight and gradient it
    is given, per parameter."""

    def __init__(self, rate):
        super().__init__(rate)
        self.seen = {}

    def __call__(self, rule, param):
        self.seen[param.name] = (param.array.dtype, param.grad.dtype)
        return super().__call__(rule, param)


@pytest.mark.parametrize('hook', ['WeightDecay', 'Lasso'])
def test_a_per_parameter_hook_sees_the_fp32_master_and_decays_it_exactly(hook):
    """The hooks saw the fp16 weight with the fp32 gradient: on a GPU,
    Chainer's WeightDecay and Lasso kernels take one type for both and
    raise; on the CPU, rate * weight in float16 is subnormal (a weight decay
    2% off per element, 2.4% of them lost; a review). They now see the fp32
    master: a step of a zero data gradient is the decay alone, computed in
    float32 as an fp32 run's would be."""
    rate = 1e-4
    with fp16_enable(loss_scale={'init_scale': 1024.0}):
        numpy.random.seed(0)
        import chainer.links as L
        model = L.Linear(64, 64, nobias=True, initialW=chainer.initializers.Normal(0.01))
        assert model.W.dtype == numpy.float16
        opt = chainer.optimizers.SGD(1.0).setup(model)
        spy = Spy(rate) if hook == 'WeightDecay' else None
        opt.add_hook(spy if spy is not None else optimizer_hooks.Lasso(rate))
        x = numpy.zeros((2, 64), numpy.float16)
        w0 = model.W.array.astype(numpy.float32)
        opt.update(lambda: F.sum(model(x)) * 0)     # zero data gradient
        first = model.W.update_rule._fp32_param.array.copy()
        opt.update(lambda: F.sum(model(x)) * 0)
    if spy is not None:
        assert spy.seen == {'W': (numpy.dtype(numpy.float32), numpy.dtype(numpy.float32))}
    for master, start in ((first, w0), (model.W.update_rule._fp32_param.array, first)):
        grad = numpy.zeros_like(start)
        grad += rate * (start if hook == 'WeightDecay' else numpy.sign(start))
        numpy.testing.assert_array_equal(master, start - 1.0 * grad)
    assert model.W.array.dtype == numpy.float16       # its own array back after the hooks


def test_a_parameter_two_links_hold_is_unscaled_once():
    """target.params() lists a tied parameter twice: its fp32 gradient was
    divided by the scale a second time (a step 1/scale of Chainer's). Against
    Chainer's own fp16 at the same fixed scale: bitwise."""
    import chainer.links as L

    class Tied(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.a = L.Linear(4, 4)
                self.b = L.Linear(4, 4)
                self.b.W = self.a.W

        def forward(self, x):
            return self.b(F.relu(self.a(x)))

    scale = 1024.0
    rng = numpy.random.RandomState(1)
    data = [(rng.normal(size=(8, 4)).astype(numpy.float16),
             rng.randint(0, 4, 8).astype(numpy.int32)) for _ in range(3)]

    def run(fast):
        numpy.random.seed(0)
        if fast:
            handle = fp16_enable(loss_scale={'init_scale': scale, 'min_scale': scale,
                                             'max_scale': scale})
            model = Tied()
            opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
        else:
            handle = None
            with chainer.using_config('dtype', chainer.mixed16):
                model = Tied()
            opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
            opt.use_fp32_update()
            opt.set_loss_scale(scale)
        assert sum(p is model.a.W for p in model.params()) == 2
        for x, t in data:
            opt.update(lambda: F.softmax_cross_entropy(model(x), t))
        if handle is not None:
            handle.disable()
        return {n: (p.array, p.update_rule._fp32_param.array) for n, p in model.namedparams()}

    plain, fast = run(False), run(True)
    for name in plain:
        numpy.testing.assert_array_equal(fast[name][0], plain[name][0], err_msg=name)
        numpy.testing.assert_array_equal(fast[name][1], plain[name][1], err_msg=name)


def test_going_back_to_a_snapshot_without_masters_takes_its_weights(tmp_path):
    """A snapshot without masters (plain Chainer's) loaded into objects that
    trained on, the optimizer first and then the model, as StandardUpdater
    does: the masters of the run going on were kept, and the next update
    undid the load (W jumped back to the run's weights, said 'copied from
    the fp16 weights'; a review). Now the next update goes on from the
    snapshot's weights as a fresh process's load would."""
    model, x, t = plain_fp16_snapshot(str(tmp_path / 'opt.npz'))
    serializers.save_npz(str(tmp_path / 'model.npz'), model)
    after = {}
    for going_back in (False, True):
        with fp16_enable():
            numpy.random.seed(1)
            model = CNN()
            opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
            if going_back:
                for x2, t2 in batches(3, seed=5):
                    step(model, opt, x2, t2)
            with pytest.warns(FastchainWarning, match='no fp32 master weights of conv/W'):
                serializers.load_npz(str(tmp_path / 'opt.npz'), opt)
            serializers.load_npz(str(tmp_path / 'model.npz'), model)
            step(model, opt, x, t)
        after[going_back] = {n: p.array.copy() for n, p in model.namedparams()}
    for name, array in after[False].items():
        numpy.testing.assert_array_equal(after[True][name], array, err_msg=name)


def test_a_master_missing_for_one_parameter_leaves_the_others_loaded(tmp_path):
    """One parameter without a master in the snapshot (a lazy layer made
    after it was taken) stopped the load of every master after it: those
    kept the run's values under the snapshot's fp16 weights (0.32 apart)."""
    import chainer.links as L

    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.l1 = L.Linear(None, 5)
                self.l2 = L.Linear(5, 3)

        def forward(self, h):
            return self.l2(F.relu(self.l1(h)))

    rng = numpy.random.RandomState(0)
    x = rng.normal(size=(8, 4)).astype(numpy.float16)
    t = rng.randint(0, 3, 8).astype(numpy.int32)
    with fp16_enable():
        numpy.random.seed(0)
        model = Net()
        opt = chainer.optimizers.SGD(0.5).setup(model)
        serializers.save_npz(str(tmp_path / 'model.npz'), model)
        serializers.save_npz(str(tmp_path / 'opt.npz'), opt)    # l1 not made yet
        for _ in range(3):
            opt.update(lambda: F.softmax_cross_entropy(model(x), t))
        serializers.load_npz(str(tmp_path / 'model.npz'), model)
        with pytest.warns(FastchainWarning, match=r'no fp32 master weight of l1/W \('):
            serializers.load_npz(str(tmp_path / 'opt.npz'), opt)
        for name in ('W', 'b'):
            p = getattr(model.l2, name)
            numpy.testing.assert_array_equal(p.update_rule._fp32_param.array,
                                             p.array.astype(numpy.float32), err_msg=name)


@pytest.mark.parametrize('options, message', [
    ({'growth_factor': '2'}, 'growth_factor must be a finite number > 1'),
    ({'init_scale': 2 ** 1100}, 'init_scale must be a finite number > 0'),
    ({'backoff_factor': 1.0}, r'backoff_factor must be a finite number in \(0, 1\)'),
    ({'growth_interval': 10.0}, 'growth_interval must be an int >= 1'),
])
def test_a_wrong_scaler_setting_names_the_setting(options, message):
    with pytest.raises(ValueError, match=message):
        fastchain.enable(fp16=True, loss_scale=options)


def test_numpy_numbers_are_scaler_settings_as_python_numbers_are():
    """numpy.float32(1024) was refused as 'must be a positive finite number'
    and numpy.int64(10) as 'must be an int' (a review)."""
    from fastchain.precision import DynamicLossScaler
    scaler = DynamicLossScaler(init_scale=numpy.float32(1024), growth_interval=numpy.int64(10),
                               backoff_factor=numpy.float32(0.5))
    assert (scaler.scale, scaler.growth_interval, scaler.backoff_factor) == (1024.0, 10, 0.5)
    assert type(scaler.growth_interval) is int and type(scaler.scale) is float


@pytest.mark.gpu
def test_weight_decay_and_lasso_run_on_a_gpu_under_fp16():
    """Chainer's WeightDecay and Lasso kernels on a GPU take the weight and
    the gradient as one type: given the fp16 weight and the fp32 gradient
    they raised TypeError at the first update (found reading the code; the
    hooks now see the fp32 master)."""
    import chainer.links as L
    import cupy
    rate = 1e-4
    with fp16_enable(loss_scale={'init_scale': 1024.0}):
        model = L.Linear(64, 64, nobias=True, initialW=chainer.initializers.Normal(0.01))
        model.to_device('@cupy:0')
        opt = chainer.optimizers.SGD(1.0).setup(model)
        opt.add_hook(optimizer_hooks.WeightDecay(rate))
        opt.add_hook(optimizer_hooks.Lasso(rate))
        x = cupy.zeros((2, 64), cupy.float16)
        w0 = model.W.array.astype(cupy.float32)
        opt.update(lambda: F.sum(model(x)) * 0)
        master = model.W.update_rule._fp32_param.array
    expected = w0 - (rate * w0 + rate * cupy.sign(w0))
    assert float(cupy.abs(master - expected).max()) <= 1e-9


@pytest.mark.parametrize('loss_scale', ['dynamic', False])
def test_an_hdf5_snapshot_without_masters_loads_and_says_so(tmp_path, loss_scale):
    """HDF5's deserializer gives a missing section as one that raises
    ValueError ('Inexistent group is specified') when read, not KeyError:
    a plain Chainer HDF5 snapshot did not load (a review)."""
    pytest.importorskip('h5py')
    model, x, t = plain_fp16_snapshot(str(tmp_path / 'unused.npz'))
    plain = chainer.optimizers.MomentumSGD(0.1).setup(model)
    plain.use_fp32_update()
    step(model, plain, x, t)
    serializers.save_hdf5(str(tmp_path / 'opt.h5'), plain)
    with fp16_enable(loss_scale=loss_scale):
        opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
        with pytest.warns(FastchainWarning, match='no .*fp32 master weights of conv/W'):
            serializers.load_hdf5(str(tmp_path / 'opt.h5'), opt)
        step(model, opt, x, t)
    assert opt.t == 2


def test_a_hook_called_with_the_optimizer_sees_the_model_as_it_is():
    """A 'pre' hook that runs the model (a probe) worked on the fp16 model;
    the masters must not be put in the model for hooks (a review: an
    InvalidType once they were)."""
    seen = []

    def probe(optimizer):
        model = optimizer.target
        seen.append(model(numpy.ones((2, 1, 8, 8), numpy.float16)).dtype)

    with fp16_enable():
        numpy.random.seed(0)
        model = CNN()
        opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
        opt.add_hook(probe, name='probe')
        opt.add_hook(optimizer_hooks.WeightDecay(1e-4))
        for x, t in batches(2):
            step(model, opt, x, t)
    assert seen == [numpy.dtype(numpy.float16)] * 2


def test_a_save_right_after_going_back_keeps_the_loaded_weights(tmp_path):
    """Loaded without masters (optimizer, then model) and saved before the
    next update: the run's master was saved beside the loaded weight, and a
    run resumed from that snapshot undid the load (1.21 off; a review). The
    check of a kept master runs at a save too; a rule let go is not kept
    alive by it."""
    import gc
    import weakref
    from fastchain.precision import _snapshot
    model, x, t = plain_fp16_snapshot(str(tmp_path / 'opt.npz'))
    serializers.save_npz(str(tmp_path / 'model.npz'), model)
    with fp16_enable():
        numpy.random.seed(1)
        model = CNN()
        opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
        for x2, t2 in batches(3, seed=5):
            step(model, opt, x2, t2)
        with pytest.warns(FastchainWarning):
            serializers.load_npz(str(tmp_path / 'opt.npz'), opt)
        serializers.load_npz(str(tmp_path / 'model.npz'), model)
        serializers.save_npz(str(tmp_path / 'again.npz'), opt)
        saved = numpy.load(str(tmp_path / 'again.npz'))
        for name, p in model.namedparams():
            key = 'fastchain_fp32_masters/' + name.lstrip('/').replace('/', '.')
            if p.dtype == numpy.float16:
                numpy.testing.assert_array_equal(saved[key].astype(numpy.float16), p.array,
                                                 err_msg=name)
        # a load lacking masters into rules that have some, then the objects let go
        step(model, opt, x, t)
        with pytest.warns(FastchainWarning):
            serializers.load_npz(str(tmp_path / 'opt.npz'), opt)
        assert len(_snapshot._unverified) > 0
        rule = weakref.ref(model.fc.W.update_rule)
        del model, opt, p
        gc.collect()
        assert rule() is None and len(_snapshot._unverified) == 0


def test_a_per_parameter_hook_reads_the_rule_and_gets_one_dtype_after_a_cleargrad():
    """The master given to a per-parameter hook had no update_rule (a hook
    reading the learning rate raised AttributeError), and after an earlier
    hook's cleargrad Chainer refills float16 zeros: the next hook got an fp32
    weight with an fp16 gradient (a review)."""
    seen = []

    def scaled_by_lr(rule, param):
        param.grad *= param.update_rule.hyperparam.lr
        seen.append((param.array.dtype, param.grad.dtype))
    scaled_by_lr.call_for_each_param = True

    def clears(rule, param):
        if param.name == 'W':
            param.cleargrad()
    clears.call_for_each_param = True

    with fp16_enable():
        numpy.random.seed(0)
        model = CNN()
        opt = chainer.optimizers.SGD(0.1).setup(model)
        opt.add_hook(clears, name='clears')
        opt.add_hook(scaled_by_lr, name='scaled')
        for x, t in batches(1):
            step(model, opt, x, t)
    assert seen and all(w == g for w, g in seen), seen


def test_a_copy_of_an_optimizer_with_a_fixed_scale_below_the_default_updates():
    """A copy took up its scaler with the default init_scale (2**15) and a
    fixed min_scale = max_scale = 1024: refused at its first update."""
    import copy
    scale = 1024.0
    with fp16_enable(loss_scale={'init_scale': scale, 'min_scale': scale, 'max_scale': scale}):
        numpy.random.seed(0)
        model = CNN()
        opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
        (x, t), = batches(1)
        step(model, opt, x, t)
        other = copy.deepcopy(opt)
        step(model, other, x, t)
        assert other._loss_scale == scale


def _trained(steps=2):
    """A CNN and its MomentumSGD after ``steps`` steps, seeded."""
    numpy.random.seed(0)
    model = CNN()
    opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
    for x, t in batches(steps):
        step(model, opt, x, t)
    return model, opt


@pytest.mark.parametrize('fmt', ['npz', 'hdf5'])
def test_an_fp16_snapshot_loaded_with_fp16_off_says_its_masters_are_not_read(tmp_path, fmt):
    # (a review: the exact fp32 masters were passed over and the model took
    # its float16-rounded weights, silently)
    save, load = {'npz': (serializers.save_npz, serializers.load_npz),
                  'hdf5': (serializers.save_hdf5, serializers.load_hdf5)}[fmt]
    path = str(tmp_path / 'opt')
    with fp16_enable():
        _, opt = _trained()
        save(path, opt)
    numpy.random.seed(0)
    fp32 = CNN()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with fastchain.enable(loader_workers=0):
            load(path, chainer.optimizers.MomentumSGD(0.1).setup(fp32))
            # a snapshot of an fp32 run: nothing to say
            plain = chainer.optimizers.MomentumSGD(0.1).setup(fp32)
            step(fp32, plain, *next(batches(1)))
            save(str(tmp_path / 'plain'), plain)
            load(str(tmp_path / 'plain'), chainer.optimizers.MomentumSGD(0.1).setup(fp32))
    said = [w for w in caught if 'master weights' in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [str(w.message) for w in caught]
    assert 'fp32 master weights of 4 parameters; fp16 is off now' in str(said[0].message)
    assert 'fastchain.enable(fp16=True)' in str(said[0].message)


def test_a_loaded_loss_scale_outside_this_runs_range_is_brought_into_it(tmp_path):
    # (a review: a fixed scale of 128 asked for, the snapshot's 32768 kept
    # for the whole run)
    with fp16_enable():
        numpy.random.seed(0)
        model = CNN()
        opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
        step(model, opt, *next(batches(1)))
        serializers.save_npz(str(tmp_path / 'opt.npz'), opt)
        assert scaler_of(opt).scale > 128
    fixed = {'init_scale': 128, 'min_scale': 128, 'max_scale': 128}
    with fp16_enable(loss_scale=fixed):
        numpy.random.seed(0)
        model = CNN()
        opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
        with pytest.warns(FastchainWarning, match=r"holds \(\d+\) is outside this run's range "
                          r"\[min_scale=128, max_scale=128\]; going on from 128"):
            serializers.load_npz(str(tmp_path / 'opt.npz'), opt)
        for x, t in batches(2, seed=1):
            step(model, opt, x, t)
        assert scaler_of(opt).scale == 128


def test_a_load_that_fails_leaves_the_rules_their_state(tmp_path):
    # (a review: a rule the file says had no state lost its own before
    # Chainer's load, which then raised on the damaged file)
    with fp16_enable():
        model, opt = _trained()
        serializers.save_npz(str(tmp_path / 'opt.npz'), opt)
        with numpy.load(str(tmp_path / 'opt.npz')) as f:
            damaged = {k: f[k] for k in f.files if not k.startswith(('fc/W/', 'conv/W/'))
                       or k.endswith('/t')}
        damaged['conv/W/t'] = numpy.array(0)       # conv/W: saved before its first update
        numpy.savez(str(tmp_path / 'damaged.npz'), **damaged)
        before = {k: v.copy() for k, v in model.conv.W.update_rule.state.items()}
        with pytest.raises(KeyError, match='fc/W/'):
            serializers.load_npz(str(tmp_path / 'damaged.npz'), opt)
        state = model.conv.W.update_rule.state
        assert state is not None and model.conv.W.update_rule.enabled
        for key, value in before.items():
            numpy.testing.assert_array_equal(state[key], value)
