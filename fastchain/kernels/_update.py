"""A fused, cache-blocked CPU kernel for the SGD and MomentumSGD updates.

Chainer's CPU update is a handful of whole-array NumPy operations per
parameter (``v *= momentum; v -= lr * grad; param += v``): each one streams
the full array through memory and the middle one allocates a temporary. For
ResNet-50 it is the largest own-time entry of an overhead-bound CPU step after
the convolutions (benchmarks/overhead.py profiles both kernels). Splitting it
over threads was tried and gained nothing in a training step: OpenBLAS's
threads still spin on the other core after the last convolution.

The fused kernel applies the *same* NumPy operations, in the same order and
with the same operand types, to blocks small enough to stay in cache, with
one small reused temporary. Each element goes through exactly the operations
Chainer's code applies to it, so the results are bitwise identical (tested).

It replaces only ``update_core_cpu`` of the rule instances it is given, so
Chainer's own ``UpdateRule.update`` still does the rest: hooks, the division
by the loss scale, fp32 master weights, ``enabled``. Anything outside its
fast path (a rule subclass with its own kernel, iDeep arrays, mixed dtypes,
non-contiguous state, a learning rate or momentum that is an array) goes
through Chainer's code unchanged. Chainer's GPU
update (one elementwise CUDA kernel) is not touched (not run on a GPU).

With ``autotune`` the fused kernel is used only for the rule kinds, dtypes
and sizes where it measured faster than Chainer's (:mod:`fastchain.tune`).
"""

import sys
import weakref

import numpy

from chainer.optimizers.momentum_sgd import MomentumSGDRule
from chainer.optimizers.sgd import SGDRule

from fastchain.config import _patches
from fastchain.tune import _tuner

# Chainer's own kernels, known by where they were defined: the fused one
# stands in for these only. A kernel patched on the class (by the script or a
# library, before fastchain's import or after the set-up; functools.wraps
# copies names, not code) runs as it is: it was skipped, a review found.
_CHAINERS = {True: MomentumSGDRule, False: SGDRule}


def _is_chainers(kernel, momentum):
    # once per kernel function: it is asked for every parameter at every step
    known = _KNOWN.get((kernel, momentum))
    if known is None:
        code = getattr(kernel, '__code__', None)
        cls = _CHAINERS[momentum]
        known = _KNOWN[(kernel, momentum)] = (
            code is not None and code.co_name == 'update_core_cpu' and
            code.co_filename == sys.modules[cls.__module__].__file__ and
            getattr(kernel, '__qualname__', None) == cls.__name__ + '.update_core_cpu')
    return known


_KNOWN = {}     # (kernel function, momentum) -> whether it is Chainer's

# Elements per block: 256 KiB of float32 per operand (the best of 2**12 to
# 2**18 measured on the 2-core development machine).
BLOCK = 1 << 16


def _momentum_blocks(p, g, v, lr, momentum):
    n = p.size
    tmp = numpy.empty(min(BLOCK, n), numpy.result_type(lr, g))
    for i in range(0, n, BLOCK):
        j = min(n, i + BLOCK)
        vb, t = v[i:j], tmp[:j - i]
        numpy.multiply(vb, momentum, out=vb)        # v *= momentum
        numpy.multiply(lr, g[i:j], out=t)           # lr * grad
        numpy.subtract(vb, t, out=vb)               # v -= ...
        pb = p[i:j]
        numpy.add(pb, vb, out=pb)                   # param += v


def _sgd_blocks(p, g, lr):
    n = p.size
    tmp = numpy.empty(min(BLOCK, n), numpy.result_type(lr, g))
    for i in range(0, n, BLOCK):
        j = min(n, i + BLOCK)
        t = tmp[:j - i]
        numpy.multiply(lr, g[i:j], out=t)           # lr * grad
        pb = p[i:j]
        numpy.subtract(pb, t, out=pb)               # param -= ...


def _one_number(value):
    value = numpy.asarray(value)
    return value.ndim == 0 and value.dtype.kind in 'fiu'


def _plain_arrays(*arrays):
    return all(type(a) is numpy.ndarray for a in arrays)


def _fused_layer_of(rule_ref, momentum, next_, param):
    return fused_layer(rule_ref(), momentum, next_, param)


def fused_layer(rule, momentum, next_, param):
    """The ``fused_update`` layer of ``rule.update_core_cpu`` (``momentum``:
    it is a MomentumSGD rule)."""
    grad = param.grad
    if not _is_chainers(type(rule).update_core_cpu, momentum):
        return next_(param)
    if grad is None:
        return
    p = param.data
    v = rule.state['v'] if momentum else p
    hp = rule.hyperparam
    if not (_plain_arrays(p, grad, v) and p.dtype == grad.dtype == v.dtype
            and p.shape == grad.shape == v.shape
            and p.flags.c_contiguous and v.flags.c_contiguous
            # an array of learning rates or momenta (a freeze mask, per row) is
            # Chainer's: the blocks take one value for all (they raised, a trial);
            # so is a value that is not a number (lr=None: Chainer's error)
            and _one_number(hp.lr) and (not momentum or _one_number(hp.momentum))):
        return next_(param)
    if not _tuner.enabled:
        return _fused(rule, momentum, p, grad, v)
    # autotune: per (rule, dtype, size), the fused kernel or Chainer's,
    # whichever is faster (the same bits either way); once decided, run
    # directly (a step makes one of these calls per parameter).
    key = (momentum, p.dtype.str, p.size)
    kept = _picks.get(key)
    if kept is not None and kept[0] == _tuner.generation and not _tuner.forced:
        return _fused(rule, momentum, p, grad, v) if kept[1] == 'fused' else next_(param)
    generation = _tuner.generation      # before the pick: a forget() between
    out = _tuner.call('fused_update', key, (
        ('fused', lambda: _fused(rule, momentum, p, grad, v)),
        ('chainer', lambda: next_(param))),
        label=lambda: '{} {} {} elements'.format(
            'MomentumSGD' if momentum else 'SGD', p.dtype, p.size))
    picked = _tuner.pick('fused_update', key)
    if picked is not None:
        _picks[key] = (generation, picked)
    return out


_picks = {}     # autotune's decided alternative per key: (generation, name)


def _fused(rule, momentum, p, grad, v):
    hp = rule.hyperparam
    g = numpy.ascontiguousarray(grad).reshape(-1)     # a copy only if needed
    if momentum:
        _momentum_blocks(p.reshape(-1), g, v.reshape(-1), hp.lr, hp.momentum)
    else:
        _sgd_blocks(p.reshape(-1), g, hp.lr)


def _is_momentum(rule):
    return isinstance(rule, MomentumSGDRule)


def supported(rule):
    """True if ``rule`` is an SGD or MomentumSGD rule using Chainer's CPU kernel."""
    for momentum, cls in _CHAINERS.items():
        if isinstance(rule, cls):
            return _is_chainers(type(rule).update_core_cpu, momentum)
    return False


def fuse(optimizer, changes=None):
    """Give every supported update rule of ``optimizer`` the fused kernel (a
    ``fused_update`` layer on the rule's ``update_core_cpu``), recorded in
    ``changes`` (a handle's; default: a new one).

    Returns a callable that puts Chainer's kernels back, and the number of
    rules changed.
    """
    import functools
    if changes is None:
        changes = _patches.Changes('fused_update')
    changed = 0
    for param in optimizer.target.params():
        rule = param.update_rule
        if rule is None or not supported(rule) or is_fused(rule) \
                or 'update_core_cpu' in vars(rule):
            continue        # not Chainer's kernel, fused already, or the user's own
        # The rule weakly: the layer is kept with the rule's dispatch point,
        # which a strong reference would keep alive, state and all, after
        # its model and optimizer are gone (a review).
        changes.wrap(rule, 'update_core_cpu', 'fused_update',
                     functools.partial(_fused_layer_of, weakref.ref(rule), _is_momentum(rule)))
        changed += 1
    return changes.undo, changed


def is_fused(rule):
    return 'fused_update' in _patches.layers(rule, 'update_core_cpu')
