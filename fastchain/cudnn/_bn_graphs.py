"""cuDNN graphs for BatchNormalization: the training forward (batch
statistics, running statistics updated as Chainer does) and its backward;
built, cached and refused per key as the convolution
graphs are (:mod:`fastchain.cudnn._graphs`, which also says how they run).

Layout: the NCHW graph where cuDNN has an engine for it, else the NHWC graph
on channels-last copies of the 4-d arrays (cuDNN's normalization engines
favour NHWC); a key neither builds for stays Chainer's, with both reasons.
No inference graph: cuDNN 9.19 had no engine for BatchNormalization's
inference on its own, in either layout, for any key of ResNet-50 (an H200,
2026-11-28); Chainer's one elementwise kernel runs it (``_layers``).
Not autotuned: the heuristics' first plan (BatchNormalization is memory
bound; the choice that matters is the layout).
"""

import numpy

from fastchain.cudnn import _frontend
from fastchain.cudnn._graphs import (HEURISTIC_PLANS, _dtype, _entry, _execute, _finish, _lock,
                                     _new_graph, _nhwc, _tensor, builds, first_runs, is_oom,
                                     more_plans, strides)


class HostScalar(numpy.ndarray):
    """A float32 scalar passed by value, shaped (1, 1, 1, 1), as the
    frontend takes it: through DLPack, on the host. Frontend 1.32 asks for
    the capsule with ``stream=-1`` (DLPack's "the caller orders its work"),
    which NumPy refuses for a host array ("NumPy only supports
    stream=None"): every BatchNormalization training forward failed on it
    (an H200, 2026-11-28). A host array is on no stream, so the request is
    answered without one. An array in every other respect: 1.32's Python
    normalization engines read the value with ``.reshape(-1)[0].item()``."""

    def __new__(cls, value):
        return numpy.full((1, 1, 1, 1), value, numpy.float32).view(cls)

    def __dlpack__(self, stream=None, **kwargs):
        return self.view(numpy.ndarray).__dlpack__()


def _param_shape(x_shape):
    return (1, x_shape[1], 1, 1)


def build_bn(key, layout='nchw'):
    """The graph of a BatchNormalization key."""
    cudnn = _frontend.module()
    handle = _frontend.handle(key.device)
    graph = _new_graph(cudnn, key, key.dtype, handle)
    p_shape = _param_shape(key.x_shape)
    x = _tensor(graph, cudnn, 'x', key.x_shape, key.dtype, layout)

    def param(name):
        return _tensor(graph, cudnn, name, p_shape, key.param_dtype)

    tensors = {'x': x}
    if key.op == 'batchnorm forward':
        tensors.update(gamma=param('gamma'), beta=param('beta'))
        if key.running:
            tensors.update(running_mean=param('running_mean'),
                           running_var=param('running_var'))
        scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT,
                      is_pass_by_value=True)
        tensors['eps'] = graph.tensor(name='eps', **scalar)
        if key.running:     # else a tensor the operation never reads, in the variant pack
            tensors['momentum'] = graph.tensor(name='momentum', **scalar)
        y, mean, inv_std, next_mean, next_var = graph.batchnorm(
            name='bn', input=x, scale=tensors['gamma'], bias=tensors['beta'],
            in_running_mean=tensors.get('running_mean'),
            in_running_var=tensors.get('running_var'),
            epsilon=tensors['eps'], momentum=tensors.get('momentum'))
        outputs = {'y': (y, key.x_shape, key.dtype, layout),
                   'mean': (mean, p_shape, 'float32', 'nchw'),
                   'inv_std': (inv_std, p_shape, 'float32', 'nchw')}
        if key.running:
            outputs.update(next_mean=(next_mean, p_shape, key.param_dtype, 'nchw'),
                           next_var=(next_var, p_shape, key.param_dtype, 'nchw'))
    elif key.op == 'batchnorm backward':
        tensors.update(gy=_tensor(graph, cudnn, 'gy', key.x_shape, key.dtype, layout),
                       gamma=param('gamma'),
                       mean=_tensor(graph, cudnn, 'mean', p_shape, 'float32'),
                       inv_std=_tensor(graph, cudnn, 'inv_std', p_shape, 'float32'))
        gx, ggamma, gbeta = graph.batchnorm_backward(
            name='bn_backward', grad=tensors['gy'], input=x, scale=tensors['gamma'],
            mean=tensors['mean'], inv_variance=tensors['inv_std'])
        outputs = {'gx': (gx, key.x_shape, key.dtype, layout),
                   'ggamma': (ggamma, p_shape, key.param_dtype, 'nchw'),
                   'gbeta': (gbeta, p_shape, key.param_dtype, 'nchw')}
    else:
        raise ValueError('no BatchNormalization graph for {!r}'.format(key.op))
    for name, (tensor, shape, dtype, out_layout) in outputs.items():
        if tensor is None:
            continue
        tensor.set_output(True).set_data_type(_dtype(cudnn, dtype)) \
            .set_dim(list(shape)).set_stride(strides(shape, out_layout))
        tensors[name] = tensor
    with _lock:
        builds[(key, layout)] += 1
    return _finish(cudnn, graph, key, tensors, layout, want=HEURISTIC_PLANS)


def _bn_entry(key):
    """BatchNormalization: NCHW where cuDNN has an engine for it, else the
    NHWC graph on channels-last copies; its first built plan to start with."""
    entry = _entry(key, build_bn, ('nchw', 'nhwc'))
    if entry.chosen is None:
        (layout, g), = entry.graphs.items()
        entry.chosen = (layout, g.plans[0])
    return entry


def _run_bn(entry, arrays):
    """Executes the entry's chosen graph; 4-d arrays go through
    channels-last copies where the graph is NHWC. Returns the outputs."""
    import cupy
    layout, plan = entry.chosen
    g = entry.graphs[layout]
    pack, outputs = {}, {}
    for name, tensor in g.tensors.items():
        if name in ('eps', 'momentum'):
            pack[tensor] = HostScalar(arrays[name])
            continue
        array = arrays.get(name)
        if array is None:               # an output: allocate it
            shape = entry.key.x_shape if name in ('y', 'gx') else \
                _param_shape(entry.key.x_shape)
            dtype = entry.key.dtype if name in ('y', 'gx') else (
                'float32' if name in ('mean', 'inv_std') else entry.key.param_dtype)
            array = outputs[name] = cupy.empty(shape, dtype=dtype)
        if array.ndim == 4 and array.shape[1:] != (array.shape[1], 1, 1) and layout == 'nhwc':
            if name in outputs:
                array = outputs[name] = cupy.empty(
                    array.shape[:1] + array.shape[2:] + array.shape[1:2],
                    array.dtype).transpose(0, 3, 1, 2)
            else:
                array = _nhwc(array)
        pack[tensor] = array
    _execute(g, pack, plan, entry.key.device)
    for name, array in outputs.items():
        if not array.flags.c_contiguous:
            outputs[name] = cupy.ascontiguousarray(array)
    return outputs


def _run(entry, arrays):
    """The chosen plan; on a key's first run, the built plans in the
    heuristics' order until one runs (cuDNN may refuse a plan only then)."""
    if entry.proven:
        return _run_bn(entry, arrays)
    layout, last, i = entry.chosen[0], None, 0
    g = entry.graphs[layout]
    while True:
        if i >= len(g.plans):
            more_plans(g, i + 1, _frontend.module())    # the next that builds
            if i >= len(g.plans):
                raise last
        entry.chosen, i = (layout, g.plans[i]), i + 1
        try:
            return _run_bn(entry, arrays)
        except Exception as e:
            if is_oom(e):
                raise
            last = e


def bn_forward(key, x, gamma, beta, running_mean, running_var, eps, decay):
    """Training forward: (y, batch mean, inverse std), the running
    statistics updated in place (Chainer's decay; cuDNN's unbiased
    variance, as Chainer's)."""
    entry = _bn_entry(key)
    p = _param_shape(key.x_shape)
    arrays = {'x': x, 'gamma': gamma.reshape(p), 'beta': beta.reshape(p),
              'eps': eps, 'momentum': 1.0 - decay}
    if key.running:
        arrays.update(running_mean=running_mean.reshape(p), running_var=running_var.reshape(p))
    out = first_runs(entry, lambda: _run(entry, arrays))
    if key.running:
        running_mean[...] = out['next_mean'].reshape(running_mean.shape)
        running_var[...] = out['next_var'].reshape(running_var.shape)
    # Chainer keeps them in x's and gamma's promoted dtype (its backward and
    # double backward expect that one).
    interm = numpy.promote_types(key.dtype, key.param_dtype)
    c = key.x_shape[1]
    return (out['y'], out['mean'].reshape(c).astype(interm, copy=False),
            out['inv_std'].reshape(c).astype(interm, copy=False))


def bn_backward(key, x, gamma, gy, mean, inv_std):
    """(gx, ggamma, gbeta) from the forward's batch mean and inverse std."""
    entry = _bn_entry(key)
    p = _param_shape(key.x_shape)
    import cupy
    arrays = {'x': x, 'gy': gy, 'gamma': gamma.reshape(p),
              'mean': cupy.ascontiguousarray(mean, numpy.float32).reshape(p),
              'inv_std': cupy.ascontiguousarray(inv_std, numpy.float32).reshape(p)}
    out = first_runs(entry, lambda: _run(entry, arrays))
    c = key.x_shape[1]
    return out['gx'], out['ggamma'].reshape(c), out['gbeta'].reshape(c)
