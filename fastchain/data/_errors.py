"""The error of an example that cannot be loaded."""


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
