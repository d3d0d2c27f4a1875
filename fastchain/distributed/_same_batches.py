"""Noticing ranks that all train on the same batches.

A script that forgets ``scatter_dataset`` gives every rank the whole
dataset; with the same seed on every rank (the usual ``numpy.random.seed``
at the top), every rank then draws the same batches in the same order and
computes the same gradients, and N ranks do the work of one, with nothing
said (ChainerMN said nothing either). The weights stay right: what is lost
is the speed-up, and each epoch counts N times the examples it should.

On its first :data:`STEPS` steps, each rank takes a fingerprint of its
step, and the ranks compare them with one small allgather: with
``update(lossfun, *inputs)``, the loss and one float64 sum per input array
(on the device, one transfer; the loss tells apart batches whose sums agree,
and ranks that take their share of one batch inside the loss function), or,
where the script ran its own backward (``update()``), its own gradients
before they are averaged. Equal on every rank for all of them, rank 0 warns,
naming the fixes: ``scatter_dataset``, or, for inputs drawn at random (a
GAN's noise), a seed of each rank's own. A step that tells nothing (a loss
or gradients not finite, as fp16's first steps may be; gradients all zero)
is not counted; after :data:`TRIES` steps the check stops.
"""

import warnings

import numpy

from fastchain.config import _patches
from fastchain.config._warning import FastchainWarning

STEPS = 2       # steps compared
TRIES = 8       # steps looked at, at most

SAME_BATCHES = (
    'fastchain data-parallel: all {n} ranks had the same loss and inputs on each of their first '
    '{steps} steps: they train on the same batches, so {n} ranks do the work of one. If each '
    'rank has the whole dataset, give each its share before building its iterator: '
    'train = fastchain.distributed.scatter_dataset(train, comm, shuffle=True); if the inputs '
    'are drawn at random (a GAN\'s noise), seed each rank differently: '
    'numpy.random.seed(seed + comm.rank)')


UNEQUAL = (
    'fastchain data-parallel: the ranks\' batch sizes differ ({sizes}): the step averages '
    'the ranks\' gradients, each the mean over its own batch, so an example of a smaller '
    'batch weighs more than one of a larger (as in ChainerMN). Give every rank the same '
    'batch size (scatter_dataset gives each rank the same number of examples)')


class SameBatches:
    """One data-parallel optimizer's check (see the module)."""

    def __init__(self, comm):
        self.comm = comm
        self.tries = TRIES if comm.size > 1 else 0
        self.same = 0
        self.sizes_said = False

    def look(self, take, batch=None):
        """Compare this step's fingerprint, ``take()`` (:func:`of_inputs`,
        :func:`of_gradients`), over the ranks (a collective: every rank
        calls it at the same step; a fingerprint that fails is None); and
        the ranks' ``batch`` sizes, where known (a review: unequal ones
        passed unsaid)."""
        if not self.tries:
            return
        self.tries -= 1
        try:
            mine = take()
        except Exception:   # an input of a kind it does not know: no information
            mine = None
        both = self.comm.allgather_obj(
            (mine, batch), what='batch fingerprints (the same-batches check)')
        sizes, everyone = [b for _, b in both], [f for f, _ in both]
        if not self.sizes_said and None not in sizes and len(set(sizes)) > 1:
            self.sizes_said = True
            if self.comm.rank == 0:
                warnings.warn(UNEQUAL.format(sizes=', '.join(
                    'rank {}: {}'.format(r, b) for r, b in enumerate(sizes))),
                    FastchainWarning, stacklevel=_patches.user_stacklevel())
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


def of_step(loss, args, kwds):
    """The loss and one float64 sum per array among the inputs (a Variable's
    array too; in lists, tuples and dicts up to 64 items), or None where the
    loss is not a finite number. The loss tells batches apart whose sums
    agree (one-hot inputs) and ranks that take their share of one batch
    inside the loss function; the inputs, batches of the same loss (a last
    layer initialised to zero gives log(classes) for any batch)."""
    arrays = []
    _arrays(loss, arrays, 0)
    if not arrays:
        return None
    _arrays(list(args) + [kwds[k] for k in sorted(kwds)], arrays, 0)
    values = _to_host(arrays)
    return tuple(values.tolist()) if numpy.isfinite(values).all() else None


def _arrays(value, into, depth):
    value = getattr(value, 'array', value)      # a Variable
    if isinstance(value, (list, tuple)) and depth < 3 and len(value) <= 64:
        for v in value:
            _arrays(v, into, depth + 1)
    elif isinstance(value, dict) and depth < 3 and len(value) <= 64:
        for k in sorted(value, key=repr):
            _arrays(value[k], into, depth + 1)
    elif (isinstance(value, (numpy.ndarray, numpy.generic))
          or type(value).__module__.startswith('cupy')) and value.dtype.kind in 'biuf':
        into.append(value.sum(dtype=numpy.float64))


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
