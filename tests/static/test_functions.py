"""One measured case per entry of the cache's table of Chainer functions
(fastchain/static/_functions.py): a replayed or fixed function trains exactly
as define-by-run; a refused one falls back at once, with a warning naming it
and why, and trains exactly as define-by-run too."""

import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from fastchain.static import StaticGraphFallback, _functions, cache_state, cache_static_graph

pytestmark = pytest.mark.usefixtures('fresh_fixes')

ROIS = numpy.array([[0, 0, 4, 4], [1, 1, 5, 5], [0, 2, 6, 6]], numpy.float32)


def _frozen_statistics():
    c = chainer.Chain()
    with c.init_scope():
        c.gamma = chainer.Parameter(numpy.ones(4, numpy.float32))
        c.beta = chainer.Parameter(numpy.zeros(4, numpy.float32))
        c.mean = chainer.Parameter(numpy.zeros(4, numpy.float32))    # trained: it changes
        c.var = chainer.Parameter(numpy.ones(4, numpy.float32))
    return c


# table entry (short name): (input kind, body(m, h, t), extra links); the
# function of the entry is the last one applied wherever it can be.
CASES = {
    'Dropout': ('vec', lambda m, h, t: F.dropout(h, 0.5), None),
    'Gaussian': ('vec', lambda m, h, t: F.gaussian(h, h * 0.1), None),
    'SimplifiedDropconnect': ('vec', lambda m, h, t: F.simplified_dropconnect(
        h, m.extra[0].W, m.extra[0].b, 0.5), lambda: [L.Linear(6, 5)]),
    'RReLU': ('vec', lambda m, h, t: F.rrelu(h), None),
    'Zoneout': ('vec', lambda m, h, t: F.zoneout(h, h * 0.5, 0.5), None),
    'NegativeSamplingFunction': ('vec', lambda m, h, t: m.extra[0](h, t),
                                 lambda: [L.NegativeSampling(6, [3, 2, 2, 1, 1, 1], 2)]),
    'BatchNormalization': ('img', lambda m, h, t: m.extra[0](h),
                           lambda: [L.BatchNormalization(4)]),
    'FixedBatchNormalization': ('img', lambda m, h, t: F.fixed_batch_normalization(
        h, m.extra[0].gamma, m.extra[0].beta, m.extra[0].mean, m.extra[0].var),
        lambda: [_frozen_statistics()]),
    'Clip': ('vec', lambda m, h, t: F.clip(h, -0.5, 0.5), None),
    'Maximum': ('vec', lambda m, h, t: F.maximum(h, h[::-1]), None),
    'SelectItem': ('vec', lambda m, h, t: F.select_item(h, t), None),
    'SoftmaxCrossEntropy': ('vec', lambda m, h, t: F.softmax_cross_entropy(h, t), None),
    'PowVarVar': ('vec', lambda m, h, t: F.absolute(h) ** F.sigmoid(h), None),
    'LocalResponseNormalization': ('img', lambda m, h, t: F.local_response_normalization(
        h, n=3), None),
    'DecorrelatedBatchNormalization': ('img', lambda m, h, t: m.extra[0](h), lambda: [
        L.DecorrelatedBatchNormalization(4, groups=2)]),
    'Max': ('vec', lambda m, h, t: F.max(h, axis=1), None),
    'Min': ('vec', lambda m, h, t: F.min(h, axis=1), None),
    'Prod': ('vec', lambda m, h, t: F.prod(h, axis=1), None),
    'Cumprod': ('vec', lambda m, h, t: F.cumprod(h, axis=1), None),
    'Where': ('vec', lambda m, h, t: F.where(m.condition, h, h * 2), None),
    'CReLU': ('vec', lambda m, h, t: F.crelu(h), None),
    'GroupNormalization': ('img', lambda m, h, t: m.extra[0](h),
                           lambda: [L.GroupNormalization(2, 4)]),
    'BatchRenormalizationFunction': ('img', lambda m, h, t: m.extra[0](h),
                                     lambda: [L.BatchRenormalization(4)]),
    'AbsoluteError': ('vec', lambda m, h, t: F.absolute_error(h, h[::-1] * 0.3), None),
    'MeanAbsoluteError': ('vec', lambda m, h, t: F.mean_absolute_error(h, h[::-1] * 0.3),
                          None),
    'Contrastive': ('vec', lambda m, h, t: F.contrastive(h, h[::-1], m.labels), None),
    'Hinge': ('vec', lambda m, h, t: F.hinge(h, t), None),
    'Triplet': ('vec', lambda m, h, t: F.triplet(h, h[::-1], h * 0.5 + 0.1), None),
    'DeCov': ('vec', lambda m, h, t: F.decov(h), None),
    'Identity': ('vec', lambda m, h, t: F.identity(h), None),
    'ReLU': ('vec', lambda m, h, t: F.relu(h), None),
    'ELU': ('vec', lambda m, h, t: F.elu(h), None),
    'LeakyReLU': ('vec', lambda m, h, t: F.leaky_relu(h), None),
    'Softmax': ('vec', lambda m, h, t: F.softmax(h), None),
    'LogSoftmax': ('vec', lambda m, h, t: F.log_softmax(h), None),
    'LogSumExp': ('vec', lambda m, h, t: F.logsumexp(h, axis=1), None),
    # Replayed as they are.
    'LinearFunction': ('vec', lambda m, h, t: h, None),
    'Convolution2DFunction': ('img', lambda m, h, t: F.convolution_2d(
        h, m.extra[0].W, pad=2, dilate=2), lambda: [L.Convolution2D(4, 4, 3)]),
    'Deconvolution2DFunction': ('img', lambda m, h, t: m.extra[0](h),
                                lambda: [L.Deconvolution2D(4, 2, 3, pad=1)]),
    'BilinearFunction': ('vec', lambda m, h, t: F.bilinear(h, h, m.extra[0].W),
                         lambda: [L.Bilinear(6, 6, 4)]),
    'EmbedIDFunction': ('vec', lambda m, h, t: m.extra[0](t) * h, lambda: [L.EmbedID(6, 6)]),
    'MaxPoolingND': ('img', lambda m, h, t: F.max_pooling_2d(h, 3, 2, cover_all=True), None),
    'AveragePooling2D': ('img', lambda m, h, t: F.average_pooling_2d(h, 2), None),
    'AveragePoolingND': ('img', lambda m, h, t: F.average_pooling_nd(h, 2), None),
    'Unpooling2D': ('img', lambda m, h, t: F.unpooling_2d(F.max_pooling_2d(h, 2), 2,
                                                            outsize=(6, 6)), None),
    'Upsampling2D': ('img', lambda m, h, t: F.upsampling_2d(
        F.average_pooling_2d(h, 2), m.indexes, ksize=2, outsize=(6, 6)), None),
    'LayerNormalization': ('vec', lambda m, h, t: m.extra[0](h),
                           lambda: [L.LayerNormalization(6)]),
    'NormalizeL2': ('vec', lambda m, h, t: F.normalize(h), None),
    'Sigmoid': ('vec', lambda m, h, t: F.sigmoid(h), None),
    'Tanh': ('vec', lambda m, h, t: F.tanh(h), None),
    'ClippedReLU': ('vec', lambda m, h, t: F.clipped_relu(h, 0.5), None),
    'HardSigmoid': ('vec', lambda m, h, t: F.hard_sigmoid(h), None),
    'PReLUFunction': ('vec', lambda m, h, t: m.extra[0](h), lambda: [L.PReLU()]),
    'Swish': ('vec', lambda m, h, t: m.extra[0](h), lambda: [L.Swish(None)]),
    'Softplus': ('vec', lambda m, h, t: F.softplus(h), None),
    'LSTM': ('vec', lambda m, h, t: F.lstm(h[:, :3] * 0, F.concat([h, h]))[1], None),
    'Add': ('vec', lambda m, h, t: h + h[::-1], None),
    'AddConstant': ('vec', lambda m, h, t: h + 1.5, None),
    'Sub': ('vec', lambda m, h, t: h - h[::-1], None),
    'SubFromConstant': ('vec', lambda m, h, t: 1 - h, None),
    'Mul': ('vec', lambda m, h, t: h * h[::-1], None),
    'MulConstant': ('vec', lambda m, h, t: h * 2.5, None),
    'Div': ('vec', lambda m, h, t: h / (F.absolute(h) + 1), None),
    'DivFromConstant': ('vec', lambda m, h, t: 2 / (h * h + 1), None),
    'Neg': ('vec', lambda m, h, t: -h, None),
    'Absolute': ('vec', lambda m, h, t: F.absolute(h), None),
    'PowVarConst': ('vec', lambda m, h, t: F.absolute(h) ** 1.5, None),
    'Minimum': ('vec', lambda m, h, t: F.minimum(h, h[::-1]), None),
    'Sum': ('vec', lambda m, h, t: F.sum(h, axis=1), None),
    'SumTo': ('vec', lambda m, h, t: F.sum_to(h, (1, 6)), None),
    'Mean': ('vec', lambda m, h, t: F.mean(h, axis=1), None),
    'MatMul': ('vec', lambda m, h, t: F.matmul(h, h, transb=True), None),
    'Exp': ('vec', lambda m, h, t: F.exp(h), None),
    'Log': ('vec', lambda m, h, t: F.log(F.absolute(h) + 1), None),
    'Sqrt': ('vec', lambda m, h, t: F.sqrt(F.absolute(h) + 1), None),
    'Square': ('vec', lambda m, h, t: F.square(h), None),
    'Sin': ('vec', lambda m, h, t: F.sin(h), None),
    'Cos': ('vec', lambda m, h, t: F.cos(h), None),
    'Erf': ('vec', lambda m, h, t: F.erf(h), None),
    'Cumsum': ('vec', lambda m, h, t: F.cumsum(h, axis=1), None),
    'TensorDot': ('vec', lambda m, h, t: F.tensordot(h, h, axes=([0], [0])), None),
    'EinSum': ('vec', lambda m, h, t: F.einsum('ij,ik->jk', h, h), None),
    'ArgMax': ('vec', lambda m, h, t: h * F.cast(F.argmax(h, axis=1), 'f').reshape(3, 1),
               None),
    'BatchL2NormSquared': ('vec', lambda m, h, t: F.batch_l2_norm_squared(h), None),
    'SquaredError': ('vec', lambda m, h, t: F.squared_error(h, h[::-1]), None),
    'MeanSquaredError': ('vec', lambda m, h, t: F.mean_squared_error(h, h[::-1]), None),
    'HuberLoss': ('vec', lambda m, h, t: F.huber_loss(h, h[::-1] * 0.3, 0.5), None),
    'SigmoidCrossEntropy': ('vec', lambda m, h, t: F.sigmoid_cross_entropy(h, m.labels6),
                            None),
    'Concat': ('vec', lambda m, h, t: F.concat([h, h * 2], axis=1), None),
    'SplitAxis': ('vec', lambda m, h, t: (lambda a: a[0] * a[1])(F.split_axis(h, 2, 1)),
                  None),
    'Reshape': ('vec', lambda m, h, t: F.reshape(h, (3, 2, 3)), None),
    'Transpose': ('vec', lambda m, h, t: F.transpose(h), None),
    'BroadcastTo': ('vec', lambda m, h, t: F.broadcast_to(F.sum(h, axis=0), (3, 6)) * h,
                    None),
    'GetItem': ('vec', lambda m, h, t: h[:, 1:4] * h[:, ::2], None),
    'Stack': ('vec', lambda m, h, t: F.stack([h, h * h]), None),
    'Pad': ('vec', lambda m, h, t: F.pad(h, ((0, 0), (1, 2)), 'constant'), None),
    'ExpandDims': ('vec', lambda m, h, t: F.expand_dims(h, 1), None),
    'Tile': ('vec', lambda m, h, t: F.tile(h, (1, 2)), None),
    'Squeeze': ('vec', lambda m, h, t: F.squeeze(F.expand_dims(h, 0)), None),
    'Cast': ('vec', lambda m, h, t: F.cast(h, numpy.float64), None),
    'FlipLR': ('vec', lambda m, h, t: F.fliplr(h), None),
    'FlipUD': ('vec', lambda m, h, t: F.flipud(h), None),
    'Repeat': ('vec', lambda m, h, t: F.repeat(h, 2, axis=1), None),
    'Hstack': ('vec', lambda m, h, t: F.hstack([h, h]), None),
    'Vstack': ('vec', lambda m, h, t: F.vstack([h, h]), None),
    'Permutate': ('vec', lambda m, h, t: F.permutate(h, numpy.array([2, 0, 1], numpy.int32)),
                  None),
    'Diagonal': ('vec', lambda m, h, t: F.diagonal(F.reshape(h, (3, 2, 3)), 0, 0, 2), None),
    'ResizeImages': ('img', lambda m, h, t: F.resize_images(h, (8, 8)), None),
    'Space2Depth': ('img', lambda m, h, t: F.space2depth(h, 2), None),
    'Depth2Space': ('img', lambda m, h, t: F.depth2space(h, 2), None),
    'Im2Col': ('img', lambda m, h, t: F.im2col(h, 3, pad=1), None),
    'TransposeSequence': ('vec', lambda m, h, t: F.stack(F.transpose_sequence(
        [h[i:i + 1] for i in range(3)])), None),
}


class Net(chainer.Chain):
    def __init__(self, kind, body, extra):
        super().__init__()
        self.body = body
        with self.init_scope():
            self.l = L.Convolution2D(4, 4, 3, pad=1) if kind == 'img' else L.Linear(6, 6)
            self.extra = chainer.ChainList(*(extra() if extra else ()))
        self.condition = numpy.arange(18).reshape(3, 6) % 4 == 1
        self.labels = numpy.array([1, 0, 1], numpy.int32)
        self.labels6 = (numpy.arange(18).reshape(3, 6) % 3 == 0).astype(numpy.int32)
        self.indexes = numpy.zeros((3, 4, 3, 3), numpy.int32)

    def forward(self, x, t):
        return self.body(self, self.l(x), t)


def _persistents(model):
    return [(path + '/' + name, numpy.asarray(link.__dict__[name]))
            for path, link in model.namedlinks() for name in sorted(link._persistent)]


def train_side_by_side(kind, body, extra, steps=4):
    """Train a define-by-run and a cached copy on the same batches (the global
    random state seeded alike for each); return the cached copy's state and
    the fallback warnings."""
    numpy.random.seed(0)
    models = [Net(kind, body, extra) for _ in range(2)]
    models[1].copyparams(models[0])
    for (_, a), (_, b) in zip(_persistents(models[0]), _persistents(models[1])):
        b[...] = a
    cache_static_graph(models[1])
    optimizers = [chainer.optimizers.SGD(0.1).setup(m) for m in models]
    rng = numpy.random.RandomState(1)
    caught = []
    for i in range(steps):
        shape = (3, 4, 6, 6) if kind == 'img' else (3, 6)
        x = rng.randn(*shape).astype(numpy.float32)
        t = rng.randint(0, 6, 3).astype(numpy.int32)
        results = []
        for model, optimizer in zip(models, optimizers):
            numpy.random.seed(100 + i)
            model.cleargrads()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter('always')
                y = model(x, t)
                seed = numpy.asarray(numpy.random.RandomState(7).randn(*y.shape), y.dtype)
                F.sum(y * seed).backward()
            caught += [str(m.message) for m in w if m.category is StaticGraphFallback]
            results.append((y.array.copy(), [(n, p.grad) for n, p in
                                             sorted(model.namedparams())],
                            numpy.random.get_state()[1].copy()))
            optimizer.update()
        (ya, ga, ra), (yb, gb, rb) = results
        numpy.testing.assert_array_equal(yb, ya, err_msg='output, step {}'.format(i))
        for (name, a), (_, b) in zip(ga, gb):
            numpy.testing.assert_array_equal(b, a, err_msg='grad {}, step {}'.format(name, i))
        numpy.testing.assert_array_equal(rb, ra, err_msg='random state, step {}'.format(i))
    for (name, a), (_, b) in zip(_persistents(models[0]), _persistents(models[1])):
        numpy.testing.assert_array_equal(b, a, err_msg=name)
    return models[1], caught


def test_every_table_entry_has_a_case():
    assert {_functions.short(name) for name in _functions.TABLE} == set(CASES)


@pytest.mark.parametrize('name', sorted(n for n in _functions.TABLE
                                        if _functions.TABLE[n][0] == _functions.REFUSED),
                         ids=_functions.short)
def test_refused_functions_fall_back_at_once_naming_the_function(name):
    short = _functions.short(name)
    cached, caught = train_side_by_side(*CASES[short])
    assert len(caught) == 1 and '{} cannot be cached'.format(short) in caught[0]
    assert cache_state(cached)['cause'] == 'refused'
    assert cache_state(cached)['sequences'] == {}      # refused when first recorded


@pytest.mark.parametrize('name', sorted(n for n in _functions.TABLE
                                        if _functions.TABLE[n][0] != _functions.REFUSED),
                         ids=_functions.short)
def test_replayed_and_fixed_functions_train_as_define_by_run(name):
    cached, caught = train_side_by_side(*CASES[_functions.short(name)])
    assert not caught
    state = cache_state(cached)
    assert state['fallback'] is None and state['verified'] == {k: 2 for k in state['sequences']}
    assert name in set().union(*state['names'].values())


def test_dropout_refused_by_verification_alone_as_a_difference():
    """Without the table, a frozen dropout mask is still caught: the random
    state advances differently in the replay than in define-by-run."""
    saved = dict(_functions.TABLE)
    _functions.TABLE.clear()
    try:
        cached, caught = train_side_by_side(*CASES['Dropout'])
    finally:
        _functions.TABLE.update(saved)
    assert len(caught) == 1 and 'random numbers' in caught[0]


def _hooked(hook):
    def extra():
        link = L.Linear(6, 5)
        link.add_hook(hook())
        return [link]
    return ('vec', lambda m, h, t: m.extra[0](h), extra)


def test_a_link_hook_that_keeps_state_is_refused_by_name():
    """SpectralNormalization's power iteration updates ``u`` in Python on
    every call; the replay skipped it and the verification caught the
    difference, blaming the cache ('a defect ... Please report it')."""
    from chainer.link_hooks import SpectralNormalization
    cached, caught = train_side_by_side(*_hooked(SpectralNormalization))
    assert len(caught) == 1, caught
    assert caught[0].startswith('fastchain static_graph: Net runs define-by-run from now on: '
                                'the link hook SpectralNormalization on /extra/0 cannot be '
                                'cached: its power iteration updates the vector u'), caught
    assert cache_state(cached)['cause'] == 'refused'
    assert cache_state(cached)['sequences'] == {}


def test_a_link_hook_without_state_is_cached():
    from chainer.link_hooks import TimerHook
    cached, caught = train_side_by_side(*_hooked(TimerHook))
    assert not caught
    assert cache_state(cached)['fallback'] is None
