"""Applies the cuDNN options through Chainer's own configuration and, where
CuPy has no cuDNN (CuPy 14), through fastchain's cuDNN graphs
(:mod:`fastchain.cudnn._layers`)."""

from fastchain.backends import cuda
from fastchain.config import _patches
from fastchain.config._options import Group, Option, State

_MODES = ('always', 'auto', 'never')
WORKSPACE = 'chainer.backends.cuda.max_workspace_size'
TF32 = 'cupy fp32 GEMM compute type (TF32)'
COMPUTE_TYPE_TF32 = 7       # CuPy's _routines_linalg (not exported to Python by name)


def tf32_accessors():
    """(get, set) of CuPy's compute type for fp32 GEMMs. ``tensor_cores=True``
    sets TF32 there: on CuPy 14 (no cuDNN) it is the only way fp32 work
    reaches TensorCores, for 2-D GEMMs (``F.linear``, im2col convolutions);
    batched matmul ignores it. CuPy itself keeps the default on GPUs below
    sm_80, with a warning."""
    import numpy
    import cupy
    return (lambda: cupy._core.get_compute_type(numpy.float32),
            lambda v: cupy._core.set_compute_type(numpy.float32, v))


def _workspace(value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError('expected a whole number of bytes')
    if value < 0:
        raise ValueError('must be >= 0 bytes')
    return value


def workspace_accessors():
    """(get, set) of cuDNN's workspace size: Chainer's where CuPy has cuDNN;
    on CuPy 14 the cuDNN graphs' own limit (Chainer's answers 0 without
    cuDNN and ignores a new value, which would leave the graphs only the
    plans that need no workspace)."""
    import chainer.backends.cuda as chainer_cuda
    if chainer_cuda.cudnn_enabled:
        return chainer_cuda.get_max_workspace_size, chainer_cuda.set_max_workspace_size
    from fastchain.cudnn import _keys
    return _keys.get_workspace_limit, _keys.set_workspace_limit


class CudnnGroup(Group):
    name = 'cudnn'
    options = (
        Option('cudnn', "cuDNN use: 'always', 'auto', 'never' (True = 'always')",
               choices=_MODES, aliases={True: 'always', False: 'never'}),
        Option('tensor_cores', "TensorCore math: 'always', 'auto', 'never'",
               choices=_MODES, aliases={True: 'always', False: 'never'}),
        Option('workspace_size', 'bytes of cuDNN workspace (Chainer: 8 MiB)',
               check=_workspace),
    )

    def probe(self):
        status = cuda.cudnn_status()
        graphs = graph_status()
        if not status.available and graphs.available:
            status = graphs
        tc_ok = status.available and cuda.tensor_cores_available()
        return [
            State('cudnn', status.available, False, why=status.why, fix=status.fix,
                  note=None if status is not graphs else
                  'cuDNN graphs ({}): CuPy {} has no cuDNN, fastchain runs convolutions '
                  'through cuDNN 9 graphs (not bitwise equal to '
                  "Chainer's im2col, as cuDNN never was); BatchNormalization's graphs only "
                  'with FASTCHAIN_CUDNN_BN=1 (not yet proven on a GPU)'.format(
                      graphs.version, cuda.cupy_status().version)),
            State('tensor_cores', tc_ok, False,
                  why=status.why or (None if tc_ok else
                                     'no GPU with compute capability >= 7.0'),
                  fix=status.fix or (None if tc_ok else
                                     'use a Volta or newer GPU')),
        ]

    def plan(self, values, explicit, plan):
        if values['cudnn'] is not None:
            plan.config('use_cudnn', values['cudnn'])
        if values['cudnn'] != 'never' and graph_status().available:
            from fastchain.cudnn import _layers
            for owner, name, layer in _layers.functions():
                plan.wrap(owner, name, 'cudnn', layer)
        elif values['cudnn'] != 'never' and stats_only():
            # FASTCHAIN_CUDNN_BN=stats needs no cuDNN: CuPy's reductions only
            from fastchain.cudnn import _layers
            for owner, name, layer in _layers.bn_functions():
                plan.wrap(owner, name, 'cudnn', layer)
        if values['tensor_cores'] is not None:
            plan.config('use_cudnn_tensor_core', values['tensor_cores'])
        if values['tensor_cores'] == 'always' and cuda.available():
            # Changes fp32 results (a 10-bit mantissa in the products): only
            # where asked for in so many words.
            plan.value(TF32, *tf32_accessors(), COMPUTE_TYPE_TF32)
        if values['workspace_size'] is not None:
            plan.value(WORKSPACE, *workspace_accessors(), values['workspace_size'])

    def states(self, values, explicit):
        import chainer
        cfg = chainer.global_config
        states = {s.name: s for s in self.probe()}
        # What Chainer will do now, whoever set it.
        in_force = {'cudnn': cfg.use_cudnn != 'never',
                    'tensor_cores': cfg.use_cudnn_tensor_core != 'never'}
        for name, on in in_force.items():
            s = states[name]
            s.setting = values[name]
            s.requested = name in explicit and values[name] not in (False, 'never')
            s.active = s.available and on
        cudnn = states['cudnn']
        if graph_status().available:            # the graphs: are the layers in force?
            cudnn.active = cudnn.active and graphs_in_force()
            if cudnn.active:
                from fastchain.cudnn import _paths
                cudnn.calls = _paths.summary()
        tc = states['tensor_cores']
        if not tc.active and cuda.tensor_cores_available() and _tf32_in_force():
            # No cuDNN (CuPy 14): fp32 GEMMs on TensorCores through TF32.
            tc.available = tc.active = True
            tc.why = tc.fix = None
            tc.note = ('TF32 for fp32 2-D GEMMs (CuPy, no cuDNN); fp16 GEMMs use '
                       'TensorCores whatever this option')
        size = values['workspace_size']
        if size is not None:
            cudnn = states['cudnn']
            get, _ = workspace_accessors()
            states['workspace_size'] = State(
                'workspace_size', cudnn.available, cudnn.available and get() == size,
                requested='workspace_size' in explicit, why=cudnn.why, fix=cudnn.fix,
                setting=size)
        return list(states.values())


def graph_status():
    """cuDNN graphs usable here (a GPU, CuPy without cuDNN, the frontend and
    cuDNN 9), as a :class:`~fastchain.backends._status.Status`. Not looked
    for without a GPU or where CuPy's own cuDNN works."""
    from fastchain.backends._status import Status
    if not cuda.available():
        return Status(False, why=cuda.cupy_status().why, fix=cuda.cupy_status().fix)
    if cuda.cudnn_status().available:
        return Status(False, why="CuPy's own cuDNN is in use (Chainer's cuDNN code)")
    from fastchain.cudnn import _frontend
    available, version, why, fix = _frontend.status()
    return Status(available, version=version, why=why, fix=fix)


def stats_only():
    """``FASTCHAIN_CUDNN_BN=stats`` on a GPU whose CuPy has no cuDNN, where
    the graphs are not usable (no frontend or cuDNN 9): BatchNormalization's
    two-level reductions run all the same."""
    from fastchain.cudnn import _layers
    return _layers.bn_mode() == 'stats' and cuda.available() and \
        not cuda.cudnn_status().available


def graphs_in_force():
    from fastchain.cudnn import _layers
    return all(_patches.in_force(owner, name, 'cudnn') is not None
               for owner, name, _ in _layers.functions())


def _tf32_in_force():
    from fastchain.config import _patches
    return TF32 in _patches.value_labels()


GROUP = CudnnGroup()
