"""The check that data-parallel ranks do not all train on the same batches
(fastchain/distributed/_same_batches.py), its decisions without MPI: a
stand-in communicator gathers what each rank would send. The real thing, over
2 MPI ranks, is dp_script.py's ``same_batches`` scenario."""

import warnings

import numpy
import pytest

import chainer

from fastchain.distributed import _same_batches as sb


class Gathered:
    """A communicator of ``size`` ranks, this one ``rank``, whose peers
    send what ``peers(mine)`` gives."""

    def __init__(self, rank=0, size=2, peers=lambda mine: mine):
        self.rank, self.size, self.peers = rank, size, peers
        self.gathers = 0

    def allgather_obj(self, obj, what=''):
        self.gathers += 1
        mine, batch = obj       # (the fingerprint, the batch size)
        return [obj] + [(self.peers(mine), batch) for _ in range(self.size - 1)]


def _said(check, takes):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for take in takes:
            check.look(take)
    return [str(w.message) for w in caught if 'had the same loss and inputs' in str(w.message)]


def _batch(seed):
    rng = numpy.random.RandomState(seed)
    x = rng.rand(4, 3).astype(numpy.float32)
    return lambda: sb.of_step(numpy.float32(x.sum() ** 2), (x, numpy.arange(4)), {})


def test_the_same_batches_on_every_rank_are_said_once_on_rank_0_only():
    for rank in (0, 1):
        check = sb.SameBatches(Gathered(rank))
        said = _said(check, [_batch(i) for i in range(6)])
        assert said == ([sb.SAME_BATCHES.format(n=2, steps=sb.STEPS)] if rank == 0 else [])
        assert check.comm.gathers == sb.STEPS      # then it stops gathering


def test_different_batches_end_the_check_at_the_first_step():
    check = sb.SameBatches(Gathered(peers=lambda mine: tuple(v + 1 for v in mine)))
    assert _said(check, [_batch(i) for i in range(6)]) == []
    assert check.comm.gathers == 1


def test_steps_that_tell_nothing_are_not_counted_and_the_check_ends():
    """No array among the inputs, a fingerprint that fails (an input of a
    kind it does not know), gradients not finite: not counted; after
    TRIES steps it stops, nothing said."""
    def fails():
        raise TypeError('an input it does not know')
    check = sb.SameBatches(Gathered())
    takes = [lambda: sb.of_step(numpy.float32('nan'), (), {}), fails] * sb.TRIES
    assert _said(check, takes) == []
    assert check.comm.gathers == sb.TRIES
    check = sb.SameBatches(Gathered())
    assert _said(check, [fails, _batch(0), fails, _batch(1)]) == [
        sb.SAME_BATCHES.format(n=2, steps=2)]      # counted around them


def test_one_process_never_gathers():
    check = sb.SameBatches(Gathered(size=1))
    assert _said(check, [_batch(0)] * 3) == [] and check.comm.gathers == 0


def test_fingerprints_of_steps_and_gradients():
    x = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
    loss = chainer.Variable(numpy.array(0.5, numpy.float32))
    assert sb.of_step(loss, (chainer.Variable(x),), {'t': numpy.ones(2, numpy.int32)}) == (
        0.5, 15.0, 2.0)
    # in lists and dicts (a sequence model's batch); a string is not an array
    assert sb.of_step(loss, ([x, x[:1]], {'b': x[1], 'a': 'text'}), {}) == (
        0.5, 15.0, 3.0, 12.0)
    assert sb.of_step(None, (x,), {}) is None           # no loss: nothing to compare
    assert sb.of_step(numpy.float32(numpy.inf), (x,), {}) is None
    p, q = chainer.Parameter(x.copy()), chainer.Parameter(x.copy())
    assert sb.of_gradients([p, q]) is None              # no gradient yet
    p.grad = numpy.ones_like(x)
    assert sb.of_gradients([p, q]) == (6.0, None)
    p.grad[...] = 0
    assert sb.of_gradients([p, q]) is None              # all zero: fp16's skipped steps
    p.grad[0, 0] = numpy.nan
    assert sb.of_gradients([p, q]) is None


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.uint8, numpy.bool_])
def test_inputs_of_any_numeric_kind_are_summed_in_float64(dtype):
    x = numpy.ones((3, 2), dtype)
    assert sb.of_step(numpy.float32(1), (x,), {}) == (1.0, 6.0)


def test_batches_whose_sums_agree_differ_by_their_loss():
    """A second review: one-hot inputs sum to the batch size whatever the
    batch, so sums alone said 'the same batches' of scattered data."""
    eye = numpy.eye(4, dtype=numpy.float32)
    a, b = sb.of_step(numpy.float32(1.25), (eye[[0, 1]],), {}), \
        sb.of_step(numpy.float32(1.5), (eye[[2, 3]],), {})
    assert a[1:] == b[1:] and a != b
