"""autotune for the loader: how many of its workers load (:mod:`fastchain.tune`).

On a machine with few cores the workers decode on the cores the step
computes on, and more of them can make a step slower. Which count is faster
depends on the step, the decode and the machine, so it is measured: the
counts from all the workers down to one take turns over whole steps (each
turn runs ``settle`` steps for the batches already in flight to drain, then
times ``timed`` steps), and the fastest count stays. Idle workers wait on
their pipe and use no CPU. Every batch and the order stay the same whatever
the count: a batch's examples and their NumPy seeds come from the schedule,
not from the worker that loads it. (Random numbers a dataset draws
elsewhere, from Python's ``random`` or a generator of its own, are the
worker's, as in any multiprocess loader; which worker loads a batch now
depends on the count in force.) (Loading in the training process instead is
not an alternative: with ``rng='global'`` it draws the examples' random
numbers from NumPy's global RNG, the workers from seeds.)
"""

from fastchain.tune import _tuner

TIMED_STEPS = 2


class WorkerTuner:
    """Chooses the pool's active worker count, step by step (:meth:`step`)."""

    def __init__(self, key, n_workers, slots, label):
        self.key = key
        self.names = tuple(str(k) for k in range(n_workers, 0, -1))
        self.label = label
        # a batch sent under the previous count is used after ``slots`` steps
        self.turns = _tuner.Turns(settle=slots, timed=TIMED_STEPS)

    def step(self, pool):
        """Call at the start of each step (each ``next()``): sets ``pool.active``."""
        if not _tuner.enabled:
            pool.active = len(pool.workers)     # autotune off (again): all of them
            self.turns.reset()
            return
        pool.active = int(self.turns.step('loader_workers', self.key, self.names,
                                          self.label))
