"""What an example drew: the generators it moved, told in the main process
(:class:`KeptGenerators`, which puts them back) and in a worker
(:class:`DrawWatch`, cheaply, on every example until one draws), and
whether the dataset seeds a generator per example itself
(:func:`seeded_per_example`), so that the loader's per-example seeding
changes nothing there. fastchain's loader says so where it takes a plain
script's SerialIterator (:data:`DRAWS_RANDOM`)."""

import random

import numpy

from fastchain.data._generators import _reseed, _same, _set_state, _state, seed_example

DRAWS_RANDOM = (
    "fastchain loader: the dataset's examples draw random numbers from {} (an "
    "augmentation: a random crop, a flip). In the loader's workers each example draws from a seed of its own, so this "
    "run's augmentation is not the one plain Chainer's SerialIterator would draw: "
    "repeatable under numpy.random.seed and the same for any number of workers, but not "
    "bitwise plain Chainer's training. loader_workers=0 keeps Chainer's iterator and its "
    "draws")


AT_EXAMPLE = (
    '. Seen at example {} of the dataset, loaded by a worker (the example looked at when '
    'the loader took the iterator drew none)')


def say_draws(index, names):
    """The warning of a MultiprocessIterator made with ``warn_draws``: a
    worker saw example ``index`` draw from the generators ``names``."""
    import warnings
    from fastchain.config import _patches
    from fastchain.config._warning import FastchainWarning
    warnings.warn(DRAWS_RANDOM.format(' and '.join(names)) + AT_EXAMPLE.format(index),
                  FastchainWarning, stacklevel=_patches.user_stacklevel())


class DrawWatch:
    """Which generators an example drew from, told in a worker cheaply
    (a few microseconds, where reading NumPy's state takes 80): each
    generator :func:`seed_example` seeds is drawn from once after its
    seeding and seeded again, and drawn from once after the example; another
    number means the example drew. A generator of the dataset's own that it
    seeds per example itself (:func:`seeded_per_example`) is left out once
    :data:`PROBES` examples that moved it said so (one that seeds it on some
    examples and draws on from where it stood on others is named at the
    first of those among them)."""

    PROBES = 8

    def __init__(self, own):
        self.own = list(own)
        self.names = ['numpy.random', "Python's random"] + [own_name(p, g) for p, g in self.own]
        self.first = None
        self.seeded = {}    # own generator's place -> examples that showed it seeded

    def seed(self, seed):
        seed_example(seed, self.own)
        self.first = self._draws()
        seed_example(seed, self.own)

    def drew(self, load):
        """The names of the generators the example ``load()`` gave drew
        from (call after loading it, seeded by :meth:`seed`)."""
        moved = [k for k, (a, b) in enumerate(zip(self.first, self._draws()))
                 if a != b and self.seeded.get(k, 0) < self.PROBES]
        mine = [self.own[k - 2] for k in moved if k >= 2]
        if mine:
            for generator in seeded_per_example(load, mine):
                k = 2 + next(j for j, g in enumerate(self.own) if g is generator)
                self.seeded[k] = self.seeded.get(k, 0) + 1
                moved.remove(k)
        return [self.names[k] for k in moved]

    def _draws(self):
        return [numpy.random.random_sample(), random.random()] + [
            g.random_sample() if isinstance(g, numpy.random.RandomState) else g.random()
            for _, g in self.own]


class KeptGenerators:
    """NumPy's global RNG, Python's ``random`` and ``own`` (:func:`find`'s)
    as they were, put back on exit; :attr:`drew` names those the code inside
    drew from."""

    def __init__(self, own=()):
        self.own = list(own)

    def __enter__(self):
        self.numpy = numpy.random.get_state()
        self.python = random.getstate()
        self.states = [_state(g) for _, g in self.own]
        self.drew = []
        return self

    def __exit__(self, *exc):
        now = numpy.random.get_state()
        if now[2:] != self.numpy[2:] or not numpy.array_equal(now[1], self.numpy[1]):
            self.drew.append('numpy.random')
        if random.getstate() != self.python:
            self.drew.append("Python's random")
        numpy.random.set_state(self.numpy)
        random.setstate(self.python)
        self.own_drew, self.after = [], []
        for (path, generator), state in zip(self.own, self.states):
            self.after.append(_state(generator))
            if not _same(self.after[-1], state):
                self.own_drew.append((path, generator))
                self.drew.append(own_name(path, generator))
            _set_state(generator, state)


def own_name(path, generator):
    return 'its own {} ({})'.format(type(generator).__name__, path)


def seeded_per_example(load, own):
    """Those of ``own`` (generators ``load()`` drew from) that ``load``
    seeds itself before it draws (``self.rng.seed(i)`` in ``get_example``):
    started from another state (the others as they were), it ends in the
    same state and ``load()`` returns the same example, so seeding it per
    example in the workers changes nothing. Loading that fails keeps them
    all (what it drew cannot be told)."""
    def run(moved):
        with KeptGenerators(own) as kept:
            for k, (_, generator) in enumerate(own):
                _reseed(generator, (0x5EED + 104729 * k + 7919 * (k == moved)) % 2**32)
            example = load()
        return example, kept.after
    try:
        example, ends = run(None)
        found = []
        for k in range(len(own)):
            other, moved = run(k)
            if _equal(example, other) and _same(ends[k], moved[k]):
                found.append(own[k])
        return found
    except Exception:
        return []


def _equal(a, b):
    """Examples ``a`` and ``b`` the same, value for value (False where that
    cannot be told)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (numpy.ndarray, numpy.generic)):
        return a.dtype == b.dtype and a.shape == b.shape and \
            numpy.array_equal(a, b, equal_nan=a.dtype.kind in 'fc')
    try:
        same = a == b
    except Exception:
        return False
    return same if isinstance(same, bool) else False
