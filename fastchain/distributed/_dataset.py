"""Each rank's share of a dataset: disjoint and of equal size."""

import warnings

import numpy

import chainer


def scatter_dataset(dataset, comm, shuffle=False, seed=None):
    """This rank's shard of ``dataset``.

    Every rank builds the same dataset (as every rank runs the same script);
    only indices are exchanged: rank 0 draws the order (``shuffle``) and
    broadcasts its seed. Shards are disjoint and of equal size, so every rank
    runs the same number of iterations per epoch; the ``len % size`` examples
    left over are dropped (with a warning).
    """
    n = len(dataset)
    if comm.bcast_obj(n, what='scatter_dataset (dataset length)') != n:
        raise ValueError('rank {} has a dataset of {} examples but rank 0 has another '
                         'length: every rank must build the same dataset'.format(comm.rank, n))
    per_rank = n // comm.size
    if per_rank == 0:
        raise ValueError('a dataset of {} examples cannot give each of {} ranks one'
                         .format(n, comm.size))
    dropped = n - per_rank * comm.size
    if dropped and comm.rank == 0:
        warnings.warn('scatter_dataset: {} of {} examples are left out so that the {} '
                      'shards have equal size'.format(dropped, n, comm.size))
    if shuffle:
        seed = numpy.random.randint(2 ** 31) if seed is None else seed
        seed = comm.bcast_obj(seed, what='scatter_dataset (seed)')
        order = numpy.random.RandomState(seed).permutation(n)
    else:
        order = numpy.arange(n)
    start = comm.rank * per_rank
    return chainer.datasets.SubDataset(dataset, start, start + per_rank, order=order)
