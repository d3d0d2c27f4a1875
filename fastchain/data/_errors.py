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


def check_args(dataset, batch_size, n_workers, prefetch, on_error):
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) \
            or batch_size < 1:
        raise ValueError('batch_size must be a positive int, got {!r}'.format(batch_size))
    if on_error not in ('raise', 'skip'):
        raise ValueError("on_error must be 'raise' or 'skip', got {!r}".format(on_error))
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 0:
        raise ValueError('n_workers must be an int >= 0, got {!r}'.format(n_workers))
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError('prefetch must be an int >= 1, got {!r}'.format(prefetch))
    if len(dataset) == 0:
        raise ValueError('the dataset is empty')
