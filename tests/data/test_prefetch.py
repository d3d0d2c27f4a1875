"""DevicePrefetcher and the loader options of enable() on a Trainer."""

import os
import time
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import serializers, training
from chainer.dataset import convert

import fastchain
from fastchain import data


@pytest.fixture
def images(image_root):
    return data.ImageListDataset(os.path.join(image_root, 'train.txt'),
                                 transform=data.RandomCrop(24))


def test_prepared_batches_equal_converting_by_hand(images):
    ref = data.MultiprocessIterator(images, 4, seed=5, n_workers=0)
    it = data.DevicePrefetcher(data.MultiprocessIterator(images, 4, seed=5, n_workers=2),
                               data.ImageConverter())
    try:
        for _ in range(7):
            expected = data.ImageConverter()(ref.next())
            batch = it.next()
            assert isinstance(batch, data.PreparedBatch)
            x, t = convert._call_converter(it.converter, batch, None)
            numpy.testing.assert_array_equal(x, expected[0])
            numpy.testing.assert_array_equal(t, expected[1])
            assert x.dtype == numpy.float32
            assert (it.epoch, it.current_position) == (ref.epoch, ref.current_position)
            assert it.epoch_detail == ref.epoch_detail
    finally:
        it.finalize()


def test_loader_errors_reach_the_training_loop(bad_root):
    d = data.ImageListDataset(os.path.join(bad_root, 'bad.txt'))
    it = data.DevicePrefetcher(data.MultiprocessIterator(d, 3, shuffle=False, n_workers=1))
    with pytest.raises(data.DataLoadError, match='corrupt.jpg'):
        for _ in range(5):
            it.next()
    it.finalize()


@pytest.mark.parametrize('workers', [0, 2])
def test_skipped_examples_are_reported_in_the_training_loops_thread(bad_root, workers):
    """The prefetch thread fetches the batches; Chainer's reporter is per
    thread, so the count must reach the training loop's reporter with them."""
    d = data.ImageListDataset(os.path.join(bad_root, 'bad.txt'))
    it = data.DevicePrefetcher(data.MultiprocessIterator(
        d, 4, repeat=False, shuffle=False, n_workers=workers, on_error='skip'),
        converter=lambda batch, device=None: len(batch))      # sizes differ: no stacking
    reported = []
    reporter = chainer.Reporter()
    try:
        while True:
            observation = {}
            with reporter.scope(observation):
                try:
                    it.next()
                except StopIteration:
                    break
            reported.append(observation.get('skipped_examples'))
    finally:
        it.finalize()
    # what each batch taken left out (entries 2..5 are bad), in this thread
    assert reported == [2, 2, 0]


def test_no_repeat_stops_and_resets(images):
    it = data.DevicePrefetcher(data.MultiprocessIterator(
        images, 5, repeat=False, shuffle=False, n_workers=1))
    try:
        assert [len(b) for b in it] == [5, 5, 5, 3]
        with pytest.raises(StopIteration):
            it.next()
        it.reset()
        assert [len(b) for b in it] == [5, 5, 5, 3]
    finally:
        it.finalize()


def test_needs_a_resumable_iterator():
    with pytest.raises(TypeError, match='serialize'):
        data.DevicePrefetcher(iter([]))


class Net(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(3, 4, 3, stride=2)
            self.fc = L.Linear(None, 3)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)))


def make_trainer(out, it, converter, iterations):
    numpy.random.seed(0)
    model = L.Classifier(Net())
    optimizer = chainer.optimizers.SGD(0.01).setup(model)
    updater = training.StandardUpdater(it, optimizer, converter=converter)
    return training.Trainer(updater, (iterations, 'iteration'), out=str(out)), model


def test_resume_through_the_prefetcher_matches_an_uninterrupted_run(images, tmp_path):
    conv = data.ImageConverter()

    def prefetcher():
        return data.DevicePrefetcher(
            data.MultiprocessIterator(images, 4, seed=11, n_workers=2), conv)

    it = prefetcher()
    trainer, model = make_trainer(tmp_path / 'a', it, it.converter, 12)
    trainer.run()
    straight = {n: p.array.copy() for n, p in model.namedparams()}

    it = prefetcher()
    trainer, _ = make_trainer(tmp_path / 'b', it, it.converter, 5)
    trainer.run()
    serializers.save_npz(str(tmp_path / 'snap.npz'), trainer)

    it = prefetcher()
    trainer, model = make_trainer(tmp_path / 'c', it, it.converter, 12)
    serializers.load_npz(str(tmp_path / 'snap.npz'), trainer)
    assert trainer.updater.iteration == 5
    trainer.run()
    for n, p in model.namedparams():
        numpy.testing.assert_allclose(p.array, straight[n], rtol=1e-6, err_msg=n)


def test_enable_upgrades_a_plain_scripts_serial_iterator(images, tmp_path):
    def script(out):
        # A plain Chainer script: SerialIterator and the default converter.
        model = L.Classifier(Net())
        optimizer = chainer.optimizers.SGD(0.01).setup(model)
        train = chainer.datasets.TransformDataset(
            images, lambda ex: (ex[0].astype(numpy.float32) / 255, ex[1]))
        it = chainer.iterators.SerialIterator(train, 4)
        updater = training.StandardUpdater(it, optimizer)
        trainer = training.Trainer(updater, (6, 'iteration'), out=str(out))
        log = training.extensions.LogReport(trigger=(2, 'iteration'))
        trainer.extend(log)
        used = []
        trainer.extend(lambda t: used.append(updater.get_iterator('main')))
        trainer.run()
        return updater, log.log, used[0], it

    with warnings.catch_warnings():
        warnings.simplefilter('error')
        # RandomCrop draws: said once (tests/data/test_group.py), nothing else
        warnings.filterwarnings('ignore', message="fastchain loader: the dataset's examples "
                                "draw random numbers from numpy.random")
        with fastchain.enable(loader_workers=2) as h:
            assert h.states['loader'].active and h.states['prefetch_to_device'].active
            updater, log, main, it = script(tmp_path / 'on')
    assert isinstance(main, data.DevicePrefetcher)
    assert main.iterator.n_workers == 2
    assert len(log) == 3 and numpy.isfinite(log[-1]['main/loss'])
    assert not main.iterator._pool.workers[0].is_alive()     # finalized by the trainer
    # and the script's iterator handed back, where the run left it (_follow)
    assert updater.get_iterator('main') is it and type(it) is chainer.iterators.SerialIterator
    assert it.epoch_detail == 6 * 4 / len(images)

    updater, _, main, _ = script(tmp_path / 'off')
    assert type(main) is chainer.iterators.SerialIterator


@pytest.mark.gpu
def test_device_prefetch_on_a_gpu_matches_the_cpu(images):
    # The GPU edge: side stream, event, the training stream waiting on it.
    import chainer.backends.cuda as cuda
    ref = data.MultiprocessIterator(images, 4, seed=5, n_workers=0)
    it = data.DevicePrefetcher(data.MultiprocessIterator(images, 4, seed=5, n_workers=2),
                               data.ImageConverter(), '@cupy:0')
    try:
        for _ in range(5):
            expected = data.ImageConverter()(ref.next())
            x, t = convert._call_converter(it.converter, it.next(), None)
            assert isinstance(x, cuda.ndarray)
            numpy.testing.assert_allclose(cuda.to_cpu(x), expected[0], rtol=1e-6)
            numpy.testing.assert_array_equal(cuda.to_cpu(t), expected[1])
    finally:
        it.finalize()


def test_bad_arguments_are_refused_before_anything_starts(images):
    it = data.MultiprocessIterator(images, 4, n_workers=0)
    for depth in (0, -1, True, 1.5, None):
        with pytest.raises(ValueError, match=r'depth \(batches prepared ahead\) must be '
                                             r'an int >= 1, got'):
            data.DevicePrefetcher(it, depth=depth)
    with pytest.raises(TypeError, match='converter must be callable'):
        data.DevicePrefetcher(it, converter='concat_examples')
    serial = chainer.iterators.SerialIterator(images, 4)
    assert data.DevicePrefetcher.can_wrap(it)
    assert not data.DevicePrefetcher.can_wrap(serial)
    with pytest.raises(TypeError, match=r'seek\(\).*MultiprocessIterator'):
        data.DevicePrefetcher(serial)
    assert it.next() is not None and it.current_position == 4   # nothing read ahead


def settle(prefetcher, seconds=10):
    """Wait until the prefetch thread has fetched all it may."""
    deadline = time.monotonic() + seconds
    while prefetcher._thread is not None and prefetcher._thread.is_alive() \
            and prefetcher._queue.qsize() < prefetcher.depth \
            and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_batch_that_ends_an_epoch_is_left_to_the_training_loop():
    # With rng='global', fetching it draws the next order from NumPy's
    # global RNG: that must happen in the training loop's next().
    examples = [numpy.full(2, i, numpy.float32) for i in range(12)]
    it = data.DevicePrefetcher(data.MultiprocessIterator(
        examples, 5, n_workers=1, rng='global'), depth=3)
    try:
        settle(it)
        assert not it._thread.is_alive()
        assert (it.iterator.epoch, it.iterator.current_position) == (0, 10)
        it.next()
        it.next()
        assert (it.epoch, it.current_position) == (0, 10)
        it.next()                               # fetched here, not ahead
        assert (it.epoch, it.current_position) == (1, 3)
        settle(it)
        assert (it.iterator.epoch, it.iterator.current_position) == (1, 8)
    finally:
        it.finalize()


def test_nothing_is_fetched_ahead_where_loading_may_draw_from_the_global_rng():
    examples = [numpy.full(2, i, numpy.float32) for i in range(12)]
    it = data.DevicePrefetcher(data.MultiprocessIterator(
        examples, 5, n_workers=0, rng='global'))
    time.sleep(0.2)
    assert it._thread is None and it.iterator.current_position == 0
    batches = [it.next() for _ in range(4)]
    assert it.iterator.current_position == it.current_position == 8
    assert all(isinstance(b, data.PreparedBatch) and b.arrays.shape == (5, 2)
               for b in batches)


# --- the GPU edge with a stand-in of CuPy's streams (no GPU here) -------------

class _FakeCuda:
    """Just what CudaEdge calls: devices, streams, events, with a log."""

    def __init__(self):
        self.log, self.device, self.stream_stack = [], 0, []
        fake = self

        class Device:
            def __init__(self, i):
                self.i = i

            def __enter__(self):
                self.previous, fake.device = fake.device, self.i

            def __exit__(self, *exc):
                fake.device = self.previous

        class Stream:
            def __init__(self, non_blocking=False):
                self.device, self.name = fake.device, 'side'

            def __enter__(self):
                fake.stream_stack.append(self)

            def __exit__(self, *exc):
                fake.stream_stack.pop()

            def record(self):
                fake.log.append(('record', self.name, len(fake.log)))
                return ('event', self.name, len(fake.log) - 1)

            def wait_event(self, event):
                fake.log.append(('wait', self.name, event))

        self.compute = Stream()
        self.compute.name = 'compute'
        self.cuda = type('cuda', (), {})()
        self.cuda.Device, self.cuda.Stream = Device, Stream
        self.cuda.get_current_stream = lambda: (
            fake.stream_stack[-1] if fake.stream_stack else fake.compute)


class _Arrays:
    pass


def test_the_gpu_edge_copies_on_the_target_device_and_frees_no_batch_early():
    import weakref
    from fastchain.data._edge import CudaEdge
    from fastchain.data._prefetch import PreparedBatch
    fake = _FakeCuda()
    edge = CudaEdge(fake, 1)            # made where device 0 is current
    assert edge.stream.device == 1      # ... but the stream belongs to device 1

    def copy(name):
        batch = PreparedBatch([name])
        with edge() as done:
            assert fake.device == 1 and fake.cuda.get_current_stream() is edge.stream
            fake.log.append(('alloc', name))
            batch.arrays = _Arrays()
        batch.event = done.event
        return batch

    b1 = copy('b1')
    edge.consume(b1)                    # the training stream waits on b1's copy
    assert fake.log[-2] == ('wait', 'compute', b1.event)
    b2 = copy('b2')
    gone1 = weakref.ref(b1.arrays)
    del b1
    assert gone1() is not None          # held: step 1 may still read it
    edge.consume(b2)                    # step 1 is enqueued: b1 retires with this event
    retire_event = fake.log[-1]
    assert retire_event[:2] == ('record', 'compute')
    assert gone1() is not None          # not yet: the side stream has not waited
    copy('b3')
    waited = fake.log.index(('wait', 'side', ('event', 'compute', retire_event[2])))
    assert waited < fake.log.index(('alloc', 'b3'))   # waits before its allocation
    assert gone1() is None              # and only then lets b1's memory go


def test_the_loaders_stacked_images_reach_the_converter(images):
    """The pool hands batches whose images are already one array
    (``LoadedBatch.stacked``); the prefetcher keeps it, so the converter
    copies that array instead of stacking the examples again."""
    seen = []

    class Recording(data.ImageConverter):
        def __call__(self, batch, device=None):
            seen.append(getattr(batch, 'stacked', None))
            return super().__call__(batch, device)

    it = data.DevicePrefetcher(data.MultiprocessIterator(images, 4, seed=5, n_workers=2),
                               Recording())
    try:
        for _ in range(3):
            it.next()
    finally:
        it.finalize()
    # (the prefetcher converts ahead: it may have seen more batches than were taken)
    assert len(seen) >= 3 and all(s is not None and s[0].shape[0] == 4 for s in seen), seen


def test_skipped_lists_what_the_batches_taken_left_out(bad_root):
    """The iterator's list also has the examples of batches fetched ahead and
    given back at a snapshot (a review: the recipe's skipped.json said 9 times
    where 4 batches had left the image out); the prefetcher's has those of the
    batches taken."""
    from chainer import serializers
    d = data.ImageListDataset(os.path.join(bad_root, 'bad.txt'))
    it = data.DevicePrefetcher(data.MultiprocessIterator(
        d, 4, shuffle=False, n_workers=1, on_error='skip'),
        converter=lambda batch, device=None: len(batch), depth=2)
    try:
        for _ in range(4):          # batches 0, 1 (2 bad each), 2, then 0 again
            it.next()
            deadline = time.time() + 10
            while it._queue.qsize() < 2 and time.time() < deadline:
                time.sleep(0.01)    # both batches after it fetched ahead
            serializers.DictionarySerializer({}).save(it)       # a snapshot: give back
        assert len(it.skipped) == 6
        assert len(it.iterator.skipped) > 6
    finally:
        it.finalize()
