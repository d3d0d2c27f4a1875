"""The cache's verification: forward and backward against define-by-run on
the same batch, leaving no trace, with tolerances that scale with the dtype."""

import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from fastchain.static import StaticGraphFallback, _verify, cache_state, cache_static_graph

from tests.helpers import copies, side_by_side

pytestmark = pytest.mark.usefixtures('fresh_fixes')


class ConvBN(chainer.Chain):
    def __init__(self, dtype=numpy.float32):
        super().__init__()
        init = chainer.initializers.Normal(0.3, dtype=dtype)
        with self.init_scope():
            self.conv = L.Convolution2D(3, 4, 3, pad=1, initialW=init, initial_bias=init)
            self.bn = L.BatchNormalization(4, dtype=dtype)
            self.out = L.Linear(4 * 6 * 6, 3, initialW=init, initial_bias=init)

    def forward(self, x):
        return self.out(F.relu(self.bn(self.conv(x))))


def batches(n=4, count=4, dtype=numpy.float32, seed=0):
    rng = numpy.random.RandomState(seed)
    return [(rng.randn(n, 3, 6, 6).astype(dtype), rng.randint(0, 3, n).astype(numpy.int32))
            for _ in range(count)]


def test_gradients_are_verified_and_a_wrong_backward_is_never_applied(monkeypatch):
    """Without fastchain's BatchNormalization fix the replay's forward is right
    and its gradients are wrong from the second batch: the first replay's
    backward is compared with define-by-run's, which replaces them before the
    update, and the cache falls back."""
    from fastchain.static import _live
    monkeypatch.setattr(_live, 'batch_normalization_backward',
                        lambda next_, *args: next_(*args))
    ordinary, cached = copies(ConvBN)
    cache_static_graph(cached)
    caught = side_by_side(ordinary, cached, batches())
    assert len(caught) == 1 and 'the gradient of parameter' in caught[0]
    assert 'on a later batch' in caught[0] and 'not of the model' in caught[0]
    assert cache_state(cached)['cause'] == 'defect'


def test_input_gradients_are_verified(monkeypatch):
    """A wrong input gradient (the bound deconvolution, made wrong on purpose)
    flowing to layers outside the cached chain is caught on the step that
    records it, and what flows on is define-by-run's."""
    from fastchain.kernels import _bind
    deconvolution = _bind._deconvolution

    def wrong(node, inputs, buffers):
        run = deconvolution(node, inputs, buffers)
        return lambda inputs: (run(inputs)[0] * 1.01,)
    monkeypatch.setattr(_bind, '_deconvolution', wrong)

    class Outer(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.front = L.Linear(3 * 6 * 6, 3 * 6 * 6)
                self.inner = ConvBN()

        def forward(self, x):
            return self.inner(F.reshape(self.front(x), x.shape))
    ordinary, cached = copies(Outer)
    cache_static_graph(cached.inner)
    caught = side_by_side(ordinary, cached, batches())
    assert len(caught) == 1 and 'the gradient of input #1' in caught[0]
    assert cache_state(cached.inner)['cause'] == 'defect'


@pytest.mark.parametrize('as_variable', [False, True])
def test_an_array_input_gets_no_gradient_and_a_variable_keeps_its_own(as_variable):
    """Chainer's static graph makes an array argument a variable that
    requires a gradient and computes it every step, though nobody can read it
    (define-by-run computes none): the cache's backward leaves it out (no
    input gradient of the first convolution), with the same bits for all
    else; a variable that requires a gradient still gets define-by-run's."""
    from tests.helpers import assert_same, schedules
    ordinary, cached = copies(ConvBN)
    cache_static_graph(cached)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphFallback)
        for i, (x, t) in enumerate(batches(count=5)):
            inputs = [chainer.Variable(x.copy()) if as_variable else x for _ in range(2)]
            for model, xi in zip((ordinary, cached), inputs):
                model.cleargrads()
                F.softmax_cross_entropy(model(xi), t).backward()
            if as_variable:
                numpy.testing.assert_array_equal(inputs[1].grad, inputs[0].grad)
            assert_same(ordinary, cached, 'step {}'.format(i))
    assert cache_state(cached)['fallback'] is None
    forward, backward = schedules(cached)
    names = [type(info.function_node).__name__ for info in backward.schedule_info_list]
    # the input gradient of a convolution is a deconvolution; the weight
    # gradient is there either way
    assert ('Deconvolution2DFunction' in names) == as_variable
    assert 'Convolution2DGradW' in names


def test_array_calls_and_variable_calls_of_one_shape_get_their_own_schedules():
    """A critic called on arrays (its input's gradient left out) and then on a
    generator's output (a variable: the generator needs that gradient), after
    the verified steps, as a WGAN trains: the generator gets define-by-run's
    gradients every step."""
    class Pair(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.generator = L.Linear(4, 3 * 6 * 6)
                self.critic = ConvBN()
    ordinary, cached = copies(Pair)
    cache_static_graph(cached.critic)
    rng = numpy.random.RandomState(2)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphFallback)
        for i in range(8):
            real = rng.randn(4, 3, 6, 6).astype(numpy.float32)
            z = rng.randn(4, 4).astype(numpy.float32)
            for model in (ordinary, cached):
                model.cleargrads()
                if i < 5:       # critic steps on arrays, past the verified ones
                    loss = F.sum(model.critic(real))
                else:           # generator steps through the critic
                    fake = F.reshape(model.generator(z), (4, 3, 6, 6))
                    loss = F.sum(model.critic(fake))
                loss.backward()
            for (name, p), (_, q) in zip(sorted(ordinary.namedparams()),
                                         sorted(cached.namedparams())):
                if i >= 5 or not name.startswith('/generator'):
                    numpy.testing.assert_array_equal(
                        q.grad, p.grad, err_msg='step {} {}'.format(i, name))
    assert cache_state(cached.critic)['fallback'] is None


def test_gradient_accumulation_over_several_backward_passes_is_exact_and_stays_cached():
    """Two passes before an update, gradients not cleared in between:
    define-by-run adds them up. Chainer's replay overwrote them (the cache
    refused it); the replay's node now returns its gradients to Chainer's
    backward, which adds them as define-by-run does, bit for bit."""
    ordinary, cached = copies(ConvBN)
    cache_static_graph(cached)
    data = batches(count=10)
    optimizers = [chainer.optimizers.SGD(0.1).setup(m) for m in (ordinary, cached)]
    for i in range(0, 10, 2):
        for model, optimizer in zip((ordinary, cached), optimizers):
            model.cleargrads()
            with warnings.catch_warnings():
                warnings.simplefilter('error', StaticGraphFallback)
                for x, t in data[i:i + 2]:
                    F.softmax_cross_entropy(model(x), t).backward()
            optimizer.update()
        from tests.helpers import assert_same
        assert_same(ordinary, cached, 'step {}'.format(i // 2))
    state = cache_state(cached)
    assert state['fallback'] is None and sum(state['verified'].values()) >= 2


def test_verification_stops_after_the_verified_steps(monkeypatch):
    runs = []
    reference = _verify.Reference

    def counted(*args):
        runs.append(1)
        return reference(*args)
    monkeypatch.setattr(_verify, 'Reference', counted)
    ordinary, cached = copies(ConvBN)
    cache_static_graph(cached, verify_steps=2)
    assert not side_by_side(ordinary, cached, batches(count=6))
    assert len(runs) == 3       # the recording step and two replays
    assert cache_state(cached)['verified'] == {k: 2 for k in cache_state(cached)['sequences']}


# --- tolerances -----------------------------------------------------------------------

@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32, numpy.float64])
def test_a_few_ulps_pass_and_more_do_not(dtype):
    rng = numpy.random.RandomState(0)
    expected = rng.randn(50).astype(dtype)
    scale = float(numpy.abs(expected).max())
    eps = float(numpy.finfo(dtype).eps)
    assert _verify.allowed(dtype) == 32 * eps
    few = expected.copy()
    few[3] += dtype(4 * eps * scale)           # 4 ulps at the magnitude
    assert _verify.difference(few, expected) is None
    many = expected.copy()
    many[3] += dtype(100 * eps * scale)
    assert 'ulps of {}'.format(numpy.dtype(dtype).name) in _verify.difference(many, expected)


def test_exact_where_exactness_is_due():
    a = numpy.array([1, 2, 3], numpy.int32)
    assert _verify.difference(a, a.copy()) is None
    assert _verify.difference(a, a + 1) is not None
    f = numpy.array([1.0, numpy.nan, numpy.inf], numpy.float32)
    assert _verify.difference(f, f.copy()) is None
    assert _verify.difference(f, numpy.array([1.0, 2.0, numpy.inf], numpy.float32))
    assert _verify.difference(f, numpy.array([1.0, numpy.nan, -numpy.inf], numpy.float32))
    assert _verify.difference(None, f) and _verify.difference(f, None)
    assert _verify.difference(f.astype(numpy.float64), f)


class ConvHead(chainer.Chain):
    """Ends in a 1x1 convolution, whose output is the chain's output."""

    def __init__(self, dtype):
        super().__init__()
        init = chainer.initializers.Normal(0.3, dtype=dtype)
        with self.init_scope():
            self.conv = L.Convolution2D(3, 4, 3, pad=1, initialW=init, initial_bias=init)
            self.head = L.Convolution2D(4, 3, 1, initialW=init, initial_bias=init)

    def forward(self, x):
        return self.head(F.relu(self.conv(x)))


def _rounding_differently(monkeypatch):
    """The bound 1x1 convolution one ulp off in half its outputs, as a GPU
    kernel that sums in another order is (define-by-run runs Chainer's): in
    float16 that is ~1e-3 of the magnitude, ten times the old fixed tolerance."""
    from fastchain.kernels import _bind
    convolution = _bind._convolution

    def nudged(node, inputs, buffers):
        run = convolution(node, inputs, buffers)
        if inputs[1].shape[2:] != (1, 1):
            return run

        def one_ulp_off(inputs):
            y = run(inputs)[0].copy()
            flat = y.reshape(-1)
            flat[::2] = numpy.nextafter(flat[::2], numpy.asarray(numpy.inf, y.dtype))
            return y,
        return one_ulp_off
    monkeypatch.setattr(_bind, '_convolution', nudged)


def _train_float16(model, count=4, every=None):
    optimizer = chainer.optimizers.SGD(0.01).setup(model)
    for i, (x, t) in enumerate(batches(dtype=numpy.float16, count=count)):
        if every is not None:
            every(i)
        optimizer.update(lambda x, t: F.softmax_cross_entropy(
            F.mean(model(x), axis=(2, 3)), t), x, t)


def test_a_float16_model_rounding_differently_within_its_resolution_is_not_refused(
        monkeypatch):
    _rounding_differently(monkeypatch)
    model = ConvHead(numpy.float16)
    cache_static_graph(model)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphFallback)
        _train_float16(model)
    state = cache_state(model)
    assert state['fallback'] is None and list(state['verified'].values()) == [2]


def test_a_float16_model_that_is_not_static_is_still_caught(monkeypatch):
    _rounding_differently(monkeypatch)

    class Branchy16(ConvHead):
        flip = False

        def forward(self, x):
            h = super().forward(x)
            return -h if self.flip else h
    model = Branchy16(numpy.float16)
    cache_static_graph(model)
    with pytest.warns(StaticGraphFallback, match='not static'):
        # on the class: no attribute of the model's shows it
        _train_float16(model, count=6, every=lambda i: setattr(Branchy16, 'flip', i == 2))
    assert cache_state(model)['cause'] == 'not static'


def test_after_cudnn_graphs_ran_float32_is_accepted_within_the_inexact_margin(monkeypatch):
    """cuDNN engines may sum in an order that varies between calls (a weight
    gradient split over thread blocks): once graphs have run, float32 is
    held to INEXACT of the magnitude, as after oneDNN; a defect (of the
    order of the magnitude) is still caught."""
    from fastchain.cudnn import _paths
    monkeypatch.setattr(_paths, 'calls', {})
    a = numpy.full(4, 1.0, numpy.float32)
    near = a + numpy.float32(1e-4)
    assert _verify.difference(near, a) is not None         # beyond 32 ulps
    monkeypatch.setattr(_paths, 'calls', {'conv weight gradient': {'graph': 3}})
    assert _verify.difference(near, a) is None              # within 2**-10
    assert _verify.difference(a * 1.01, a) is not None      # a defect's size
    monkeypatch.setattr(_paths, 'calls', {'conv forward': {'chainer': 3}})
    assert _verify.difference(near, a) is not None          # Chainer's own: exact as before


class OwnVariable(chainer.Chain):
    """A forward that makes its own variable of an array before a
    deconvolution (``x if isinstance(x, Variable) else Variable(x)``), or,
    with ``doubled``, computes otherwise for a variable than for an array."""

    def __init__(self, doubled=False):
        super().__init__()
        self.doubled = doubled
        with self.init_scope():
            self.d = L.Deconvolution2D(3, 3, 2)
            self.head = L.Linear(3, 3)

    def forward(self, x):
        if isinstance(x, chainer.Variable):
            h = x * 2 if self.doubled else x
        else:
            h = chainer.Variable(x)     # requires a gradient: the deconvolution's input
        return self.head(F.mean(self.d(h), axis=(2, 3)))


@pytest.mark.parametrize('doubled', [False, True])
def test_the_reference_gets_an_array_argument_as_define_by_run_does(doubled):
    """The reference ran the forward on a variable requiring no gradient for
    an array argument: a forward that makes its own variable then gave
    Chainer's deconvolution a backward for its weight alone, which raised a
    bare ValueError (a fuzzing helper); and one that computes otherwise for
    a variable (as Chainer's replay gives it one) was verified against the
    same branch and trained differently without a word. Now the reference
    gets the array, and both train bitwise define-by-run's: the second falls
    back naming the input's type; the first falls back too, as a limit of the
    cache (its replay leaves the array's gradient out, and Chainer's
    deconvolution backward then raises on the weight's alone), saying so."""
    ordinary, cached = copies(lambda: OwnVariable(doubled))
    cache_static_graph(cached)
    said = side_by_side(ordinary, cached, batches(count=5))
    assert len(said) == 1 and cache_state(cached)['fallback'] is not None
    if doubled:
        assert 'the type of an input' in said[0], said
    else:
        assert "Chainer's replay of the backward raised ValueError" in said[0], said


def test_the_references_backward_leaves_every_leafs_gradient_as_it_was():
    """The reference's gradients come from Chainer's backward, which writes
    into every leaf it reaches: a variable the model holds and returns was
    left with a gradient (a review); its gradient and loss scale are put
    back, as are the parameters'."""
    class Returns(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.l1 = L.Linear(4, 4)
            self.t = chainer.Variable(numpy.full((1, 4), 0.5, numpy.float32))

        def forward(self, x):
            return self.l1(x) * F.broadcast_to(self.t, (2, 4)), self.t

    model = Returns()
    model.l1.W.grad = numpy.full((4, 4), 7, numpy.float32)
    model.l1.W._loss_scale = 8.0
    x = chainer.Variable(numpy.ones((2, 4), numpy.float32))
    reference = _verify.Reference(model, model.forward, (x,))
    grads, _ = reference.gradients(list(model.params()), [
        numpy.ones((2, 4), numpy.float32), numpy.full((1, 4), 3, numpy.float32)])
    assert grads[0] is not None and not (grads[0] == 7).all()
    assert model.t.grad_var is None and model.t._loss_scale is None
    numpy.testing.assert_array_equal(model.l1.W.grad, numpy.full((4, 4), 7, numpy.float32))
    assert model.l1.W._loss_scale == 8.0
