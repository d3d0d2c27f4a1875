"""Each rank's share of a dataset: disjoint and of equal size."""

import operator
import warnings

import numpy

import chainer


def scatter_dataset(dataset, comm, shuffle=False, seed=None, root=0):
    """This rank's shard of ``dataset``.

    Two ways to call it:

    - every rank built the same dataset: only indices are decided (by
      ``root``, which draws the order when ``shuffle``); nothing is sent;
    - only ``root`` has it (ChainerMN's way: load on rank 0, pass ``None``
      elsewhere): ``root`` sends each rank its examples.

    Shards are disjoint and of equal size, so every rank runs the same number
    of iterations per epoch (unless a loader with ``on_error='skip'`` leaves
    out a whole batch on one rank: its epoch then ends a batch earlier); the
    ``len % size`` examples left over are dropped (with a warning).
    """
    try:
        rank = operator.index(root)
    except TypeError:
        rank = -1
    if not 0 <= rank < comm.size:
        raise ValueError('scatter_dataset: root={!r} is not a rank of this job (0 to {}): '
                         'give the rank that has the dataset'.format(root, comm.size - 1))
    root = rank
    have = comm.allgather_obj(dataset is not None, what='scatter_dataset (who has data)')
    if not have[root]:
        raise ValueError('scatter_dataset: rank {} (the root) has no dataset'.format(root))
    everywhere = all(have)
    if not everywhere and any(h for r, h in enumerate(have) if r != root):
        raise ValueError('scatter_dataset: give the dataset on every rank, or on the '
                         'root only (None elsewhere); ranks {} have one'.format(
                             [r for r, h in enumerate(have) if h]))
    n = comm.bcast_obj(len(dataset) if comm.rank == root else None, root=root,
                       what='scatter_dataset (dataset length)')
    if everywhere and len(dataset) != n:
        raise ValueError('rank {} has a dataset of {} examples but rank {} has {}: every '
                         'rank must build the same dataset'.format(comm.rank, len(dataset),
                                                                  root, n))
    per_rank = n // comm.size
    if per_rank == 0:
        raise ValueError('a dataset of {} examples cannot give each of {} ranks one'
                         .format(n, comm.size))
    dropped = n - per_rank * comm.size
    if dropped and comm.rank == root:
        from fastchain.config._warning import FastchainWarning
        warnings.warn('scatter_dataset: {} of {} examples are left out so that the {} '
                      'shards have equal size'.format(dropped, n, comm.size), FastchainWarning,
                      stacklevel=2)
    if shuffle:
        seed = numpy.random.randint(2 ** 31) if seed is None else seed
        seed = comm.bcast_obj(seed, root=root, what='scatter_dataset (seed)')
        order = numpy.random.RandomState(seed).permutation(n)
    else:
        order = numpy.arange(n)
    if everywhere:
        start = comm.rank * per_rank
        return chainer.datasets.SubDataset(dataset, start, start + per_rank, order=order)
    if comm.rank == root:
        for r in range(comm.size):
            if r != root:
                # indexed with NumPy's ints, as the root's SubDataset and Chainer index
                shard = [dataset[i] for i in order[r * per_rank:(r + 1) * per_rank]]
                comm.send_obj(shard, r, what='scatter_dataset (shard to rank {})'.format(r))
        start = root * per_rank
        return chainer.datasets.SubDataset(dataset, start, start + per_rank, order=order)
    return comm.recv_obj(root, what='scatter_dataset (shard from rank {})'.format(root))
