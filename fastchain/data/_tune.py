"""autotune for the loader: how many of its workers load, and how many
batches are in flight (:mod:`fastchain.tune`).

On a machine with few cores the workers decode on the cores the step
computes on, and more of them can make a step slower. Which count is faster
depends on the step, the decode and the machine, so it is measured: all
the workers, then the powers of two below their number (:func:`counts`:
16, 8, 4, 2, 1 on 16 cores; 3, 2, 1 on 3), take turns over whole steps (each
turn runs ``settle`` steps for the batches already in flight to drain, then
times ``timed`` steps), and the fastest count stays. Idle workers wait on
their pipe and use no CPU. Then, for the count kept, the prefetch depth (the
batches sent ahead: all the slots, two per loading worker, one per loading
worker) is measured the same way and the fastest kept; a shallower depth
starts loading a batch later, so the loading runs at other moments of the
step. Every batch and the order stay the same whatever the count and the
depth: a batch's examples and their NumPy seeds come from the schedule, not
from the worker that loads it or from when it is loaded. (Random numbers a
dataset draws elsewhere, from Python's ``random`` or a generator of its own,
are the worker's, as in any multiprocess loader; which worker loads a batch
now depends on the count in force.) (Loading in the training process instead
is not an alternative: with ``rng='global'`` it draws the examples' random
numbers from NumPy's global RNG, the workers from seeds.)
"""

from fastchain.tune import _tuner

TIMED_STEPS = 2


def counts(n_workers):
    """The loading-worker counts measured, as names: all ``n_workers``, then
    the powers of two below (a count between them decodes at a rate between
    theirs; trying all 16 of a 16-core node would take 16 x 4 turns)."""
    below = [1 << k for k in range(n_workers.bit_length()) if 1 << k < n_workers]
    return tuple(str(k) for k in [n_workers] + sorted(below, reverse=True))


def depths(active, slots):
    """The prefetch depths measured for ``active`` loading workers: all the
    slots (the default, first), two batches per worker, one per worker."""
    return tuple(str(d) for d in sorted({slots, 2 * active, active}, reverse=True)
                 if 1 <= d <= slots)


class WorkerTuner:
    """Chooses the pool's active worker count, then its prefetch depth, step
    by step (:meth:`step`)."""

    def __init__(self, key, n_workers, slots, label):
        self.key = key
        self.slots = slots
        self.names = counts(n_workers)
        self.label = label
        # a batch sent under the previous count is used after ``slots`` steps
        self.turns = _tuner.Turns(settle=slots, timed=TIMED_STEPS)
        self.depth_turns = _tuner.Turns(settle=slots, timed=TIMED_STEPS)

    def step(self, pool):
        """Call at the start of each step (each ``next()``): sets
        ``pool.active`` and ``pool.depth``."""
        if not _tuner.enabled:
            # autotune off (again): all of them, all the slots
            pool.active, pool.depth = len(pool.workers), self.slots
            self.turns.reset()
            self.depth_turns.reset()
            return
        active = int(self.turns.step('loader_workers', self.key, self.names, self.label))
        pool.active = active
        decided = _tuner.forced.get('loader_workers') is not None or \
            _tuner.choice('loader_workers', self.key, self.names).picked is not None
        names = depths(active, self.slots)
        if not decided or len(names) == 1:
            pool.depth = self.slots
            return
        pool.depth = int(self.depth_turns.step(
            'loader_prefetch', self.key + (active,), names,
            lambda: '{}, {} loading: batches in flight'.format(self.label, active)))


def tuner_for(iterator):
    """A tuner of how many of ``iterator``'s workers load (all of them, or a
    power of two below, measured over whole steps), or None without two."""
    if iterator._pool is None or iterator.n_workers < 2:
        return None
    key = (type(iterator.dataset).__name__, len(iterator.dataset), iterator.batch_size,
           iterator.n_workers)
    return WorkerTuner(key, iterator.n_workers, iterator.prefetch, (
        'loader of {} ({} examples, batch {}) with up to {} workers'.format(*key)))
