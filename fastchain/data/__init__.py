"""The input pipeline: image datasets on real files, uint8 augmentation, a
multiprocess prefetching iterator and device prefetch.

A typical training input::

    from fastchain import data
    train = data.ImageListDataset('train.txt', root, transform=data.RandomResizedCrop(224))
    it = data.create_iterator(train, batch_size=32)             # workers = cores
    it = data.DevicePrefetcher(it, data.ImageConverter(), device)
    updater = StandardUpdater(it, optimizer, converter=it.converter, device=device)

``fastchain.enable()`` does the last three lines for a plain script whose
StandardUpdater gets a SerialIterator (option ``loader_workers``), with
``rng='global'``: the SerialIterator's batches, in its order, drawn at the
same points of NumPy's global RNG stream.
"""

from fastchain.data._demo import CLASSES as DEMO_CLASSES, make_demo_dataset
from fastchain.data._images import (ImageDecodeError, ImageFolderDataset,
                                    ImageListDataset)
from fastchain.data._errors import DataLoadError
from fastchain.data._iterator import MultiprocessIterator, available_cores
from fastchain.data._pool import WorkerDiedError
from fastchain.data._prefetch import DevicePrefetcher, ImageConverter, PreparedBatch
from fastchain.data._transforms import (CenterCrop, Normalize, RandomCrop,
                                        RandomResizedCrop)


def create_iterator(dataset, batch_size, n_workers=None, **kwargs):
    """A :class:`MultiprocessIterator` with the given workers (default: the
    cores available). All other keywords are MultiprocessIterator's."""
    return MultiprocessIterator(dataset, batch_size, n_workers=n_workers, **kwargs)


__all__ = ['CenterCrop', 'DEMO_CLASSES', 'DataLoadError', 'DevicePrefetcher', 'ImageConverter',
           'ImageDecodeError', 'ImageFolderDataset', 'ImageListDataset',
           'MultiprocessIterator', 'Normalize', 'PreparedBatch', 'RandomCrop',
           'RandomResizedCrop', 'WorkerDiedError', 'available_cores', 'make_demo_dataset',
           'create_iterator']
