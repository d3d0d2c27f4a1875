"""The loading schedule: batches as Chainer walks them, seeds by position,
a sampler's orders drawn when SerialIterator draws them."""

import chainer
import numpy
import pytest

from fastchain.data._schedule import Schedule, seed_from_global_rng


@pytest.mark.parametrize('repeat', [True, False])
def test_batches_walk_as_chainers_serial_iterator(repeat):
    serial = chainer.iterators.SerialIterator(list(range(10)), 4, repeat=repeat,
                                              shuffle=False)
    schedule = Schedule(10, 4, shuffle=False, repeat=repeat, seed=0)
    epoch, position = 0, 0
    for _ in range(7 if repeat else 3):
        indices, epoch, position = schedule.batch(epoch, position)
        assert indices == serial.next()
        assert (epoch, position) == (serial.epoch, serial.current_position)
    assert (schedule.plan(epoch, position) is None) == (not repeat)


def test_orders_and_seeds_depend_only_on_seed_epoch_and_position():
    a = Schedule(10, 4, shuffle=True, repeat=True, seed=3)
    b = Schedule(10, 4, shuffle=True, repeat=True, seed=3)
    b.plan(5, 0)                                    # another history first
    assert a.plan(1, 4) == b.plan(1, 4)
    assert a.plan(1, 4)[1] != a.plan(1, 8)[1]       # new seeds at each position
    assert sorted(a.order(0)) == list(range(10))
    assert list(a.order(0)) != list(a.order(1))


class Recorder:
    """An order sampler that remembers how it was called."""

    def __init__(self):
        self.calls = []
        self.random = numpy.random.RandomState(0)

    def __call__(self, order, position):
        self.calls.append((list(order), position))
        return self.random.permutation(len(order))


@pytest.mark.parametrize('batch_size', [4, 5, 10, 25])
@pytest.mark.parametrize('repeat', [True, False])
def test_a_samplers_orders_are_drawn_when_and_as_serial_iterator_draws_them(
        batch_size, repeat):
    ours, theirs = Recorder(), Recorder()
    serial = chainer.iterators.SerialIterator(list(range(10)), batch_size,
                                              repeat=repeat, order_sampler=theirs)
    schedule = Schedule(10, batch_size, shuffle=True, repeat=repeat, seed=0, sampler=ours)
    schedule.restart()
    assert ours.calls == theirs.calls
    epoch, position = 0, 0
    for _ in range(8 if repeat else 1):
        indices, epoch, position = schedule.batch(epoch, position, draw=True)
        assert indices == serial.next()
        assert (epoch, position) == (serial.epoch, serial.current_position)
        assert ours.calls == theirs.calls       # after the same batches
    schedule.restart()
    serial.reset()
    assert ours.calls == theirs.calls


def test_no_batch_is_planned_before_the_order_it_needs_is_drawn():
    schedule = Schedule(10, 5, shuffle=True, repeat=True, seed=0, sampler=Recorder())
    schedule.restart()
    assert schedule.plan(0, 5)[2:] == (1, 0)        # ends with the epoch: planned
    assert schedule.plan(1, 0) is None              # epoch 1's order: not drawn yet
    assert schedule.plan(0, 8) is None              # crosses into it
    schedule.batch(0, 5, draw=True)                 # the training loop's next()
    assert len(schedule.sampler.calls) == 2
    assert schedule.plan(1, 0)[0] == list(schedule.order(1)[:5])
    schedule.batch(0, 5, draw=True)                 # again (after a seek): no new draw
    assert len(schedule.sampler.calls) == 2


def test_the_seed_from_the_global_rng_leaves_it_alone():
    numpy.random.seed(1)
    seed = seed_from_global_rng()
    assert seed_from_global_rng() == seed and 0 <= seed < 2**63
    numpy.random.seed(1)
    expected = numpy.random.rand()
    numpy.random.seed(1)
    seed_from_global_rng()
    assert numpy.random.rand() == expected
    assert seed_from_global_rng() != seed           # another state, another seed
