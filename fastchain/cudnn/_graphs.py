"""cuDNN 9 operation graphs for Chainer's convolutions and BatchNormalization.

One graph per key (:mod:`fastchain.cudnn._keys`), built on the key's first
call and kept for the process: validated, lowered, its execution plans made
from the heuristics (mode A, then the fallback list) and checked, and the
plans built. Calls of a key then execute a plan on CuPy's arrays (the
frontend takes their pointers through DLPack), a workspace from CuPy's
memory pool and the device's cuDNN handle set to CuPy's current stream.

Which plan: without autotune, the heuristics' first. With autotune
(``fastchain.tune._tuner.enabled``, what ``enable(autotune=...)`` sets), on
the key's first call every plan that builds (at most ``MAX_PLANS``) is run
``TRIALS`` times after one untimed run, each timed with CUDA events (one
trial only for a plan that took over ``_plans.SLOW`` times the best so far),
and the fastest median is kept, for convolutions also against the same graph on
channels-last (NHWC) copies, the transposes timed with it (cuDNN's
TensorCore engines favour NHWC; Chainer's arrays stay NCHW outside).
The key's first call gives the kept plan's result (it runs last); the
choice is in ``handle.report()`` under autotune, kind ``'cudnn_graph'``.

Numerics. float16 graphs take float16 data with float32 accumulation
(``compute_data_type`` FLOAT), TensorCores allowed unless
``use_cudnn_tensor_core='never'``; float32 graphs exclude the engines cuDNN
notes as TensorCore (TF32) unless ``use_cudnn_tensor_core='always'``.
``cudnn_deterministic`` excludes the engines noted non-deterministic.
BatchNormalization keeps its statistics and parameters in their own dtype
(float32 under ``mixed16``). Results are cuDNN's, not bitwise Chainer's
im2col: the GPU tests state the tolerance per dtype
(``tests/cudnn/test_graphs_gpu.py``).

A key cuDNN has no plan for raises :class:`Unsupported` once; the reason is
kept, Chainer's code runs for that key from then on, and ``doctor`` and
``handle.report()`` show the reason (:mod:`fastchain.cudnn._paths`).
"""

import collections
import threading

import numpy

from fastchain.cudnn import _frontend, _keys
from fastchain.cudnn._plans import (is_oom, more_plans, plan_count,  # noqa: F401 (is_oom)
                                     plan_label, time_plan, workspace_for)

TRIALS = 3
REPEATS = 5             # runs between one pair of CUDA events (a trial: their mean)
MAX_PLANS = 16
HEURISTIC_PLANS = 1     # built without autotune: the first that builds (more if it fails)

_lock = threading.Lock()
_entries = {}           # key -> _Entry
_refused = {}           # key -> reason
builds = collections.Counter()      # key -> graphs built (tests: once per key)


class Unsupported(Exception):
    """cuDNN has no plan for a key (the reason is kept for reports)."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


def refused(key):
    """The reason cuDNN refused ``key`` before, or None."""
    return _refused.get(key)


class _Entry:
    """A key's graphs (one per layout tried) and the chosen (layout, plan)."""

    __slots__ = ('key', 'graphs', 'chosen', 'tuned', 'times', 'proven')

    def __init__(self, key):
        self.key = key
        self.graphs = {}        # layout -> _Graph
        self.chosen = None      # (layout, plan index): the heuristics' (no autotune)
        self.tuned = None       # (layout, plan index): autotune's (each kept apart, so a
                                # key met first without autotune is still tuned with it)
        self.times = {}         # 'layout plan i' -> median ms (autotune)
        self.proven = False     # a call ran to the end: later errors are real errors


class _Graph:
    """A built graph: its plans in the frontend's list (``count``), those
    built so far (``plans``), the next index to try, the first build error."""

    __slots__ = ('graph', 'tensors', 'plans', 'layout', 'count', 'next', 'error', 'walked',
                 'workspace')

    def __init__(self, graph, tensors, layout, count):
        self.graph, self.tensors, self.layout, self.walked = graph, tensors, layout, 0
        self.plans, self.count, self.next, self.error = [], count, 0, None
        self.workspace = {}     # plan -> its workspace bytes (asked once)


def _dtype(cudnn, dtype):
    return {numpy.dtype(numpy.float16): cudnn.data_type.HALF,
            numpy.dtype(numpy.float32): cudnn.data_type.FLOAT}[numpy.dtype(dtype)]


def strides(shape, layout):
    """Element strides of a 4-d NCHW-ordered ``shape`` stored as ``layout``."""
    n, c, h, w = shape
    if layout == 'nhwc':
        return [h * w * c, 1, w * c, c]
    return [c * h * w, h * w, w, 1]


def _new_graph(cudnn, key, io_dtype, handle):
    return cudnn.pygraph(io_data_type=_dtype(cudnn, io_dtype),
                         intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=handle)


def _tensor(graph, cudnn, name, shape, dtype, layout='nchw'):
    return graph.tensor(name=name, dim=list(shape), stride=strides(shape, layout),
                        data_type=_dtype(cudnn, dtype))


def _finish(cudnn, graph, key, tensors, layout, want=None):
    """Validate, lower, make and filter the plans, then build them one by one
    (``want`` of them: ``MAX_PLANS`` under autotune, else the heuristics'
    first that builds); Unsupported when none does."""
    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        # fp32 accumulation as stated: no engine that converts the inputs
        # down or reduces in a lower precision; TF32 only where asked for.
        notes = [cudnn.numerical_note.DOWN_CONVERT_INPUTS,
                 cudnn.numerical_note.REDUCED_PRECISION_REDUCTION]
        if isinstance(key, _keys.ConvKey) and not key.tensor_cores:
            notes.append(cudnn.numerical_note.TENSOR_CORE)
        if getattr(key, 'deterministic', False):
            notes.append(cudnn.numerical_note.NONDETERMINISTIC)
        graph.deselect_numeric_notes(notes)
        limit = getattr(key, 'workspace', None)
        if limit is not None and hasattr(graph, 'deselect_workspace_greater_than'):
            graph.deselect_workspace_greater_than(limit)
        graph.check_support()
        g = _Graph(graph, tensors, layout, plan_count(graph))
        more_plans(g, want or (MAX_PLANS if _tuning() else HEURISTIC_PLANS), cudnn)
    except Exception as e:      # the frontend's errors (cudnnGraphNotSupportedError, ...)
        if is_oom(e):
            raise
        raise Unsupported('no cuDNN engine for {} ({}: {})'.format(
            layout.upper(), type(e).__name__, _first_line(e)))
    if not g.plans:
        raise Unsupported('no cuDNN engine for {} (no plan of {} built{})'.format(
            layout.upper(), g.count, ': ' + g.error if g.error else ''))
    return g


def _first_line(e):
    text = str(e).strip()
    return text.splitlines()[0] if text else ''


def build_conv(key, layout='nchw'):
    """The graph of a convolution key, its tensors named 'a', 'b' (inputs)
    and 'out', in ``layout``."""
    cudnn = _frontend.module()
    handle = _frontend.handle(key.device)
    graph = _new_graph(cudnn, key, key.dtype, handle)
    x_shape, w_shape, y_shape = key.x_shape, key.w_shape, key.y_shape
    dims = dict(padding=list(key.pad), stride=list(key.stride), dilation=list(key.dilation),
                compute_data_type=cudnn.data_type.FLOAT)
    if key.op == 'conv forward':
        a = _tensor(graph, cudnn, 'x', x_shape, key.dtype, layout)
        b = _tensor(graph, cudnn, 'w', w_shape, key.dtype, layout)
        out = graph.conv_fprop(image=a, weight=b, name='fprop', **dims)
        out_shape = y_shape
    elif key.op == 'conv input gradient':
        a = _tensor(graph, cudnn, 'dy', y_shape, key.dtype, layout)
        b = _tensor(graph, cudnn, 'w', w_shape, key.dtype, layout)
        out = graph.conv_dgrad(loss=a, filter=b, name='dgrad', **dims)
        out_shape = x_shape
    else:
        a = _tensor(graph, cudnn, 'x', x_shape, key.dtype, layout)
        b = _tensor(graph, cudnn, 'dy', y_shape, key.dtype, layout)
        out = graph.conv_wgrad(image=a, loss=b, name='wgrad', **dims)
        out_shape = w_shape
    out.set_output(True).set_data_type(_dtype(cudnn, key.dtype)) \
        .set_dim(list(out_shape)).set_stride(strides(out_shape, layout))
    with _lock:
        builds[(key, layout)] += 1
    return _finish(cudnn, graph, key, {'a': a, 'b': b, 'out': out}, layout)


def guarded(builder, key, layout):
    """``builder(key, layout)``; any error of the frontend while the graph is
    described (an API it does not have, a tensor it refuses) is an
    :class:`Unsupported` naming it, so the call stays Chainer's with the
    reason shown instead of failing the training step."""
    try:
        return builder(key, layout)
    except Unsupported:
        raise
    except Exception as e:
        raise Unsupported('the cuDNN frontend could not describe the {} graph ({}: {})'.format(
            layout.upper(), type(e).__name__, _first_line(e)))


def _entry(key, builder, layouts=('nchw',)):
    """The key's entry, its graph built on first use in the first of
    ``layouts`` cuDNN has an engine for; a key none builds for is refused
    (every layout's reason kept) and raises :class:`Unsupported`."""
    entry = _entries.get(key)
    if entry is not None:
        return entry
    reason = _refused.get(key)
    if reason is not None:
        raise Unsupported(reason)
    entry, reasons = _Entry(key), []
    for layout in layouts:
        try:
            entry.graphs[layout] = guarded(builder, key, layout)
            break
        except Unsupported as e:
            reasons.append(e.reason)
    if not entry.graphs:
        _refused[key] = '; '.join(reasons)
        raise Unsupported(_refused[key])
    _entries[key] = entry
    return entry


def _execute(g, pack, plan, device):
    """Runs plan ``plan`` of ``g`` on CuPy's current stream. ``pack`` maps
    the graph's tensors to arrays: the frontend takes each one's pointer
    through DLPack (CuPy arrays on the device, NumPy arrays for the scalars
    passed by value), as it does the workspace's."""
    handle = _frontend.bind_stream(device)
    workspace = workspace_for(g, plan)
    run_plan = getattr(g.graph, 'execute_plan_at_index', None)
    if run_plan is not None:
        run_plan(pack, workspace, plan, handle=handle)
    else:
        g.graph.execute(pack, workspace)


def first_runs(entry, run):
    """``run()`` for ``entry``; until one call of the key has run to the end,
    an error (cuDNN refusing a plan at execution) refuses the key with the
    error named, and the call goes to Chainer's code: raises
    :class:`Unsupported`. Afterwards errors propagate as they are."""
    if entry.proven:
        return run()
    try:
        out = run()
    except Exception as e:
        if is_oom(e):
            raise           # memory now, not the key: the next call tries again
        reason = e.reason if isinstance(e, Unsupported) else \
            'cuDNN could not run the {} graph ({}: {})'.format(
                (entry.tuned or entry.chosen or ('nchw',))[0].upper(), type(e).__name__,
                _first_line(e))
        with _lock:
            _refused[entry.key] = reason
            _entries.pop(entry.key, None)
        raise Unsupported(reason) from None
    entry.proven = True
    return out


def _pointers(g, arrays):
    """The variant pack: each graph tensor to its array."""
    return {g.tensors[name]: array for name, array in arrays.items()}


def _nhwc(array):
    """A channels-last copy, viewed in NCHW index order (what the NHWC graph
    is told: NCHW dims, NHWC strides)."""
    import cupy
    return cupy.ascontiguousarray(array.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def _run_conv_layout(entry, layout, plan, a, b, out):
    """One run of (layout, plan) into ``out`` (NCHW), copies included."""
    g = entry.graphs[layout]
    if layout == 'nchw':
        _execute(g, _pointers(g, {'a': a, 'b': b, 'out': out}), plan, entry.key.device)
        return
    import cupy
    a2, b2 = _nhwc(a), _nhwc(b)
    out2 = cupy.empty(out.shape[:1] + out.shape[2:] + out.shape[1:2], out.dtype)
    _execute(g, _pointers(g, {'a': a2, 'b': b2, 'out': out2}), plan, entry.key.device)
    out[...] = out2.transpose(0, 3, 1, 2)


def conv(key, a, b, out):
    """Runs a convolution key's graph: ``out`` gets the forward output, the
    input gradient or the weight gradient (``a``, ``b``: x and W, dy and W,
    x and dy; CuPy arrays, C-contiguous NCHW)."""
    entry = _entry(key, build_conv)
    tuning = _tuning()
    if entry.proven:                    # the common case: the key's plan, no search
        chosen = entry.tuned if tuning else entry.chosen
        if chosen is not None:
            _run_conv_layout(entry, *chosen, a, b, out)
            return

    def run():
        chosen = entry.tuned if tuning else entry.chosen
        if chosen is None:
            chosen, wrote = _choose(entry, lambda layout, plan: _run_conv_layout(
                entry, layout, plan, a, b, out), tuning, conv_layouts=True)
            if tuning:
                entry.tuned = chosen
            else:
                entry.chosen = chosen
            if wrote:       # the chosen plan's run was the last: ``out`` is its result
                return
        _run_conv_layout(entry, *chosen, a, b, out)
    first_runs(entry, run)


def _tuning():
    from fastchain.tune import _tuner
    return _tuner.enabled


def _choose(entry, run, tuning, conv_layouts=False):
    """((layout, plan), wrote) for a key: the first NCHW plan in the
    heuristics' order that runs, or with autotune the fastest of every plan
    (and layout) timed, or the pick an autotune cache file holds for the key
    (:mod:`fastchain.tune._cache`). ``wrote``: the last run made here was the
    chosen one's (its output is the call's)."""
    cudnn = _frontend.module()
    if not tuning:
        # The heuristics' order: the first plan that runs (built as needed).
        g, last, i = entry.graphs['nchw'], None, 0
        while True:
            if i >= len(g.plans):
                more_plans(g, i + 1, cudnn)
                if i >= len(g.plans):
                    break
            plan, i = g.plans[i], i + 1
            try:
                run('nchw', plan)
                return ('nchw', plan), True
            except Exception as e:
                if is_oom(e):
                    raise
                last = e
        raise Unsupported('cuDNN could run none of the NCHW graph\'s {} plan(s) ({}: {})'.format(
            len(g.plans), type(last).__name__, _first_line(last)))
    import cupy
    from fastchain.tune import _tuner
    if conv_layouts and 'nhwc' not in entry.graphs:
        try:
            entry.graphs['nhwc'] = guarded(build_conv, entry.key, 'nhwc')
        except Unsupported:
            pass
    for g in entry.graphs.values():         # a graph built without autotune: the rest
        more_plans(g, MAX_PLANS, cudnn)
    candidates = [(layout, plan) for layout, g in entry.graphs.items()
                  for plan in g.plans[:MAX_PLANS]]
    names = [plan_label(entry.graphs[layout], plan) for layout, plan in candidates]
    choice = _tuner.choice('cudnn_graph', entry.key, names, lambda: _keys.describe(entry.key))
    if choice.picked is not None:           # read from a cache file
        return candidates[names.index(choice.picked)], False
    events = cupy.cuda.Event(), cupy.cuda.Event()
    times = {}
    for candidate in candidates:
        try:
            times[candidate] = time_plan(lambda: run(*candidate), events, TRIALS, REPEATS,
                                         min(times.values(), default=None))
        except Exception as e:
            if is_oom(e):
                raise
            continue                        # a plan that fails to run is not a candidate
    if not times:
        raise Unsupported('no cuDNN plan ran for this key')
    chosen = min(times, key=lambda c: (times[c], candidates.index(c)))
    label = dict(zip(candidates, names))
    entry.times = {label[c]: round(t, 4) for c, t in times.items()}
    with _tuner._lock:
        choice.times = {label[c]: [times[c] / 1e3] if c in times else [] for c in candidates}
        choice.picked = label[chosen]
    return chosen, False


def forget():
    """Drops every graph, refusal and count (tests)."""
    with _lock:
        _entries.clear()
        _refused.clear()
        builds.clear()
