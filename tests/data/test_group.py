"""The loader of enable() in a SerialIterator's place: the same batches, in
the same order, drawn at the same points of NumPy's global RNG stream."""

import contextlib
import functools
import threading
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import serializers

import fastchain
from fastchain import data
from fastchain.data._group import upgrade_iterator
from tests.helpers import Indexed, Noisy

N = len(Indexed())      # examples


def walk(it, n):
    """``n`` batches and the iterator's state after each; between batches the
    global RNG is drawn from, as a training step does (dropout)."""
    out = []
    for _ in range(n):
        batch = it.next()
        out.append(([int(t) for _, t in batch], [x.tolist() for x, _ in batch],
                    it.epoch, it.current_position, it.is_new_epoch, it.epoch_detail,
                    it.previous_epoch_detail, numpy.random.rand()))
    return out + [numpy.random.rand()]


def walk_to_the_end(it):
    out = []
    while True:
        try:
            out.append([int(t) for _, t in it.next()])
        except StopIteration:
            return out + [(it.epoch, it.is_new_epoch, it.epoch_detail,
                           it.previous_epoch_detail), numpy.random.rand()]


def serial(dataset, batch_size, shuffle=None, repeat=True):
    return chainer.iterators.SerialIterator(dataset, batch_size, repeat=repeat,
                                            shuffle=shuffle)


def upgraded(dataset, batch_size, workers, prefetch, shuffle=None, repeat=True):
    it = upgrade_iterator(serial(dataset, batch_size, shuffle, repeat), workers)
    return data.DevicePrefetcher(it) if prefetch else it


def batches_for(batch_size, epochs=3.5):
    return max(3, -(-int(epochs * N) // batch_size))


@pytest.mark.parametrize('prefetch', [False, True])
@pytest.mark.parametrize('workers', [0, 2])
@pytest.mark.parametrize('batch_size', [4, 5, 25])     # divides N, does not, > 2N
@pytest.mark.parametrize('shuffle', [None, False])
def test_same_batches_and_global_rng_as_serial_iterator(shuffle, batch_size, workers,
                                                        prefetch):
    n = batches_for(batch_size)
    numpy.random.seed(0)
    expected = walk(serial(Indexed(), batch_size, shuffle), n)
    numpy.random.seed(0)
    it = upgraded(Indexed(), batch_size, workers, prefetch, shuffle)
    try:
        assert walk(it, n) == expected
    finally:
        it.finalize()


@pytest.mark.parametrize('prefetch', [False, True])
@pytest.mark.parametrize('workers', [0, 2])
def test_without_repeat_the_end_and_reset_are_serial_iterators(workers, prefetch):
    # SerialIterator draws an order at the end of the only epoch too, and
    # again in reset().
    numpy.random.seed(4)
    it = serial(Indexed(), 5, repeat=False)
    expected = walk_to_the_end(it)
    it.reset()
    expected += walk_to_the_end(it)
    numpy.random.seed(4)
    it = upgraded(Indexed(), 5, workers, prefetch, repeat=False)
    try:
        got = walk_to_the_end(it)
        it.reset()
        assert got + walk_to_the_end(it) == expected
    finally:
        it.finalize()


@pytest.mark.parametrize('prefetch', [False, True])
def test_a_random_dataset_loaded_here_is_serial_iterators_exactly(prefetch):
    numpy.random.seed(5)
    expected = walk(serial(Noisy(), 5), 8)
    numpy.random.seed(5)
    it = upgraded(Noisy(), 5, 0, prefetch)
    try:
        assert walk(it, 8) == expected
    finally:
        it.finalize()


@pytest.mark.parametrize('prefetch', [False, True])
def test_a_random_dataset_in_workers_is_repeatable_under_numpy_seed(prefetch):
    # Workers draw from per-example seeds, derived from the global RNG's
    # state: not SerialIterator's numbers, but the same for the same seed,
    # whatever the number of workers. The global RNG is left alone, so the
    # orders and the training's draws are those of a dataset that draws
    # nothing (SerialIterator's examples would have advanced it).
    def run(seed, workers):
        numpy.random.seed(seed)
        it = upgraded(Noisy(), 5, workers, prefetch)
        try:
            return walk(it, 8)
        finally:
            it.finalize()

    first = run(5, 2)
    assert run(5, 2) == first and run(5, 1) == first
    assert run(6, 2)[0][1] != first[0][1]
    numpy.random.seed(5)
    deterministic = walk(serial(Indexed(), 5), 8)
    assert [b[0] for b in first[:-1]] == [b[0] for b in deterministic[:-1]]
    assert [b[2:] for b in first[:-1]] == [b[2:] for b in deterministic[:-1]]
    assert first[-1] == deterministic[-1]
    numpy.random.seed(5)
    plain = walk(serial(Noisy(), 5), 8)
    assert first[0][0] == plain[0][0] and first[0][1] != plain[0][1]    # other noise


@pytest.mark.parametrize('prefetch', [False, True])
@pytest.mark.parametrize('workers', [0, 2])
def test_snapshots_move_both_ways_and_later_epochs_agree(tmp_path, workers, prefetch):
    path = str(tmp_path / 'it.npz')
    # SerialIterator -> fastchain, into the second epoch
    numpy.random.seed(1)
    it = serial(Indexed(), 5)
    walk(it, 3)
    serializers.save_npz(path, it)
    state = numpy.random.get_state()
    expected = walk(it, 8)                  # crosses two more epoch ends
    numpy.random.seed(2)
    ours = upgraded(Indexed(), 5, workers, prefetch)
    try:
        walk(ours, 2)                       # somewhere else first
        serializers.load_npz(path, ours)
        numpy.random.set_state(state)
        assert walk(ours, 8) == expected
        # fastchain -> SerialIterator, mid-epoch
        serializers.save_npz(path, ours)
        state = numpy.random.get_state()
        expected = walk(ours, 8)
    finally:
        ours.finalize()
    it = serial(Indexed(), 5)
    serializers.load_npz(path, it)
    numpy.random.set_state(state)
    assert walk(it, 8) == expected


class ThreadsOfDraws(chainer.iterators.ShuffleOrderSampler):
    """Remembers the thread each order is drawn in."""

    def __init__(self):
        super().__init__()
        self.threads = []

    def __call__(self, order, position):
        self.threads.append(threading.current_thread())
        return super().__call__(order, position)


@pytest.mark.parametrize('depth', [1, 3])
def test_orders_are_drawn_by_the_training_loop_not_the_prefetch_thread(depth):
    sampler = ThreadsOfDraws()
    numpy.random.seed(7)
    expected = walk(chainer.iterators.SerialIterator(Indexed(), 4, order_sampler=sampler), 13)
    assert len(sampler.threads) == 5        # construction and four epoch ends
    sampler = ThreadsOfDraws()
    numpy.random.seed(7)
    it = upgrade_iterator(chainer.iterators.SerialIterator(Indexed(), 4, order_sampler=sampler), 2)
    it = data.DevicePrefetcher(it, depth=depth)
    try:
        assert walk(it, 13) == expected
    finally:
        it.finalize()
    assert sampler.threads == [threading.main_thread()] * 5


def test_a_serial_iterator_already_under_way_is_taken_over_where_it_stands():
    numpy.random.seed(8)
    it = serial(Indexed(), 5)
    walk(it, 3)
    state = numpy.random.get_state()
    expected = walk(it, 8)
    numpy.random.seed(8)
    it = serial(Indexed(), 5)
    walk(it, 3)
    assert numpy.random.get_state()[1].tolist() == state[1].tolist()
    ours = upgrade_iterator(it, 2)
    try:
        assert walk(ours, 8) == expected
    finally:
        ours.finalize()


class Dropper(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 8)
            self.l2 = L.Linear(None, 2)     # initialised at the first step

    def forward(self, x):
        return self.l2(F.dropout(F.relu(self.l1(x)), 0.5))


def plain_script(steps=9):
    """A plain Chainer script: SerialIterator, dropout, numpy.random.seed."""
    rs = numpy.random.RandomState(1)
    train = chainer.datasets.TupleDataset(rs.randn(N, 3).astype(numpy.float32),
                                          rs.randint(0, 2, N).astype(numpy.int32))
    numpy.random.seed(0)
    model = L.Classifier(Dropper())
    optimizer = chainer.optimizers.MomentumSGD(0.1).setup(model)
    updater = chainer.training.StandardUpdater(
        chainer.iterators.SerialIterator(train, 5), optimizer)
    main = updater.get_iterator('main')
    for _ in range(steps):                  # 45 examples: into the fourth epoch
        updater.update()
    updater.finalize()
    return main, {n: p.array.copy() for n, p in model.namedparams()}, numpy.random.rand()


@pytest.mark.parametrize('options', [
    {'loader_workers': 2},
    {'loader_workers': 2, 'prefetch_to_device': False},
    {'loader_workers': 1},
])
def test_enable_trains_a_plain_script_bit_for_bit_as_chainer(options):
    _, expected, rand = plain_script()
    with fastchain.enable(**options):
        main, params, rand_after = plain_script()
    assert isinstance(main, (data.DevicePrefetcher, data.MultiprocessIterator))
    assert sorted(params) == sorted(expected)
    for name, value in params.items():
        assert value.tobytes() == expected[name].tobytes(), name
    assert rand_after == rand


def _main_iterator_under(dataset, **options):
    model = L.Classifier(L.Linear(3, 2))
    optimizer = chainer.optimizers.SGD(0.1).setup(model)
    with fastchain.enable(**options) as handle:
        updater = chainer.training.StandardUpdater(
            chainer.iterators.SerialIterator(dataset, 4), optimizer)
        report = handle.report()['loader']
    main = updater.get_iterator('main')
    updater.finalize()
    return main, report


def _arrays():
    return chainer.datasets.TupleDataset(numpy.zeros((N, 3), numpy.float32),
                                         numpy.zeros(N, numpy.int32))


@pytest.mark.parametrize('make, in_memory', [
    (_arrays, True),
    (lambda: chainer.datasets.split_dataset(_arrays(), 5)[1], True),     # a SubDataset
    (lambda: chainer.datasets.DictDataset(x=numpy.zeros((N, 3), numpy.float32)), True),
    (lambda: [numpy.zeros(3, numpy.float32)] * N, True),
    (Indexed, False),                                 # computes each example
    (lambda: chainer.datasets.TransformDataset(_arrays(), lambda e: e), False),
])
def test_a_dataset_in_memory_keeps_its_serial_iterator_unless_workers_are_asked_for(
        make, in_memory):
    # MNIST-size arrays through worker processes made the MNIST recipe 1.45x
    # slower (11.2 s against 7.7 s here): by default they stay serial.
    main, report = _main_iterator_under(make(), prefetch_to_device=False)
    assert isinstance(main, data.MultiprocessIterator) is not in_memory
    assert report['active'] and 'keeps its SerialIterator' in report['note']
    # what it did with this updater (the note is the general rule: a trial)
    assert ('its iterator kept (a SerialIterator over a dataset in memory' in
            report['calls'][-1]) is in_memory, report['calls']
    main, report = _main_iterator_under(make(), loader_workers=1, prefetch_to_device=False)
    assert isinstance(main, data.MultiprocessIterator)
    assert report['note'] is None
    assert report['calls'][-1] == 'StandardUpdater: 1 worker process'


def test_the_default_worker_count_is_this_processes_share_when_the_updater_is_built(
        monkeypatch):
    from fastchain import _node
    from fastchain.data import _group
    monkeypatch.setattr(_group, 'available_cores', lambda: 8)
    dataset = chainer.datasets.TransformDataset(_arrays(), lambda e: e)
    with fastchain.enable(prefetch_to_device=False):
        # A communicator made after enable() (4 processes on the node)
        # still counts: the share is read when the updater is built.
        monkeypatch.setattr(_node, 'cores_per_process', 2)
        model = L.Classifier(L.Linear(3, 2))
        updater = chainer.training.StandardUpdater(
            chainer.iterators.SerialIterator(dataset, 4),
            chainer.optimizers.SGD(0.1).setup(model))
    assert updater.get_iterator('main').n_workers == 2
    updater.finalize()
    monkeypatch.setattr(_node, 'cores_per_process', None)
    assert _group.default_workers() == 8
    assert _group._resolve({'loader_workers': 3, 'prefetch_to_device': None}) == (3, True)


def test_default_device_prefetch_says_a_dataset_in_memory_is_not_prefetched():
    with fastchain.enable() as handle:
        updater = chainer.training.StandardUpdater(
            chainer.iterators.SerialIterator(_arrays(), 4),
            chainer.optimizers.SGD(0.1).setup(L.Classifier(L.Linear(3, 2))))
        report = handle.report()['prefetch_to_device']
    assert not isinstance(updater.get_iterator('main'), data.DevicePrefetcher)
    updater.finalize()
    assert report['active'] and 'keeps its SerialIterator' in report['note']
    with fastchain.enable(prefetch_to_device=True) as handle:   # asked: no such caveat
        assert handle.report()['prefetch_to_device']['note'] is None


def test_asking_for_device_prefetch_uses_workers_for_a_dataset_in_memory_too():
    main, report = _main_iterator_under(_arrays(), prefetch_to_device=True)
    assert isinstance(main, data.DevicePrefetcher)
    assert report['note'] is None


class _OwnIterator(chainer.dataset.Iterator):
    """A script's own iterator (as Chainer's PTB and word2vec examples have)."""

    def __init__(self, dataset):
        self.dataset, self.epoch, self.is_new_epoch = dataset, 0, False

    def __next__(self):
        return [self.dataset[0]]


@pytest.mark.parametrize('make, warned', [
    (lambda d: _OwnIterator(d), True),
    (lambda d: chainer.iterators.SerialIterator(
        d, 4, order_sampler=lambda order, position: order), True),
    (lambda d: chainer.iterators.MultithreadIterator(d, 4, n_threads=1), False),
])
def test_asked_for_workers_an_updater_whose_iterator_stays_says_so(make, warned):
    """loader_workers=N left such an iterator unchanged without a word while
    the report said the loader was active."""
    dataset = chainer.datasets.TransformDataset(_arrays(), lambda e: e)
    iterator = make(dataset)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter('always')
        with fastchain.enable(loader_workers=2, prefetch_to_device=False):
            updater = chainer.training.StandardUpdater(
                iterator, chainer.optimizers.SGD(0.1).setup(L.Classifier(L.Linear(3, 2))))
    assert updater.get_iterator('main') is iterator
    said = [str(w.message) for w in record if 'leave this updater' in str(w.message)]
    assert len(said) == warned
    if warned:
        assert type(iterator).__name__ in said[0]
        assert 'fastchain.data.MultiprocessIterator' in said[0]
        assert ('order_sampler' in said[0]) == isinstance(
            iterator, chainer.iterators.SerialIterator)
    if hasattr(iterator, 'finalize'):
        iterator.finalize()


def test_an_updater_built_before_workers_were_asked_for_is_named():
    # It kept its SerialIterator without a word while report() said the
    # loader was active (a review's trial).
    def build():
        return chainer.training.StandardUpdater(
            serial(Indexed(), 4), chainer.optimizers.SGD(0.1).setup(L.Classifier(L.Linear(3, 2))))

    def said(**options):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter('always')
            fastchain.enable(**options).disable()
        return [str(w.message) for w in record if 'when a StandardUpdater is built' in
                str(w.message)]
    other = chainer.training.StandardUpdater(     # iterators named otherwise: passed over
        {'train': serial(Indexed(), 4)},
        chainer.optimizers.SGD(0.1).setup(L.Classifier(L.Linear(3, 2))))
    own = chainer.training.StandardUpdater(       # an order of its own: the layer leaves it
        chainer.iterators.SerialIterator(Indexed(), 4, order_sampler=lambda o, p: o),
        chainer.optimizers.SGD(0.1).setup(L.Classifier(L.Linear(3, 2))))
    before = build()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter('always')
        fastchain.enable(loader_workers=2).disable()       # the script's own line
    assert [w.filename for w in record if 'StandardUpdater is built' in str(w.message)] \
        == [__file__]
    assert said(loader_workers=2) == [
        'fastchain: loader_workers acts when a StandardUpdater is built; an updater built '
        'before this enable() keeps its SerialIterator: nothing loads in worker processes '
        'for it. Call fastchain.enable() before building the updater']
    assert 'loader_workers and prefetch_to_device act' in \
        said(loader_workers=1, prefetch_to_device=True)[0]
    assert said() == []             # not asked for: the default loader is not named
    del before, other, own
    with fastchain.enable(loader_workers=2):
        under = build()             # taken by the loader: not named afterwards
    assert type(under.get_iterator('main')) is not chainer.iterators.SerialIterator
    assert said(loader_workers=2) == []
    under.get_iterator('main').finalize()


class _PythonNoisy(Indexed):
    """Draws from Python's ``random``, as an augmentation may."""

    def get_example(self, i):
        import random
        x, t = super().get_example(i)
        return x + numpy.float32(random.random()), t


@pytest.mark.parametrize('make, drew', [
    (Noisy, 'numpy.random'), (_PythonNoisy, "Python's random"), (Indexed, None)])
def test_a_dataset_that_draws_random_numbers_is_said_when_the_loader_takes_it(make, drew):
    """A new-user trial: a random crop and flip in get_example trained
    differently under enable() (loss 0.57 off at the first step), with
    nothing said at run time. The probe puts the generators back."""
    import random
    numpy.random.seed(3)
    random.seed(3)
    serial(make(), 4)       # what plain Chainer draws: its first order
    before = numpy.random.get_state()[1].copy(), random.getstate()
    numpy.random.seed(3)
    random.seed(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        main, _ = _main_iterator_under(make(), loader_workers=1, prefetch_to_device=False)
    said = [str(w.message) for w in caught if 'draw random numbers' in str(w.message)]
    if drew is None:
        assert said == []
    else:
        assert said == [data._group.DRAWS_RANDOM.format(drew)]
        assert 'loader_workers=0 keeps Chainer\'s iterator' in said[0]
    assert (numpy.random.get_state()[1] == before[0]).all() and random.getstate() == before[1]
    main.finalize()


def test_pythons_random_in_workers_is_seeded_per_example():
    """Each worker is a fork of the main process: unseeded, Python's
    ``random`` gave every worker the same numbers (two examples in a batch
    of 2 workers with one augmentation), and another for another worker
    count. Seeded per example, as NumPy's global RNG is: the same for any
    count, different from example to example."""
    def run(workers):
        numpy.random.seed(5)
        it = upgraded(_PythonNoisy(), 4, workers, False)
        try:
            return [[float(x[0]) - float(t) for x, t in it.next()] for _ in range(3)]
        finally:
            it.finalize()
    one = run(1)
    assert run(2) == one and run(3) == one
    drawn = [v for batch in one for v in batch]
    assert len(set(drawn)) == len(drawn)


def _plain_and_loaded(body, prefetch):
    """``body(optimizer)`` in plain Chainer and under the loader, from the
    same seed and model: ((its result, the weights after), the same under
    the loader)."""
    def run(options):
        numpy.random.seed(0)
        model = L.Classifier(L.Linear(3, N))
        opt = chainer.optimizers.SGD(0.1).setup(model)
        handle = None if options is None else fastchain.enable(**options)
        try:
            return body(opt), [p.array.copy() for p in model.params()]
        finally:
            if handle is not None:
                handle.disable()
    return run(None), run(dict(loader_workers=1, prefetch_to_device=prefetch))


def _saved(iterator):
    state = {}
    serializers.DictionarySerializer(state).save(iterator)
    return state


@pytest.mark.parametrize('prefetch', [False, True])
def test_the_scripts_own_iterator_follows_the_loaders(prefetch):
    # The loader takes the SerialIterator's place in the updater: the
    # script's object stopped moving, and Chainer's own idiom below looped
    # for ever (a new-user trial). It now reads as the updater's iterator.
    def body(opt):
        train_iter = chainer.iterators.SerialIterator(Indexed(), 4)
        updater = chainer.training.StandardUpdater(train_iter, opt)
        seen = []
        while train_iter.epoch < 2 and len(seen) < 100:
            updater.update()
            seen.append((train_iter.epoch, train_iter.epoch_detail,
                         train_iter.is_new_epoch, updater.epoch_detail))
        state = _saved(train_iter)
        following = isinstance(train_iter, chainer.iterators.SerialIterator)
        updater.finalize()
        return seen, state, following
    (plain, plain_weights), (got, weights) = _plain_and_loaded(body, prefetch)
    assert got[0] == plain[0] and len(plain[0]) == -(-2 * N // 4)
    for key in plain[1]:        # (and fastchain's own keys: its seed)
        numpy.testing.assert_array_equal(got[1][key], plain[1][key], err_msg=key)
    assert got[2]           # still a SerialIterator to the script
    numpy.testing.assert_array_equal(weights[0], plain_weights[0])


@pytest.mark.parametrize('prefetch', [False, True])
def test_writes_to_the_scripts_own_iterator_are_refused_where_chainer_or_the_loader_cannot(
        prefetch):
    # (a review: its read-only properties were written on the loader, which
    # broke its next batch or overwrote them; a new dataset or order sampler
    # was not seen, the batches went on from the old ones, silently)
    with fastchain.enable(loader_workers=1, prefetch_to_device=prefetch):
        train_iter = chainer.iterators.SerialIterator(Offset(), 4)
        updater = chainer.training.StandardUpdater(
            train_iter, chainer.optimizers.SGD(0.1).setup(L.Classifier(L.Linear(3, 2))))
    try:
        updater.update()
        for name in ('epoch', 'current_position', 'is_new_epoch', 'epoch_detail'):
            with pytest.raises(AttributeError, match="property '{}' of 'SerialIterator' "
                               'object has no setter'.format(name)):
                setattr(train_iter, name, 0)
        for name, value in (('dataset', Offset()), ('order_sampler', lambda o, p: o)):
            with pytest.raises(AttributeError, match="SerialIterator's {} cannot change while "
                               "fastchain's loader serves it.*loader_workers=0".format(name)):
                setattr(train_iter, name, value)
        train_iter.repeat_note = 'the script may keep its own attributes'
        updater.update()
        assert (train_iter.epoch, train_iter.current_position) == (0, 8)
        assert train_iter.repeat_note == 'the script may keep its own attributes'
    finally:
        updater.finalize()
    train_iter.dataset = Offset()          # handed back: its own again
    assert train_iter.next()


@pytest.mark.parametrize('prefetch', [False, True])
def test_the_scripts_own_iterator_outlives_the_run_and_copies_as_its_class(prefetch):
    """In plain Chainer a SerialIterator outlives ``trainer.run()`` (its
    finalize does nothing): a second trainer goes on with it. Under the
    loader that raised 'this DevicePrefetcher was finalized', and a pickle
    or deep copy of the script's object failed (a new-user trial). Both as
    plain Chainer: the same batches, weights and positions, bit for bit."""
    import copy
    import pickle

    def body(opt):
        it = chainer.iterators.SerialIterator(Indexed(), 5)
        copies = []

        def keep(made):
            assert type(made) is chainer.iterators.SerialIterator
            copies.append(_saved(made))

        def copy_it(trainer):       # during a run: the script's object follows
            keep(pickle.loads(pickle.dumps(it)))
            keep(copy.deepcopy(it))
        for iterations in (2, 6):       # across two epochs
            trainer = chainer.training.Trainer(
                chainer.training.StandardUpdater(it, opt), (iterations, 'iteration'))
            trainer.extend(copy_it, trigger=(1, 'iteration'))
            trainer.run()
            keep(it)
        copies.append({'batch': [int(t) for _, t in it.next()]})    # a loop of its own
        return copies
    plain, got = _plain_and_loaded(body, prefetch)
    assert len(got[0]) == len(plain[0]) == 2 * (2 + 6) + 3
    for mine, theirs in zip(got[0], plain[0]):
        for key in theirs:
            numpy.testing.assert_array_equal(mine[key], theirs[key], err_msg=key)
    for mine, theirs in zip(got[1], plain[1]):
        numpy.testing.assert_array_equal(mine, theirs)


def _same_updater_second_trainer(it, opt):
    updater = chainer.training.StandardUpdater(it, opt)
    for iterations in (2, 5):       # a run extended: the stop counts the updater's iterations
        chainer.training.Trainer(updater, (iterations, 'iteration')).run()


def _updates_by_hand_after_the_run(it, opt):
    updater = chainer.training.StandardUpdater(it, opt)
    chainer.training.Trainer(updater, (2, 'iteration')).run()
    for _ in range(3):
        updater.update()


def _the_script_finalizes_its_iterator(it, opt):
    updater = chainer.training.StandardUpdater(it, opt)
    updater.update()
    it.finalize()                   # (a SerialIterator's does nothing)
    for _ in range(3):
        updater.update()


def _two_updaters_share_it(it, opt):
    first = chainer.training.StandardUpdater(it, opt)
    second = chainer.training.StandardUpdater(it, opt)
    chainer.training.Trainer(first, (2, 'iteration')).run()
    for _ in range(3):
        second.update()


def _two_updaters_with_their_own_converters(it, opt):
    def doubled(batch, device=None):
        x, t = chainer.dataset.concat_examples(batch, device)
        return x * 2, t
    first = chainer.training.StandardUpdater(it, opt)
    second = chainer.training.StandardUpdater(it, opt, converter=doubled)
    for _ in range(3):
        first.update()
        second.update()
    first.finalize()


def _the_script_keeps_no_reference(it, opt):
    updater = chainer.training.StandardUpdater(
        chainer.iterators.SerialIterator(Indexed(), 4), opt)
    for iterations in (2, 5):
        chainer.training.Trainer(updater, (iterations, 'iteration')).run()
    return updater.get_iterator('main')


@pytest.mark.parametrize('prefetch', [False, True])
@pytest.mark.parametrize('case', [_same_updater_second_trainer, _updates_by_hand_after_the_run,
                                  _the_script_finalizes_its_iterator, _two_updaters_share_it,
                                  _two_updaters_with_their_own_converters,
                                  _the_script_keeps_no_reference],
                         ids=lambda case: case.__name__.strip('_'))
def test_an_updater_goes_on_after_its_loader_is_finalized(case, prefetch):
    """Each raised 'this MultiprocessIterator (DevicePrefetcher) was
    finalized' (a review): the updaters the loader served have the script's
    iterator back, where the training left it, and go on as plain Chainer's."""
    def body(opt):
        it = chainer.iterators.SerialIterator(Indexed(), 5)
        it = case(it, opt) or it
        assert type(it) is chainer.iterators.SerialIterator
        return _saved(it), numpy.random.rand()
    (plain, plain_weights), (got, weights) = _plain_and_loaded(body, prefetch)
    for key in plain[0]:
        numpy.testing.assert_array_equal(got[0][key], plain[0][key], err_msg=key)
    for mine, theirs in zip(weights, plain_weights):
        numpy.testing.assert_array_equal(mine, theirs)
    assert got[1] == plain[1]       # NumPy's global random state


class Offset(chainer.dataset.DatasetMixin):
    """Computes each example from its index (not in memory: the loader takes
    it): ``x[i] + i * 0.1`` runs in float64 for NumPy's int64 index, which
    Chainer's iterators pass, and in float32 for a Python int (NEP 50)."""

    def __init__(self):
        self.x = numpy.arange(N * 3, dtype=numpy.float32).reshape(N, 3) / 7

    def __len__(self):
        return N

    def get_example(self, i):
        return (self.x[i] + i * 0.1).astype(numpy.float32), numpy.int32(i % 2)


def noisy_script(converter, dataset, steps=9):
    """A plain script whose converter (if given) draws from NumPy's global
    RNG, as mixup or input noise does, beside the model's dropout."""
    numpy.random.seed(0)
    model = L.Classifier(Dropper())
    optimizer = chainer.optimizers.MomentumSGD(0.1).setup(model)
    kwargs = {} if converter is None else {'converter': converter}
    updater = chainer.training.StandardUpdater(
        chainer.iterators.SerialIterator(dataset, 5), optimizer, **kwargs)
    for _ in range(steps):
        updater.update()
    main = updater.get_iterator('main')
    updater.finalize()
    return main, {n: p.array.tobytes() for n, p in model.namedparams()}, numpy.random.rand()


def noise_converter(batch, device=None):
    x, t = chainer.dataset.concat_examples(batch, device)
    return x + numpy.random.normal(0, 0.1, x.shape).astype(x.dtype), t


@pytest.mark.parametrize('converter, ahead', [
    (noise_converter, False),       # the script's own: in the training loop
    (None, True),                   # Chainer's concat_examples: ahead
    (functools.partial(chainer.dataset.concat_examples, padding=0), True),
])
def test_the_scripts_converter_and_dataset_see_what_they_see_in_chainer(converter, ahead):
    # (a review: a converter drawing random numbers ran ahead on the prefetch
    # thread, between the model's dropout draws, 0.066 off after 13 steps,
    # not repeatable; a dataset computing with its index got a Python int
    # where Chainer passes NumPy's int64, 2.9e-6 off; nothing said)
    _, expected, rand = noisy_script(converter, Offset())
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with fastchain.enable(loader_workers=1, prefetch_to_device=True):
            main, params, rand_after = noisy_script(converter, Offset())
    assert isinstance(main, data.DevicePrefetcher) and main.convert_ahead is ahead
    assert params == expected and rand_after == rand


def test_a_known_converter_converts_ahead_under_the_training_threads_config():
    # chainer.config is per thread: set in the script's thread only, the
    # prefetch thread read the global value (Normalize: the compute dtype)
    images = [(numpy.full((3, 2, 2), i, numpy.uint8), numpy.int32(0)) for i in range(N)]
    it = data.DevicePrefetcher(data.MultiprocessIterator(images, 4, n_workers=1),
                               data.ImageConverter())
    try:
        with chainer.using_config('dtype', numpy.float64):
            it.reset()          # the thread starts again under this config
            dtypes = [it.converter(it.next())[0].dtype for _ in range(3)]
        assert dtypes == [numpy.float64] * 3
    finally:
        it.finalize()


def test_a_new_batch_size_or_dataset_length_mid_run_is_refused_naming_the_fix():
    # (a review: batch_size = 8 read back 8 and the batches stayed at 4)
    dataset = Offset()
    with fastchain.enable(loader_workers=1):
        model = L.Classifier(L.Linear(3, 2))
        updater = chainer.training.StandardUpdater(
            chainer.iterators.SerialIterator(dataset, 4),
            chainer.optimizers.SGD(0.1).setup(model))
    script_iterator = updater.get_iterator('main')
    try:
        updater.update()
        script_iterator.batch_size = 4          # the same: fine
        with pytest.raises(ValueError, match='batch_size 4, and cannot change it to 8.*'
                           'loader_workers=0'):
            script_iterator.batch_size = 8
        assert script_iterator.batch_size == 4
        dataset.x = numpy.zeros((N + 1, 3), numpy.float32)
        dataset.__class__ = type('Longer', (Offset,), {'__len__': lambda self: N + 1})
        with pytest.raises(ValueError, match='{} examples now.*made for {}'.format(N + 1, N)):
            for _ in range(3):      # (a batch fetched ahead before the change comes first)
                updater.update()
    finally:
        updater.finalize()


def test_only_converters_known_to_draw_nothing_are_run_ahead():
    from fastchain.data._group import converts_alike_ahead

    def jitter(x):      # a normalize of the script's own (a review: run ahead)
        return x + numpy.random.normal(0, 1, x.shape).astype(numpy.float32)
    concat = chainer.dataset.concat_examples
    assert converts_alike_ahead(concat)
    assert converts_alike_ahead(functools.partial(concat, padding=0))
    assert converts_alike_ahead(data.ImageConverter())
    assert converts_alike_ahead(data.ImageConverter(data.Normalize(mean=0.0, std=1.0)))
    assert not converts_alike_ahead(data.ImageConverter(jitter))
    assert not converts_alike_ahead(noise_converter)
    assert not converts_alike_ahead(chainer.dataset.converter()(noise_converter))
    assert not converts_alike_ahead(lambda batch, device=None: concat(batch, device))


class BadSeventh(Offset):
    def get_example(self, i):
        if i == 7:
            raise ValueError('bad example 7')
        return super().get_example(i)


class Flaky(Offset):
    """Index 7 fails on its first read (``always``: on every read); the
    count is shared with the workers."""

    def __init__(self, always):
        super().__init__()
        import multiprocessing
        self.always, self.failed = always, multiprocessing.Value('i', 0)

    def get_example(self, i):
        if i == 7 and (self.always or not self.failed.value):
            self.failed.value = 1
            raise IOError('cannot read example 7')
        return super().get_example(i)


def _goes_on_after_errors(always, **options):
    """A script that catches a dataset's error and goes on: what each update
    did, where the iterator stood, and the weights."""
    numpy.random.seed(0)
    with fastchain.enable(**options) if options else contextlib.nullcontext():
        model = L.Classifier(L.Linear(3, 2))
        it = chainer.iterators.SerialIterator(Flaky(always), 4, shuffle=False)
        updater = chainer.training.StandardUpdater(it, chainer.optimizers.SGD(0.1).setup(model))
    log = []
    try:
        for _ in range(2 * N // 4):
            try:
                updater.update()
                log.append((it.epoch, it.current_position))
            except (IOError, data.DataLoadError) as e:
                assert 'example 7' in str(e)
                log.append('error')
    finally:
        updater.finalize()
    return log, [p.array.tobytes() for p in model.params()]


@pytest.mark.parametrize('always', [False, True])
@pytest.mark.parametrize('prefetch', [False, True])
def test_after_a_bad_example_a_script_that_goes_on_trains_as_with_chainers_iterator(
        always, prefetch):
    # Chainer's SerialIterator stands past a batch that failed and goes on
    # with the next after a dataset's error a script catches. The loader
    # stopped: each later update said "the prefetch thread ended without a
    # batch or an error" (a review), then the loader stopped at the error
    # (with prefetch_to_device) or the script's iterator, handed back, read
    # the failed batch again, training otherwise, silently (a second review).
    expected = _goes_on_after_errors(always)
    assert expected[0].count('error') == (2 if always else 1)       # (N = 12: 2 epochs)
    assert _goes_on_after_errors(always, loader_workers=1,
                                 prefetch_to_device=prefetch) == expected


def test_a_prefetcher_of_the_scripts_own_says_the_loader_stopped_after_a_bad_example():
    # (not serving a script's iterator, it has nothing to hand back)
    it = data.DevicePrefetcher(data.MultiprocessIterator(BadSeventh(), 4, shuffle=False,
                                                         n_workers=1))
    try:
        it.next()
        with pytest.raises(data.DataLoadError, match='example 7: ValueError: bad example 7'):
            it.next()
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"stopped at the error above \(DataLoadError: "
                               r"example 7.*on_error='skip'.*loader_workers=0"):
                it.next()
    finally:
        it.finalize()
