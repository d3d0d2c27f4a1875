"""The cuDNN graph backend on a CPU: finding the frontend (and saying what
is missing), keys, the choice of path and its reasons, what each graph is
told, one build per key, refusals kept, and the autotuner's pick, with a
stand-in frontend and CuPy (tests/cudnn/standin.py). What cuDNN computes is
checked on a GPU (test_graphs_gpu.py)."""

import sys
import types

import numpy
import pytest

import chainer
from chainer.functions.connection import convolution_2d as _conv2d
from chainer.functions.connection import deconvolution_2d as _deconv2d

from fastchain.cudnn import _bn_graphs, _frontend, _graphs, _keys, _layers, _paths
from fastchain.tune import _tuner

from . import standin
from .standin import dev


@pytest.fixture(autouse=True)
def clean():
    yield
    _frontend.forget()
    _graphs.forget()
    _paths.forget()
    _tuner.forget('cudnn_graph')


# The frontend -----------------------------------------------------------------

def test_no_frontend_says_which_packages_bring_cudnn_back(monkeypatch):
    monkeypatch.setitem(sys.modules, 'cudnn', None)     # import cudnn fails
    monkeypatch.setattr(_frontend, 'installed_version', lambda: None)
    _frontend.forget()
    available, version, why, fix = _frontend.status()
    assert not available and version is None
    assert 'nvidia-cudnn-frontend' in why and "'cudnn' module" in why
    assert fix.startswith('pip install nvidia-cudnn-frontend nvidia-cudnn-cu')
    with pytest.raises(RuntimeError, match='cuDNN graphs are not available: the cuDNN '
                                           'frontend is not installed'):
        _frontend.module()


def test_frontend_without_libcudnn_names_the_load_error(monkeypatch):
    def missing():
        raise OSError('libcudnn.so.9: cannot open shared object file')
    standin.install(monkeypatch, backend=missing)
    available, _, why, fix = _frontend.status()
    assert not available
    assert why == ('the cuDNN frontend ? could not load cuDNN 9: libcudnn.so.9: cannot '
                   'open shared object file')
    assert 'nvidia-cudnn-cu' in fix


def test_cudnn_8_is_refused_and_9_is_named(monkeypatch):
    standin.install(monkeypatch, backend=8907)
    available, _, why, _ = _frontend.status()
    assert not available and why.startswith('cuDNN 8.9.7 is older than 9')
    standin.install(monkeypatch, backend=91000)
    assert _frontend.status() == (True, 'frontend 1.16.0, cuDNN 9.10.0', None, None)


def test_a_module_named_cudnn_that_is_not_the_frontend(monkeypatch):
    monkeypatch.setitem(sys.modules, 'cudnn', types.ModuleType('cudnn'))
    monkeypatch.setattr(_frontend, 'installed_version', lambda: None)
    _frontend.forget()
    available, _, why, _ = _frontend.status()
    assert not available and 'not the cuDNN frontend' in why


# Keys and paths -------------------------------------------------------------

def conv_node(**kwargs):
    node = _conv2d.Convolution2DFunction(**kwargs)
    node._input_layouts = (None, None)
    return node


@pytest.mark.parametrize('kwargs, arrays, reason', [
    (dict(cover_all=True), ('f', 'f'), 'cover_all=True'),
    ({}, ('f', 'e'), 'mixed dtypes (float16, float32)'),
    ({}, ('d', 'd'), 'float64 (the graphs take float16 and float32)'),
    ({}, ('f', 'f'), None),
    ({}, ('e', 'e'), None),
])
def test_conv_refusals(kwargs, arrays, reason):
    node = conv_node(**kwargs)
    x = numpy.zeros((2, 4, 5, 5), arrays[0])
    W = numpy.zeros((3, 4, 3, 3), arrays[1])
    got = _keys.conv_refusal('conv forward', node, (x, W))
    assert (got is None) if reason is None else got.startswith(reason)


def test_conv_refusal_layouts_contiguity_and_weight_gradient_dtype():
    node = conv_node()
    x, W = numpy.zeros((2, 4, 5, 5), 'f'), numpy.zeros((3, 4, 3, 3), 'f')
    node._input_layouts = ("some layout", None)
    assert 'memory layout' in _keys.conv_refusal('conv forward', node, (x, W))
    node._input_layouts = (None, None)
    assert _keys.conv_refusal('conv forward', node, (x[:, :, ::2], W)) == \
        'a non-contiguous input'
    gy = numpy.zeros((2, 3, 3, 3), 'e')
    assert _keys.conv_refusal('conv weight gradient', node, (x.astype('e'), gy), 'f') \
        .startswith('mixed dtypes')


@pytest.mark.parametrize('dtype, setting, allowed', [
    ('e', 'auto', True), ('e', 'always', True), ('e', 'never', False),
    ('f', 'auto', False), ('f', 'never', False), ('f', 'always', True)])
def test_tensor_cores_for_float32_only_when_asked_in_so_many_words(dtype, setting, allowed):
    assert _keys.tensor_cores_allowed(dtype, setting) is allowed


def test_bn_refusals():
    g = numpy.ones(4, 'f')
    x = numpy.zeros((2, 4, 3, 3), 'f')
    ok = (numpy.zeros(4, 'f'), numpy.ones(4, 'f'))
    assert _keys.bn_refusal(x, g, (0, 2, 3), None, ok) is None
    assert _keys.bn_refusal(x.astype('e'), g, (0, 2, 3), None, ok) is None      # mixed16
    assert _keys.bn_refusal(x[:, :, 0, 0], g, (0,), None, ok).startswith('2-d input')
    assert _keys.bn_refusal(x, g, (0, 1, 2, 3), None, ok).startswith('statistics over')
    assert _keys.bn_refusal(x.astype('d'), g.astype('d'), (0, 2, 3), None, ok) \
        .startswith('float64 input')
    assert _keys.bn_refusal(numpy.zeros((1, 4, 1, 1), 'f'), g, (0, 2, 3), None, ok) \
        .startswith('one value per channel')
    assert _keys.bn_refusal(x, g, (0, 2, 3), None, (ok[0], None)) \
        == 'one running statistic without the other'


def test_keys_differ_by_everything_that_changes_the_graph():
    node = conv_node(stride=2, pad=1)
    base = dict(op='conv forward', node=node, x_shape=(2, 4, 8, 8), w_shape=(3, 4, 3, 3),
                y_shape=(2, 3, 4, 4), dtype='f', tensor_cores=False, deterministic=False,
                device=0)
    key = _keys.conv_key(**base)
    assert key == _keys.conv_key(**base)
    for change in (dict(dtype='e'), dict(tensor_cores=True), dict(deterministic=True),
                   dict(device=1), dict(x_shape=(4, 4, 8, 8)), dict(op='conv input gradient'),
                   dict(node=conv_node(stride=1, pad=1))):
        assert _keys.conv_key(**dict(base, **change)) != key, change
    assert _keys.describe(key) == ('conv forward 2x4x8x8 * 3x4x3x3 -> 2x3x4x4 float32 s2 p1 '
                                   'd1 g1')


def test_paths_are_counted_with_their_reasons():
    _paths.record('conv forward', 'graph')
    _paths.record('conv forward', 'graph')
    _paths.record('conv forward', 'chainer', 'cover_all=True')
    assert _paths.summary() == {'conv forward': {'paths': {'graph': 2, 'chainer': 1},
                                                 'reasons': {'cover_all=True': 1}}}
    assert _paths.describe(_paths.summary()) == [
        'conv forward: graph 2, chainer 1 (cover_all=True: 1)']


# Graphs -----------------------------------------------------------------------

def key_of(op, dtype='f', groups=1, tensor_cores=False, deterministic=False):
    node = conv_node(stride=1, pad=1, groups=groups)
    return _keys.conv_key(op, node, (2, 4, 6, 6), (8, 4 // groups, 3, 3), (2, 8, 6, 6), dtype,
                          tensor_cores, deterministic, 0)


@pytest.mark.parametrize('op, method, inputs, out', [
    ('conv forward', 'conv_fprop', {'image': [2, 4, 6, 6], 'weight': [8, 4, 3, 3]},
     [2, 8, 6, 6]),
    ('conv input gradient', 'conv_dgrad', {'loss': [2, 8, 6, 6], 'filter': [8, 4, 3, 3]},
     [2, 4, 6, 6]),
    ('conv weight gradient', 'conv_wgrad', {'image': [2, 4, 6, 6], 'loss': [2, 8, 6, 6]},
     [8, 4, 3, 3]),
])
def test_each_convolution_graph_is_told_its_geometry(monkeypatch, op, method, inputs, out):
    fe = standin.install(monkeypatch)
    g = _graphs.build_conv(key_of(op, dtype='e', tensor_cores=True))
    graph = fe.graphs[0]
    assert graph.kwargs['io_data_type'] == 'HALF'
    assert graph.kwargs['compute_data_type'] == 'FLOAT'         # fp32 accumulation
    ((kind, kwargs),) = graph.ops
    assert kind == method
    assert {k: v.dim for k, v in kwargs.items() if k in inputs} == inputs
    assert kwargs['padding'] == [1, 1] and kwargs['stride'] == [1, 1]
    assert kwargs['dilation'] == [1, 1] and kwargs['compute_data_type'] == 'FLOAT'
    assert g.tensors['out'].dim == out and g.tensors['out'].output
    assert g.tensors['out'].stride == _graphs.strides(out, 'nchw')
    # float16: TensorCores allowed; never inputs converted down or reductions
    # in a lower precision (fp32 accumulation as stated).
    assert graph.deselected == ['DOWN_CONVERT_INPUTS', 'REDUCED_PRECISION_REDUCTION']
    # Without autotune the heuristics' first plan that builds is built, one
    # index at a time (with it: up to MAX_PLANS).
    assert graph.steps[-1] == ('build_plan_at_index', 0)
    assert not any(step[0] == 'build_plans' for step in graph.steps if isinstance(step, tuple))


def test_float32_excludes_tensor_core_engines_and_deterministic_the_others(monkeypatch):
    fe = standin.install(monkeypatch)
    _graphs.build_conv(key_of('conv forward', deterministic=True))
    assert fe.graphs[0].deselected[2:] == ['TENSOR_CORE', 'NONDETERMINISTIC']
    _graphs.build_conv(key_of('conv forward', tensor_cores=True), 'nhwc')
    assert fe.graphs[1].deselected[2:] == []
    assert fe.graphs[1].tensors[0].stride == [6 * 6 * 4, 1, 6 * 4, 4]     # NHWC strides


def test_one_build_per_key_and_a_refusal_is_kept(monkeypatch):
    fe = standin.install(monkeypatch)
    key = key_of('conv forward')
    a, b, out = dev(numpy.zeros((2, 4, 6, 6), 'f')), dev(numpy.zeros((8, 4, 3, 3), 'f')), \
        dev(numpy.zeros((2, 8, 6, 6), 'f'))
    _graphs.conv(key, a, b, out)
    _graphs.conv(key, a, b, out)
    assert _graphs.builds[(key, 'nchw')] == 1 and len(fe.graphs) == 1
    assert [e[:2] for e in fe.executions] == [('nchw', 0), ('nchw', 0)]
    pack = fe.executions[0][2]
    assert sorted(t.name for t in pack) == ['conv_fprop_out0', 'w', 'x']
    assert pack[fe.graphs[0].tensors[0]] is a
    # CuPy's current stream, set on the handle when it is another than the last
    assert fe.streams == [1234]
    cuda = sys.modules['cupy'].cuda
    for ptr in (5678, 5678, 1234):
        monkeypatch.setattr(cuda, 'get_current_stream', lambda p=ptr: types.SimpleNamespace(ptr=p))
        _graphs.conv(key, a, b, out)
    assert fe.streams == [1234, 5678, 1234]
    # A key cuDNN has no engine for: refused once, the reason kept, no rebuild.
    fe.unsupported.add('nchw')
    other = key_of('conv forward', dtype='e')
    for _ in range(2):
        with pytest.raises(_graphs.Unsupported) as e:
            _graphs.conv(other, a, b, out)
    assert e.value.reason == ('no cuDNN engine for NCHW (NotSupported: '
                              'cudnnGraphNotSupportedError: no engine)')
    assert _graphs.refused(other) == e.value.reason
    assert _graphs.builds[(other, 'nchw')] == 1


def test_autotune_times_every_plan_and_layout_and_keeps_the_fastest(monkeypatch):
    fe = standin.install(monkeypatch)
    fe.plan_costs = {'nchw': [3.0, 1.0, 2.0], 'nhwc': [1.5]}
    monkeypatch.setattr(_tuner, 'enabled', True)
    key = key_of('conv forward')
    a, b, out = dev(numpy.zeros((2, 4, 6, 6), 'f')), dev(numpy.zeros((8, 4, 3, 3), 'f')), \
        dev(numpy.zeros((2, 8, 6, 6), 'f'))
    _graphs.conv(key, a, b, out)
    runs = [e[:2] for e in fe.executions]
    # one untimed, then the timed trials (each REPEATS runs between two events)
    per_candidate = 1 + _graphs.TRIALS * _graphs.REPEATS
    assert runs.count(('nchw', 0)) == per_candidate
    assert runs.count(('nhwc', 0)) == per_candidate
    assert runs[-1] == ('nchw', 1)          # the call's own result: the kept plan's
    (choice,) = [c for c in _tuner.choices('cudnn_graph')]
    assert choice['picked'] == 'nchw plan 1'
    assert choice['median_ms'] == {'nchw plan 0': 3.0, 'nchw plan 1': 1.0,
                                   'nchw plan 2': 2.0, 'nhwc plan 0': 1.5}
    before, queries = len(fe.executions), list(fe.size_queries)
    _graphs.conv(key, a, b, out)            # no search the second time
    assert [e[:2] for e in fe.executions[before:]] == [('nchw', 1)]
    # each run had its plan's workspace; the size is asked of the frontend
    # once per plan (the run's own query included), not per call
    assert {w for w in fe.workspaces} == {('nchw', 0, 1), ('nchw', 1, 256), ('nchw', 2, 512),
                                         ('nhwc', 0, 1)}
    assert fe.size_queries[len(queries):] == []


def test_autotune_gives_a_plan_far_slower_than_the_best_one_trial_and_keeps_the_pick(
        monkeypatch):
    """On the GPU run cuDNN's slowest engine made 70% of the tuning's timed
    medians: a plan whose first trial is over SLOW times the best so far
    gets no more trials; the pick is the one full timing gives."""
    from fastchain.cudnn import _plans
    fe = standin.install(monkeypatch)
    fe.plan_costs = {'nchw': [1.0, 50.0, 2.0, 2.9], 'nhwc': [4.0]}
    monkeypatch.setattr(_tuner, 'enabled', True)
    _graphs.conv(key_of('conv forward'), *_conv_arrays())
    runs = [e[:2] for e in fe.executions]
    full, cut = 1 + _graphs.TRIALS * _graphs.REPEATS, 1 + _graphs.REPEATS
    assert _plans.SLOW == 3.0
    assert [runs.count(('nchw', i)) for i in range(4)] == [full + 1, cut, full, full]
    assert runs.count(('nhwc', 0)) == cut       # 4.0 > 3 x 1.0
    assert runs[-1] == ('nchw', 0)
    (choice,) = _tuner.choices('cudnn_graph')
    assert choice['picked'] == 'nchw plan 0'
    assert choice['median_ms'] == {'nchw plan 0': 1.0, 'nchw plan 1': 50.0, 'nchw plan 2': 2.0,
                                   'nchw plan 3': 2.9, 'nhwc plan 0': 4.0}


def test_without_autotune_the_heuristics_first_plan_and_no_nhwc_graph(monkeypatch):
    fe = standin.install(monkeypatch)
    fe.plan_costs = {'nchw': [3.0, 1.0]}
    monkeypatch.setattr(_tuner, 'enabled', False)
    key = key_of('conv weight gradient')
    _graphs.conv(key, dev(numpy.zeros((2, 4, 6, 6), 'f')), dev(numpy.zeros((2, 8, 6, 6), 'f')),
                 dev(numpy.zeros((8, 4, 3, 3), 'f')))
    assert [e[:2] for e in fe.executions] == [('nchw', 0)]
    assert len(fe.graphs) == 1


def test_an_nhwc_pick_copies_in_and_out_and_gives_nchw(monkeypatch):
    fe = standin.install(monkeypatch)
    fe.plan_costs = {'nchw': [3.0], 'nhwc': [1.0]}
    monkeypatch.setattr(_tuner, 'enabled', True)
    key = key_of('conv forward')
    x = dev(numpy.arange(2 * 4 * 6 * 6, dtype='f').reshape(2, 4, 6, 6))
    out = dev(numpy.zeros((2, 8, 6, 6), 'f'))
    _graphs.conv(key, x, dev(numpy.zeros((8, 4, 3, 3), 'f')), out)
    layout, _, pack = fe.executions[-1]
    assert layout == 'nhwc'
    x_tensor = [t for t in pack if t.name == 'x'][0]
    assert pack[x_tensor].data.ptr != x.data.ptr    # a channels-last copy went in
    assert out.flags.c_contiguous and out.shape == (2, 8, 6, 6)


# The layers on Chainer's functions --------------------------------------------

def test_forward_layer_runs_the_graph_adds_the_bias_and_retains_inputs(monkeypatch):
    standin.install(monkeypatch)
    node = conv_node(stride=1, pad=1)
    x = dev(numpy.zeros((2, 4, 6, 6), 'f'))
    W = dev(numpy.zeros((8, 4, 3, 3), 'f'))
    b = dev(numpy.arange(8, dtype='f'))
    called = []
    with chainer.using_config('use_cudnn', 'auto'):
        y, = _layers.forward_layer(lambda *a: called.append(a), node, (x, W, b))
    assert called == []
    assert y.shape == (2, 8, 6, 6)
    numpy.testing.assert_array_equal(y[1, :, 2, 3], numpy.arange(8))  # graph out (0) + b
    assert _paths.summary()['conv forward']['paths'] == {'graph': 1}


def test_layers_leave_the_call_to_chainer_and_say_why(monkeypatch):
    fe = standin.install(monkeypatch)
    x = dev(numpy.zeros((2, 4, 6, 6), 'f'))
    W = dev(numpy.zeros((8, 4, 3, 3), 'f'))
    chainer_ran = []

    def chainer_code(node, inputs):
        chainer_ran.append(node)
        return 'chainer',
    with chainer.using_config('use_cudnn', 'never'):
        assert _layers.forward_layer(chainer_code, conv_node(pad=1), (x, W)) == ('chainer',)
    with chainer.using_config('use_cudnn', 'auto'):
        _layers.forward_layer(chainer_code, conv_node(pad=1, cover_all=True), (x, W))
        fe.unsupported.add('nchw')
        _layers.forward_layer(chainer_code, conv_node(pad=1), (x, W))
        _layers.forward_layer(chainer_code, conv_node(pad=1), (x, W))
    assert len(chainer_ran) == 4
    reasons = _paths.summary()['conv forward']['reasons']
    assert reasons["use_cudnn='never'"] == 1
    assert sum(n for r, n in reasons.items() if r.startswith('cover_all=True')) == 1
    assert sum(n for r, n in reasons.items() if r.startswith('no cuDNN engine for NCHW')) == 2
    assert len(fe.graphs) == 1              # the refused key was built once


def test_input_gradient_layer_and_an_outsize_the_convolution_cannot_give(monkeypatch):
    standin.install(monkeypatch)
    W = dev(numpy.zeros((8, 4, 3, 3), 'f'))
    gy = dev(numpy.zeros((2, 8, 3, 3), 'f'))
    with chainer.using_config('use_cudnn', 'auto'):
        # The convolution's input gradient: stride 2, pad 1, input 6x6 -> 3x3.
        node = _deconv2d.Deconvolution2DFunction(stride=2, pad=1, outsize=(6, 6))
        node._input_layouts = (None, None)
        gx, = _layers.input_gradient_layer(lambda *a: None, node, (gy, W))
        assert gx.shape == (2, 4, 6, 6)
        # To 8x8: a convolution of 8x8 gives 4x4, not 3x3 (Chainer's cover_all).
        node = _deconv2d.Deconvolution2DFunction(stride=2, pad=1, outsize=(8, 8))
        node._input_layouts = (None, None)
        out = _layers.input_gradient_layer(lambda *a: ('chainer',), node, (gy, W))
    assert out == ('chainer',)
    entry = _paths.summary()['conv input gradient']
    assert entry['paths'] == {'graph': 1, 'chainer': 1}
    assert list(entry['reasons']) == [
        'cover_all=True (cuDNN has no cover_all; Chainer skips cuDNN too)']


def test_weight_gradient_layer_takes_the_weights_dtype(monkeypatch):
    standin.install(monkeypatch)
    node = _conv2d.Convolution2DGradW(conv_node(pad=1), (8, 4, 3, 3), numpy.float32, None)
    node._input_layouts = (None, None)
    x = dev(numpy.zeros((2, 4, 6, 6), 'f'))
    gy = dev(numpy.zeros((2, 8, 6, 6), 'f'))
    with chainer.using_config('use_cudnn', 'auto'):
        gW, = _layers.weight_gradient_layer(lambda *a: None, node, (x, gy))
    assert gW.shape == (8, 4, 3, 3) and gW.dtype == numpy.float32


# BatchNormalization -------------------------------------------------------------

def bn_key(op, x_dtype='f', param_dtype='f', running=True, shape=(2, 4, 3, 3)):
    x = numpy.zeros(shape, x_dtype)
    return _keys.bn_key(op, x, numpy.zeros(shape[1], param_dtype), 2e-5, running, 0)


def test_batchnorm_forward_graph_takes_the_running_statistics_eps_and_momentum(monkeypatch):
    fe = standin.install(monkeypatch)
    key = bn_key('batchnorm forward', x_dtype='e')      # mixed16: float32 parameters
    x = dev(numpy.zeros((2, 4, 3, 3), 'e'))
    gamma, beta = dev(numpy.ones(4, 'f')), dev(numpy.zeros(4, 'f'))
    mean, var = dev(numpy.full(4, 5.0, 'f')), dev(numpy.full(4, 7.0, 'f'))
    y, batch_mean, inv_std = _bn_graphs.bn_forward(key, x, gamma, beta, mean, var, 2e-5, 0.9)
    graph = fe.graphs[0]
    ((kind, kwargs),) = graph.ops
    assert kind == 'batchnorm'
    assert kwargs['input'].dim == [2, 4, 3, 3] and kwargs['input'].data_type == 'HALF'
    assert kwargs['scale'].dim == [1, 4, 1, 1] and kwargs['scale'].data_type == 'FLOAT'
    assert kwargs['in_running_mean'] is not None and kwargs['epsilon'].is_pass_by_value
    assert graph.scalars == {'eps': pytest.approx(2e-5), 'momentum': pytest.approx(0.1)}
    # y in x's dtype; the statistics Chainer keeps in the promoted dtype.
    assert y.dtype == numpy.float16 and y.shape == (2, 4, 3, 3)
    assert batch_mean.dtype == numpy.float32 and batch_mean.shape == (4,)
    assert inv_std.shape == (4,)
    # The running statistics are the graph's next_running_* outputs (zeros
    # from the stand-in), written into Chainer's arrays in place.
    assert (mean == 0).all() and (var == 0).all()


def test_batchnorm_without_running_statistics_and_its_backward(monkeypatch):
    fe = standin.install(monkeypatch)
    key = bn_key('batchnorm forward', running=False)
    x = dev(numpy.zeros((2, 4, 3, 3), 'f'))
    g = dev(numpy.ones(4, 'f'))
    _bn_graphs.bn_forward(key, x, g, g, None, None, 2e-5, 0.9)
    kwargs = fe.graphs[0].ops[0][1]
    assert kwargs['in_running_mean'] is None and kwargs['in_running_var'] is None
    key = bn_key('batchnorm backward')
    gx, ggamma, gbeta = _bn_graphs.bn_backward(key, x, g, x, dev(numpy.zeros(4, 'f')), g)
    kind, kwargs = fe.graphs[1].ops[0]
    assert kind == 'batchnorm_backward'
    assert kwargs['grad'].name == 'gy' and kwargs['inv_variance'].name == 'inv_std'
    assert gx.shape == (2, 4, 3, 3) and ggamma.shape == gbeta.shape == (4,)


def test_batchnorm_goes_nhwc_where_nchw_has_no_engine_and_says_why_when_neither(monkeypatch):
    fe = standin.install(monkeypatch)
    fe.unsupported.add('nchw')
    key = bn_key('batchnorm backward')
    x = dev(numpy.arange(72, dtype='f').reshape(2, 4, 3, 3))
    g = dev(numpy.ones(4, 'f'))
    gx, _, _ = _bn_graphs.bn_backward(key, x, g, x, g, g)
    assert gx.flags.c_contiguous and gx.shape == (2, 4, 3, 3)
    assert [e[0] for e in fe.executions] == ['nhwc']
    x_tensor = [t for t in fe.executions[0][2] if t.name == 'x'][0]
    assert fe.executions[0][2][x_tensor].data.ptr != x.data.ptr     # a channels-last copy
    fe.unsupported.add('nhwc')
    other = bn_key('batchnorm backward', shape=(4, 4, 3, 3))
    with pytest.raises(_graphs.Unsupported, match='NCHW .*; no cuDNN engine for NHWC'):
        _bn_graphs.bn_backward(other, x, g, x, g, g)


def test_batchnorm_inference_stays_chainers_and_says_why(monkeypatch):
    """cuDNN 9.19 had no engine for it on its own (every key of ResNet-50,
    both layouts, on an H200): no graph is built, the call is counted."""
    from chainer.functions.normalization import batch_normalization as _bn
    fe = standin.install(monkeypatch)
    monkeypatch.setattr(_layers, '_is_cupy', lambda x: True)
    monkeypatch.setenv(_layers.BN_ENV, '1')
    _paths.forget()
    node = _bn.FixedBatchNormalization(eps=2e-5)
    x, g = dev(numpy.zeros((2, 4, 3, 3), 'f')), dev(numpy.ones(4, 'f'))
    calls = []
    with chainer.using_config('use_cudnn', 'auto'):
        out = _layers.inference_layer(lambda n, i: calls.append(i) or 'y', node, (x, g, g, g, g))
    with chainer.using_config('use_cudnn', 'never'):
        _layers.inference_layer(lambda n, i: None, node, (x, g, g, g, g))
    assert out == 'y' and len(calls) == 1 and not fe.graphs
    assert _paths.summary()['batchnorm inference'] == {
        'paths': {'chainer': 2}, 'reasons': {_layers.BN_INFERENCE: 1, "use_cudnn='never'": 1}}
    with pytest.raises(ValueError, match='no BatchNormalization graph'):
        _bn_graphs.build_bn(bn_key('batchnorm inference'))


def test_batchnorm_selector_takes_the_graph_where_chainer_takes_its_general_code(monkeypatch):
    from chainer.functions.normalization import batch_normalization as _bn
    standin.install(monkeypatch)
    monkeypatch.setattr(_layers, '_is_cupy', lambda x: True)
    node = _bn.BatchNormalization(eps=2e-5, mean=dev(numpy.zeros(4, 'f')),
                                  var=dev(numpy.ones(4, 'f')), decay=0.9)
    node.axis, node.key_axis = (0, 2, 3), (1,)
    node._input_layouts = (None, None, None)
    x, g = dev(numpy.zeros((2, 4, 3, 3), 'f')), dev(numpy.ones(4, 'f'))
    monkeypatch.delenv(_layers.BN_ENV, raising=False)
    with chainer.using_config('use_cudnn', 'auto'):
        # off until proven on a GPU: Chainer's, and the report says why
        assert type(_layers._select(node, (x, g, g))) is _bn.GeneralBatchNormalizationImpl
        monkeypatch.setenv(_layers.BN_ENV, '1')
        assert _layers._select(node, (x, g, g)) is _layers._IMPL
        assert type(_layers._select(node, (x[:1, :, :1, :1].copy(), g, g))) is not \
            _layers.GraphImpl           # one value per channel: Chainer's
    with chainer.using_config('use_cudnn', 'never'):
        assert type(_layers._select(node, (x, g, g))) is _bn.GeneralBatchNormalizationImpl
    reasons = _paths.summary()['batchnorm forward']['reasons']
    assert reasons == {'one value per channel (the variance of one value)': 1,
                       "use_cudnn='never'": 1, _layers.BN_OFF: 1}
    assert 'FASTCHAIN_CUDNN_BN=1 turns them on' in _layers.BN_OFF


def test_enable_puts_the_graph_layers_in_force_where_cupy_has_no_cudnn(monkeypatch):
    """A CuPy 14 machine with the frontend (stand-in probes): enable() wraps
    Chainer's convolution and BatchNormalization functions, the report says
    which path each operation took, and disable() takes the layers away."""
    import warnings
    import fastchain
    from fastchain.backends import cuda
    from fastchain.backends._status import Status
    from fastchain.cudnn import _group
    from fastchain.config import _patches
    monkeypatch.setattr(cuda, 'available', lambda: True)
    monkeypatch.setattr(cuda, 'cudnn_status', lambda: Status(
        False, why='CuPy 14.2.0 has no cuDNN (removed in CuPy 14)', fix='...'))
    monkeypatch.setattr(cuda, 'cupy_status', lambda: Status(True, version='14.2.0'))
    monkeypatch.setattr(cuda, 'tensor_cores_available', lambda: True)
    monkeypatch.setattr(_group, 'graph_status', lambda: Status(
        True, version='frontend 1.16.0, cuDNN 9.10.0'))
    _paths.record('conv forward', 'graph')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with fastchain.enable(cudnn='auto', loader_workers=0) as h:
            for owner, name, _ in _layers.functions():
                assert _patches.in_force(owner, name, 'cudnn') is not None, (owner, name)
            report = h.report()['cudnn']
            assert report['available'] and report['active']
            assert report['note'].startswith('cuDNN graphs (frontend 1.16.0, cuDNN 9.10.0): '
                                             'CuPy 14.2.0 has no cuDNN')
            assert report['calls'] == {'conv forward': {'paths': {'graph': 1}, 'reasons': {}}}
            assert h.report()['autotune']['note'] is None   # the graphs' plans are tuned
        with fastchain.enable(cudnn='never', loader_workers=0) as h:
            assert _patches.in_force(_conv2d.Convolution2DFunction, 'forward_gpu',
                                     'cudnn') is None
            assert not h.report()['cudnn']['active']
    for owner, name, _ in _layers.functions():
        assert _patches.in_force(owner, name, 'cudnn') is None


def test_batchnorm_layer_chains_after_the_selector_the_node_has(monkeypatch):
    """Under onednn (outer, CPU) the node's selector is onednn's; the graph
    layer asks it first and takes over only where it gave Chainer's general
    implementation, and wraps a node once."""
    from chainer.functions.normalization import batch_normalization as _bn
    standin.install(monkeypatch)
    monkeypatch.setattr(_layers, '_is_cupy', lambda x: True)
    monkeypatch.setenv(_layers.BN_ENV, '1')      # off by default until proven on a GPU
    asked = []

    def onednn_like(func, inputs):
        asked.append(func)
        return _bn.GeneralBatchNormalizationImpl()
    node = _bn.BatchNormalization(eps=2e-5, mean=dev(numpy.zeros(4, 'f')),
                                  var=dev(numpy.ones(4, 'f')), impl_selector=onednn_like)
    node.axis, node.key_axis = (0, 2, 3), (1,)
    node._input_layouts = (None, None, None)
    x, g = dev(numpy.zeros((2, 4, 3, 3), 'f')), dev(numpy.ones(4, 'f'))
    selectors = []
    for _ in range(2):
        _layers.training_layer(lambda n, i: selectors.append(n._impl_selector), node, (x, g, g))
    assert selectors[0] is selectors[1]             # wrapped once
    with chainer.using_config('use_cudnn', 'auto'):
        assert node._impl_selector(node, (x, g, g)) is _layers._IMPL
    assert asked == [node]


def test_a_frontend_that_refuses_the_description_leaves_the_call_to_chainer(monkeypatch):
    """An older or newer frontend without an argument fastchain passes: the
    key is refused with the error named, and Chainer's code runs."""
    fe = standin.install(monkeypatch)

    def old_batchnorm(**kwargs):
        raise TypeError('batchnorm(): incompatible function arguments')
    monkeypatch.setattr(standin.Graph, 'batchnorm', lambda self, **kw: old_batchnorm(**kw))
    key = bn_key('batchnorm forward')
    x, g = dev(numpy.zeros((2, 4, 3, 3), 'f')), dev(numpy.ones(4, 'f'))
    with pytest.raises(_graphs.Unsupported) as e:
        _bn_graphs.bn_forward(key, x, g, g, g.copy(), g.copy(), 2e-5, 0.9)
    assert e.value.reason.startswith(
        'the cuDNN frontend could not describe the NCHW graph (TypeError: batchnorm(): '
        'incompatible function arguments); the cuDNN frontend could not describe the NHWC')
    assert _graphs.refused(key) == e.value.reason
    assert len(fe.graphs) == 2


def _conv_arrays(dtype='f'):
    return (dev(numpy.zeros((2, 4, 6, 6), dtype)), dev(numpy.zeros((8, 4, 3, 3), dtype)),
            dev(numpy.zeros((2, 8, 6, 6), dtype)))


def test_a_plan_cudnn_will_not_run_is_passed_over_then_the_key_refused(monkeypatch):
    fe = standin.install(monkeypatch)
    monkeypatch.setattr(_tuner, 'enabled', False)
    fe.plan_costs = {'nchw': [1.0, 1.0, 1.0]}
    fe.fail_plans = {'nchw': {0}}
    key = key_of('conv forward')
    _graphs.conv(key, *_conv_arrays())
    # Plan 0 refused at execution (tried: a handle passed), plan 1 ran once:
    # the call's own result.
    assert len(fe.handles) == 2 and all(h is not None for h in fe.handles)
    assert [e[:2] for e in fe.executions] == [('nchw', 1)]
    _graphs.conv(key, *_conv_arrays())
    assert [e[:2] for e in fe.executions][-1] == ('nchw', 1)
    # Every plan refused: the key goes to Chainer, with cuDNN's error named.
    fe.fail_plans = {'nchw': {0, 1, 2}}
    other = key_of('conv forward', dtype='e')
    with pytest.raises(_graphs.Unsupported, match="cuDNN could run none of the NCHW graph's "
                                                  '3 plan.s. .RuntimeError: CUDNN_STATUS_NOT_'):
        _graphs.conv(other, *_conv_arrays())
    assert _graphs.refused(other).startswith('cuDNN could run none')
    # Once a key has run, an error is an error (not a quiet fallback).
    fe.fail_plans = {'nchw': {1}}
    with pytest.raises(RuntimeError, match='CUDNN_STATUS_NOT_SUPPORTED'):
        _graphs.conv(key, *_conv_arrays())
    assert _graphs.refused(key) is None


def test_plans_the_frontend_keeps_but_never_built_are_no_candidates(monkeypatch):
    """Frontend 1.32 keeps deselected and unbuilt plans in its list; they
    are skipped, a plan failing under autotune is no candidate, and the
    reports work with the alternatives that could not run."""
    fe = standin.install(monkeypatch)
    monkeypatch.setattr(_tuner, 'enabled', True)
    fe.plan_costs = {'nchw': [1.0, 5.0, 2.0, 3.0]}
    fe.dead = {'nchw': {0}}
    fe.fail_plans = {'nchw': {2}}
    fe.unsupported.add('nhwc')
    key = key_of('conv forward')
    _graphs.conv(key, *_conv_arrays())
    runs = [e[:2] for e in fe.executions]
    assert ('nchw', 0) not in runs and runs[-1] == ('nchw', 3)
    (choice,) = _tuner.choices('cudnn_graph')
    assert choice['picked'] == 'nchw plan 3'
    assert choice['median_ms'] == {'nchw plan 1': 5.0, 'nchw plan 2': None, 'nchw plan 3': 3.0}
    summary = _tuner.summary()['cudnn_graph']           # no median of nothing
    assert summary['ms'] == {'nchw plan 1': 5.0, 'nchw plan 3': 3.0}
    assert _tuner.decided()[('cudnn_graph', repr(key))]['median_ms']['nchw plan 2'] is None


def test_an_unaligned_view_stays_chainers_and_out_of_memory_is_not_a_refusal(monkeypatch):
    standin.install(monkeypatch)
    node = conv_node(pad=1)
    x = dev(numpy.zeros((3, 1, 1, 3), 'e'))[1:]        # 6 bytes into the array
    W = dev(numpy.zeros((2, 1, 1, 1), 'e'))
    assert x.flags.c_contiguous and x.data.ptr % 16
    assert _keys.conv_refusal('conv forward', node, (x, W)).startswith(
        'an input not 16-byte aligned')

    class OutOfMemoryError(Exception):
        pass

    def no_memory(*args, **kwargs):
        raise OutOfMemoryError('out of memory allocating 1 GiB')
    key = key_of('conv forward')
    monkeypatch.setattr(standin.Graph, 'execute_plan_at_index', no_memory)
    with pytest.raises(OutOfMemoryError):
        _graphs.conv(key, *_conv_arrays())
    assert _graphs.refused(key) is None             # the next call tries again


def test_plans_over_chainers_workspace_size_are_deselected(monkeypatch):
    fe = standin.install(monkeypatch)
    node = conv_node(pad=1)
    key = _keys.conv_key('conv forward', node, (2, 4, 6, 6), (8, 4, 3, 3), (2, 8, 6, 6), 'f',
                         False, False, 0, workspace=8 << 20)
    _graphs.build_conv(key)
    assert fe.graphs[0].workspace_limit == 8 << 20
    assert key != key._replace(workspace=512 << 20)     # another limit, another graph


def test_a_batchnorm_graph_whose_first_plan_cudnn_refuses_runs_the_next(monkeypatch):
    fe = standin.install(monkeypatch)
    fe.plan_costs = {'nchw': [1.0, 1.0]}
    fe.fail_plans = {'nchw': {0}}
    key = bn_key('batchnorm forward')
    x, g = dev(numpy.zeros((2, 4, 3, 3), 'f')), dev(numpy.ones(4, 'f'))
    _bn_graphs.bn_forward(key, x, g, g, g.copy(), g.copy(), 2e-5, 0.9)
    assert [e[:2] for e in fe.executions] == [('nchw', 1)]
    _bn_graphs.bn_forward(key, x, g, g, g.copy(), g.copy(), 2e-5, 0.9)
    assert [e[:2] for e in fe.executions][-1] == ('nchw', 1)


def test_a_batchnorm_graph_that_fails_its_first_run_leaves_the_statistics_alone(monkeypatch):
    fe = standin.install(monkeypatch)
    fe.fail_plans = {'nchw': {0}}
    key = bn_key('batchnorm forward')
    x, g = dev(numpy.zeros((2, 4, 3, 3), 'f')), dev(numpy.ones(4, 'f'))
    mean, var = dev(numpy.full(4, 5.0, 'f')), dev(numpy.full(4, 7.0, 'f'))
    with pytest.raises(_graphs.Unsupported, match='cuDNN could not run the NCHW graph'):
        _bn_graphs.bn_forward(key, x, g, g, mean, var, 2e-5, 0.9)
    assert (mean == 5).all() and (var == 7).all()       # Chainer's code updates them
    assert _graphs.refused(key).startswith('cuDNN could not run the NCHW graph')


def test_deselected_plans_in_the_list_are_passed_over_one_by_one(monkeypatch):
    """Frontend 1.32 keeps deselected plans in its list and its own
    build_plans(ALL) stops at the first with a RuntimeError: plans are built
    one index at a time, the deselected ones passed over, with autotune and
    without."""
    fe = standin.install(monkeypatch)
    fe.plan_costs = {'nchw': [1.0, 4.0, 2.0, 3.0]}
    fe.dead = {'nchw': {0, 2}}
    fe.unsupported.add('nhwc')
    monkeypatch.setattr(_tuner, 'enabled', False)
    key = key_of('conv forward')
    _graphs.conv(key, *_conv_arrays())
    assert [e[:2] for e in fe.executions] == [('nchw', 1)]      # the first that built
    assert _graphs.refused(key) is None
    monkeypatch.setattr(_tuner, 'enabled', True)
    other = key_of('conv forward', dtype='e')
    _graphs.conv(other, *_conv_arrays('e'))
    (choice,) = _tuner.choices('cudnn_graph')
    assert set(choice['median_ms']) == {'nchw plan 1', 'nchw plan 3'}
    assert choice['picked'] == 'nchw plan 3'


def test_a_graph_with_no_plan_that_builds_is_refused_with_the_first_reason(monkeypatch):
    fe = standin.install(monkeypatch)
    fe.plan_costs = {'nchw': [1.0, 2.0]}
    fe.dead = {'nchw': {0, 1}}
    with pytest.raises(_graphs.Unsupported, match=r"no cuDNN engine for NCHW \(no plan of 2 "
                       r"built: plan 0: RuntimeError: Chosen plan index has been deselected"):
        _graphs.build_conv(key_of('conv forward'))


def test_a_frontend_without_build_plan_at_index_walks_its_own_list(monkeypatch):
    fe = standin.install(monkeypatch)
    fe.per_index = False
    fe.plan_costs = {'nchw': [1.0, 2.0]}
    g = _graphs.build_conv(key_of('conv forward'))
    assert fe.graphs[0].steps[-1] == ('build_plans', 'HEURISTICS') and g.plans[:1] == [0]
    _graphs.more_plans(g, _graphs.MAX_PLANS, fe)        # autotune comes: all of it
    assert fe.graphs[0].steps[-1] == ('build_plans', 'ALL') and g.plans == [0, 1]
    _graphs.more_plans(g, _graphs.MAX_PLANS, fe)        # once
    assert [s for s in fe.graphs[0].steps if s[0] == 'build_plans'] == [
        ('build_plans', 'HEURISTICS'), ('build_plans', 'ALL')]


def test_a_key_met_first_without_autotune_is_tuned_when_autotune_comes(monkeypatch):
    """The heuristics' plan and autotune's are kept apart: the ladder's
    cudnn rung (no autotune) runs a key before its autotune rung does."""
    fe = standin.install(monkeypatch)
    fe.plan_costs = {'nchw': [3.0, 1.0, 2.0]}
    fe.unsupported.add('nhwc')
    key = key_of('conv forward')
    monkeypatch.setattr(_tuner, 'enabled', False)
    _graphs.conv(key, *_conv_arrays())
    assert fe.graphs[0].built == {0}            # one plan built without autotune
    monkeypatch.setattr(_tuner, 'enabled', True)
    _graphs.conv(key, *_conv_arrays())
    assert fe.graphs[0].built == {0, 1, 2}      # the rest built for the search
    (choice,) = _tuner.choices('cudnn_graph')
    assert choice['picked'] == 'nchw plan 1'
    before = len(fe.executions)
    monkeypatch.setattr(_tuner, 'enabled', False)
    _graphs.conv(key, *_conv_arrays())          # without autotune: the heuristics' again
    assert [e[:2] for e in fe.executions[before:]] == [('nchw', 0)]


def test_the_graphs_keep_their_own_workspace_limit_which_enable_sets(monkeypatch):
    """Chainer's workspace setting answers 0 without CuPy's cuDNN (and
    ignores a new value): the graphs' limit is theirs, 8 MiB by default."""
    import chainer.backends.cuda as chainer_cuda
    import fastchain
    from fastchain.cudnn import _group
    assert not chainer_cuda.cudnn_enabled and chainer_cuda.get_max_workspace_size() == 0
    get, set_ = _group.workspace_accessors()
    assert get() == _keys.DEFAULT_WORKSPACE == 8 << 20
    node = conv_node(pad=1)
    assert _layers._key('conv forward', node, (2, 4, 6, 6), (8, 4, 3, 3), (2, 8, 6, 6), 'f',
                        0).workspace == 8 << 20
    with fastchain.enable(workspace_size=64 << 20, loader_workers=0):
        assert get() == 64 << 20
        assert _layers._key('conv forward', node, (2, 4, 6, 6), (8, 4, 3, 3), (2, 8, 6, 6),
                            'f', 0).workspace == 64 << 20
    assert get() == 8 << 20


def test_an_unaligned_beta_stays_chainers():
    """beta was not in BatchNormalization's alignment check (x, gamma and
    the running statistics were): a view at an odd offset would reach cuDNN
    as a misaligned pointer (a review)."""
    x = dev(numpy.zeros((2, 8, 2, 2), 'f'))
    gamma = dev(numpy.ones(8, 'f'))
    beta = dev(numpy.zeros(9, 'f'))[1:]
    assert beta.data.ptr % 16
    assert _keys.bn_refusal(x, gamma, (0, 2, 3)) is None
    assert _keys.bn_refusal(x, gamma, (0, 2, 3), beta=beta).startswith(
        'an input not 16-byte aligned')
