"""fastchain's graph descriptions against the real cuDNN frontend (the
``nvidia-cudnn-frontend`` wheel, which ``make setup`` installs without its
dependencies): every convolution and BatchNormalization graph fastchain
builds is described through the frontend's own API, up to the point where
the frontend needs cuDNN and a GPU (validation lowers the graph to cuDNN's
backend). What cuDNN then does with them is test_graphs_gpu.py's."""

import numpy
import pytest

from fastchain.cudnn import _bn_graphs, _frontend, _graphs, _keys

cudnn = pytest.importorskip('cudnn', reason='the cuDNN frontend is not installed '
                            '(pip install --no-deps nvidia-cudnn-frontend)')
if not hasattr(cudnn, 'pygraph'):
    pytest.skip('a module named cudnn that is not the cuDNN frontend', allow_module_level=True)


@pytest.fixture
def described(monkeypatch):
    """Builders run against the real module; the steps that need cuDNN stop."""
    monkeypatch.setattr(_frontend, '_loaded', cudnn)
    monkeypatch.setattr(_frontend, 'handle', lambda device: None)

    def describe_only(module, graph, key, tensors, layout, want=None):
        return _graphs._Graph(graph, tensors, layout, 1)
    monkeypatch.setattr(_graphs, '_finish', describe_only)
    monkeypatch.setattr(_bn_graphs, '_finish', describe_only)
    yield
    _graphs.forget()


class Node:
    sy = sx = 2
    ph = pw = 1
    dy = dx = 1
    groups = 2


@pytest.mark.parametrize('layout', ['nchw', 'nhwc'])
@pytest.mark.parametrize('dtype', ['float16', 'float32'])
@pytest.mark.parametrize('op, out', [('conv forward', [4, 6, 5, 5]),
                                     ('conv input gradient', [4, 8, 9, 9]),
                                     ('conv weight gradient', [6, 4, 3, 3])])
def test_convolution_graphs_are_described_through_the_frontend(described, op, out, dtype,
                                                               layout):
    key = _keys.conv_key(op, Node, (4, 8, 9, 9), (6, 4, 3, 3), (4, 6, 5, 5), dtype, True,
                         False, 0)
    g = _graphs.build_conv(key, layout)
    t = g.tensors['out']
    # Each tensor at the port the frontend's node has for it.
    (node,) = g.graph.nodes
    ports = {'conv forward': (('image', 'a'), ('weight', 'b'), 'Y'),
             'conv input gradient': (('loss', 'a'), ('filter', 'b'), 'DX'),
             'conv weight gradient': (('image', 'a'), ('loss', 'b'), 'DW')}[op]
    for port, name in ports[:2]:
        assert node.inputs[port] is g.tensors[name], port
    assert node.outputs[ports[2]] is t
    assert list(t.dim) == out
    assert list(t.stride) == _graphs.strides(out, layout)
    assert t.data_type == (cudnn.data_type.HALF if dtype == 'float16' else cudnn.data_type.FLOAT)


@pytest.mark.parametrize('layout', ['nchw', 'nhwc'])
@pytest.mark.parametrize('running', [True, False])
@pytest.mark.parametrize('op, outputs', [
    ('batchnorm forward', {'y', 'mean', 'inv_std'}),
    ('batchnorm backward', {'gx', 'ggamma', 'gbeta'})])
def test_batchnorm_graphs_are_described_through_the_frontend(described, op, outputs, running,
                                                             layout):
    key = _keys.bn_key(op, numpy.zeros((4, 8, 5, 5), 'e'), numpy.zeros(8, 'f'), 2e-5,
                       running, 0)
    g = _bn_graphs.build_bn(key, layout)
    if op == 'batchnorm forward' and running:
        outputs = outputs | {'next_mean', 'next_var'}
    assert outputs <= set(g.tensors)
    (node,) = g.graph.nodes
    inputs = {'batchnorm forward': {'input': 'x', 'scale': 'gamma', 'bias': 'beta',
                                    'epsilon': 'eps'},
              'batchnorm backward': {'grad': 'gy', 'input': 'x', 'scale': 'gamma',
                                     'mean': 'mean', 'inv_variance': 'inv_std'}}[op]
    if op == 'batchnorm forward' and running:
        inputs.update(in_running_mean='running_mean', in_running_var='running_var',
                      momentum='momentum')
    ports = {'batchnorm forward': {'Y': 'y', 'mean': 'mean', 'inv_var': 'inv_std',
                                   'next_running_mean': 'next_mean',
                                   'next_running_var': 'next_var'},
             'batchnorm backward': {'DX': 'gx', 'DScale': 'ggamma', 'DBias': 'gbeta'}}[op]
    for port, name in inputs.items():
        assert node.inputs[port] is g.tensors[name], port
    for port, name in ports.items():
        if name in g.tensors:
            assert node.outputs[port] is g.tensors[name], port
    if op == 'batchnorm forward':
        assert node.inputs['epsilon'].is_pass_by_value
    # momentum only with the running statistics it updates: a tensor the
    # operation does not read would be in the variant pack
    assert ('momentum' in g.tensors) == (op == 'batchnorm forward' and running)
    if 'momentum' in g.tensors:
        assert node.inputs['momentum'].is_pass_by_value
    assert ('next_mean' in g.tensors) == (op == 'batchnorm forward' and running)
    for name in outputs:
        assert g.tensors[name].dim[1] == 8
    assert list(g.tensors['x'].stride) == _graphs.strides((4, 8, 5, 5), layout)


def test_the_frontend_without_cudnn_says_so():
    """This machine has the frontend but no cuDNN library: status names it."""
    _frontend.forget()
    try:
        available, _, why, fix = _frontend.status()
    finally:
        _frontend.forget()
    try:
        cudnn.backend_version()
        pytest.skip('cuDNN loads here')
    except Exception:
        pass
    assert not available
    assert why.startswith('the cuDNN frontend {} could not load cuDNN 9: '.format(
        cudnn.__version__))
    assert 'nvidia-cudnn-cu' in fix


def test_the_scalars_passed_by_value_are_read_as_the_frontend_reads_them(described):
    """eps and momentum as fastchain packs them, read by the frontend's own
    readers: the backend's, and 1.32's Python one, which asks for each
    operand's DLPack capsule with stream=-1 (NumPy's host arrays refuse it:
    every training forward failed on it on the first GPU run that reached it;
    the stand-in's execute asks the same of what fastchain packs)."""
    key = _keys.bn_key('batchnorm forward', numpy.zeros((4, 8, 5, 5), 'f'),
                       numpy.zeros(8, 'f'), 2e-5, True, 0)
    g = _bn_graphs.build_bn(key, 'nchw')
    describe = getattr(g.graph, '_describe', None)
    for name, value in (('eps', 2e-5), ('momentum', 0.1)):
        scalar = _bn_graphs.HostScalar(value)
        ptr = cudnn._pybind_module._get_data_ptr(scalar)
        assert ptr == scalar.ctypes.data
        assert scalar.reshape(-1)[0].item() == numpy.float32(value)  # 1.32's Python engines
        if describe is not None:
            read, _ = describe(scalar, g.tensors[name].uid)
            assert read == ptr, name
        assert numpy.from_dlpack(scalar).ravel()[0] == numpy.float32(value)


def test_a_forward_pack_is_normalised_by_the_frontend_as_it_executes(described):
    """The whole variant pack of a training forward through 1.32's own
    normalisation (what execute does before the backend runs); NumPy host
    arrays for the scalars fail there, as they did on the GPU."""
    key = _keys.bn_key('batchnorm forward', numpy.zeros((4, 8, 5, 5), 'f'),
                       numpy.zeros(8, 'f'), 2e-5, True, 0)
    g = _bn_graphs.build_bn(key, 'nchw')
    normalize = getattr(g.graph, '_normalize', None)
    if normalize is None:
        pytest.skip('this frontend has no Python normalisation of the pack')

    def pack(scalar):
        # device operands stand in as host arrays of their shape and dtype:
        # what is read here is the geometry, not the device
        return {t.uid: scalar(0.5) if name in ('eps', 'momentum') else
                _bn_graphs.HostScalar(0.0) for name, t in g.tensors.items()}
    normalize(pack(_bn_graphs.HostScalar), None)
    with pytest.raises(Exception, match='stream'):
        normalize(pack(lambda v: numpy.full((1, 1, 1, 1), v, numpy.float32)), None)
