"""Gradient terms from outside a cached call: said, not left to the README.

A cached call is one node of Chainer's graph (:mod:`fastchain.static._node`),
which brings each parameter's gradient from inside the call as one term.
Chainer's backward adds a parameter's terms one by one as it reaches the
functions that take it (a heap by rank, ties by the order nodes were
pushed), after any gradient the parameter held; the node is reached at
another point than the define-by-run functions it stands for. Terms of
functions that depend on the call's outputs (a tied head's ``F.matmul(y,
W)``) come before the call's either way; a term of a function that does not
(``F.sum(p * p)`` in the loss: two) may come before or after them, and the
sum may then be grouped otherwise: a difference of rounding, which Adam
turns into a full step for a gradient that is zero in exact arithmetic (a
bias before BatchNormalization; README: the differential suite's
tolerances).

The first :data:`CHECKS` backward passes that reach a cache's node (or a
define-by-run call of its chain) count, before they run, the terms each of
its parameters will get, walking the graph back from the variable the
backward starts from: one per input slot of a function taking the parameter,
the calls' (through a node, or a function a cached chain's define-by-run
call made: :func:`called` notes them for the thread until its backward),
those that depend on a call's outputs, and the rest. Where the call's terms
and the rest may be grouped otherwise (:func:`may_differ`), a
:class:`StaticGraphOrder` warning is given once per model, and the model's
entry in ``handle.report()['static_graph']['calls']['not_bitwise']``.
A parameter used two or more times inside the call (a link applied
twice) comes from the node as one sum of those uses, where define-by-run
adds them one by one: wherever it meets another term (a gradient held from
an earlier pass, a use outside, another call), that is said too; the uses
are counted in the define-by-run reference of each verified call, per
key (:func:`note_uses`). Not counted: passes after those (a loss that starts
using the parameters later), ``chainer.grad`` (only ``Variable.backward`` is
layered), and the terms of what the call takes or returns used three or more times
(a VAE's encoder outputs: DEVELOPERS.md, Chainer's ``static_graph``).
"""

import threading
import weakref

from fastchain.config import _patches
from fastchain.config._warning import FastchainWarning
from fastchain.static import _verify

CHECKS = 3          # backward passes through a cache's node that are counted
IDLE = 16           # counted passes that do not reach the node (another model's, define-by-run
                    # turns) before a cache is left alone
NAMES = 3           # parameters named in the warning
USES = 'static_uses'  # on a key's ScheduleManager: id(parameter node) -> uses in a call (2+)
LIMIT = 1 << 16     # functions of the chain's define-by-run calls kept for one pass
WANTED = weakref.WeakSet()  # caches with passes left to count
_local = threading.local()

ROUNDING = (
    "so the terms may be summed in another order: the training can differ from "
    "define-by-run's by rounding (growing as the trainings drift apart: measured at most "
    '2.0e-5 of the largest value in float32 and 2.3e-2 in fp16 over 8 steps, both in '
    'trainings that diverge; with Adam a gradient that is zero in exact arithmetic, such as '
    'a bias before BatchNormalization, can become a full step). ')
MESSAGE = (
    'fastchain static_graph: the gradient of {params} of {model} gets terms from functions '
    "outside the cached call that do not depend on its outputs (a penalty over the "
    "parameters in the loss, F.sum(p * p)), and the cached call brings its own terms at "
    "another point of Chainer's backward than define-by-run, " + ROUNDING +
    'For bitwise results apply such '
    'a penalty as an optimizer hook (chainer.optimizer_hooks.WeightDecay(2 * c) for '
    'c * F.sum(p * p)), or train this model without static_graph')
INSIDE = (
    'fastchain static_graph: {params} of {model}: each used more than once inside the cached '
    "call, whose replay brings those terms as one sum where define-by-run adds them one by "
    'one to the rest of the gradient (a gradient held from an earlier backward pass, a use '
    "outside the call, another call's terms), " + ROUNDING + 'For bitwise results clear '
    'the gradients before each backward (cleargrads: zeros from zerograds count as held), '
    'use the model once a backward, or train this model without static_graph')


class StaticGraphOrder(FastchainWarning):
    """A cached chain's parameters get gradient terms from outside the call:
    the same terms, summed in another order than define-by-run's."""


def watch(cache):
    """A new cache: its next :data:`CHECKS` backward passes are counted."""
    cache.outside_left, cache.outside_idle = CHECKS, IDLE
    WANTED.add(cache)


def unwatch(cache):
    """``cache`` has no node any more (it fell back)."""
    WANTED.discard(cache)


def called(cache, args, result):
    """``cache``'s chain was called on ``args`` and gave ``result`` (in
    training, with backprop): if it ran define-by-run, the functions it made
    are the call's own, noted for this thread until its next backward."""
    import chainer
    if not (chainer.config.train and chainer.config.enable_backprop):
        return
    outputs = [y for y in _flatten(result)
               if isinstance(y, chainer.Variable) and y.creator_node is not None]
    if not outputs or any(_node_of(y.creator_node) for y in outputs):
        return
    inside = _inside()
    if len(inside) >= LIMIT:    # calls without a backward: forget the dead
        for key in [k for k, refs in inside.items() if refs[0]() is None]:
            del inside[key]
        if len(inside) >= LIMIT:
            _local.unsure = True     # too many: no verdict on the next pass
            return
    stop = {id(x.node) for x in _flatten(args) if isinstance(x, chainer.Variable)}
    stack = [y.creator_node for y in outputs]
    while stack:
        func = stack.pop()
        if id(func) in inside:
            continue
        if len(inside) >= LIMIT:
            _local.unsure = True
            return
        inside[id(func)] = weakref.ref(func), weakref.ref(cache)    # (no graph kept alive)
        stack.extend(x.creator_node for x in func.inputs
                     if x.creator_node is not None and id(x) not in stop)


def note_uses(cache, manager, outputs):
    """A verified call's define-by-run reference gave ``outputs`` (its
    inputs detached): each parameter used two or more times in it is noted
    on the key's schedule ``manager`` with that count, the terms a replay's
    node of that key sums before Chainer's backward adds them to the rest."""
    chain = cache.ref()
    if chain is None or manager is None:
        return
    params = {id(p.node) for p in chain.params()}
    uses = {}
    for func in _verify.functions(outputs):
        for x in func.inputs:
            if id(x) in params:
                uses[id(x)] = uses.get(id(x), 0) + 1
    noted = _patches.attached(manager, USES)
    if noted is None:
        noted = {}
        _patches.attach(manager, USES, noted)
    for key, n in uses.items():
        if n >= 2 and n > noted.get(key, 0):
            noted[key] = n


def _inside():
    """This thread's functions of the cached chains' define-by-run calls
    since its last backward: id -> weak references to it and its cache."""
    inside = getattr(_local, 'inside', None)
    if inside is None:
        inside = _local.inside = {}
    return inside


def _node_of(func):
    """The cache a replay's node belongs to, or None."""
    from chainer.graph_optimizations.static_graph import StaticScheduleFunction
    if not isinstance(func, StaticScheduleFunction):
        return None
    from fastchain.static import _node
    return _node.owner(func)


def _flatten(x):
    """:func:`fastchain.static._verify.flatten`, a dict's values too (what a
    define-by-run call returns is not checked by the cache)."""
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flatten(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in _flatten(item)]
    return [x]


def backward_layer(next_, variable, *args, **kwargs):
    """``Variable.backward`` while a chain is cached: its terms counted
    first while some cache has passes left."""
    if WANTED and not getattr(_local, 'busy', False):
        _local.busy = True      # a backward inside it is the outer one's
        try:
            if not getattr(_local, 'unsure', False):
                _count(variable)
            return next_(variable, *args, **kwargs)
        finally:
            _local.busy = _local.unsure = False
            _local.inside = {}
    return next_(variable, *args, **kwargs)


def _count(variable):
    """The terms each watched parameter will get in the backward from
    ``variable``, by where Chainer's backward adds them: the calls' (through
    a cache's node or a function of a cached chain's define-by-run call);
    those of functions that depend on a call's outputs (``after``: popped
    before any of the call's, with or without the cache: their place is
    kept); and the others (``apart``: a penalty over the parameters, whose
    place among the call's terms may move)."""
    inside = _inside()
    # id(parameter node) -> (parameter, caches, [call, after, apart], {cache whose call
    # takes it in this pass: the most uses one of its calls sums})
    watched = {}
    for cache in list(WANTED):
        chain = cache.ref()
        if chain is not None:
            for p in chain.params():
                if p.array is not None:
                    watched.setdefault(id(p.node), (p, [], [0, 0, 0], {}))[1].append(cache)
    funcs = list(_verify.functions([variable]))
    calls = {}      # id(function) -> (its cache, the uses its inputs stand for)
    for f in funcs:
        node = _node_of(f)
        if node is not None:
            calls[id(f)] = node, _patches.attached(f.schedule_manager, USES) or {}
        elif id(f) in inside and inside[id(f)][0]() is f:
            calls[id(f)] = inside[id(f)][1](), {}
    after = _downstream(funcs, calls)
    for func in funcs:
        where = 0 if id(func) in calls else 1 if id(func) in after else 2
        for x in func.inputs:
            entry = watched.get(id(x))
            if entry is None:
                continue
            if where == 0:      # a replay's node: the uses it stands for
                cache, uses = calls[id(func)]
                n = uses.get(id(x), 1)
                entry[2][0] += n
                entry[3][cache] = max(entry[3].get(cache, 0), n)
            else:
                entry[2][where] += 1
    _judge(watched.values())


def _downstream(funcs, calls):
    """The ids of the functions in ``funcs`` (a graph's) that depend on an
    output of one of ``calls``."""
    by_id = {id(f): f for f in funcs}
    memo = {}
    for root in funcs:
        stack = [(root, False)]
        while stack:
            func, ready = stack.pop()
            key = id(func)
            if key in memo:
                continue
            parents = [x.creator_node for x in func.inputs
                       if x.creator_node is not None and id(x.creator_node) in by_id]
            if not ready:
                stack.append((func, True))
                stack.extend((f, False) for f in parents if id(f) not in memo)
                continue
            memo[key] = any(id(f) in calls or memo.get(id(f), False) for f in parents)
    return {k for k, v in memo.items() if v}


def summed_inside(call, after, apart, held, inside):
    """Whether a parameter used ``inside`` >= 2 times in one call meets
    other terms: a replay's node brings its uses as one sum, where
    define-by-run adds them one by one to the rest."""
    return inside >= 2 and bool(held or after or apart or call > inside)


def may_differ(call, after, apart, held):
    """Whether a parameter's sum may change with the call's terms' place
    among the ``apart`` ones: the prefix (a gradient held from before, the
    ``after`` terms) is added first either way, and two terms commute. With
    two or more calls, a term after one call's output may come before
    another call's terms (the differential suite: a tied head called three
    times), so it moves too. (Uses summed inside a call: :func:`summed_inside`.)"""
    if call >= 2:
        after, apart = 0, apart + after
    moving = call + apart
    return bool(call and apart and (moving >= 3 or (moving >= 2 and (held or after))))


def _judge(entries):
    """Each cache whose node or define-by-run call the pass reaches has one
    pass fewer left (one it does not reach, one idle pass fewer), and one
    whose parameters' sums may change is named."""
    found, reached = {}, set()
    for p, caches, (call, after, apart), took in entries:
        if call:
            reached.update(caches)
        inside = max(took.values(), default=1)     # (this pass's calls only)
        held = p.grad_var is not None
        summed = summed_inside(call, after, apart, held, inside)
        outside = may_differ(call, after, apart, held)
        # the caches whose calls took it (one that shares the parameter but was
        # not called, or called it once beside another's sum, is not to blame)
        for cache in took or caches:
            if summed and took.get(cache, 1) >= 2:
                found.setdefault(cache, []).append((p, True))
            elif outside:
                found.setdefault(cache, []).append((p, False))
    for cache in list(WANTED):
        if cache in reached:
            cache.outside_left -= 1
        else:
            cache.outside_idle -= 1
        if cache.outside_left <= 0 or cache.outside_idle <= 0:
            WANTED.discard(cache)
    for cache, params in found.items():
        if cache is not None and cache in reached and cache.state.get('not_bitwise') is None:
            _name(cache, params)


def _name(cache, found):
    """Says it once for ``cache``: ``found``, (parameter, whether its uses
    inside the call are what meets other terms); those from outside first."""
    import warnings
    chain = cache.ref()
    names = {id(p): name for name, p in chain.namedparams()} if chain is not None else {}
    said = []
    for text, inside in ((MESSAGE, False), (INSIDE, True)):
        listed = [names.get(id(p), p.name or '?') for p, why in found if why == inside]
        if listed:
            params = ', '.join(listed[:NAMES]) + (' and {} more'.format(len(listed) - NAMES)
                                                  if len(listed) > NAMES else '')
            said.append(text.format(params=params, model=cache.name))
    message = '; '.join(said[:1] + [m[len('fastchain static_graph: '):] for m in said[1:]])
    cache.state['not_bitwise'] = message
    WANTED.discard(cache)
    warnings.warn(message, StaticGraphOrder, stacklevel=_patches.user_stacklevel())
