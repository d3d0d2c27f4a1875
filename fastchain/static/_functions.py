"""Chainer's functions under the static cache: what each does when replayed.

Chainer's replay calls the *same* function nodes every step: a node's
``forward`` runs again on the new arrays, but the backward schedule holds
the nodes made by the first step's ``backward``. Two kinds of function are
therefore at risk: those whose forward draws random numbers (a node that
keeps its draw replays it), and those whose backward node keeps state
computed in forward (a copy from the first step, not refreshed). Each
function below was measured against define-by-run over several different
batches, with parameters updated between them
(``tests/static/test_functions.py`` keeps one case per entry):

- ``REPLAYS``: the replay equals define-by-run;
- ``FIXED``: equal with the fix named (:mod:`fastchain.static._fixes`);
- ``REFUSED``: the cache runs define-by-run, with the reason in a warning.

A function not in the table is covered only by the verification of the
first steps; a difference then names it as a suspect.
"""

import chainer

REPLAYS, FIXED, REFUSED = 'replays', 'fixed', 'refused'

_RANDOM = ("it draws random numbers in forward, and Chainer's replay keeps the first "
           "step's draw: the same {} on every step")
_STATE = ("its backward keeps {} computed on the first step, which Chainer's replay "
          'does not refresh: wrong gradients from the second step')
_FAILS = ("its backward computes arrays in Python that Chainer's schedule does not keep: "
          'the replay raises')
_LAST = ("as the last function of a cached chain, its retained arrays were not refreshed by "
         "Chainer's replay (wrong gradients); fastchain marks them (_fixes, fault 4)")

_F = 'chainer.functions.'
# 'module.Class': (decision, why); one measured case per entry in
# tests/static/test_functions.py.
TABLE = {
    # Forward draws random numbers.
    _F + 'noise.dropout.Dropout': (REFUSED, _RANDOM.format('mask')),
    _F + 'noise.gaussian.Gaussian': (REFUSED, _RANDOM.format('noise')),
    _F + 'noise.simplified_dropconnect.SimplifiedDropconnect': (
        REFUSED, _RANDOM.format('mask')),
    _F + 'activation.rrelu.RReLU': (REFUSED, _RANDOM.format('slopes')),
    _F + 'noise.zoneout.Zoneout': (
        REFUSED, "it draws random numbers in forward, and its backward keeps the first "
        "step's flags (Chainer's replay then raises)"),
    _F + 'loss.negative_sampling.NegativeSamplingFunction': (
        REFUSED, "it takes samples the link draws in Python, which Chainer's replay keeps "
        "from the first step"),
    # Backward keeps state computed in forward.
    _F + 'normalization.batch_normalization.BatchNormalization': (
        FIXED, "its backward kept the first step's batch statistics; fastchain's grad node "
        'reads them from the forward node (_fixes, fault 1; running statistics: fault 2)'),
    _F + 'normalization.batch_normalization.FixedBatchNormalization': (
        FIXED, "its backward kept the first step's inverse std (wrong when the statistics "
        "change); fastchain's grad node reads it from the forward node (_live)"),
    _F + 'math.clip.Clip': (REFUSED, _STATE.format('the mask of unclipped inputs')),
    _F + 'math.maximum.Maximum': (REFUSED, _STATE.format('the mask of the larger input')),
    _F + 'array.select_item.SelectItem': (REFUSED, _STATE.format('the selected indices')),
    _F + 'loss.softmax_cross_entropy.SoftmaxCrossEntropy': (
        REFUSED, _STATE.format('the softmax')),
    _F + 'math.basic_math.PowVarVar': (REFUSED, _STATE.format('the power')),
    _F + 'normalization.local_response_normalization.LocalResponseNormalization': (
        REFUSED, _STATE.format('the scale')),
    _F + 'normalization.decorrelated_batch_normalization.DecorrelatedBatchNormalization': (
        REFUSED, _STATE.format('the whitening')),
    # Chainer's replay fails.
    _F + 'math.minmax.Max': (REFUSED, _FAILS),
    _F + 'math.minmax.Min': (REFUSED, _FAILS),
    _F + 'math.prod.Prod': (REFUSED, _FAILS),
    _F + 'math.cumprod.Cumprod': (REFUSED, _FAILS),
    _F + 'array.where.Where': (REFUSED, _FAILS),
    _F + 'activation.crelu.CReLU': (REFUSED, _FAILS),
    _F + 'normalization.group_normalization.GroupNormalization': (REFUSED, _FAILS),
    _F + 'normalization.batch_renormalization.BatchRenormalizationFunction': (
        REFUSED, _FAILS),
    _F + 'loss.absolute_error.AbsoluteError': (REFUSED, _FAILS),
    _F + 'loss.mean_absolute_error.MeanAbsoluteError': (REFUSED, _FAILS),
    _F + 'loss.contrastive.Contrastive': (REFUSED, _FAILS),
    _F + 'loss.hinge.Hinge': (REFUSED, _FAILS),
    _F + 'loss.triplet.Triplet': (REFUSED, _FAILS),
    _F + 'loss.decov.DeCov': (REFUSED, _FAILS),
    _F + 'math.identity.Identity': (
        REFUSED, "it returns its input arrays, which Chainer's schedule cannot record"),
    # Fixed as the last function of a chain (its retained arrays).
    _F + 'activation.relu.ReLU': (FIXED, _LAST),
    _F + 'activation.elu.ELU': (FIXED, _LAST),
    _F + 'activation.leaky_relu.LeakyReLU': (FIXED, _LAST),
    _F + 'activation.softmax.Softmax': (FIXED, _LAST),
    _F + 'activation.log_softmax.LogSoftmax': (FIXED, _LAST),
    _F + 'math.logsumexp.LogSumExp': (FIXED, _LAST),
    _F + 'activation.sigmoid.Sigmoid': (FIXED, _LAST),
    _F + 'activation.tanh.Tanh': (FIXED, _LAST),
    _F + 'math.exponential.Exp': (FIXED, _LAST),
    _F + 'math.sqrt.Sqrt': (FIXED, _LAST),
}

# Replayed equal to define-by-run as measured (several batches, parameters
# updated in between, also as the last function of the chain); two only in
# some uses, the others raise on the step that records them (a fallback).
TABLE[_F + 'array.split_axis.SplitAxis'] = (
    REPLAYS, "replayed equal with every output used; with one unused, Chainer's replay "
    'raises on the step that records it (a fallback)')
TABLE[_F + 'array.cast.Cast'] = (
    REPLAYS, "replayed equal; a cast to the input's own dtype returns the input array, "
    "which Chainer's schedule cannot record (a fallback)")
for _name in """
        connection.linear.LinearFunction connection.convolution_2d.Convolution2DFunction
        connection.deconvolution_2d.Deconvolution2DFunction connection.bilinear.BilinearFunction
        connection.embed_id.EmbedIDFunction pooling.max_pooling_nd.MaxPoolingND
        pooling.average_pooling_2d.AveragePooling2D pooling.average_pooling_nd.AveragePoolingND
        pooling.unpooling_2d.Unpooling2D pooling.upsampling_2d.Upsampling2D
        normalization.layer_normalization.LayerNormalization
        normalization.l2_normalization.NormalizeL2
        activation.clipped_relu.ClippedReLU
        activation.hard_sigmoid.HardSigmoid activation.prelu.PReLUFunction
        activation.swish.Swish activation.softplus.Softplus rnn.lstm.LSTM
        math.basic_math.Add math.basic_math.AddConstant math.basic_math.Sub
        math.basic_math.SubFromConstant math.basic_math.Mul math.basic_math.MulConstant
        math.basic_math.Div math.basic_math.DivFromConstant math.basic_math.Neg
        math.basic_math.Absolute math.basic_math.PowVarConst math.minimum.Minimum
        math.sum.Sum math.sum.SumTo math.average.Mean math.matmul.MatMul
        math.exponential.Log math.square.Square
        math.trigonometric.Sin math.trigonometric.Cos math.erf.Erf math.cumsum.Cumsum
        math.tensordot.TensorDot math.einsum.EinSum math.minmax.ArgMax
        math.batch_l2_norm_squared.BatchL2NormSquared
        loss.squared_error.SquaredError loss.mean_squared_error.MeanSquaredError
        loss.huber_loss.HuberLoss loss.sigmoid_cross_entropy.SigmoidCrossEntropy
        array.concat.Concat array.split_axis.SplitAxis array.reshape.Reshape
        array.transpose.Transpose array.broadcast.BroadcastTo array.get_item.GetItem
        array.stack.Stack array.pad.Pad array.expand_dims.ExpandDims array.tile.Tile
        array.squeeze.Squeeze array.cast.Cast array.fliplr.FlipLR array.flipud.FlipUD
        array.repeat.Repeat array.hstack.Hstack array.vstack.Vstack
        array.permutate.Permutate array.diagonal.Diagonal array.resize_images.ResizeImages
        array.space2depth.Space2Depth array.depth2space.Depth2Space array.im2col.Im2Col
        array.transpose_sequence.TransposeSequence""".split():
    TABLE.setdefault(_F + _name, (REPLAYS, 'replayed equal to define-by-run (measured)'))


def name_of(function):
    """'module.Class' of a function node (of the old-style Function it adapts)."""
    cls = type(getattr(function, '_function', function))
    return '{}.{}'.format(cls.__module__, cls.__qualname__)


def short(name):
    return name.rsplit('.', 1)[-1]


def decision(function):
    return TABLE.get(name_of(function), (None, None))[0]


def refusal(names):
    """The reason to refuse a graph applying functions ``names``, or None."""
    for name in sorted(names):
        entry = TABLE.get(name)
        if entry is not None and entry[0] == REFUSED:
            fix = ('; compute the loss outside the cached chain (a forward returning the '
                   "prediction, as L.Classifier's predictor, which enable(static_graph=True) "
                   'caches)') if name.startswith(_F + 'loss.') else ''
            return '{} cannot be cached: {}{}'.format(short(name), entry[1], fix)
    return None


# Link hooks run Python around every call of their link, which a replay skips;
# those whose Python keeps state (the verification would catch it, blaming
# the cache) are refused by name before anything records.
HOOKS = {
    'chainer.link_hooks.spectral_normalization.SpectralNormalization': (
        'its power iteration updates the vector u (a persistent of the link) in Python on '
        "every training call, which the replay skips, so u and the weight's scale would "
        'stay as the first call left them'),
}


def hook_refusal(chain):
    """The reason to refuse ``chain`` for the link hooks on its links, or None."""
    for path, link in sorted(chain.namedlinks(), key=lambda item: item[0]):
        # Chainer's property would make the table on a link that has none
        for name, hook in (link.__dict__.get('_local_link_hooks') or {}).items():
            cls = type(hook)
            why = HOOKS.get('{}.{}'.format(cls.__module__, cls.__qualname__))
            if why is not None:
                return 'the link hook {} on {} cannot be cached: {}'.format(
                    name, path or '/', why)
    return None


def unknown(names):
    """The functions among ``names`` that the table does not know, short names."""
    return sorted({short(n) for n in names if n not in TABLE})


_SKIP = frozenset(('rank', 'stack', 'lazy_grad_sum', 'inputs', 'outputs'))
_SCALARS = (bool, int, float, str, slice, type(None), type(Ellipsis))


def _constants(function):
    """The function's public scalar attributes before it runs: the constants
    Python gave it (a value computed from the data shows up here)."""
    import numpy
    found = []
    for key, value in sorted(vars(function).items()):
        if key.startswith('_') or key in _SKIP:
            continue
        if isinstance(value, numpy.generic):
            value = value.item()
        if isinstance(value, _SCALARS) or (isinstance(value, tuple) and all(
                isinstance(v, _SCALARS) for v in value)):
            found.append((key, repr(value)))
    return tuple(found)


def _replay_node(function):
    """The node that runs a schedule: not one of the model's own functions."""
    return type(function).__name__ == 'StaticScheduleFunction'


class Recorder(chainer.FunctionHook):
    """Records the functions a forward pass applies: ``calls`` is a list of
    ``(name, input shapes, constants, parameters)``, the last the name of the
    parameter each input is (None for other inputs) once :meth:`resolve` has
    run; ``names`` is the set of 'module.Class'."""

    def __init__(self):
        self.name = 'fastchain_static_sequence_{}'.format(id(self))  # recorders may nest
        self.calls = []
        self.names = set()
        self._pending = {}
        self._ids = []
        self.inputs = set()     # ids of every input array and of the arrays they view
        self.last = None        # the last function that started: the one that failed

    def forward_preprocess(self, function, in_data):
        if not _replay_node(function):
            self.last = name_of(function)
            self.names.add(self.last)       # also when the function then fails
            self._pending[id(function)] = _constants(function)

    def forward_postprocess(self, function, in_data):
        if _replay_node(function):
            return
        name = name_of(function)
        self.calls.append((short(name), tuple(tuple(x.shape) for x in in_data),
                           self._pending.pop(id(function), ())))
        self._ids.append(tuple(id(x) for x in in_data))
        for x in in_data:
            while x is not None:        # a view's base too (self.queue[:k])
                self.inputs.add(id(x))
                x = getattr(x, 'base', None)

    def resolve(self, chain):
        """Name the parameters among the inputs; call right after the pass (the
        parameters' arrays are those it used)."""
        params = {id(p.array): name for name, p in chain.namedparams() if p.array is not None}
        self.calls = [call + (tuple(params.get(i) for i in ids),)
                      for call, ids in zip(self.calls, self._ids)]
        self._ids = []
        return self
