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
  lost: 0.02 off, measured): that step's gradients are computed define-by-run
  from the call's own inputs (:func:`double_backward`: the chain's forward
  again, its state put back after) and the chain runs define-by-run from then
  on.
"""

import contextlib

import chainer

from fastchain.config import _patches

PARAMS = 'static_node_params'   # forward schedule: (call inputs, parameters, their indices)
GRADS = 'static_node_grads'     # backward schedule: {parameter index: unique array index}
PLAN = 'static_node_plan'       # backward schedule: per parameter input, (index, copy) or None
CALL = 'static_node_call'       # forward schedule: (weakref to the cache, key, args) of the call
OWNER = 'static_node_owner'     # Chainer's ScheduleManager: the cache it belongs to (weakref)

DOUBLE_BACKWARD = (
    'a double backward (enable_double_backprop=True: a gradient penalty, a Hessian-vector '
    "product) went through the chain, and Chainer's backward schedule cannot be "
    "differentiated: that step's gradients were computed define-by-run")


def owner(schedule):
    """The cache ``schedule`` belongs to, or None (another static graph)."""
    ref = _patches.attached(schedule.schedule_manager, OWNER)
    return None if ref is None else ref()


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
    attach gradients to parameters leave its lists; a backward schedule's
    are noted under :data:`GRADS` (those whose array is the parameter's
    gradient now: Chainer's pass that built it has just set them)."""
    params = schedule.params_list
    ua = schedule.unique_arrays
    found = {}
    for hooks in (schedule.param_hooks, schedule.param_post_hooks):
        kept = []
        for hook in hooks:
            u, (i, attribute) = hook
            if attribute != 'grad':
                kept.append(hook)
            elif ua[u] is not None and ua[u] is params[i].grad:
                found[i] = u
        hooks[:] = kept         # the forward's list is the same list
    if schedule.pass_depth == 1:
        _patches.attach(schedule, GRADS, found)


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
    from fastchain.static import _verify
    n, params, indices = _patches.attached(schedule, PARAMS)
    building = schedule.backward_schedule_func is None
    saved = [p.grad_var for p in params] if building else None
    try:
        if building:    # its define-by-run pass is the cache's own
            with _verify.without_function_hooks():
                gxs = tuple(next_(schedule, indexes, grad_outputs))
        else:
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


def double_backward(schedule, grad_outputs, call):
    """The node's gradients for a double backward, define-by-run from the
    call's inputs (``call``: :data:`CALL`); the cache gives up."""
    from fastchain.static import _keys, _verify
    ref, key, args = (None, None, None) if call is None else call
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
    state = _verify.Snapshot(chain, grads=False)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_verify.reference_run())
            stack.enter_context(_verify.without_function_hooks())
            for name, value in zip(_keys.CONFIG, key[1]):   # the call's configuration
                if getattr(chainer.config, name, None) != value:
                    stack.enter_context(chainer.using_config(name, value))
            outputs = _verify.flatten(cache.forward(chain, *args))
    finally:
        state.put_back()        # the replay made this call's updates already
    flat = _verify.flatten(args)
    wanted = [isinstance(x, chainer.Variable) and x.requires_grad for x in flat]
    targets = [x for x, w in zip(flat, wanted) if w] + list(params)
    pairs = [(y, g) for y, g in zip(outputs, grad_outputs)
             if g is not None and isinstance(y, chainer.Variable)]
    with _verify.without_function_hooks():  # only what flows back through them counts
        grads = chainer.grad([y for y, _ in pairs], targets,
                             grad_outputs=[g for _, g in pairs],
                             enable_double_backprop=True) if pairs else [None] * len(targets)
    grads = iter(grads)
    cache.fall_back('unsupported', DOUBLE_BACKWARD)
    return tuple(next(grads) if w else None for w in wanted[:n]) + tuple(grads)
