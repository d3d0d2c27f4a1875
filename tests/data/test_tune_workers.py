"""autotune picks how many of the loader's workers load, then how many
batches are in flight; every batch, their order and the training stay what
they are with any count and any depth."""

import warnings

import numpy
import pytest

import chainer
import chainer.links as L

import fastchain
from fastchain.data import _group, _tune
from fastchain.tune import _tuner
from tests.helpers import Indexed, Noisy

ITERATIONS = 80     # 3 counts x 3 turns (1 untimed, 2 timed) x 8 steps, and after
BOTH = 160          # and then 3 depths x 3 turns x 8 steps


def run(dataset, options=None, iterations=ITERATIONS):
    """A plain script (SerialIterator, StandardUpdater); returns the batches
    the model saw, its weights, and the loader's pool (None: no workers)."""
    seen = []

    def converter(batch, device=None):
        arrays = chainer.dataset.concat_examples(batch, device)
        seen.append([a.copy() for a in arrays])
        return arrays
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        handle = None if options is None else fastchain.enable(**options)
        try:
            numpy.random.seed(3)
            model = L.Classifier(L.Linear(3, 12))
            optimizer = chainer.optimizers.SGD(0.01).setup(model)
            it = chainer.iterators.SerialIterator(dataset, 4)
            updater = chainer.training.StandardUpdater(it, optimizer, converter=converter)
            for _ in range(iterations):
                updater.update()
            main = updater.get_iterator('main')
            pool = getattr(getattr(main, 'iterator', main), '_pool', None)
            active = None if pool is None else pool.active
            depth = None if pool is None else pool.depth
            updater.finalize()
        finally:
            if handle is not None:
                handle.disable()
    return seen, model.predictor.W.array.copy(), active, depth


def assert_same(a, b):
    assert len(a[0]) == len(b[0])
    for x, y in zip(a[0], b[0]):
        for u, v in zip(x, y):
            assert u.tobytes() == v.tobytes()
    assert a[1].tobytes() == b[1].tobytes()


def test_the_counts_measured_are_all_then_the_powers_of_two_below():
    assert _tune.counts(2) == ('2', '1')
    assert _tune.counts(3) == ('3', '2', '1')
    assert _tune.counts(12) == ('12', '8', '4', '2', '1')
    assert _tune.counts(16) == ('16', '8', '4', '2', '1')
    tuner = _tune.WorkerTuner(('k',), 16, 32, 'a loader')
    assert tuner.names == _tune.counts(16)


@pytest.fixture
def three_workers(monkeypatch):
    monkeypatch.setattr(_group, 'default_workers', lambda: 3)


@pytest.mark.parametrize('prefetch', [False, True])
def test_the_fastest_count_is_kept_and_training_is_plain_chainers(tuner, three_workers,
                                                                  prefetch):
    tuner.update({'3': 2.0, '2': 1.0, '1': 3.0})
    plain = run(Indexed())
    got = run(Indexed(), {'prefetch_to_device': prefetch})
    assert_same(plain, got)
    [c] = _tuner.choices('loader_workers')
    assert c['picked'] == '2' and c['trials'] == {'3': 2, '2': 2, '1': 2}
    assert got[2] == 2
    assert 'up to 3 workers' in c['key']


def test_any_count_gives_the_same_random_examples(tuner, three_workers, monkeypatch):
    """Examples that draw random numbers (augmentation) are seeded per
    example, whichever worker and however many load them."""
    tuner.update({'3': 1.0, '2': 2.0, '1': 3.0})
    measured = run(Noisy(), {})
    for forced in ('1', '3'):
        monkeypatch.setitem(_tuner.forced, 'loader_workers', forced)
        got = run(Noisy(), {})
        assert_same(measured, got)
        assert got[2] == int(forced)


def test_then_the_fastest_depth_is_kept_and_training_is_plain_chainers(tuner, three_workers):
    """After the count (2 of 3), the depths 6 (all the slots), 4 (two a
    worker) and 2 (one a worker) take turns; the fastest stays."""
    tuner.update({('loader_workers', '3'): 2.0, ('loader_workers', '2'): 1.0,
                  ('loader_workers', '1'): 3.0, ('loader_prefetch', '6'): 2.0,
                  ('loader_prefetch', '4'): 1.0, ('loader_prefetch', '2'): 3.0})
    got = run(Indexed(), {}, iterations=BOTH)
    [c] = _tuner.choices('loader_prefetch')
    assert c['picked'] == '4' and c['trials'] == {'6': 2, '4': 2, '2': 2}
    assert '2 loading' in c['key']
    assert got[2:] == (2, 4)
    plain = run(Indexed(), iterations=BOTH)
    # the device prefetcher may have converted one batch more, ahead
    assert_same(plain, (got[0][:BOTH],) + got[1:])


@pytest.mark.parametrize('depth', ['1', '2'])
def test_a_depth_bounds_the_batches_in_flight_and_changes_no_batch(
        tuner, three_workers, monkeypatch, depth):
    """Forced to one worker and a depth: at most that many batches are ever
    sent ahead, and the batches are still plain Chainer's."""
    from fastchain.data._pool import WorkerPool
    most = []
    fill = WorkerPool.fill

    def counting_fill(self):
        fill(self)
        most.append(len(self.in_flight))
    monkeypatch.setattr(WorkerPool, 'fill', counting_fill)
    monkeypatch.setitem(_tuner.forced, 'loader_workers', '1')
    monkeypatch.setitem(_tuner.forced, 'loader_prefetch', depth)
    got = run(Indexed(), {}, iterations=40)
    # the first fills (before the first step sets the depth) send the rest
    # of the epoch (3 batches: the next epoch's order is drawn by next());
    # those are taken within 6 steps
    assert max(most) == 3 and max(most[-60:]) == int(depth)
    assert got[2:] == (1, int(depth))
    assert_same(run(Indexed(), iterations=40), (got[0][:40],) + got[1:])


def test_the_depths_measured():
    assert _tune.depths(3, 6) == ('6', '3')
    assert _tune.depths(2, 6) == ('6', '4', '2')
    assert _tune.depths(1, 4) == ('4', '2', '1')
    assert _tune.depths(2, 4) == ('4', '2')
    assert _tune.depths(1, 1) == ('1',)


def test_workers_asked_for_are_not_tuned(tuner, three_workers):
    tuner.update({'3': 2.0, '2': 1.0, '1': 3.0})
    got = run(Indexed(), {'loader_workers': 3})
    assert _tuner.choices('loader_workers') == [] and got[2] == 3


def test_without_autotune_all_workers_load(tuner, three_workers):
    tuner.update({'3': 2.0, '2': 1.0, '1': 3.0})
    got = run(Indexed(), {'autotune': False})
    assert _tuner.choices('loader_workers') == [] and got[2:] == (3, 6)


def test_autotune_turned_off_later_gives_all_workers_back(tuner, three_workers):
    """An iterator made while autotune measured loads with every worker once
    no handle asks for autotune any more."""
    tuner.update({'3': 2.0, '2': 1.0, '1': 3.0, ('loader_prefetch', '6'): 0.9,
                  ('loader_prefetch', '4'): 0.5, ('loader_prefetch', '2'): 0.7})
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with fastchain.enable():
            it = chainer.iterators.SerialIterator(Indexed(), 4)
            model = L.Classifier(L.Linear(3, 12))
            updater = chainer.training.StandardUpdater(
                it, chainer.optimizers.SGD().setup(model))
            main = updater.get_iterator('main')
            pool = getattr(main, 'iterator', main)._pool
            for _ in range(BOTH):
                updater.update()
            assert (pool.active, pool.depth) == (2, 4)
        with fastchain.enable(autotune=False):
            # the first batch may have been fetched ahead before this handle;
            # the second's next() ran after it
            updater.update()
            updater.update()
            assert (pool.active, pool.depth) == (3, 6)
    updater.finalize()


def test_a_forced_count_that_does_not_exist_is_an_error_naming_the_counts(three_workers,
                                                                             monkeypatch):
    monkeypatch.setitem(_tuner.forced, 'loader_workers', '7')
    with pytest.raises(KeyError, match=r"forced '7' for loader_workers.*\(it has 3, 2, 1\)"):
        run(Indexed(), {}, iterations=1)
