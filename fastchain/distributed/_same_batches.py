"""Noticing ranks that all train on the same batches.

A script that forgets ``scatter_dataset`` gives every rank the whole
dataset; with the same seed on every rank (the usual ``numpy.random.seed``
at the top), every rank then draws the same batches in the same order and
computes the same gradients, and N ranks do the work of one, with nothing
said (ChainerMN said nothing either). The weights stay right: what is lost
is the speed-up, and each epoch counts N times the examples it should.

On its first :data:`STEPS` steps, each rank takes a fingerprint of its
batch (the arrays given to ``update(lossfun, *inputs)``: one float64 sum
each, on the device, one transfer), or of its own gradients before they are
averaged where the script computed them (``update()``), and the ranks
compare them with one small allgather. Equal on every rank for all of them
(different batches never are), rank 0 warns, naming the fix. A step that
tells nothing (no array among the inputs; gradients all zero or not finite,
as fp16's first steps may be) is not counted; after :data:`TRIES` steps the
check stops.
"""

import warnings

import numpy

from fastchain.config import _patches
from fastchain.config._warning import FastchainWarning

STEPS = 2       # steps compared
TRIES = 8       # steps looked at, at most

SAME_BATCHES = (
    'fastchain data-parallel: all {n} ranks had the same batch on each of their first '
    '{steps} steps: every rank trains on the same batches (each has the whole dataset, '
    'in the same order), so {n} ranks do the work of one and an epoch counts each '
    'example {n} times. Give each rank its share before building its iterator: '
    'train = fastchain.distributed.scatter_dataset(train, comm, shuffle=True)')


class SameBatches:
    """One data-parallel optimizer's check (see the module)."""

    def __init__(self, comm):
        self.comm = comm
        self.tries = TRIES if comm.size > 1 else 0
        self.same = 0

    def look(self, take):
        """Compare this step's fingerprint, ``take()`` (:func:`of_inputs`,
        :func:`of_gradients`), over the ranks (a collective: every rank
        calls it at the same step; a fingerprint that fails is None)."""
        if not self.tries:
            return
        self.tries -= 1
        try:
            mine = take()
        except Exception:   # an input of a kind it does not know: no information
            mine = None
        everyone = self.comm.allgather_obj(
            mine, what='batch fingerprints (the same-batches check)')
        if any(f is None for f in everyone):
            return          # no information on some rank: not counted
        if any(f != everyone[0] for f in everyone):
            self.tries = 0  # different batches: done
            return
        self.same += 1
        if self.same == STEPS:
            self.tries = 0
            if self.comm.rank == 0:
                warnings.warn(SAME_BATCHES.format(n=self.comm.size, steps=STEPS),
                              FastchainWarning, stacklevel=_patches.user_stacklevel())


def of_inputs(args, kwds):
    """One float64 sum per array among ``args`` and ``kwds`` (a Variable's
    array too), or None where there is none."""
    arrays = []
    for value in list(args) + [kwds[k] for k in sorted(kwds)]:
        value = getattr(value, 'array', value)      # a Variable
        if (isinstance(value, numpy.ndarray) or type(value).__module__.startswith('cupy')) \
                and value.ndim > 0 and value.dtype.kind in 'biuf':
            arrays.append(value.sum(dtype=numpy.float64))
    if not arrays:
        return None
    values = _to_host(arrays)
    return tuple(values.tolist()) if numpy.isfinite(values).all() else None


def of_gradients(params):
    """One float64 sum per gradient (the parameters' order), or None where
    every gradient is zero or absent, or one is not finite."""
    sums = [None if p.grad is None else p.grad.sum(dtype=numpy.float64) for p in params]
    arrays = [s for s in sums if s is not None]
    if not arrays:
        return None
    values = _to_host(arrays)
    if not numpy.isfinite(values).all() or not values.any():
        return None
    it = iter(values.tolist())
    return tuple(None if s is None else next(it) for s in sums)


def _to_host(sums):
    if all(isinstance(s, (numpy.ndarray, numpy.generic)) for s in sums):
        return numpy.array(sums, numpy.float64)
    import cupy
    return cupy.stack([cupy.asarray(s) for s in sums]).get()
