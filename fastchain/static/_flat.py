"""A flat program for a built static schedule: the replay without its
bookkeeping.

Chainer replays a schedule entry by entry through ``ScheduleInfo.__call__``:
two method calls and six loops over hook lists per entry, a lookup of every
returned array's ``retain`` flag, and the generic wrapper that turns the input
list into a tuple for ``FunctionNode.forward``. Around the entries, the
parameter hooks assign every parameter's gradient through ``Variable.grad``,
whose setter checks the array's type, dtype and shape against the parameter
each time (three assignments per parameter and step for a training step).
For ResNet-50 that is ~400 entries and ~1,100 parameter hooks per step, all
decided when the schedule was built.

:func:`compile_schedule` decides them once: each entry becomes one closure
with its input positions, deletions and returns (copy into the retained
array, or rebind) resolved to tuples; the parameter hooks become pairs of
(unique-array index, parameter); a cached chain's schedules have no hooks
that attach gradients left (:mod:`fastchain.static._node` returns them to
Chainer's backward instead). The program does what Chainer's
``StaticScheduleFunction.forward`` does, in the same order, with the same
arrays: only the interpretation of the hook lists is gone, so results are
bitwise those of Chainer's replay (tested). A gradient is attached without
Chainer's check only when it is a plain array of the parameter's own type,
shape and dtype (what the check would accept); anything else goes through
``Variable.grad`` and gets Chainer's error.

Entries other than the functions Chainer wrapped automatically (a user's
``@static_code`` function, Chainer's static linear kernels, which write into
output lists) run through their own ``ScheduleInfo`` unchanged. Schedules
with Chainer's debug verbosity (>= 2) keep Chainer's replay and its prints.
"""

import numpy

from fastchain.kernels._bind import _Lazy

# Whether schedules built from now on get a flat program.
enabled = True


def compile_schedule(schedule):
    """Give a built ``StaticScheduleFunction`` a flat ``forward``.

    Returns the number of entries compiled (the rest run Chainer's
    ``ScheduleInfo``), or None if the schedule keeps Chainer's replay.
    """
    if not enabled or schedule.verbosity_level >= 2 or not schedule.schedule_built:
        return None
    ua = schedule.unique_arrays
    params = schedule.params_list
    data_pre, grad_pre = _param_hooks(schedule.param_hooks, params)
    data_post, grad_post = _param_hooks(schedule.param_post_hooks, params)
    in_var_hooks = tuple(schedule.in_var_hooks)     # (unique index, input index)
    out_var_hooks = tuple(schedule.out_var_hooks)   # (output index, unique index)
    program = []
    compiled = 0
    for info in schedule.schedule_info_list:
        run = _entry(info)
        if run is None:
            program.append(info)        # Chainer's ScheduleInfo.__call__
        else:
            program.append(run)
            compiled += 1
    program = tuple(program)

    def forward(inputs):
        for u, p in data_pre:
            ua[u] = p.array
        for p, u in grad_pre:
            _attach(p, ua[u])
        for u, i in in_var_hooks:
            ua[u] = inputs[i]
        for run in program:
            run()
        out_vars = schedule.out_vars
        for o, u in out_var_hooks:
            out_vars[o].data = ua[u]
        for u, p in data_post:
            p.data = ua[u]
        for p, u in grad_post:
            _attach(p, ua[u])
        return tuple(None if y is None or y.data is None else y.data.copy(order="K")
                     for y in out_vars)

    forward.fastchain_flat = compiled
    # An instance attribute: this schedule only; FunctionNode.apply calls
    # self.forward(inputs).
    schedule.forward = forward
    return compiled


def _param_hooks(hooks, params):
    data, grad = [], []
    for u, (p, attribute) in hooks:
        if attribute == 'data':
            data.append((u, params[p]))
        elif attribute == 'grad':
            grad.append((params[p], u))
    return tuple(data), tuple(grad)


def _attach(param, g):
    """``param.grad = g``, skipping Chainer's check where it cannot fail."""
    if g is None:
        param._set_grad_without_check(None)
        return
    a = param.array
    if (type(g) is numpy.ndarray and type(a) is numpy.ndarray
            and g.shape == a.shape and g.dtype == a.dtype and param._layout is None):
        param._set_grad_without_check(g)
    else:
        param.grad = g


def _entry(info):
    """One closure doing what ``info()`` does, or None to keep ``info``."""
    if info.outputs_hooks or info.args[1:] or set(info.kwargs) != {'inputs'}:
        return None
    node = info.function_node
    if node is None:
        return None
    func = info.func
    if getattr(func, '__name__', None) == 'generic_static_forward':
        def call(ins):
            return node.forward(tuple(ins))
    elif isinstance(func, _Lazy):
        def call(ins):
            return func(node, ins)
    else:
        return None
    ua = info.unique_arrays
    template = tuple(info.in_list)          # hooked positions are None after build
    hooked = tuple(info.inputs_hooks)
    deletes = tuple(info.delete_hooks)
    copies = tuple((r, u) for r, u in info.return_hooks if info.array_infos[u].retain)
    rebinds = tuple((r, u) for r, u in info.return_hooks if not info.array_infos[u].retain)

    def run():
        ins = list(template)
        for i, u in hooked:
            ins[i] = ua[u]
        for u in deletes:
            ua[u] = None
        ret = call(ins)
        for r, u in copies:
            ua[u][...] = ret[r]
        for r, u in rebinds:
            ua[u] = ret[r]
    return run
