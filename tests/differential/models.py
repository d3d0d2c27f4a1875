"""Random models, optimizers and option sets for the differential suite.

A model is drawn as a *spec* (plain tuples, so a failing example prints as
something to read) and built by :func:`build`: convolutions and
deconvolutions of random kernel, stride, pad, dilation and groups; batch
normalisation; dropout; pooling; residual adds; optionally a second input,
a branch on the data and a count of calls kept in Python; global average
pooling and a linear classifier (optionally of an input size Chainer infers
on the first call).
"""

import numpy
from hypothesis import strategies as st

import chainer
import chainer.functions as F
import chainer.links as L
from chainer.utils.conv import get_conv_outsize

CLASSES = 3


def _conv_out(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _deconv_out(size, k, s, p):
    return (size - 1) * s - 2 * p + k


@st.composite
def model_specs(draw, max_layers=4, allow_bn=True, allow_dropout=True, allow_branch=True,
                allow_lazy=True, allow_calls=False, min_batch=1):
    # a batch of 1 too: NumPy multiplies Chainer's im2col matrix in another
    # layout then (a view, not a copy), which cpu_conv got wrong (a trial)
    n = draw(st.integers(min_batch, 4))
    c = draw(st.integers(1, 4))
    h, w = draw(st.integers(4, 11)), draw(st.integers(4, 11))
    spec_input = (n, c, h, w)
    layers = []
    for _ in range(draw(st.integers(1, max_layers))):
        # twins twice: a defect that needs two of its convolutions in one
        # cached schedule was found by only half of 300-example runs
        kinds = ['conv', 'deconv', 'relu', 'maxpool', 'avgpool', 'res', 'twins', 'twins']
        if allow_calls:
            # a residual convolution applied twice (tied weights inside the
            # call: a replay sums its two terms before the rest, a fuzzing
            # helper found it unsaid)
            kinds.append('res_twice')
        if allow_bn:
            kinds.append('bn')
        if allow_dropout:
            kinds.append('dropout')
        kind = draw(st.sampled_from(kinds))
        if kind in ('conv', 'deconv'):
            groups = draw(st.sampled_from([g for g in (1, 2, 3) if c % g == 0]))
            out = groups * draw(st.integers(1, 3))
            k = draw(st.integers(1, 4))
            s = draw(st.integers(1, 2))
            p = draw(st.integers(0, 2))
            d = draw(st.integers(1, 2)) if kind == 'conv' else 1
            if kind == 'conv':
                size = (_conv_out(h, k, s, p, d), _conv_out(w, k, s, p, d))
            else:
                size = (_deconv_out(h, k, s, p), _deconv_out(w, k, s, p))
            if min(size) < 1 or max(size) > 24:
                continue
            layers.append((kind, out, k, s, p, d, groups, draw(st.booleans())))
            c, (h, w) = out, size
        elif kind in ('maxpool', 'avgpool'):
            k = draw(st.integers(2, 3))
            cover_all = kind == 'maxpool'       # Chainer's defaults
            size = (get_conv_outsize(h, k, 2, 0, cover_all=cover_all),
                    get_conv_outsize(w, k, 2, 0, cover_all=cover_all))
            if min(size) < 1:
                continue
            layers.append((kind, k, 2))
            h, w = size
        elif kind in ('res', 'res_twice'):
            k = draw(st.sampled_from([1, 3]))
            layers.append((kind, c, k))
        elif kind == 'twins':
            # Two convolutions whose padded inputs have the same shape with
            # different padding (3x3 pad 1 on s px, 5x5 pad 2 on s-2 px),
            # with a 3x3 unpadded one between them.
            if min(h, w) < 3:
                continue
            layers += [('conv', c, 3, 1, 1, 1, 1, True), ('conv', c, 3, 1, 0, 1, 1, False),
                       ('conv', c, 5, 1, 2, 1, 1, True)]
            h, w = h - 2, w - 2
        elif kind == 'dropout':
            layers.append(('dropout', draw(st.sampled_from([0.1, 0.5]))))
        else:
            layers.append((kind,))
    extra = draw(st.booleans())
    branch = allow_branch and draw(st.integers(0, 5)) == 0     # one model in six
    # the head's input size left to Chainer (L.Linear(None, n)): its weights
    # are made on the first call, from NumPy's global generator
    lazy = allow_lazy and draw(st.booleans())
    # several calls a step (their losses summed, one backward), and an L.LSTM
    # before the head keeping h and c from call to call (truncated backprop,
    # as Chainer's PTB example trains)
    # (rarely: the cache gives such models up, and replays need models it keeps)
    calls = draw(st.sampled_from([1, 1, 1, 1, 1, 2, 3])) if allow_calls else 1
    recurrent = allow_calls and draw(st.integers(0, 7)) == 0
    # the model's parameters also used by the loss, outside the call: an L2
    # penalty over all of them, or the head's weight tied to an output layer
    tied = draw(st.sampled_from([None, None, None, 'penalty', 'tie'])) if allow_calls else None
    # a count of calls the forward keeps in Python, halving the output every
    # fifth call: state a replay does not advance, on a period the verified
    # steps may not reach
    counter = allow_calls and draw(st.integers(0, 7)) == 0
    # a value of the model's the training loop sets before each step, from the
    # batch (a curriculum switch, a loss weight): halving the output on some
    # steps, first on one the verified steps may not reach; set as an
    # attribute, or inside a config dict the model holds
    knob = allow_calls and draw(st.integers(0, 5)) == 0
    knob = draw(st.sampled_from(['attribute', 'config'])) if knob else False
    return {'input': spec_input, 'layers': tuple(layers), 'extra_input': extra,
            'branch': branch, 'lazy_head': lazy, 'calls': calls, 'recurrent': recurrent,
            'tied': tied, 'counter': counter, 'knob': knob}


class Net(chainer.Chain):
    """The model a spec describes."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.kinds = []
        c = spec['input'][1]
        init = chainer.initializers.Normal(0.3)
        with self.init_scope():
            for i, layer in enumerate(spec['layers']):
                kind = layer[0]
                name = 'l{}'.format(i)
                if kind == 'conv':
                    _, out, k, s, p, d, g, bias = layer
                    setattr(self, name, L.Convolution2D(c, out, k, s, p, nobias=not bias,
                                                        dilate=d, groups=g, initialW=init))
                    c = out
                elif kind == 'deconv':
                    _, out, k, s, p, _, g, bias = layer
                    setattr(self, name, L.Deconvolution2D(c, out, k, s, p, nobias=not bias,
                                                          groups=g, initialW=init))
                    c = out
                elif kind == 'bn':
                    setattr(self, name, L.BatchNormalization(c))
                elif kind in ('res', 'res_twice'):
                    setattr(self, name, L.Convolution2D(c, c, layer[2], 1, layer[2] // 2,
                                                        initialW=init))
            if spec.get('recurrent'):
                self.rec = L.LSTM(c, c)
            self.head = L.Linear(None if spec.get('lazy_head') else c, CLASSES,
                                 initialW=init)
            if spec['extra_input']:
                self.side = L.Linear(3, CLASSES, initialW=init)
            if spec['branch']:
                self.other = L.Linear(c, CLASSES, initialW=init)
        self.calls = 0
        self.knob = 1.0
        self.cfg = {'knob': 1.0}

    def serialize(self, serializer):
        super().serialize(serializer)
        if self.spec.get('counter'):
            # in a snapshot (a resumed run goes on counting), not a persistent
            # value (the verification compares those)
            self.calls = serializer('calls', self.calls)

    def forward(self, x, *rest):
        h = x
        for i, layer in enumerate(self.spec['layers']):
            kind = layer[0]
            link = getattr(self, 'l{}'.format(i), None)
            if kind in ('conv', 'deconv', 'bn'):
                h = link(h)
            elif kind == 'res':
                h = h + link(h)
            elif kind == 'res_twice':
                h = h + link(F.relu(link(h)))
            elif kind == 'relu':
                h = F.relu(h)
            elif kind == 'maxpool':
                h = F.max_pooling_2d(h, layer[1], layer[2])
            elif kind == 'avgpool':
                h = F.average_pooling_2d(h, layer[1], layer[2])
            elif kind == 'dropout':
                h = F.dropout(h, layer[1])
        h = F.mean(h, axis=(2, 3))
        if self.spec.get('recurrent'):
            h = self.rec(h)
        if self.spec['branch'] and float(getattr(x, 'array', x).mean()) > 0:
            y = self.other(h)       # the data decides which head runs
        else:
            y = self.head(h)
        if self.spec['extra_input']:
            y = y + self.side(rest[0])
        if self.spec.get('counter'):
            self.calls += 1
            if self.calls % 5 == 0:
                y = y * 0.5
        if self.spec.get('knob'):
            y = y * (self.knob if self.spec['knob'] == 'attribute' else self.cfg['knob'])
        return y


def build(spec):
    return Net(spec)


def tied(spec):
    """Whether a parameter of the model gets gradient terms a replay may sum
    in another order than define-by-run: a use outside the call (a penalty,
    a tied head), or a link applied twice inside with more than one call a
    step."""
    twice = any(layer[0] == 'res_twice' for layer in spec['layers'])
    return bool(spec['tied'] or (twice and spec.get('calls', 1) > 1))


def loss_of(model, arrays):
    """A step's loss on a batch ``(x[, z], t)``: the model called
    ``spec['calls']`` times, the losses summed; a recurrent model's state
    carried from call to call, reset at the start (a snapshot does not hold
    it: a resumed run starts from none, as Chainer's own would)."""
    if model.spec.get('recurrent'):
        model.rec.reset_state()
    if model.spec.get('knob'):
        value = 0.5 if int(arrays[-1].sum()) % 3 == 0 else 1.0
        if model.spec['knob'] == 'attribute':
            model.knob = value
        else:
            model.cfg['knob'] = value
    loss = 0
    tied = model.spec.get('tied')
    for _ in range(model.spec.get('calls', 1)):
        # The image as a Variable: Chainer 7.8.1's deconvolution backward
        # fails when only its weight needs a gradient (DEVELOPERS.md), i.e.
        # on a plain array.
        x = chainer.Variable(arrays[0])
        y = model(x, *arrays[1:-1])
        loss += F.softmax_cross_entropy(y, arrays[-1])
        if tied == 'tie' and model.head.W.array is not None:
            # the head's weight, (classes, c), as an output layer's (unmade: a
            # lazy head the data branch has not reached)
            loss += 0.1 * F.mean(F.tanh(F.matmul(y, model.head.W)))
    if tied == 'penalty':
        # (in the loss's dtype: under fp16, BatchNormalization's are float32)
        loss += 1e-3 * sum(F.cast(F.sum(p * p), loss.dtype) for p in model.params()
                           if p.array is not None)
    return loss


def batches(spec, steps, seed, dtype=numpy.float32):
    """``steps`` inputs for the model: (x[, z], t)."""
    rng = numpy.random.RandomState(seed)
    n, c, h, w = spec['input']
    out = []
    for _ in range(steps):
        arrays = [rng.normal(0, 1, (n, c, h, w)).astype(dtype)]
        if spec['extra_input']:
            arrays.append(rng.normal(0, 1, (n, 3)).astype(dtype))
        arrays.append(rng.randint(0, CLASSES, n).astype(numpy.int32))
        out.append(tuple(arrays))
    return out


SGD_FAMILY = st.one_of(
    st.tuples(st.just('SGD'), st.sampled_from([0.01, 0.1])),
    st.tuples(st.just('MomentumSGD'), st.sampled_from([0.01, 0.1])),
)
OPTIMIZERS = st.one_of(SGD_FAMILY, st.tuples(st.just('Adam'), st.sampled_from([0.001, 0.01])))

HOOKS = st.lists(st.one_of(
    st.tuples(st.just('WeightDecay'), st.sampled_from([1e-4, 1e-2])),
    st.tuples(st.just('GradientClipping'), st.sampled_from([0.1, 1.0])),
), max_size=2, unique_by=lambda h: h[0])


def make_optimizer(spec, hooks):
    name, rate = spec
    if name == 'Adam':
        opt = chainer.optimizers.Adam(alpha=rate)
    else:
        opt = getattr(chainer.optimizers, name)(lr=rate)
    return opt, [getattr(chainer.optimizer_hooks, h)(v) for h, v in hooks]
