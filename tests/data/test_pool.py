"""WorkerPool through its interface (a plan in; batches and errors out), and
the shared memory's layout from the first example that loads."""

import os

import numpy
import pytest

from fastchain import data
from fastchain.data._pool import WorkerPool
from fastchain.data._schedule import Schedule


def test_bad_examples_come_back_as_errors_for_the_iterator_to_judge(bad_root):
    # bad.txt: 2 good, corrupt, truncated, missing, not an image, 6 good.
    d = data.ImageListDataset(os.path.join(bad_root, 'bad.txt'),
                              transform=data.RandomCrop(24))
    schedule = Schedule(len(d), 4, shuffle=False, repeat=False, seed=0)
    pool = WorkerPool(d, schedule.plan, 4, n_workers=2, slots=2, sample=d[0])
    try:
        pool.seek(0, 0)
        got = []
        for indices in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]):
            got.append(pool.take(indices))
            pool.fill()
        assert [len(batch) for batch, _, _ in got] == [2, 2, 4]
        assert [(e[0], e[1], os.path.basename(e[3])) for _, errors, _ in got for e in errors] == [
            (2, 'ImageDecodeError', 'corrupt.jpg'), (3, 'ImageDecodeError', 'truncated.jpg'),
            (4, 'ImageDecodeError', 'missing.jpg'), (5, 'ImageDecodeError', 'notes.jpg')]
        last = got[-1][0]
        assert got[0][0].stacked is None and last.stacked[0].shape == (4, 3, 24, 24)
        numpy.testing.assert_array_equal(last.stacked[0][1], last[1][0])
        assert [int(t) for _, t in last] == [d.label(i) for i in range(8, 12)]
        # Back to a position: what is in flight is dropped (take() checks that
        # the oldest batch is the one asked for), the same seeds give the
        # same pixels.
        pool.seek(0, 0)
        pool.take([0, 1, 2, 3])
        pool.fill()
        assert [indices for _, indices, _ in pool.in_flight.values()] == \
            [[4, 5, 6, 7], [8, 9, 10, 11]]
        pool.seek(0, 8)
        again, errors, _ = pool.take([8, 9, 10, 11])
        assert errors == []
        numpy.testing.assert_array_equal(again.stacked[0], last.stacked[0])
    finally:
        pool.close()
    assert pool.closed and not any(p.is_alive() for p in pool.workers)


def test_no_example_to_lay_out_the_shared_memory_is_a_clear_error(bad_root):
    listing = os.path.join(bad_root, 'all_bad.txt')
    with open(listing, 'w') as f:
        f.write('corrupt.jpg 0\ntruncated.jpg 0\nmissing.jpg 1\nnotes.jpg 1\n')
    d = data.ImageListDataset(listing)
    with pytest.raises(data.DataLoadError, match='none of the first 4 examples') as e:
        data.MultiprocessIterator(d, 2, shuffle=False, n_workers=2)
    assert e.value.index == 0 and e.value.path.endswith('corrupt.jpg')
    assert 'shared_memory=False' in str(e.value)
    # Without shared memory nothing loads before next(): each batch decides,
    # and batches none of whose examples loads are left out, up to an epoch's
    # worth (empty batches came out, which no converter takes).
    it = data.MultiprocessIterator(d, 2, repeat=False, shuffle=False, n_workers=2,
                                   shared_memory=False, on_error='skip')
    try:
        with pytest.raises(data.DataLoadError, match="no example loads.*a whole epoch's"):
            it.next()
        assert len(it.skipped) == 4
    finally:
        it.finalize()




def test_the_shared_memory_is_unlinked_even_while_a_view_of_it_lives():
    """A traceback can keep a view of a slot alive at shutdown (Ctrl-C inside
    a batch's assembly): the name must still leave /dev/shm."""
    examples = [numpy.full((3, 4, 4), i, numpy.float32) for i in range(8)]
    schedule = Schedule(len(examples), 2, shuffle=False, repeat=True, seed=0)
    pool = WorkerPool(examples, schedule.plan, 2, n_workers=1, slots=2, sample=examples[0])
    name = pool.shm.name
    view = numpy.frombuffer(pool.shm.buf, numpy.uint8)     # what the traceback holds
    pool.close()
    assert not os.path.exists('/dev/shm/' + name.lstrip('/'))
    del view
