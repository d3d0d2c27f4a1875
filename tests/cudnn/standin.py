"""Stand-ins for the cuDNN frontend's ``cudnn`` module and for the parts of
CuPy the graph backend calls (no GPU here). The graph records what it is
told; executing a plan advances a device clock by that plan's cost, so the
autotuner's CUDA-event timing can be checked; nothing is computed."""

import sys
import types

import numpy


class DevArray(numpy.ndarray):
    """A NumPy array posing as a CuPy one: ``.data.ptr`` and ``.device.id``."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__['data'][0])

    @property
    def device(self):
        return types.SimpleNamespace(id=0)


def dev(array):
    return numpy.asarray(array).view(DevArray)


class Clock:
    def __init__(self):
        self.now = 0.0      # ms


class Event:
    def __init__(self, clock):
        self.clock, self.t = clock, None

    def record(self, stream=None):
        self.t = self.clock.now

    def synchronize(self):
        pass


def fake_cupy(clock):
    cupy = types.ModuleType('cupy')
    cupy.__path__ = []
    cupy.cuda = types.SimpleNamespace(
        Event=lambda *a, **k: Event(clock),
        get_elapsed_time=lambda a, b: b.t - a.t,
        get_current_stream=lambda: types.SimpleNamespace(ptr=1234),
        Device=lambda i: _Nothing())
    cupy.empty = lambda shape, dtype=numpy.float32: dev(numpy.zeros(shape, dtype))
    cupy.ascontiguousarray = lambda a, dtype=None: dev(numpy.ascontiguousarray(a, dtype))
    cupy.reciprocal = lambda a: dev(numpy.reciprocal(a))
    cupy.sqrt = lambda a, dtype=None: dev(numpy.sqrt(a, dtype=dtype))
    return cupy


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Tensor:
    def __init__(self, graph, name, dim=None, stride=None, data_type=None,
                 is_pass_by_value=False):
        self.graph, self.name = graph, name
        self.dim, self.stride, self.data_type = dim, stride, data_type
        self.is_pass_by_value = is_pass_by_value
        self.output = False

    def set_output(self, value):
        self.output = value
        return self

    def set_data_type(self, value):
        self.data_type = value
        return self

    def set_dim(self, value):
        self.dim = value
        return self

    def set_stride(self, value):
        self.stride = value
        return self


class NotSupported(RuntimeError):
    pass


class Graph:
    """Records the graph; ``frontend.plan_costs[layout]`` gives the plans
    (ms each) a graph of that layout gets; ``frontend.unsupported`` makes
    ``check_support`` raise for graphs whose first tensor has that layout."""

    def __init__(self, frontend, **kwargs):
        self.frontend, self.kwargs = frontend, kwargs
        self.tensors, self.ops, self.deselected, self.steps = [], [], [], []
        self.executed = []
        self.built = set()
        if not frontend.per_index:          # a frontend before build_plan_at_index
            self.build_plan_at_index = None
        frontend.graphs.append(self)

    @property
    def layout(self):
        first = self.tensors[0]
        return 'nhwc' if first.stride[1] == 1 and first.dim[1] != 1 else 'nchw'

    def tensor(self, name, dim, stride, data_type, is_pass_by_value=False):
        t = Tensor(self, name, dim, stride, data_type, is_pass_by_value)
        self.tensors.append(t)
        return t

    def _op(self, kind, n_out, kwargs):
        self.ops.append((kind, kwargs))
        outs = [Tensor(self, '{}_out{}'.format(kind, i)) for i in range(n_out)]
        return outs[0] if n_out == 1 else outs

    def conv_fprop(self, **kwargs):
        return self._op('conv_fprop', 1, kwargs)

    def conv_dgrad(self, **kwargs):
        return self._op('conv_dgrad', 1, kwargs)

    def conv_wgrad(self, **kwargs):
        return self._op('conv_wgrad', 1, kwargs)

    def batchnorm(self, **kwargs):
        return self._op('batchnorm', 5, kwargs)

    def batchnorm_backward(self, **kwargs):
        return self._op('batchnorm_backward', 3, kwargs)

    def batchnorm_inference(self, **kwargs):
        return self._op('batchnorm_inference', 1, kwargs)

    def validate(self):
        self.steps.append('validate')

    def build_operation_graph(self):
        self.steps.append('build_operation_graph')

    def create_execution_plans(self, modes):
        self.steps.append(('create_execution_plans', tuple(modes)))

    def deselect_numeric_notes(self, notes):
        self.deselected += list(notes)

    def deselect_workspace_greater_than(self, limit):
        self.workspace_limit = limit

    def check_support(self):
        self.steps.append('check_support')
        if self.layout in self.frontend.unsupported:
            raise NotSupported('cudnnGraphNotSupportedError: no engine\nsecond line')

    def build_plans(self, policy):
        # As frontend 1.32's walk: deselected plans stay in its list, and
        # building one raises a RuntimeError that ends the walk (only a
        # cudnnGraphNotSupportedError moves it on).
        self.steps.append(('build_plans', policy))
        indices = range(self.get_execution_plan_count()) if policy == 'ALL' else [0]
        for index in indices:
            self._build(index)

    def _build(self, index):
        if index in self.frontend.dead.get(self.layout, ()):
            raise RuntimeError('Chosen plan index has been deselected.')
        self.built.add(index)

    def build_plan_at_index(self, index):
        self.steps.append(('build_plan_at_index', index))
        self._build(index)
        return self

    def get_execution_plan_count(self):
        return len(self.frontend.plan_costs.get(self.layout, [1.0]))

    def get_workspace_size_plan_at_index(self, index):
        # deselected and unbuilt plans stay in the list: nothing to tell
        if index in self.frontend.dead.get(self.layout, ()):
            raise RuntimeError('plan {} is not executable'.format(index))
        self.frontend.size_queries.append((self.layout, index))
        return 256 * index if index in self.built else 0

    def execute_plan_at_index(self, pack, workspace, index, handle=None):
        self.frontend.handles.append(handle)
        if (self.frontend.fail_plans.get(self.layout, set())
                | self.frontend.dead.get(self.layout, set())) & {index}:
            raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED: plan {} cannot run".format(index))
        # The frontend takes every pointer through DLPack: device arrays,
        # and host arrays for the scalars passed by value, whose capsule
        # frontend 1.32 asks for with stream=-1 (NumPy's own arrays refuse it).
        assert all(hasattr(a, '__dlpack__') for a in pack.values())
        assert hasattr(workspace, '__dlpack__')
        for t, a in pack.items():
            if t.is_pass_by_value:
                a.__dlpack__(stream=-1)
                assert a.__dlpack_device__()[0] == 1        # kDLCPU
        self.scalars = {t.name: float(numpy.from_dlpack(a).ravel()[0])
                        for t, a in pack.items() if t.is_pass_by_value}
        assert index in self.built, 'plan {} executed unbuilt'.format(index)
        self.executed.append(index)
        self.frontend.executions.append((self.layout, index, pack))
        self.frontend.workspaces.append((self.layout, index, workspace.size))
        self.frontend.clock.now += self.frontend.plan_costs.get(self.layout, [1.0])[index]


def frontend(clock, backend=90300):
    """A ``cudnn`` module: the names the graph backend uses."""
    m = types.ModuleType('cudnn')
    m.__version__ = '1.16.0'
    m.graphs, m.executions, m.streams, m.handles = [], [], [], []
    m.workspaces, m.size_queries = [], []     # (layout, plan, bytes), (layout, plan)
    m.fail_plans = {}       # layout -> plan indices that raise when executed
    m.dead = {}             # layout -> plan indices kept in the list but never built
    m.per_index = True      # build_plan_at_index (frontend 1.x); False: build_plans alone
    m.plan_costs = {}
    m.unsupported = set()
    m.clock = clock
    m.data_type = types.SimpleNamespace(HALF='HALF', FLOAT='FLOAT', BFLOAT16='BFLOAT16')
    m.heur_mode = types.SimpleNamespace(A='A', B='B', FALLBACK='FALLBACK')
    m.build_plan_policy = types.SimpleNamespace(ALL='ALL', HEURISTICS_CHOICE='HEURISTICS')
    m.numerical_note = types.SimpleNamespace(
        TENSOR_CORE='TENSOR_CORE', NONDETERMINISTIC='NONDETERMINISTIC',
        DOWN_CONVERT_INPUTS='DOWN_CONVERT_INPUTS',
        REDUCED_PRECISION_REDUCTION='REDUCED_PRECISION_REDUCTION')
    m.backend_version = (lambda: backend) if not callable(backend) else backend
    m.create_handle = lambda: object()
    m.set_stream = lambda handle, stream: m.streams.append(stream)
    m.pygraph = lambda **kwargs: Graph(m, **kwargs)
    return m


def install(monkeypatch, clock=None, **kwargs):
    """Puts the stand-in frontend and CuPy in ``sys.modules``; returns the frontend."""
    from fastchain.cudnn import _frontend, _graphs, _paths
    clock = clock or Clock()
    m = frontend(clock, **kwargs)
    monkeypatch.setitem(sys.modules, 'cudnn', m)
    monkeypatch.setitem(sys.modules, 'cupy', fake_cupy(clock))
    monkeypatch.setattr(_frontend, 'installed_version', lambda: None)   # the stand-in's
    _frontend.forget()
    _graphs.forget()
    _paths.forget()
    return m
