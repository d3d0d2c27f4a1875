"""The replay as one node of Chainer's graph, with the chain's parameters
among its inputs.

Chainer applies a cached call's ``StaticScheduleFunction`` to the call's
inputs only, and the schedules attach gradients to the parameters
themselves: hooks around the backward schedule set ``p.grad`` to the arrays
it computed, and, as the two schedules share their hook list, the forward
replay set it to the previous step's arrays. ``Variable.backward`` keeps the
gradients of the rest of the graph in its own table, which loads a
parameter's ``grad`` the first time it meets the parameter and writes the sum
at the end. A parameter reached both ways (weight tying,
``F.matmul(net(x), net.l2.W)``, or a penalty over the parameters in the loss)
got the previous step's gradient added, or lost the replay's: measured, 51
off on the first replayed step, NaN by the fifth, with no warning. A
gradient accumulated over several backward passes was overwritten.

For a cached chain's schedules (those of fastchain's key managers):

- the node's inputs are the call's inputs and then the chain's parameters
  (:func:`apply_with_parameters`); the forward does not read the extra ones;
- when a schedule is built, its hooks that attach gradients to parameters
  are taken out, and for the backward schedule the array holding each
  parameter's gradient is noted (:func:`take_gradient_hooks`);
- the node's backward returns those arrays as the gradients of the parameter
  inputs (:func:`backward`), and Chainer's backward sums them with the rest
  of the graph's and with what the parameter held before, as define-by-run
  does. The call that builds the backward schedule, where Chainer's
  define-by-run pass sets the gradients itself, puts them back first. An
  array the schedule writes again on its next run is copied.
- a double backward (``enable_double_backprop``, a gradient penalty) cannot
  go through the backward schedule, whose node has only the output gradients
  as inputs (the second-order terms through the parameters and inputs are
  lost: 0.02 off, measured): that step's second-order terms are computed
  define-by-run from the call's own inputs (:func:`double_backward`: the
  chain's forward again, its state put back after), the first-order ones by
  the replay, summed at the parameters (not bitwise: rounding), and the chain
  runs define-by-run from then on;
- a call is handed a schedule no pending graph uses, else a new one
  (:func:`claim`); the outputs of the call a schedule served last, still
  alive after their backward, are handed to a stand-in node that refuses a
  second backward by name (:func:`supersede`); and a schedule whose
  backward was not built on the call that recorded it is not built later
  from stale arrays (:func:`late`).
"""

import contextlib
import weakref

import chainer

from fastchain.config import _patches
from fastchain.static import _keys, _verify

PARAMS = 'static_node_params'   # forward schedule: (call inputs, parameters, their indices)
GRADS = 'static_node_grads'     # backward schedule: {parameter index: unique array index}
PLAN = 'static_node_plan'       # backward schedule: per parameter input, (index, copy) or None
# On a forward schedule, an attribute of its own rather than an attachment:
# (weakref to the cache, key, args, whether it recorded) of its last call,
# until a backward goes through it. The args' graph may lead back to the schedule (a call on an
# earlier call's output), which an attachment, held by a table keyed weakly
# by the schedule, would keep alive for ever; the schedule's own attribute
# is an ordinary cycle the collector frees.
CALL = '_fastchain_call'
LATE = 'static_node_late'       # Chainer's ScheduleManager: a backward met a late schedule
MAX_SCHEDULES = 8               # a key's schedules with graphs alive at once (see claim)
TOO_MANY = (
    'more than {} of its calls with the same input shapes have graphs alive at once, none '
    'backpropagated (outputs kept, e.g. in a list, without a backward): each would need '
    'a schedule of its own, holding its arrays'.format(MAX_SCHEDULES))

SUPERSEDED = (
    'fastchain static_graph: a second backward went through an earlier call of {} after '
    'the model was called again: the cache gave that call\'s schedule, and the arrays its '
    'backward needs, to the later call, so the earlier graph cannot be differentiated '
    'again. Take every backward over a call\'s outputs before calling the model again, '
    'or run this model without static_graph')

DOUBLE_BACKWARD = (
    'a backward with enable_double_backprop=True went through the chain (a gradient '
    'penalty, a Hessian-vector product; the flag alone counts, a second derivative taken '
    "or not), and Chainer's backward schedule cannot be differentiated. That step's "
    "gradients are define-by-run's terms, the replay's first-order ones and the "
    "recomputed forward's second-order ones, summed where they meet at the parameters "
    "rather than inside the chain: not bitwise plain Chainer's, a difference of rounding")


def owner(schedule):
    """The cache ``schedule`` belongs to, or None (another static graph)."""
    ref = _patches.attached(schedule.schedule_manager, _keys.OWNER)
    return None if ref is None else ref()


def busy(schedule):
    """A call of ``schedule`` that no backward has gone through yet has a
    graph still alive (its outputs are): applying the schedule again would
    rebind that node, breaking the graph (``y1 = model(a)``, a backward over
    another call, ``model(c)``, then a backward through ``y1``)."""
    if getattr(schedule, CALL, None) is None:
        return False
    return any(ref() is not None for ref in getattr(schedule, 'outputs', None) or ())


def claim(manager):
    """Before a call: Chainer's next ``get_schedule`` on ``manager`` (one
    key) hands out a schedule that is not :func:`busy`, else a new one.
    (Chainer hands them out in turn and starts again when a backward of the
    key ends its "iteration": a call whose output is dropped without a
    backward made it record a new schedule every step, and a call after a
    backward over another call reused a node still in a graph.) Among free
    schedules, one whose backward is built comes first, then one not
    recorded; one recorded without a backward built comes next (forward-only
    calls reuse it) unless a backward of the key has already met such a
    schedule (:func:`late`: then a new one records, with its backward the
    same step). Returns False when :data:`MAX_SCHEDULES` are all busy."""
    if not manager.schedules:
        return True
    (key, schedules), = manager.schedules.items()
    free = [i for i, schedule in enumerate(schedules) if not busy(schedule)]
    built = [i for i in free if schedules[i].backward_schedule_func is not None]
    empty = [i for i in free if schedules[i].is_empty()]
    unbuilt = [] if _patches.attached(manager, LATE) else free
    for choice in (built, empty, unbuilt):
        if choice:
            manager.in_use_count[key] = choice[0]
            return True
    manager.in_use_count[key] = len(schedules)
    return len(schedules) < MAX_SCHEDULES


class Superseded(chainer.FunctionNode):
    """Stands in the graph of a call whose schedule a later call took, in
    place of the schedule, with the call's inputs and rank: a backward
    reaching it raises :data:`SUPERSEDED` (Chainer would run the schedule's
    backward with the later call's arrays: an AttributeError inside
    ``linear``, then an AssertionError of its own)."""

    def __init__(self, schedule, name):
        self.inputs = schedule.inputs
        self.outputs = schedule.outputs
        self.rank = schedule.rank
        self.name = name

    @property
    def label(self):
        return 'fastchain static_graph: superseded call of {}'.format(self.name)

    def backward(self, target_input_indexes, grad_outputs):
        raise RuntimeError(SUPERSEDED.format(self.name))


def supersede(schedule, name):
    """Right before ``schedule`` is applied to a new call (it is not
    :func:`busy`: a backward went through its last call, or that call's
    outputs are dead): those outputs, if still alive, get a
    :class:`Superseded` creator, since the new call rebinds the node."""
    nodes = [ref() for ref in getattr(schedule, 'outputs', None) or ()]
    nodes = [node for node in nodes if node is not None and node.creator_node is schedule]
    if nodes:
        stand_in = Superseded(schedule, name)
        for node in nodes:
            node.creator_node = stand_in


def called(schedule, cache, key, args, recording):
    """Right after ``schedule`` was applied to a call of ``cache``'s chain
    (``recording``: the call that recorded it)."""
    setattr(schedule, CALL, (weakref.ref(cache), key, args, recording))


def apply_with_parameters(next_, schedule, inputs):
    """``StaticScheduleFunction.apply``: a cached chain's built forward
    schedule is applied to the call's inputs and the chain's parameters."""
    if schedule.pass_depth or not schedule.schedule_built:
        return next_(schedule, inputs)
    entry = _patches.attached(schedule, PARAMS)
    if entry is None:
        if owner(schedule) is None:
            return next_(schedule, inputs)
        indices = tuple(i for i, p in enumerate(schedule.params_list) if p.array is not None)
        entry = (len(inputs), tuple(schedule.params_list[i] for i in indices), indices)
        _patches.attach(schedule, PARAMS, entry)
    return next_(schedule, tuple(inputs) + entry[1])


def take_gradient_hooks(schedule):
    """Right after ``schedule`` (a cached chain's) is built: its hooks that
    attach gradients to parameters leave its lists; for a backward schedule,
    the array that holds each parameter's gradient is noted under
    :data:`GRADS` (Chainer's pass that built it has just set the gradients;
    one array may be two parameters' gradient, ``x + p1 + p2``, which
    Chainer's hooks give to one of them only)."""
    for hooks in (schedule.param_hooks, schedule.param_post_hooks):
        hooks[:] = [hook for hook in hooks if hook[1][1] != 'grad']    # shared with the forward
    if schedule.pass_depth != 1:
        return
    where = {id(a): u for u, a in enumerate(schedule.unique_arrays) if a is not None}
    _patches.attach(schedule, GRADS, {
        i: where[id(p.grad)] for i, p in enumerate(schedule.params_list)
        if p.grad is not None and id(p.grad) in where})


def _plan(schedule, indices):
    """For each parameter input: where the backward schedule leaves its
    gradient, and whether to copy it (an array the next run writes into,
    rather than one it makes anew)."""
    found = _patches.attached(schedule, GRADS, {})
    plan = []
    for i in indices:
        u = found.get(i)
        if u is None:
            plan.append(None)
        else:
            info = schedule.unique_array_infos[u]
            plan.append((u, info.retain or not info.dynamically_allocated))
    plan = tuple(plan)
    _patches.attach(schedule, PLAN, plan)
    return plan


def backward(next_, schedule, indexes, grad_outputs):
    """Chainer's backward of the node (``next_``), and the parameters'
    gradients as the gradients of the parameter inputs."""
    n, params, indices = _patches.attached(schedule, PARAMS)
    building = schedule.backward_schedule_func is None
    saved = [p.grad_var for p in params] if building else None
    # building: its define-by-run pass is the cache's own
    hidden = _verify.without_function_hooks() if building else contextlib.nullcontext()
    try:
        with hidden:
            gxs = tuple(next_(schedule, indexes, grad_outputs))
    finally:
        if building:    # Chainer's define-by-run pass set them
            for p, g in zip(params, saved):
                p.grad_var = g
    back = schedule.backward_schedule_func
    plan = _patches.attached(back, PLAN)
    if plan is None:
        plan = _plan(back, indices)
    ua = schedule.unique_arrays
    grads = []
    for item in plan:
        a = None if item is None else ua[item[0]]
        grads.append(None if a is None else chainer.Variable(
            a.copy() if item[1] else a, requires_grad=False))
    return gxs[:n] + tuple(grads)


def _upstream(inputs, params):
    """Whether one of ``params`` made one of ``inputs`` (a chain applied to
    its own output)."""
    wanted = {id(p.node) for p in params}
    return any(id(node) in wanted for func in _verify.functions(inputs) for node in func.inputs)


def _recompute(schedule, grad_outputs, call, double):
    """The node's gradients computed define-by-run from the call's inputs
    (``call``: :data:`CALL`): the chain's forward again under the call's
    configuration, its state put back after. Returns (cache, gradients).

    First order, on copies of the inputs cut from their graph: ``chainer.grad``
    over the inputs themselves would also follow what made them back to the
    parameters (``model(model(x))``), counting those terms twice (measured by
    a review). A double backward needs them attached (second-order terms
    through what made them); where a parameter of the chain made an input,
    it cannot be exact and raises."""
    ref, key, args, _ = (None, None, None, None) if call is None else call
    cache = None if ref is None else ref()
    chain = None if cache is None else cache.ref()
    if chain is None:
        # its inputs were let go by a first backward over the same graph
        raise RuntimeError(
            'fastchain static_graph: a double backward (enable_double_backprop=True) '
            'reached a replayed call of a cached model after a backward over the same '
            "graph had already run, or after the model was deleted; the replay's "
            'second-order gradients cannot be computed. Run the double backward first, '
            'or turn static_graph off for this model')
    n, params, _ = _patches.attached(schedule, PARAMS)
    flat = _verify.flatten(args)
    wanted = [isinstance(x, chainer.Variable) and x.requires_grad for x in flat]
    if double:
        if _upstream([x for x, w in zip(flat, wanted) if w], params):
            raise RuntimeError(
                'fastchain static_graph: a double backward (enable_double_backprop=True) '
                "through a cached call of {} whose input was made from the model's own "
                'parameters (the model applied to its own output) cannot be computed '
                'exactly from the replay; turn static_graph off for this model'
                .format(cache.name))
        inputs = args
    else:
        inputs = _detached(args)
        flat = _verify.flatten(inputs)
    state = _verify.Snapshot(chain, grads=False)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_verify.reference_run())
            stack.enter_context(_verify.without_function_hooks())
            stack.enter_context(chainer.force_backprop_mode())  # off in a first-order backward
            # the call's configuration, the user's entries too
            for name, value in list(zip(_keys.CONFIG, key[1])) + list(key[2]):
                if isinstance(value, tuple) and value[:1] == ('unhashable',):
                    continue        # (the object itself is not in the key)
                if getattr(chainer.config, name, None) != value:
                    stack.enter_context(chainer.using_config(name, value))
            outputs = _verify.flatten(cache.forward(chain, *inputs))
    finally:
        state.put_back()        # the replay made this call's updates already
    targets = [x for x, w in zip(flat, wanted) if w] + list(params)
    pairs = [(y, g) for y, g in zip(outputs, grad_outputs)
             if g is not None and isinstance(y, chainer.Variable)]
    with _verify.without_function_hooks():  # only what flows back through them counts
        grads = chainer.grad([y for y, _ in pairs], targets,
                             grad_outputs=[g for _, g in pairs],
                             enable_double_backprop=double) if pairs else [None] * len(targets)
    grads = iter(grads)
    return cache, tuple(next(grads) if w else None for w in wanted[:n]) + tuple(grads)


def _detached(x):
    """``x`` (nested lists and tuples of variables and arrays) with each
    variable replaced by a new leaf on the same array."""
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(item) for item in x)
    if isinstance(x, chainer.Variable):
        return chainer.Variable(x.array, requires_grad=x.requires_grad)
    return x


def unused_outputs_backward(next_, schedule, indexes, grad_outputs, call):
    """Some outputs of the call reached no backward (their gradient is None:
    an LSTM's final state the loss leaves out). Chainer's backward schedule
    takes an array for every output: its build failed (``None.data``, the
    cache gave up blaming itself) and a replay raised inside its program
    (``None + array``, the user's step crashed). This call's gradients are
    define-by-run's (:func:`_recompute`: exact, the forward once more; a
    zero in place of a missing gradient is not: a parameter only the unused
    output reaches would get zeros instead of None, which momentum updates).
    A backward not built yet is built here from zeros in their place, for
    the calls that use every output."""
    if schedule.backward_schedule_func is None:
        xp = chainer.backend.get_array_module(
            next(g for g in grad_outputs if g is not None).array)
        # (the outputs' shapes as recorded: a dropped output's node is gone)
        filled = tuple(g if g is not None else chainer.Variable(
            xp.zeros(y.shape, y.dtype)) for g, y in zip(grad_outputs, schedule.out_vars))
        backward(next_, schedule, indexes, filled)
    _, grads = _recompute(schedule, grad_outputs, call, False)
    return grads


def double_backward(schedule, grad_outputs, call):
    """The node's gradients for a double backward, define-by-run; the cache
    gives up."""
    cache, grads = _recompute(schedule, grad_outputs, call, True)
    cache.fall_back('unsupported', DOUBLE_BACKWARD)
    return grads


def late(schedule, call):
    """``schedule``'s backward was not built on the call that recorded it
    (that call's output left out of every backward) and a later call
    reaches it: Chainer would build it from the recorded graph, whose
    arrays the replays since have not all refreshed (measured: a weight
    gradient 3.9 off, which the verification caught)."""
    return (schedule.backward_schedule_func is None and call is not None
            and not call[3])


def late_backward(schedule, grad_outputs, call):
    """This call's gradients define-by-run; the schedule leaves its key's
    list, so that a later call records anew (its backward then built on the
    same step)."""
    _, grads = _recompute(schedule, grad_outputs, call, False)
    manager = schedule.schedule_manager
    _patches.attach(manager, LATE, True)
    for schedules in manager.schedules.values():
        if schedule in schedules:
            schedules.remove(schedule)
    return grads
