"""What the examples draw, told while the loader's workers load them
(fastchain/data/_draws.py): where fastchain's loader takes a plain script's
SerialIterator, the first example that draws random numbers is said, not
only the one example looked at when it takes it."""

import random
import warnings

import numpy
import pytest

import chainer

import fastchain
from fastchain import data
from fastchain.data import _draws
from tests.helpers import Indexed, train_classifier

DRAWN = 'draw random numbers'


class _OddOnly(Indexed):
    """Augments only the odd examples (a class-dependent augmentation): the
    first example of the order, 0, draws nothing."""

    def __init__(self, draw=lambda: numpy.random.rand()):
        self.draw = draw

    def get_example(self, i):
        x, t = super().get_example(i)
        return (x + numpy.float32(self.draw()) if i % 2 else x), t


class _OwnSeededOddOnly(Indexed):
    def __init__(self):
        self.rng = numpy.random.RandomState(0)

    def get_example(self, i):
        x, t = super().get_example(i)
        if i % 2:
            self.rng.seed(int(i))
            x = x + numpy.float32(self.rng.rand())
        return x, t


def _updates(dataset, steps=4, **options):
    """Runs ``steps`` updates of a classifier on ``dataset`` (unshuffled,
    batches of 4); the loader warnings said, as (step, message), and the
    parameters."""
    return train_classifier(dataset, steps, 4, False, chainer.optimizers.SGD(0.1), options)


LOADER = dict(loader_workers=2, prefetch_to_device=False)


@pytest.mark.parametrize('make, drew', [
    (_OddOnly, 'numpy.random'),
    (lambda: _OddOnly(random.random), "Python's random"),
    (lambda: chainer.datasets.ConcatenatedDataset(
        chainer.datasets.SubDataset(Indexed(), 0, 4), _Noisy4()), 'numpy.random')])
def test_an_augmentation_only_some_examples_take_is_said_when_a_worker_meets_it(make, drew):
    """A new-user trial: only odd labels were cropped at random; the look at
    the first example (0) saw no draw, and the run trained otherwise than
    plain Chainer (the loss 0.137 off at the first step) with nothing said.
    Now the first batch a worker loads with a drawing example says so, once,
    naming the example."""
    said, _ = _updates(make(), **LOADER)
    first = 1 if isinstance(make(), _OddOnly) else 4
    assert said == [(0 if first < 4 else 1, data._group.DRAWS_RANDOM.format(drew) +
                     _draws.AT_EXAMPLE.format(first))]


class _Noisy4(Indexed):
    def __len__(self):
        return 8

    def get_example(self, i):
        x, t = super().get_example(i + 4)
        return x + numpy.float32(numpy.random.rand()), t


def test_what_draws_nothing_or_seeds_itself_per_example_is_not_said():
    """No draw over the run: nothing said. A generator of the dataset's own
    that the example seeds itself before it draws gives plain Chainer's
    batches: not said either, and the training is plain Chainer's."""
    assert _updates(Indexed(), steps=6, **LOADER)[0] == []
    said, mine = _updates(_OwnSeededOddOnly(), **LOADER)
    assert said == []
    _, plain = _updates(_OwnSeededOddOnly())
    assert all(numpy.array_equal(a, b) for a, b in zip(plain, mine))


def test_a_loader_the_script_made_itself_is_not_watched():
    """fastchain.data.MultiprocessIterator made by the script: its seeding is
    its documented behaviour, nothing said (warn_draws is off by default)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        it = data.MultiprocessIterator(_OddOnly(), 4, shuffle=False, n_workers=2)
        try:
            for _ in range(3):
                it.next()
        finally:
            it.finalize()
    assert [w for w in caught if DRAWN in str(w.message)] == []


def test_the_watch_names_what_an_example_drew():
    """DrawWatch, as a worker uses it: each generator seeded per example,
    the ones the example moved named; one the example seeds itself is
    left out."""
    own_rng, seeded_rng = numpy.random.RandomState(1), random.Random(2)
    own = [('dataset.a', own_rng), ('dataset.b', seeded_rng)]
    watch = _draws.DrawWatch(own)

    def example(i):
        seeded_rng.seed(i)
        return [seeded_rng.random()] + ([own_rng.rand(), numpy.random.rand()] if i % 2 else [])

    watch.seed(5)
    example(0)
    assert watch.drew(lambda: example(0)) == []
    watch.seed(6)
    example(1)
    assert watch.drew(lambda: example(1)) == [
        'numpy.random', 'its own RandomState (dataset.a)']


class _SomeSeeded(Indexed):
    """Seeds ``self.rng`` on even examples; odd ones draw on from where it
    stood (a review: the first example looked at, 0, showed it seeded, and
    it was let be for good while the training differed)."""

    def __init__(self):
        self.rng = numpy.random.RandomState(0)

    def get_example(self, i):
        x, t = super().get_example(i)
        if i % 2 == 0:
            self.rng.seed(int(i))
        return x + numpy.float32(self.rng.rand()), t


def test_a_generator_seeded_on_some_examples_only_is_said():
    said, mine = _updates(_SomeSeeded(), **LOADER)
    _, plain = _updates(_SomeSeeded())
    assert not all(numpy.array_equal(a, b) for a, b in zip(plain, mine))
    assert said == [(0, data._group.DRAWS_RANDOM.format('its own RandomState (dataset.rng)') +
                     _draws.AT_EXAMPLE.format(1))]


def _batches(dataset, watch, **options):
    it = data.MultiprocessIterator(dataset, 4, seed=3, n_workers=2, warn_draws=watch,
                                   **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            return [[(x.copy(), int(t)) for x, t in it.next()] for _ in range(3)], \
                [str(w.message) for w in caught if DRAWN in str(w.message)]
        finally:
            it.finalize()


@pytest.mark.parametrize('make', [_OddOnly, _SomeSeeded, _OwnSeededOddOnly])
def test_watching_changes_no_draw(make):
    """The watch draws and seeds again before each example, and loads an
    example again to ask whether a generator is seeded per example: the
    batches are those of a loader that does not watch, bitwise."""
    (watched, said), (plain, unsaid) = _batches(make(), True), _batches(make(), False)
    assert [[t for _, t in b] for b in watched] == [[t for _, t in b] for b in plain]
    assert all(numpy.array_equal(a, b) for wb, pb in zip(watched, plain)
               for (a, _), (b, _) in zip(wb, pb))
    odd = [x for b in watched for x, t in b if t % 2]
    assert odd and all(not numpy.array_equal(x, numpy.full(3, t, numpy.float32))
                       for b in watched for x, t in b if t % 2)     # they drew
    assert unsaid == [] and len(said) == (make is not _OwnSeededOddOnly)
    assert all('Seen at example' in m for m in said)


def test_under_warnings_as_errors_the_iterator_stays_in_step():
    """A review: the warning was raised between the pool's batch and the
    iterator's position, and the next next() failed ('prefetch out of
    step'). Now it is raised with the position moved on: the next batch is
    the one after."""
    it = data.MultiprocessIterator(_OddOnly(), 4, shuffle=False, n_workers=2, warn_draws=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            with pytest.raises(fastchain.FastchainWarning, match='Seen at example 1'):
                it.next()
            assert [int(t) for _, t in it.next()] == [4, 5, 6, 7]
    finally:
        it.finalize()
