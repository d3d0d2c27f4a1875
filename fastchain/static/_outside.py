"""Gradient terms from outside a cached call: said, not left to the README.

A cached call is one node of Chainer's graph (:mod:`fastchain.static._node`),
which brings each parameter's gradient from inside the call as one term.
Chainer's backward adds a parameter's terms one by one as it reaches them
(a heap by rank, ties by the order nodes were pushed), and the node is
reached at another point than the define-by-run functions it stands for. Two
terms add up the same either way (float addition commutes); three or more
may be grouped otherwise, a difference of rounding: a penalty over the
parameters in the loss (``F.sum(p * p)`` brings two terms of its own),
or a parameter used once more outside the call besides a gradient
accumulated from an earlier backward. Adam turns such rounding noise in a
gradient that is zero in exact arithmetic (a bias before BatchNormalization)
into a full step (README: the differential suite's tolerances).

The first :data:`CHECKS` backward passes that reach a cache's node count,
before they run, the terms each of its parameters will get: Chainer's
backward adds one term per input slot of a function that takes the
parameter (``p * p``: two), found by walking the graph back from the
variable the backward starts from. A term is the call's when it comes
through the cache's node, or through a function one of the chain's own
define-by-run calls made (a lazily sized layer's first step, autotune's
turns, an output the loss leaves out: :func:`called` notes their functions
while the cache is counted); any other is from outside. A parameter with
three or more terms in all (a gradient left from an earlier backward is
one), some from outside, gets a :class:`StaticGraphOrder` warning once per
model, and the model's entry in ``handle.report()['static_graph']['calls']
['not_bitwise']``. Later passes are not counted (a loss that starts using
the parameters later is not seen), and a parameter used twice inside the
call counts as one term (the node adds its two first; DEVELOPERS.md,
Chainer's ``static_graph``).
"""

import threading
import weakref

from fastchain.config import _patches
from fastchain.config._warning import FastchainWarning

CHECKS = 3          # backward passes through a cache's node that are counted
IDLE = 16           # counted passes that do not reach the node (another model's, define-by-run
                    # turns) before a cache is left alone
NAMES = 3           # parameters named in the warning
LIMIT = 1 << 16     # functions of the chain's define-by-run calls kept for one pass
WANTED = weakref.WeakSet()  # caches with passes left to count
_local = threading.local()

MESSAGE = (
    'fastchain static_graph: the gradient of {params} of {model} adds terms from outside '
    'the cached call (a penalty over the parameters in the loss, a parameter also used '
    'by the loss) to the call\'s, {terms} terms in all, and the cached call brings its '
    'terms at another point of Chainer\'s backward than define-by-run, so they may be '
    'summed in another order: the training can differ from define-by-run\'s by rounding '
    '(growing as the trainings drift apart: measured within 4.2e-6 of the largest '
    'value in float32 over 8 steps; with Adam a gradient '
    'that is zero in exact arithmetic, such as a bias before BatchNormalization, can '
    'become a full step). For bitwise results put the penalty in an optimizer hook '
    '(chainer.optimizer_hooks.WeightDecay) or train this model without static_graph')


class StaticGraphOrder(FastchainWarning):
    """A cached chain's parameters get gradient terms from outside the call:
    the same terms, summed in another order than define-by-run's."""


def watch(cache):
    """A new cache: its next :data:`CHECKS` backward passes are counted."""
    cache.outside_left, cache.outside_idle = CHECKS, IDLE
    cache.outside_inside, cache.outside_unsure = [], False
    WANTED.add(cache)


def unwatch(cache):
    """``cache`` has no node any more (it fell back)."""
    WANTED.discard(cache)


def called(cache, args, result):
    """``cache``'s chain was called on ``args`` and gave ``result``: if it
    ran define-by-run, the functions it made are the call's own."""
    import chainer
    outputs = [y for y in _flatten(result)
               if isinstance(y, chainer.Variable) and y.creator_node is not None]
    if not outputs or any(_node_of(y.creator_node) for y in outputs):
        return
    inside = cache.outside_inside
    stop = {id(x.node) for x in _flatten(args) if isinstance(x, chainer.Variable)}
    seen = set(id(f) for f in inside)
    stack = [y.creator_node for y in outputs]
    while stack:
        func = stack.pop()
        if id(func) in seen:
            continue
        if len(inside) >= LIMIT:
            cache.outside_unsure = True     # too big to keep: no verdict this pass
            return
        seen.add(id(func))
        inside.append(func)
        stack.extend(x.creator_node for x in func.inputs
                     if x.creator_node is not None and id(x) not in stop)


def _node_of(func):
    """The cache a replay's node belongs to, or None."""
    from chainer.graph_optimizations.static_graph import StaticScheduleFunction
    if not isinstance(func, StaticScheduleFunction):
        return None
    from fastchain.static import _node
    return _node.owner(func)


def _flatten(x):
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flatten(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in _flatten(item)]
    return [x]


def backward_layer(next_, variable, *args, **kwargs):
    """``Variable.backward`` while a chain is cached: its terms counted
    first while some cache has passes left."""
    if WANTED and not getattr(_local, 'busy', False):
        _local.busy = True      # a backward inside it (F.forget's) is its own
        try:
            _count(variable)
            return next_(variable, *args, **kwargs)
        finally:
            _local.busy = False
            for cache in list(WANTED):
                cache.outside_inside, cache.outside_unsure = [], False
    return next_(variable, *args, **kwargs)


def _count(variable):
    """The terms each watched parameter will get in the backward from
    ``variable``: the call's (``inside``) and the rest."""
    watched = {}
    for cache in list(WANTED):
        chain = cache.ref()
        if chain is not None:
            mine = {id(f) for f in cache.outside_inside}
            for p in chain.params():
                if p.array is not None:
                    watched[id(p.node)] = (cache, p, mine, [0, 0])
    seen, stack = set(), [variable.creator_node]
    while stack:
        func = stack.pop()
        if func is None or id(func) in seen:
            continue
        seen.add(id(func))
        owner = _node_of(func)
        for x in func.inputs:
            entry = watched.get(id(x))
            if entry is not None:
                entry[3][0 if owner is entry[0] or id(func) in entry[2] else 1] += 1
            elif x.creator_node is not None:
                stack.append(x.creator_node)
    _judge(watched)


def _judge(watched):
    """Each cache whose node the pass reaches has one pass fewer left (one it
    does not reach, one idle pass fewer), and one whose parameters get
    outside terms is named."""
    found, most, reached = {}, {}, set()
    for cache, p, _, (inside, outside) in watched.values():
        if inside:
            reached.add(cache)
        total = inside + outside + (p.grad_var is not None)
        if outside and total >= 3:
            found.setdefault(cache, []).append(p)
            most[cache] = max(most.get(cache, 0), total)
    for cache in list(WANTED):
        if cache in reached:
            cache.outside_left -= 1
        else:
            cache.outside_idle -= 1
        if cache.outside_left <= 0 or cache.outside_idle <= 0:
            WANTED.discard(cache)
    for cache, params in found.items():
        if cache in reached and not cache.outside_unsure and \
                cache.state.get('not_bitwise') is None:
            _name(cache, params, most[cache])
def _name(cache, found, most):
    import warnings
    chain = cache.ref()
    names = {id(p): name for name, p in chain.namedparams()} if chain is not None else {}
    listed = [names.get(id(p), p.name or '?') for p in found]
    params = ', '.join(listed[:NAMES]) + (' and {} more'.format(len(listed) - NAMES)
                                          if len(listed) > NAMES else '')
    message = MESSAGE.format(params=params, model=cache.name, terms=most)
    cache.state['not_bitwise'] = message
    WANTED.discard(cache)
    warnings.warn(message, StaticGraphOrder, stacklevel=_patches.user_stacklevel())
