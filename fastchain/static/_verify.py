"""Checking a replay against define-by-run on the same batch.

On a verified step the cache runs the replay (what training uses), puts the
model's state back as it was before the call, runs the chain define-by-run
(the *reference*) on detached copies of the same inputs, compares, and puts
the replay's state back; the reference's graph is kept until the replay's
backward, where its gradients are computed with the same output gradients
and compared too (:class:`BackwardCheck`). What is compared:

- forward: the functions applied (names, input shapes and their scalar
  constants), the outputs, every persistent value of every link (running
  statistics), and NumPy's global random state (the same draws consumed);
  a call that leaves a variable in a link's attribute (``L.LSTM``'s ``h``)
  is refused before the reference runs;
- backward: the call's gradient of every parameter (what the replay's node
  returns, :mod:`fastchain.static._node`; Chainer's backward adds it to the
  rest) and of every floating-point input.

Tolerance: a difference is accepted when it is at most ``ULPS`` units in the
last place of the array's dtype relative to the larger magnitude of the two
arrays (``ULPS * finfo(dtype).eps * max(|a|, |b|)``): 32 ulps is 3.8e-6 of
the magnitude in float32, 3.1e-2 in float16 and 7.1e-15 in float64. Integer
arrays, NaN and infinity patterns and ``None`` must match exactly. On the
CPU the replay is bitwise define-by-run (measured), so any difference is
real; the margin is for GPU kernels whose summation order varies. While the
``onednn`` option is in force or has run in the process (oneDNN's kernels,
not bitwise equal to Chainer's: a cache recorded with them and verified
after the option was turned off sees their rounding), or cuDNN graphs have
run (their engines may sum in a varying order; also under
``cudnn_deterministic``, which this does not look at), float32 arrays are
accepted within ``INEXACT`` of the largest magnitude among the arrays
compared together (the outputs, or the gradients: a bias's gradient sums to
little from larger values and carries their rounding); a defect of the cache
(a wrong input, a stale array) is of the order of the magnitude itself.
"""

import contextlib
import threading

import numpy

import chainer

from fastchain.cudnn import _paths
from fastchain.kernels import _onednn
from fastchain.static import _functions, _state

ULPS = 32
INEXACT = 2.0 ** -10     # relative, float32, once onednn is in force (_inexact)
RAISED = 'raised'       # what a difference is "in" when the replay's backward raised
UNUSED = 'unused'       # a verified call's outputs that reached no backward: not verifiable


def allowed(dtype):
    """The accepted difference relative to the magnitude, for ``dtype``."""
    dtype = numpy.dtype(dtype)
    if dtype.kind != 'f':
        return 0.0
    ulps = ULPS * float(numpy.finfo(dtype).eps)
    # oneDNN computes float32 only
    return max(ulps, INEXACT) if dtype == numpy.float32 and _inexact() else ulps


def _inexact():
    """oneDNN's kernels are in force or have run in this process (a cache may
    be verified after the option was turned off), or cuDNN graphs have
    (their engines may sum in a varying order: split weight gradients)."""
    return (_onednn.enabled or any(_onednn.calls.values())
            or any(paths.get('graph') for paths in _paths.calls.values()))


def _host(x):
    x = getattr(x, 'array', x)
    if x is None or isinstance(x, numpy.ndarray):
        return x
    if hasattr(x, 'shape'):
        return chainer.backend.CpuDevice().send(x)
    return numpy.asarray(x)


def difference(got, expected, scale=0.0):
    """None if ``got`` is ``expected`` within the tolerance, else what differs
    (``scale``: a magnitude to measure the difference against, if larger than
    the arrays' own)."""
    got, expected = _host(got), _host(expected)
    if got is None or expected is None:
        if got is None and expected is None:
            return None
        return 'None instead of an array' if got is None else 'an array instead of None'
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return '{} {} instead of {} {}'.format(got.dtype, got.shape, expected.dtype,
                                               expected.shape)
    if expected.dtype.kind != 'f':
        return None if numpy.array_equal(got, expected) else 'differ (exact dtype)'
    if not numpy.array_equal(numpy.isnan(got), numpy.isnan(expected)):
        return 'NaN where define-by-run has none, or the reverse'
    finite = numpy.isfinite(expected)
    if not numpy.array_equal(got[~finite], expected[~finite], equal_nan=True):
        return 'infinities differ'
    g, e = got[finite].astype(numpy.float64), expected[finite].astype(numpy.float64)
    if not g.size:
        return None
    worst = float(numpy.abs(g - e).max())
    scale = max(float(numpy.abs(e).max()), float(numpy.abs(g).max()), scale)
    if worst <= allowed(expected.dtype) * scale:
        return None
    eps = float(numpy.finfo(expected.dtype).eps)
    return 'differ by {:.3g} at magnitude {:.3g} ({:.3g} ulps of {}; {:.3g} allowed)'.format(
        worst, scale, worst / (eps * scale) if scale else float('inf'),
        expected.dtype.name, allowed(expected.dtype) / eps)


def _largest(pairs):
    largest = 0.0
    for _, _, expected in pairs:
        e = _host(expected)
        if e is not None and e.dtype.kind == 'f' and e.size:
            finite = e[numpy.isfinite(e)]
            if finite.size:
                largest = max(largest, float(numpy.abs(finite).max()))
    return largest


def first_difference(pairs):
    """The first ``(name, description)`` among ``(name, got, expected)`` that differ."""
    pairs = list(pairs)
    # Inexact kernels (onednn): a gradient that sums to little (a bias's)
    # carries the rounding of the larger values it was summed from, so the
    # difference is measured against the largest array compared with it.
    scale = _largest(pairs) if _inexact() else 0.0
    for name, got, expected in pairs:
        found = difference(got, expected, scale)
        if found is not None:
            return name, found
    return None


def flatten(x):
    """Nested lists and tuples of variables or arrays, in order."""
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in flatten(item)]
    return [x]


def _copy(x, inputs):
    """``x``, each variable a new leaf requiring a gradient where the caller's
    does, an array as it is (as define-by-run gets it: a forward may branch on it)."""
    if isinstance(x, (list, tuple)):
        return type(x)(_copy(item, inputs) for item in x)
    v = chainer.Variable(x.array, requires_grad=x.requires_grad) \
        if isinstance(x, chainer.Variable) else x
    inputs.append(v)
    return v


class Snapshot:
    """What a call may change, to put back: every link's persistent values,
    the arrays and variables its other attributes hold (the state a link
    keeps between calls, L.LSTM's ``h`` and ``c``, and what a forward leaves
    behind, L.Classifier's ``loss``: by reference, as a forward rebinds them),
    every parameter's gradient, NumPy's global random state, and which
    parameters were not made yet (``L.Linear(None, n)``: a call that makes
    one draws from that random state, so putting the state back unmakes it,
    and the define-by-run call that follows makes it as plain Chainer does)."""

    def __init__(self, chain, grads=True, python=False):
        self.persistents, self.attributes = [], []
        # what the links' other attributes hold (counters, lists, generators)
        self.python = _state.PythonState(chain) if python else None
        for path, link in chain.namedlinks():
            for name in sorted(link._persistent):
                value = link.__dict__.get(name)
                copy = value.copy() if hasattr(value, 'copy') else value
                self.persistents.append((link, name, path.rstrip('/') + '/' + name, copy))
            self.attributes.append((link, path.rstrip('/'), _held(link)))
        self.grads = None
        if grads:
            self.grads = [(name, p, p.grad_var) for name, p in chain.namedparams()
                          if p.array is not None]
        self.random = numpy.random.get_state()
        self.unmade = [p for _, p in chain.namedparams() if p.array is None]

    def restore(self):
        if self.python is not None:
            self.python.restore()
        self.put_back()
        for p in self.unmade:
            if p.array is not None:
                p._set_array(None, layout_check=False)
                p._set_grad(None, layout_check=False)
        if self.grads is not None:
            for _, p, grad_var in self.grads:
                p.grad_var = grad_var

    def put_back(self):
        """The links' state (persistent values, held arrays and variables) and
        NumPy's random state as they were; gradients and unmade parameters
        are :meth:`restore`'s."""
        self.restore_persistents()
        self.restore_attributes()
        numpy.random.set_state(self.random)

    def restore_persistents(self):
        for link, name, _, saved in self.persistents:
            current = link.__dict__.get(name)
            if (hasattr(current, 'shape') and hasattr(saved, 'shape')
                    and current.shape == saved.shape and current.dtype == saved.dtype):
                current[...] = saved
            else:
                setattr(link, name, saved.copy() if hasattr(saved, 'copy') else saved)

    def restore_attributes(self):
        """Each link's arrays and variables held in attributes as they were
        (a call run twice, replay and reference, starts from the same state
        and leaves the replay's: the reference run of an L.LSTM advanced its
        ``h`` a second time)."""
        for link, _, held in self.attributes:
            for name in set(_held(link)) - set(held):
                del link.__dict__[name]         # made by the call
            for name, value in held.items():
                link.__dict__[name] = value

    def kept_variables(self):
        """The attributes (``/path/name``) that now hold a variable they did not
        hold at the snapshot: a forward keeping what it made (L.LSTM's ``h``)."""
        return ['{}/{}'.format(path, name) for link, path, held in self.attributes
                for name, value in sorted(_held(link).items())
                if isinstance(value, chainer.Variable) and held.get(name) is not value]

    def compare_persistents(self, other):
        """The first persistent value that differs from ``other``'s, or None."""
        return first_difference((path, mine, theirs) for (_, _, path, mine), (_, _, _, theirs)
                                in zip(self.persistents, other.persistents))

    def random_moved(self):
        """NumPy's global random state has advanced since the snapshot."""
        return not _same_random(self.random, numpy.random.get_state())

    def same_random_state(self, other):
        return _same_random(self.random, other.random)


def _same_random(a, b):
    """Two states of ``numpy.random.get_state()`` are the same."""
    return a[0] == b[0] and a[2:] == b[2:] and numpy.array_equal(a[1], b[1])


def _held(link):
    """``link``'s attributes holding an array, a variable or None, other than
    its parameters, persistent values and child links."""
    skip = link._params | link._persistent | _state.child_names(link)
    kinds = (chainer.Variable,) + tuple(chainer.get_array_types())
    # (by type: isinstance asks a dead weakref proxy, which raises)
    return {name: value for name, value in link.__dict__.items()
            if name not in skip and (value is None or issubclass(type(value), kinds))}


_local = threading.local()


@contextlib.contextmanager
def reference_run():
    """A define-by-run run of a cached chain (cached chains called inside
    run define-by-run too)."""
    _local.depth = getattr(_local, 'depth', 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


@contextlib.contextmanager
def without_function_hooks():
    """Chainer's function hooks (a user's timer, the data-parallel gradient
    capture) do not see what the cache computes for itself: a reference run,
    its gradients, Chainer's define-by-run pass that builds a backward
    schedule (the capture counted those gradients as the step's: measured,
    weights 0.057 off over 2 MPI ranks)."""
    hooks = chainer.get_function_hooks()
    saved = list(hooks.items())
    hooks.clear()
    try:
        yield
    finally:
        added = list(hooks.items())
        hooks.clear()
        hooks.update(saved)
        hooks.update(added)


def in_reference():
    """True while a reference run is under way (cached chains inside it run
    define-by-run: the reference is define-by-run all through)."""
    return getattr(_local, 'depth', 0) > 0


class Reference:
    """The chain run define-by-run on detached copies of a call's inputs."""

    def __init__(self, chain, plain, args):
        self.inputs = []
        copies = _copy(args, self.inputs)
        self.recorder = _functions.Recorder()
        with reference_run(), without_function_hooks(), self.recorder:
            self.outputs = flatten(plain(*copies))
        self.recorder.resolve(chain)

    def gradients(self, params, grad_outputs):
        """This call's parameter and input gradients for ``grad_outputs``
        (what its node returns; Chainer's backward sums them with the rest)."""
        pairs = [(y, g) for y, g in zip(self.outputs, grad_outputs)
                 if g is not None and isinstance(y, chainer.Variable)]
        inputs = [x for x in self.inputs if isinstance(x, chainer.Variable)
                  and x.dtype.kind == 'f' and x.requires_grad]
        targets = list(params) + inputs
        if not pairs or not targets:
            return [None] * len(params), [None] * len(self.inputs)
        seeds = [chainer.Variable(g.array if isinstance(g, chainer.Variable) else g)
                 for _, g in pairs]
        # Chainer's backward, as plain Chainer's (chainer.grad asks functions
        # only for what leads to its targets; the deconvolution's weight alone
        # raised: a fuzzing helper); the leaves' gradients are put back.
        ys = [y for y, _ in pairs]
        held = [(v, v.grad_var, v._loss_scale) for v in {
            id(v): v for v in targets + _leaves(ys)}.values()]
        try:
            for v, _, _ in held:
                v.grad_var = None
            with without_function_hooks():
                chainer.backward(ys, seeds)
            grads = [v.grad_var for v in targets]
        finally:
            for v, g, scale in held:
                v.grad_var, v._loss_scale = g, scale
        by_input = dict(zip(map(id, inputs), grads[len(params):]))
        return ([None if g is None else g.array for g in grads[:len(params)]],
                [by_input.get(id(x)) for x in self.inputs])


def functions(variables):
    """Each function of the graph behind ``variables`` (or their nodes), once."""
    seen = set()
    stack = [x.creator_node for x in variables if getattr(x, 'creator_node', None) is not None]
    while stack:
        func = stack.pop()
        if id(func) not in seen:
            seen.add(id(func))
            yield func
            stack.extend(x.creator_node for x in func.inputs if x.creator_node is not None)


def _leaves(outputs):
    """The live leaf variables requiring a gradient behind ``outputs`` or among them."""
    nodes = {id(y.node): y.node for y in outputs}
    nodes.update((id(x), x) for func in functions(outputs) for x in func.inputs)
    found = (x.get_variable_or_none() for x in nodes.values()
             if x.creator_node is None and x.requires_grad)
    return [v for v in found if v is not None]


class BackwardCheck:
    """Runs the replay's backward and compares it with the reference's.

    Made right after the replay's forward; ``names``: the parameters' names by
    their ``id``. ``report(difference_or_None)`` is told the outcome. On a
    difference (or an error of the replay) the node returns the reference's
    gradients (of the inputs, then of the parameters,
    :mod:`fastchain.static._node`), so the step's update is define-by-run's.
    """

    def __init__(self, reference, names, report):
        self.reference = reference
        self.names = names
        self.report = report

    def __call__(self, run, schedule, indexes, grad_outputs, params):
        expected_params, expected_inputs = self.reference.gradients(params, grad_outputs)
        named = [(self.names.get(id(p), '?'), p) for p in params]
        try:
            result = tuple(run(schedule, indexes, grad_outputs))
            found = self._compare(named, expected_params, indexes, result, expected_inputs)
        except Exception as e:      # Chainer's replay could not run its backward
            found = (RAISED, '{}: {}'.format(type(e).__name__, e))
        self.report(found)
        if found is None:
            return result
        return tuple(expected_inputs) + tuple(
            None if g is None else chainer.Variable(g, requires_grad=False)
            for g in expected_params)

    @staticmethod
    def _compare(named, expected_params, indexes, result, expected_inputs):
        n = len(expected_inputs)
        got = result[:n]
        pairs = [('the gradient of parameter ' + name, None if g is None else g.array, e)
                 for (name, _), g, e in zip(named, result[n:], expected_params)]
        for i, (g, e) in enumerate(zip(got, expected_inputs)):
            if e is not None and i in indexes:
                pairs.append(('the gradient of input #{}'.format(i + 1), g, e))
        return first_difference(pairs)
