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

import time

from fastchain.tune import _tuner

TIMED_STEPS = 2


class WorkerTuner:
    """Chooses the pool's active worker count, step by step (:meth:`step`)."""

    def __init__(self, key, n_workers, slots, label):
        self.key = key
        self.names = tuple(str(k) for k in range(n_workers, 0, -1))
        self.settle = slots         # a batch sent under the old count is used by then
        self.label = label
        self.turn = None            # [alternative, timed, steps so far, start of timing]

    def step(self, pool):
        """Call at the start of each step (each ``next()``): sets ``pool.active``."""
        if not _tuner.enabled:
            pool.active = len(pool.workers)     # autotune off (again): all of them
            self.turn = None
            return
        forced = _tuner.forced_name('loader_workers', self.names)
        if forced is not None:
            pool.active = int(forced)
            return
        choice = _tuner.choice('loader_workers', self.key, self.names, self.label)
        if choice.picked is not None:
            pool.active = int(choice.picked)
            return
        now = time.perf_counter()
        turn = self.turn
        if turn is not None:
            turn[2] += 1
            if turn[2] == self.settle:
                turn[3] = now
            if turn[2] < self.settle + TIMED_STEPS:
                return
            if turn[1]:
                choice.record(turn[0], (now - turn[3]) / TIMED_STEPS)
            if choice.picked is not None:
                pool.active = int(choice.picked)
                self.turn = None
                return
        name, timed = choice.next()
        pool.active = int(name)
        self.turn = [name, timed, 0, None]
