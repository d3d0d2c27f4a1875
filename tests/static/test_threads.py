"""Another thread drawing from NumPy's global random state while a cached
call is verified (a MultithreadIterator's augmentation, a prefetch thread
shuffling at an epoch's end). The verification compares that state and
puts it back (:mod:`fastchain.static._verify`); before, such a thread's
draws were taken for the forward's (the model fell back, in 3 of 3 runs)
and rewound by the put-back (about a fifth of that thread's numbers came
out twice). Now its ``numpy.random`` calls wait until the call is verified
(:func:`fastchain.static._draws.holding_numpy`)."""

import threading
import time
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from fastchain.static import StaticGraphFallback, cache_state, cache_static_graph
from fastchain.static import _draws

from tests.helpers import assert_same, copies

pytestmark = pytest.mark.usefixtures('fresh_fixes')


class Deep(chainer.Chain):
    """Long enough a forward (a few ms) for the thread to draw inside it."""

    def __init__(self, noise=False):
        super().__init__()
        self.noise = noise
        with self.init_scope():
            self.ls = chainer.ChainList(*[L.Linear(128, 128) for _ in range(10)])

    def forward(self, x):
        for link in self.ls:
            x = F.relu(link(x))
        if self.noise:
            x = x + numpy.random.randn(*x.shape).astype(numpy.float32)
        return x


class Drawing:
    """A thread drawing from NumPy's global state until stopped."""

    def __init__(self, draw=lambda: numpy.random.random_sample()):
        self.draws, self.stop = [], threading.Event()
        self.thread = threading.Thread(target=self._run, args=(draw,), daemon=True)

    def _run(self, draw):
        while not self.stop.is_set():
            self.draws.append(draw())
            time.sleep(0.0002)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _train(models, steps, during=None):
    optimizers = [chainer.optimizers.MomentumSGD(0.01).setup(m) for m in models]
    x = numpy.random.RandomState(0).rand(32, 128).astype(numpy.float32)
    caught = []
    for i in range(steps):
        for model, optimizer in zip(models, optimizers):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter('always')
                optimizer.update(lambda: F.sum(model(x)))
            caught += [str(m.message) for m in w if m.category is StaticGraphFallback]
        assert_same(models[0], models[1], 'step {}'.format(i))
    return caught


def test_a_threads_draws_meanwhile_are_neither_taken_for_the_forward_nor_rewound():
    ordinary, cached = copies(Deep)
    cache_static_graph(cached)
    with Drawing() as thread:
        caught = _train((ordinary, cached), 5)
    assert caught == []
    assert cache_state(cached)['fallback'] is None
    assert sum(cache_state(cached)['verified'].values()) >= 2
    assert len(thread.draws) > 50
    assert len(set(thread.draws)) == len(thread.draws)     # none drawn twice
    # the functions are NumPy's own again once no call is verified
    for name in ('random_sample', 'seed', 'rand'):
        assert not hasattr(getattr(numpy.random, name), 'fastchain_holds'), name


def test_the_forwards_own_draw_still_falls_back_while_a_thread_draws():
    numpy.random.seed(0)
    model = Deep(noise=True)
    cache_static_graph(model)
    optimizer = chainer.optimizers.SGD(0.01).setup(model)
    x = numpy.ones((32, 128), numpy.float32)
    with Drawing(), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(4):
            optimizer.update(lambda: F.sum(model(x)))
    (message,) = [str(m.message) for m in w if m.category is StaticGraphFallback]
    assert "NumPy's random state advanced" in message
    assert cache_state(model)['cause'] == 'not static'


class Waiting(chainer.Chain):
    """A forward that waits on a thread of its own, which draws three times."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 3)

    def forward(self, x):
        out = []
        helper = threading.Thread(target=lambda: out.extend(
            numpy.random.rand() for _ in range(3)))
        helper.start()
        helper.join()
        return self.l1(x) * float(min(out) >= 0)


def test_a_forward_waiting_on_a_thread_that_draws_goes_on_after_the_hold(monkeypatch):
    monkeypatch.setattr(_draws, 'HOLD', 0.2)
    model = Waiting()
    cache_static_graph(model)
    took = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(3):
            start = time.monotonic()
            F.sum(model(numpy.ones((2, 3), numpy.float32))).backward()
            took.append(time.monotonic() - start)
    # that thread's draws are the forward's: not cached (at the first replay,
    # which draws none where define-by-run draws)
    (message,) = [str(m.message) for m in w if m.category is StaticGraphFallback]
    assert 'Another thread drew from it (numpy.random.rand)' in message
    assert 'waiting 0.2 s' in message
    # a thread waits once a hold, not once a draw (the recording's helper and
    # the reference run's: two waits; before, six)
    assert max(took) < 0.2 * 2 + 0.6, took


def test_a_draw_running_when_the_check_begins_is_waited_for():
    """Arrays drawn by a data thread (their fill runs without the GIL): one
    that began, or was looked up, just before the check had landed inside it
    (a fallback in 10 of 10 runs at 3 x 224 x 224, in a review)."""
    pairs = [copies(Deep) for _ in range(6)]     # (copies seeds NumPy's global state)
    with Drawing(lambda: float(numpy.random.normal(0, 1, (3, 160, 160)).ravel()[0])) as thread:
        for trial, (ordinary, cached) in enumerate(pairs):
            cache_static_graph(cached)
            assert _train((ordinary, cached), 4) == [], trial
    assert len(set(thread.draws)) == len(thread.draws) > 20


def test_numpys_functions_stay_themselves_for_other_threads_while_held():
    """Chainer's ShuffleOrderSampler reads numpy.random.random.__self__ (a
    SerialIterator built in another thread meanwhile raised), and a function
    taken meanwhile pickles as NumPy's."""
    import pickle
    got = []
    with _draws.holding_numpy():
        taken = numpy.random.normal
        # (made, not drawn from: this thread waits for it, and its draw for this one)
        helper = threading.Thread(target=lambda: got.append(
            chainer.iterators.ShuffleOrderSampler()._random))
        helper.start()
        helper.join()
        assert numpy.random.random.__self__ is numpy.random.mtrand._rand
        assert hasattr(numpy.random.mtrand.rand, 'fastchain_holds')       # both held
        assert hasattr(numpy.random.rand, 'fastchain_holds')
    assert got == [numpy.random.mtrand._rand]
    assert pickle.dumps(taken) == pickle.dumps(numpy.random.normal)     # as NumPy's
    assert taken.__name__ == 'normal' and 'Draw random samples' in taken.__doc__


def test_a_function_replaced_while_held_is_left_as_replaced():
    original = numpy.random.rand

    def mine(*args):
        return 0.5
    try:
        with _draws.holding_numpy():
            assert numpy.random.rand is not original        # one that waits
            assert 0.0 <= numpy.random.rand() < 1.0         # this thread's draws go on
            numpy.random.rand = mine
        assert numpy.random.rand is mine                    # the user's stays
        assert numpy.random.randn.__self__ is numpy.random.mtrand._rand
    finally:
        numpy.random.rand = original


@pytest.mark.skipif(not hasattr(__import__('os'), 'fork'), reason='no fork here')
def test_a_process_forked_while_a_call_is_verified_draws_without_waiting(monkeypatch):
    """A pool's worker forked from another thread meanwhile (a
    MultiprocessIterator's pool replacing a worker) has no verified call:
    its draws must not wait for one."""
    import multiprocessing
    monkeypatch.setattr(_draws, 'HOLD', 5.0)
    ctx = multiprocessing.get_context('fork')
    result = ctx.Queue()

    def child():
        start = time.monotonic()
        numpy.random.rand()
        held = hasattr(numpy.random.rand, 'fastchain_holds')
        result.put((time.monotonic() - start, held))

    def fork_from_another_thread(out):
        p = ctx.Process(target=child)
        p.start()
        out.append(result.get(timeout=20))
        p.join(20)
    out = []
    with _draws.holding_numpy():
        helper = threading.Thread(target=fork_from_another_thread, args=(out,))
        helper.start()
        helper.join(30)
    (took, held), = out
    assert took < 1.0 and not held


def test_chainers_shuffle_order_sampler_in_another_thread_is_held_too():
    """A SerialIterator's next order, drawn by another thread (a prefetch
    thread at an epoch's end) from the global RandomState object itself."""
    iterator = chainer.iterators.SerialIterator(list(range(20)), 20)    # an epoch a batch
    orders = []
    pairs = [copies(Deep) for _ in range(3)]     # (copies seeds NumPy's global state)

    def draw():
        batch = iterator.next()
        orders.append(tuple(batch))
        return batch[0]
    with Drawing(draw):
        for ordinary, cached in pairs:
            cache_static_graph(cached)
            assert _train((ordinary, cached), 4) == []
    assert len(orders) > 20
    assert len(set(orders)) == len(orders)      # none rewound and drawn again
