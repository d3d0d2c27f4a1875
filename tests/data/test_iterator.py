"""MultiprocessIterator: order, resume, bad input, and the fault paths."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy
import pytest

import chainer
from chainer import serializers

from fastchain import data
from tests.helpers import Indexed, Noisy


@pytest.fixture
def images(image_root):
    return data.ImageListDataset(os.path.join(image_root, 'train.txt'),
                                 transform=data.RandomResizedCrop(24))


def batches(it, n):
    out = []
    for _ in range(n):
        batch = it.next()
        out.append(([x.copy() for x, _ in batch], [int(t) for _, t in batch]))
    return out


def assert_same(a, b):
    assert len(a) == len(b)
    for (xa, ta), (xb, tb) in zip(a, b):
        assert ta == tb
        for x, y in zip(xa, xb):
            numpy.testing.assert_array_equal(x, y)


def children_alive(pids):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            # a zombie still answers kill(0); it must have been reaped
            with open('/proc/{}/stat'.format(pid)) as f:
                if f.read().split(')')[-1].split()[0] != 'Z':
                    alive.append(pid)
                else:
                    alive.append(pid)
        except (ProcessLookupError, FileNotFoundError):
            pass
    return alive


@pytest.mark.parametrize('workers', [1, 2])
def test_same_seed_same_batches_whatever_the_workers(images, workers):
    ref = data.MultiprocessIterator(images, 5, seed=7, n_workers=0)
    it = data.MultiprocessIterator(images, 5, seed=7, n_workers=workers, prefetch=3)
    try:
        assert_same(batches(ref, 9), batches(it, 9))   # crosses two epochs
    finally:
        it.finalize()


def test_each_epoch_visits_every_example_once(image_root):
    d = data.ImageListDataset(os.path.join(image_root, 'train.txt'))
    it = data.MultiprocessIterator(d, 4, seed=1, n_workers=2)
    try:
        seen, epochs = [], []
        while it.epoch < 2:
            seen.extend(int(t) for _, t in it.next())
            epochs.append(it.epoch_detail)
        assert len(seen) == 36          # 2 epochs x 18 examples
        assert sorted(seen[:18]) == sorted([0] * 6 + [1] * 6 + [2] * 6)
        assert epochs[-1] == 2.0 and it.is_new_epoch
    finally:
        it.finalize()


def test_no_repeat_gives_a_partial_last_batch_then_stops_and_resets(images):
    it = data.MultiprocessIterator(images, 5, repeat=False, shuffle=False, n_workers=2)
    try:
        sizes = [len(b) for b in it]
        assert sizes == [5, 5, 5, 3]
        with pytest.raises(StopIteration):
            it.next()
        it.reset()
        assert [len(b) for b in it] == [5, 5, 5, 3]
    finally:
        it.finalize()


@pytest.mark.parametrize('workers', [0, 2])
def test_resume_mid_epoch_from_a_snapshot(images, tmp_path, workers):
    it = data.MultiprocessIterator(images, 4, seed=3, n_workers=workers)
    batches(it, 6)                      # into the second epoch
    path = str(tmp_path / 'it.npz')
    serializers.save_npz(path, it)
    expected = batches(it, 5)
    it.finalize()

    fresh = data.MultiprocessIterator(images, 4, seed=99, n_workers=workers)
    batches(fresh, 2)                   # already somewhere else
    serializers.load_npz(path, fresh)
    assert fresh.epoch == 1 and fresh.current_position == 6
    assert_same(batches(fresh, 5), expected)
    fresh.finalize()


def test_snapshots_move_between_serial_and_fastchain_iterators(tmp_path, image_root):
    d = data.ImageListDataset(os.path.join(image_root, 'train.txt'))
    serial = chainer.iterators.SerialIterator(d, 4)
    labels = lambda b: [int(t) for _, t in b]   # noqa: E731
    serial.next()
    path = str(tmp_path / 's.npz')
    serializers.save_npz(path, serial)
    expected = [labels(serial.next()) for _ in range(2)]
    ours = data.MultiprocessIterator(d, 4, n_workers=1)
    serializers.load_npz(path, ours)
    assert [labels(ours.next()) for _ in range(2)] == expected
    serializers.save_npz(path, ours)
    # (within the epoch: the next epoch's order comes from each one's own RNG)
    expected = labels(ours.next())
    ours.finalize()
    serial2 = chainer.iterators.SerialIterator(d, 4)
    serializers.load_npz(path, serial2)
    assert labels(serial2.next()) == expected


@pytest.mark.parametrize('workers', [0, 2])
@pytest.mark.parametrize('name', ['corrupt.jpg', 'truncated.jpg', 'missing.jpg',
                                  'notes.jpg'])
def test_bad_file_raises_in_the_main_process_naming_it(bad_root, workers, name):
    d = data.ImageListDataset(os.path.join(bad_root, 'bad.txt'))
    index = [os.path.basename(d.path(k)) for k in range(len(d))].index(name)
    # Only the bad file and good ones around it, so the error is this one.
    picked = [0, index, 1]

    class Three(chainer.dataset.DatasetMixin):
        def __len__(self):
            return 3

        def get_example(self, i):
            return d[picked[i]]

    it = data.MultiprocessIterator(Three(), 3, shuffle=False, n_workers=workers)
    with pytest.raises(data.DataLoadError) as e:
        it.next()
    assert e.value.index == 1 and e.value.path.endswith(name)
    assert 'example 1 (' in str(e.value)
    assert name in str(e.value)
    it.finalize()


@pytest.mark.parametrize('workers', [0, 2])
def test_skip_option_leaves_bad_files_out_and_counts_them(bad_root, workers):
    d = data.ImageListDataset(os.path.join(bad_root, 'bad.txt'))
    it = data.MultiprocessIterator(d, 4, repeat=False, shuffle=False,
                                   n_workers=workers, on_error='skip')
    reporter = chainer.Reporter()
    sizes, reported = [], []
    for _ in range(3):
        observation = {}
        with reporter.scope(observation):
            sizes.append(len(it.next()))
        reported.append(observation['skipped_examples'])
    with pytest.raises(StopIteration):
        it.next()
    assert sum(sizes) == len(d) - 4
    assert sorted(os.path.basename(s['path']) for s in it.skipped) == \
        ['corrupt.jpg', 'missing.jpg', 'notes.jpg', 'truncated.jpg']
    # each next() reports what its batch left out (entries 2..5 are bad), not
    # a running count: LogReport averages a key over its interval
    assert reported == [2, 2, 0]
    it.finalize()


def test_a_log_report_of_skipped_examples_adds_up_to_the_count(bad_root):
    """Through a trainer's LogReport, the mean of skipped_examples times the
    interval's iterations is the number of examples left out in it (a running
    count averaged over the interval was neither)."""
    d = data.ImageListDataset(os.path.join(bad_root, 'bad.txt'))
    it = data.MultiprocessIterator(d, 4, shuffle=False, n_workers=0, on_error='skip')
    model = chainer.links.Classifier(chainer.links.Linear(None, 2))
    optimizer = chainer.optimizers.SGD()
    optimizer.setup(model)

    def colours(batch, device=None):     # the images' sizes differ
        return (numpy.stack([x.mean(axis=(1, 2)) for x, _ in batch]).astype(numpy.float32),
                numpy.array([t for _, t in batch], numpy.int32))
    updater = chainer.training.StandardUpdater(it, optimizer, converter=colours)
    trainer = chainer.training.Trainer(updater, (6, 'iteration'))
    log = chainer.training.extensions.LogReport(trigger=(3, 'iteration'))
    trainer.extend(log)
    trainer.run()
    it.finalize()
    assert [round(e['skipped_examples'] * 3) for e in log.log] == [4, 4]


class _BadAt:
    """Examples 0..n-1 (an array and a label); those in ``bad`` raise."""

    def __init__(self, n, bad):
        self.n, self.bad = n, set(bad)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise ValueError('example {} is bad'.format(i))
        return numpy.full(3, i, numpy.float32), i


@pytest.mark.parametrize('workers', [0, 2])
@pytest.mark.parametrize('repeat', [True, False])
def test_skip_leaves_out_a_batch_none_of_whose_examples_loads(workers, repeat):
    # A batch left empty could not be converted ('batch is empty' from
    # Chainer's concat_examples, a traceback mid-training): the next is taken.
    it = data.MultiprocessIterator(_BadAt(6, {2, 3}), 2, repeat=repeat, shuffle=False,
                                   n_workers=workers, on_error='skip')
    try:
        first = it.next()
        assert [t for _, t in first] == [0, 1] and not it.is_new_epoch
        second = it.next()
        assert [t for _, t in second] == [4, 5]
        assert it.is_new_epoch and it.epoch == 1 and it.current_position == 0
        assert (it.previous_epoch_detail, it.epoch_detail) == (1 / 3, 1.0)
        assert [s['index'] for s in it.skipped] == [2, 3]
        if repeat:
            assert [t for _, t in it.next()] == [0, 1]
        else:
            with pytest.raises(StopIteration):
                it.next()
    finally:
        it.finalize()


def test_skip_under_the_global_rng_never_fetches_ahead():
    # a batch left out takes the next one, which may reach the end of the
    # epoch and draw the next order from NumPy's global RNG: on the training
    # loop's thread only
    drawn = []

    def sampler(order, position):
        drawn.append(position)
        return numpy.arange(len(order))

    it = data.MultiprocessIterator(_BadAt(6, {2, 3}), 2, n_workers=1, on_error='skip',
                                   rng='global', order_sampler=sampler)
    try:
        it.next()
        assert not it.may_fetch_ahead()
        it.next()               # [2, 3] left out, [4, 5] ends the epoch: a draw
        assert len(drawn) == 2 and it.epoch == 1
    finally:
        it.finalize()
    plain = data.MultiprocessIterator(_BadAt(6, {2, 3}), 2, n_workers=1, rng='global',
                                      order_sampler=sampler)
    try:
        assert plain.may_fetch_ahead()      # on_error='raise': as before
    finally:
        plain.finalize()


def test_skip_with_no_example_loading_in_a_whole_epoch_is_an_error():
    it = data.MultiprocessIterator(_BadAt(4, range(4)), 2, shuffle=False, n_workers=0,
                                   on_error='skip')
    with pytest.raises(data.DataLoadError, match="no example loads.*a whole epoch's worth"):
        it.next()


@pytest.mark.parametrize('sig, cause', [
    (signal.SIGKILL, 'run out of memory'),
    (signal.SIGTERM, 'Another process'),        # not the out-of-memory advice
])
def test_a_killed_worker_raises_promptly_and_leaves_no_process(images, sig, cause):
    it = data.MultiprocessIterator(images, 3, n_workers=2, prefetch=2)
    it.next()
    pids = [p.pid for p in it._pool.workers]
    os.kill(pids[1], sig)
    start = time.monotonic()
    with pytest.raises(data.WorkerDiedError, match=sig.name) as e:
        for _ in range(10):
            it.next()
    assert cause in str(e.value)
    # one error: not raised while handling the broken pipe to the dead worker
    assert e.value.__context__ is None or e.value.__suppress_context__, e.value.__context__
    assert time.monotonic() - start < 10
    assert children_alive(pids) == []
    assert not os.path.exists('/dev/shm/' + it._pool.shm.name.lstrip('/'))


def test_finalize_stops_workers_and_frees_shared_memory(images):
    it = data.MultiprocessIterator(images, 3, n_workers=2)
    it.next()
    pids = [p.pid for p in it._pool.workers]
    shm = '/dev/shm/' + it._pool.shm.name.lstrip('/')
    assert os.path.exists(shm)
    it.finalize()
    it.finalize()
    assert children_alive(pids) == []
    assert not os.path.exists(shm)


def test_a_hanging_dataset_times_out_with_the_worker_named():
    class Slow(chainer.dataset.DatasetMixin):
        def __len__(self):
            return 10

        def get_example(self, i):
            if i > 0:
                time.sleep(60)
            return numpy.zeros(3, numpy.float32), numpy.int32(0)

    it = data.MultiprocessIterator(Slow(), 2, shuffle=False, n_workers=1, timeout=1.0)
    with pytest.raises(TimeoutError, match=r'worker 0 \(pid \d+\)'):
        it.next()


def test_bad_arguments():
    with pytest.raises(ValueError, match='batch_size'):
        data.MultiprocessIterator([1], 0)
    with pytest.raises(ValueError, match='on_error'):
        data.MultiprocessIterator([1], 1, on_error='ignore')
    with pytest.raises(ValueError, match='n_workers'):
        data.MultiprocessIterator([1], 1, n_workers=-1)
    with pytest.raises(ValueError, match='empty'):
        data.MultiprocessIterator([], 1)


@pytest.mark.parametrize('kwargs, message', [
    (dict(n_workers='2'), "n_workers must be an int >= 0, got '2'"),
    (dict(timeout=0), 'timeout must be a number of seconds > 0'),
    (dict(timeout='5'), 'timeout must be a number of seconds > 0'),
    (dict(seed=-1), 'seed must be an int >= 0'),
    (dict(seed=1.5), 'seed must be an int >= 0'),
    (dict(shared_memory='no'), "shared_memory must be True or False, got 'no'"),
    (dict(n_processes=2), "'n_processes' is chainer.iterators.MultiprocessIterator's "
                          'argument; fastchain.data.MultiprocessIterator calls it n_workers'),
    (dict(maxtasksperchild=4), 'has no such setting'),
    (dict(bogus=1), 'unexpected keyword argument'),
])
def test_each_bad_argument_is_named(kwargs, message):
    # raw errors, or taken (timeout=0, seed=1.5, shared_memory='no'): a trial
    with pytest.raises((ValueError, TypeError), match=message):
        data.MultiprocessIterator(list(range(8)), 2, **kwargs)


def test_numpy_integers_are_taken_as_chainer_takes_them():
    it = data.MultiprocessIterator(list(range(8)), numpy.int64(3), n_workers=numpy.int64(0),
                                   shuffle=False)
    assert it.batch_size == 3 and type(it.batch_size) is int and it.next() == [0, 1, 2]


class _Locked(Indexed):
    def __init__(self):
        import threading
        self.lock = threading.Lock()


def test_a_dataset_spawn_cannot_send_is_named_and_its_shared_memory_freed():
    before = set(os.listdir('/dev/shm'))
    with pytest.raises(TypeError, match="cannot be sent to the workers: start method 'spawn' "
                                        'pickles it.*Fix: make the dataset picklable'):
        data.MultiprocessIterator(_Locked(), 2, n_workers=1, start_method='spawn')
    assert set(os.listdir('/dev/shm')) - before == set()    # each failure left it


SCRIPT = textwrap.dedent('''
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from fastchain import data
    from data.conftest import make_images
    root = {root!r}
    make_images(root, n_per_class=4, classes=2)
    d = data.ImageListDataset(os.path.join(root, 'train.txt'),
                              transform=data.RandomCrop(24))
    it = data.MultiprocessIterator(d, 2, n_workers=2)
    print(' '.join(str(p.pid) for p in it._pool.workers), flush=True)
    {body}
''')


def run_script(tmp_path, body, **kwargs):
    code = SCRIPT.format(tests=os.path.dirname(os.path.dirname(__file__)),
                         root=str(tmp_path), body=body)
    kwargs.setdefault('stderr', subprocess.PIPE)
    return subprocess.Popen([sys.executable, '-X', 'faulthandler', '-c', code],
                            stdout=subprocess.PIPE, text=True, **kwargs)


def _ctrl_c_as_in_a_terminal():
    # A job started in the background by a non-interactive shell (as CI
    # runners may do) inherits SIGINT ignored, and Python then keeps it
    # ignored: Ctrl-C would do nothing. Give the script a terminal's default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_the_process_and_its_workers(tmp_path):
    # stderr goes to a file: waiting for the process must not depend on
    # every descendant having closed an inherited pipe.
    err_path = tmp_path / 'stderr.txt'
    with open(err_path, 'w') as err_file:
        proc = run_script(tmp_path, 'while True:\n        it.next()', stderr=err_file,
                          preexec_fn=_ctrl_c_as_in_a_terminal)
        pids = [int(p) for p in proc.stdout.readline().split()]
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # Where is it stuck? faulthandler (-X faulthandler) dumps every
            # thread's stack on SIGABRT.
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=10)
            pytest.fail('the main process did not end within 30 s of Ctrl-C; workers '
                        'alive: {}; its stacks:\n{}'.format(children_alive(pids),
                                                            err_path.read_text()[-6000:]))
    proc.stdout.close()
    err = err_path.read_text()
    assert 'KeyboardInterrupt' in err, err
    deadline = time.monotonic() + 5
    while children_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children_alive(pids) == []


def test_end_of_script_without_finalize_leaves_no_process(tmp_path):
    proc = run_script(tmp_path, 'it.next(); it.next()')
    pids = [int(p) for p in proc.stdout.readline().split()]
    proc.communicate(timeout=30)
    assert proc.returncode == 0
    deadline = time.monotonic() + 5
    while children_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children_alive(pids) == []


def test_full_dev_shm_is_a_clear_error(tmp_path):
    if os.geteuid() != 0 or not _has('unshare'):
        pytest.skip('needs root and unshare to mount a tiny /dev/shm')
    code = textwrap.dedent('''
        import os, sys
        sys.path.insert(0, {tests!r})
        from fastchain import data
        from data.conftest import make_images
        make_images({root!r}, n_per_class=4, classes=2, min_side=200, max_side=201)
        d = data.ImageListDataset(os.path.join({root!r}, 'train.txt'))
        try:
            data.MultiprocessIterator(d, 8, n_workers=2, prefetch=8)
        except OSError as e:
            print('ERROR', e)
    ''').format(tests=os.path.dirname(os.path.dirname(__file__)), root=str(tmp_path))
    out = subprocess.run(
        ['unshare', '--mount', 'sh', '-c',
         'mount -t tmpfs -o size=256k tmpfs /dev/shm && exec "$0" -c "$1"',
         sys.executable, code], capture_output=True, text=True, timeout=60)
    if 'mount' in out.stderr and 'ERROR' not in out.stdout:
        pytest.skip('cannot mount tmpfs here: ' + out.stderr.strip())
    assert 'ERROR' in out.stdout, out.stderr
    assert '/dev/shm is full' in out.stdout and '--shm-size' in out.stdout


def _has(cmd):
    import shutil
    return shutil.which(cmd) is not None


@pytest.mark.parametrize('workers', [0, 2])
def test_a_bad_first_example_is_skipped_with_or_without_workers(first_bad_list, workers):
    # With workers, the first examples are loaded here to lay out the shared
    # memory: a bad one must not stop the iterator from being built.
    d = data.ImageListDataset(first_bad_list, transform=data.RandomCrop(24))
    it = data.MultiprocessIterator(d, 4, repeat=False, shuffle=False,
                                   n_workers=workers, on_error='skip')
    try:
        labels = [[int(t) for _, t in batch] for batch in it]
    finally:
        it.finalize()
    expected = [d.label(i) for i in range(1, len(d))]
    assert labels == [expected[:3]] + [expected[k:k + 4] for k in range(3, len(expected), 4)]
    assert [(s['index'], os.path.basename(s['path'])) for s in it.skipped] == \
        [(0, 'corrupt.jpg')]


@pytest.mark.parametrize('workers', [0, 2])
def test_a_bad_first_example_raises_in_next_naming_it(first_bad_list, workers):
    d = data.ImageListDataset(first_bad_list)
    it = data.MultiprocessIterator(d, 3, shuffle=False, n_workers=workers)
    try:
        with pytest.raises(data.DataLoadError) as e:
            it.next()
    finally:
        it.finalize()
    assert e.value.index == 0 and e.value.path.endswith('corrupt.jpg')
    assert str(e.value).startswith('example 0 (') and 'ImageDecodeError' in str(e.value)


def test_a_resumed_run_does_not_fail_on_a_bad_example_it_will_not_load(
        first_bad_list, tmp_path):
    d = data.ImageListDataset(first_bad_list)
    first = data.MultiprocessIterator(d, 3, shuffle=False, n_workers=0, on_error='skip')
    first.next()
    serializers.save_npz(str(tmp_path / 'it.npz'), first)
    it = data.MultiprocessIterator(d, 3, shuffle=False, n_workers=2)
    try:
        serializers.load_npz(str(tmp_path / 'it.npz'), it)
        assert [int(t) for _, t in it.next()] == [d.label(i) for i in (3, 4, 5)]
    finally:
        it.finalize()


@pytest.mark.parametrize('workers', [0, 2])
def test_seek_goes_back_to_a_position_exactly(images, workers):
    it = data.MultiprocessIterator(images, 4, seed=5, n_workers=workers)
    try:
        batches(it, 3)
        state = (it.epoch, it.current_position, it.is_new_epoch, it.previous_epoch_detail)
        expected = batches(it, 4)           # into the next epoch
        it.seek(*state)
        assert (it.epoch, it.current_position, it.is_new_epoch,
                it.previous_epoch_detail) == state
        assert_same(batches(it, 4), expected)
        with pytest.raises(ValueError, match=r'current_position must be in \[0, 18\)'):
            it.seek(0, 18)
    finally:
        it.finalize()


@pytest.mark.parametrize('rng', ['seed', 'global'])
def test_building_one_draws_what_serial_iterator_draws_from_the_global_rng(rng):
    # With workers, an example is loaded here to lay out the shared memory:
    # whatever it draws must not show.
    numpy.random.seed(3)
    if rng == 'global':
        chainer.iterators.SerialIterator(Noisy(), 4)    # draws the first order
    expected = numpy.random.rand()
    numpy.random.seed(3)
    it = data.MultiprocessIterator(Noisy(), 4, n_workers=2, rng=rng)
    try:
        assert numpy.random.rand() == expected
    finally:
        it.finalize()


def test_with_the_global_rng_only_batches_that_draw_nothing_may_be_fetched_ahead():
    seeded = data.MultiprocessIterator(Indexed(), 5, n_workers=0)
    here = data.MultiprocessIterator(Indexed(), 5, n_workers=0, rng='global')
    ahead = data.MultiprocessIterator(Indexed(), 5, n_workers=1, rng='global')
    once = data.MultiprocessIterator(Indexed(), 5, repeat=False, n_workers=1, rng='global')
    try:
        got = []
        for _ in range(5):          # positions 0, 5, 10 (ends epoch 0), 3, 8 (ends 1)
            got.append((seeded.may_fetch_ahead(), here.may_fetch_ahead(),
                        ahead.may_fetch_ahead()))
            for it in (seeded, here, ahead):
                it.next()
        # No workers: loaded in the training loop, whatever the mode (loading
        # seeds or draws from NumPy's global RNG, which that thread uses).
        assert got == [(False, False, True), (False, False, True), (False, False, False),
                       (False, False, True), (False, False, False)]
        got = [once.may_fetch_ahead()]
        for _ in once:
            got.append(once.may_fetch_ahead())
        assert got == [True, True, False, True]     # the end: nothing left to draw
    finally:
        ahead.finalize()
        once.finalize()


class NoisyScalars(chainer.dataset.DatasetMixin):
    """Draws from NumPy's global RNG in every example, as augmentation does
    (a float each: batches compare with ``==``)."""

    def __len__(self):
        return 12

    def get_example(self, i):
        return numpy.float32(i + numpy.random.rand())


def test_seeded_loading_without_workers_leaves_the_global_rng_as_it_was():
    it = data.MultiprocessIterator(NoisyScalars(), 5, n_workers=0, seed=3)
    numpy.random.seed(7)
    first = [it.next() for _ in range(3)]
    after = numpy.random.rand()
    numpy.random.seed(7)
    assert numpy.random.rand() == after     # the batches drew nothing from it
    again = data.MultiprocessIterator(NoisyScalars(), 5, n_workers=0, seed=3)
    assert [again.next() for _ in range(3)] == first    # per-example seeds: repeatable


def test_seek_refuses_an_epoch_whose_order_is_not_drawn():
    it = data.MultiprocessIterator(Indexed(), 5, n_workers=0, rng='global')
    it.seek(0, 7)
    with pytest.raises(ValueError, match="epoch 1's order is not drawn yet"):
        it.seek(1, 0)


def test_rng_and_order_arguments():
    sampler = chainer.iterators.ShuffleOrderSampler()
    with pytest.raises(ValueError, match="rng must be 'seed' or 'global'"):
        data.MultiprocessIterator([1], 1, rng='os')
    for kwargs in ({'shuffle': True}, {'shuffle': False}, {'rng': 'seed'}):
        with pytest.raises(ValueError, match="order_sampler gives the orders with "
                                             "rng='global' and shuffle=None"):
            data.MultiprocessIterator([1], 1, order_sampler=sampler, **kwargs)
    with pytest.raises(ValueError, match=r"order \(the first epoch's\) needs"):
        data.MultiprocessIterator([1], 1, order=[0])
    with pytest.raises(ValueError, match=r'one index per example \(3\)'):
        data.MultiprocessIterator([1, 2, 3], 1, n_workers=0, rng='global', order=[0, 1])
    it = data.MultiprocessIterator([1, 2, 3], 3, n_workers=0, order_sampler=sampler)
    assert it.rng == 'global' and sorted(it.next()) == [1, 2, 3]
    it = data.MultiprocessIterator([1, 2, 3], 3, n_workers=0, rng='global', shuffle=False)
    assert it.next() == [1, 2, 3]


def _group_of_workers(env, monkeypatch, start_method=None):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    x = numpy.arange(64, dtype=numpy.float32).reshape(16, 4)
    it = data.MultiprocessIterator(list(x), 4, n_workers=2, start_method=start_method)
    try:
        it.next()
        pids = [p.pid for p in it._pool.workers]
        return [os.getpgid(p) for p in pids], it
    except Exception:
        it.finalize()
        raise


def test_loader_workers_stay_in_the_main_process_group_unless_launched_by_mpi(monkeypatch):
    # Outside MPI, the group is the user's (Ctrl-Z, or the benchmarks'
    # SIGSTOP of a rung's group, stops the workers too); under an MPI launcher
    # they leave it, so that mpiexec killing a rank's group leaves them the
    # moment to free the shared memory.
    for name in ('PMI_RANK', 'OMPI_COMM_WORLD_RANK', 'PMIX_RANK', 'SLURM_PROCID'):
        monkeypatch.delenv(name, raising=False)
    groups, it = _group_of_workers({}, monkeypatch)
    it.finalize()
    assert groups == [os.getpgid(0)] * 2
    groups, it = _group_of_workers({'PMI_RANK': '0', 'PMI_SIZE': '1'}, monkeypatch)
    it.finalize()
    assert os.getpgid(0) not in groups


def test_forkserver_workers_outlive_an_idle_second(monkeypatch):
    # A forkserver worker's parent is the forkserver: taken for the main
    # process being gone, every worker quit after a second without a task.
    groups, it = _group_of_workers({}, monkeypatch, start_method='forkserver')
    try:
        pids = [p.pid for p in it._pool.workers]
        time.sleep(2.5)
        assert all(p.is_alive() for p in it._pool.workers), pids
        it.next()
    finally:
        it.finalize()


def test_a_worker_that_stops_answering_is_not_said_to_have_exited():
    from fastchain.data import _pool
    how, why = _pool._death(None)           # its pipe closed, the process still running
    assert 'still running' in how and 'sys.exit' not in why
    assert 'SIGTERM' in _pool._death(-15)[0] and 'run out of memory' in _pool._death(-9)[1]


class IndexTypes(chainer.dataset.DatasetMixin):
    """Each example is the type of the index it was given, and a value
    computed with it (NEP 50: float64 for NumPy's int64, float32 for an int)."""

    def __len__(self):
        return 10

    def get_example(self, i):
        return (numpy.float32(1 / 7) + i * 0.1).astype(numpy.float32), type(i).__name__


@pytest.mark.parametrize('workers', [0, 1])
def test_the_dataset_gets_the_index_type_chainers_iterators_give(workers):
    # (a review: a Python int, where Chainer's iterators pass numpy.int64)
    expected = chainer.iterators.SerialIterator(IndexTypes(), 4, shuffle=False)
    it = data.MultiprocessIterator(IndexTypes(), 4, shuffle=False, n_workers=workers)
    try:
        for _ in range(4):
            assert [(x.tobytes(), kind) for x, kind in it.next()] == \
                [(x.tobytes(), kind) for x, kind in expected.next()]
    finally:
        it.finalize()


_Pair = __import__('collections').namedtuple('_Pair', 'x t')


class _Tagged(tuple):
    """A tuple of the script's own kind (not a namedtuple): it travels whole."""


class Kinds(chainer.dataset.DatasetMixin):
    """Examples of several kinds: a namedtuple, 0-d array fields, a tuple
    subclass, and (from index 8) plain tuples after namedtuples."""

    def __init__(self, kind):
        self.kind = kind

    def __len__(self):
        return 12

    def get_example(self, i):
        x = numpy.full((2, 3), i, numpy.float32)
        if self.kind == 'named':
            return _Pair(x, numpy.int32(i % 3))
        if self.kind == '0-d':
            return x, numpy.array(i % 3, numpy.int32), numpy.array(i / 7)
        if self.kind == 'own':
            return _Tagged((x, numpy.int32(i)))
        if self.kind == 'made':     # a class made per example, pickle cannot find
            return __import__('collections').namedtuple('Made', 'x t')(x, numpy.int32(i))
        return (x, numpy.int32(i)) if i >= 8 else _Pair(x, numpy.int32(i))    # mixed


def _structure(example):
    fields = example if isinstance(example, tuple) else (example,)
    kind = type(example)
    return (kind if kind.__name__ != 'Made' else (kind.__name__, kind._fields),
            [(type(f), numpy.shape(f), numpy.asarray(f).tobytes()) for f in fields])


@pytest.mark.parametrize('kind', ['named', '0-d', 'own', 'mixed', 'made'])
@pytest.mark.parametrize('workers, shared, start', [
    (0, True, None), (1, True, None), (1, False, None), (1, True, 'spawn')])
def test_examples_come_back_of_the_kind_the_dataset_gave(kind, workers, shared, start):
    # (a review: a namedtuple came back a plain tuple, and a 0-d array field
    # a NumPy scalar, through shared memory; the review of that change: a
    # class made per example failed in the worker, and under spawn one
    # pickle cannot find failed at the start)
    if start == 'spawn' and kind != 'made':
        pytest.skip('spawn: the class pickle cannot find is the case')
    expected = chainer.iterators.SerialIterator(Kinds(kind), 4, shuffle=False)
    it = data.MultiprocessIterator(Kinds(kind), 4, shuffle=False, n_workers=workers,
                                   shared_memory=shared, start_method=start)
    if kind == 'made' and workers and not shared:   # pickled whole: cannot be sent
        with pytest.raises(data.DataLoadError, match='example 0: PicklingError: the worker '
                           'cannot send the example back.*loader_workers=0'):
            it.next()
        return
    try:
        for _ in range(3):
            assert [_structure(e) for e in it.next()] == \
                [_structure(e) for e in expected.next()]
    finally:
        it.finalize()


def test_a_snapshot_of_another_datasets_length_is_named_with_the_likely_cause():
    # (a review: a data-parallel job resumed with another number of ranks
    # failed on NumPy's "could not broadcast input array from shape (48,)")
    saved = {}
    serial = chainer.iterators.SerialIterator(Indexed(), 4)
    serial.next()
    serializers.DictionarySerializer(saved).save(serial)
    half = chainer.datasets.SubDataset(Indexed(), 0, len(Indexed()) // 2)
    it = data.MultiprocessIterator(half, 4, n_workers=0)
    try:
        with pytest.raises(ValueError, match=r"another length than this one's 6 examples "
                           r"\(.*broadcast.*\): .*another number of ranks"):
            serializers.NpzDeserializer(saved).load(it)
    finally:
        it.finalize()


def test_an_error_that_is_not_the_datasets_leaves_the_position(monkeypatch):
    # (a review of the change that moves past a batch that failed to load:
    # it moved on for any error, Ctrl-C or a dead worker too, one batch each
    # call, and the workers' batches fell out of step with the position)
    it = data.MultiprocessIterator(Indexed(), 4, shuffle=False, n_workers=1)
    try:
        it.next()
        assemble, calls = it._pool._assemble, []

        def interrupted(*args):     # Ctrl-C as the batch is copied out of its slot
            calls.append(args)      # (the pool has taken it: the second review)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return assemble(*args)
        monkeypatch.setattr(it._pool, '_assemble', interrupted)
        with pytest.raises(KeyboardInterrupt):
            it.next()
        assert (it.epoch, it.current_position) == (0, 4)
        assert [int(t) for _, t in it.next()] == [4, 5, 6, 7]
        assert [int(t) for _, t in it.next()] == [8, 9, 10, 11]
        os.kill(it._pool.workers[0].pid, signal.SIGKILL)
        with pytest.raises(data.WorkerDiedError):
            for _ in range(4):      # (a batch loaded ahead may come first)
                at = (it.epoch, it.current_position)
                it.next()
        assert (it.epoch, it.current_position) == at
        with pytest.raises(RuntimeError, match='finalized'):
            it.next()
        assert (it.epoch, it.current_position) == at
    finally:
        it.finalize()


class _Unsendable(chainer.dataset.DatasetMixin):
    """Example 3 does not pickle (a ctypes pointer among its fields); the
    error of example 1 holds an object pickle refuses (a lock)."""

    def __len__(self):
        return 8

    def get_example(self, i):
        import ctypes
        import threading
        from fastchain.data._images import ImageDecodeError
        if i == 1:
            raise ImageDecodeError('/data/img1.jpg', i, threading.Lock())
        return (numpy.full(3, i, numpy.float32),
                ctypes.pointer(ctypes.c_int(i)) if i == 3 else numpy.int32(i))


def test_what_a_worker_cannot_send_back_is_named_and_the_rest_of_the_batch_goes():
    # (a second review: every example of the batch was blamed, a ctypes
    # pointer or an error holding a lock still ended the worker, said to
    # have called sys.exit)
    it = data.MultiprocessIterator(_Unsendable(), 4, shuffle=False, n_workers=1,
                                   on_error='skip')
    try:
        assert [int(t) for _, t in it.next()] == [0, 2]
        assert [s['index'] for s in it.skipped] == [1, 3]
        assert 'ImageDecodeError' in it.skipped[0]['error']
        assert ('cannot send the example back to the training process (ValueError: ctypes'
                in it.skipped[1]['error'])
        assert [int(t) for _, t in it.next()] == [4, 5, 6, 7]
    finally:
        it.finalize()
