"""The error of an example that cannot be loaded, and of arguments that
cannot make a loader."""


class DataLoadError(Exception):
    """An example could not be loaded.

    Attributes:
        index (int): the example's index in the dataset.
        path (str or None): its file, when the dataset has one.
    """

    def __init__(self, index, path, kind, message, detail=''):
        self.index = index
        self.path = path
        where = 'example {}'.format(index) + (' ({})'.format(path) if path else '')
        super().__init__('{}: {}: {}{}'.format(
            where, kind, message,
            ('\nIn the worker:\n' + detail) if detail else ''))


def _whole(value, low):
    import numpy
    return not isinstance(value, (bool, numpy.bool_)) and \
        isinstance(value, (int, numpy.integer)) and value >= low


def check_args(dataset, batch_size, n_workers, prefetch, on_error, timeout=None,
               seed=None, shared_memory=True):
    """Each argument by name (NumPy's integers taken as Chainer takes them);
    returns (batch_size, n_workers, prefetch) as ints."""
    if not _whole(batch_size, 1):
        raise ValueError('batch_size must be a positive int, got {!r}'.format(batch_size))
    if on_error not in ('raise', 'skip'):
        raise ValueError("on_error must be 'raise' or 'skip', got {!r}".format(on_error))
    if not _whole(n_workers, 0):
        raise ValueError('n_workers must be an int >= 0, got {!r}'.format(n_workers))
    if not _whole(prefetch, 1):
        raise ValueError('prefetch must be an int >= 1, got {!r}'.format(prefetch))
    import numbers
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(
            timeout, numbers.Real) or not timeout > 0):
        raise ValueError('timeout must be a number of seconds > 0 (or None: wait as long '
                         'as it takes), got {!r}'.format(timeout))
    if seed is not None and not _whole(seed, 0):
        raise ValueError('seed must be an int >= 0 (or None), got {!r}'.format(seed))
    if not isinstance(shared_memory, bool):
        raise ValueError('shared_memory must be True or False, got {!r}'.format(shared_memory))
    if len(dataset) == 0:
        raise ValueError('the dataset is empty')
    return int(batch_size), int(n_workers), int(prefetch)


# chainer.iterators.MultiprocessIterator's names for what this one calls otherwise
CHAINER_NAMES = {'n_processes': 'n_workers', 'n_prefetch': 'prefetch',
                 'shared_mem': 'shared_memory (True or False; its size is found from the '
                               'first example)',
                 'dataset_timeout': 'timeout', 'maxtasksperchild': None}


def chainer_names(given):
    """Chainer's keyword arguments given to fastchain's iterator: named, with
    fastchain's own (or that it has none)."""
    for name in given:
        if name in CHAINER_NAMES:
            ours = CHAINER_NAMES[name]
            raise TypeError('{!r} is chainer.iterators.MultiprocessIterator\'s argument; '
                            'fastchain.data.MultiprocessIterator {}'.format(
                                name, 'calls it ' + ours if ours else
                                'has no such setting (its workers live for the iterator)'))
    if given:
        raise TypeError('MultiprocessIterator() got unexpected keyword argument(s) {}'.format(
            ', '.join(sorted(given))))


class FixedBatchSize:
    """``batch_size`` of an iterator that lays out its batches ahead (the
    schedule, the workers' shared memory, the batches in flight): set once;
    another value later is refused, naming the fix. (Chainer's iterators
    take a new batch size at the next batch; the loader ignored it and read
    back the new value, a review found.)"""

    def __get__(self, iterator, owner=None):
        if iterator is None:
            return self
        try:
            return iterator.__dict__['_batch_size']
        except KeyError:        # (not set yet: hasattr() says no)
            raise AttributeError('batch_size') from None

    def __set__(self, iterator, value):
        old = iterator.__dict__.get('_batch_size')
        if old is not None and value != old:
            raise ValueError(
                "fastchain's loader lays out its batches ahead at batch_size {}, and cannot "
                'change it to {!r} mid-run. Fix: make a new iterator (and updater) with the '
                "new batch size, or use Chainer's SerialIterator, which takes a new one (under "
                'fastchain.enable(), loader_workers=0 keeps it)'.format(old, value))
        iterator.__dict__['_batch_size'] = value


def check_same_length(iterator, n):
    """The dataset still has the ``n`` examples the loader was made for."""
    if len(iterator.dataset) != n:
        raise ValueError(
            "the dataset has {} examples now, and fastchain's loader was made for {} (it "
            'lays out its epochs ahead, and its workers hold the dataset as it was when they '
            "started, as Chainer's MultiprocessIterator's do). Fix: make a new iterator (and "
            "updater) after changing the dataset, or use Chainer's SerialIterator, which "
            'follows it (under fastchain.enable(), loader_workers=0 keeps it)'.format(
                len(iterator.dataset), n))


def load_order(serializer, order):
    """``serializer('order', order)``: a snapshot's order of another length
    than this dataset's is named, with the likely cause (Chainer's message
    was NumPy's "could not broadcast input array from shape (48,) into shape
    (96,)"; a review)."""
    try:
        return serializer('order', order)
    except ValueError as e:
        if 'broadcast' not in str(e):
            raise
        raise ValueError(
            "this snapshot's iterator walks a dataset of another length than this one's {} "
            'examples ({}): it was written for another dataset, or by a data-parallel job of '
            'another number of ranks (each rank walks its own shard). Resume with the same '
            'dataset and number of processes'.format(len(order), e)) from None
