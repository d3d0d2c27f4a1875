"""The loading schedule: batches as Chainer walks them, seeds by position."""

import chainer
import pytest

from fastchain.data._schedule import Schedule


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
