"""Each rank's share of a dataset: disjoint and of equal size."""

import hashlib
import operator
import warnings

import numpy

import chainer


def scatter_dataset(dataset, comm, *positional, shuffle=False, seed=None, root=0):
    """This rank's shard of ``dataset``.

    Two ways to call it:

    - every rank built the same dataset: only indices are decided (by
      ``root``, which draws the order when ``shuffle``); nothing is sent.
      The copies are compared by what they are made of, without reading an
      example (a SubDataset's order and range, a few rows of each array,
      a few entries of each list of files or examples): copies that differ,
      such as a random split drawn without a seed on each rank, are refused
      on every rank;
    - only ``root`` has it (ChainerMN's way: load on rank 0, pass ``None``
      elsewhere): an in-memory dataset (arrays, lists, a TupleDataset or
      DictDataset of them) sends each rank its examples, and so does a
      TransformDataset over one (its transform sent along, run on each
      rank); any other dataset is sent whole, pickled, as ChainerMN does.
      Either way every rank draws its own augmentations each epoch (its
      files must be readable on every rank's node). A transform that does
      not pickle, over data in memory, falls back to the root running it
      and sending the results, with a warning (their augmentations are then
      drawn once); any other dataset that does not pickle is refused on
      every rank.

    Shards are disjoint and of equal size, so every rank runs the same number
    of iterations per epoch (unless a loader with ``on_error='skip'`` leaves
    out a whole batch on one rank: its epoch then ends a batch earlier); the
    ``len % size`` examples left over are dropped (with a warning).

    ``shuffle``, ``seed`` and ``root`` are given by name (ChainerMN's order,
    ``root, shuffle, seed``, differs: by position they would be misread).
    """
    if positional:
        raise TypeError(
            'scatter_dataset(dataset, comm, {}): give shuffle, seed and root by name, e.g. '
            'scatter_dataset(dataset, comm, shuffle=True, seed=0, root=0) (ChainerMN took '
            'them in the order root, shuffle, seed)'.format(
                ', '.join(repr(p) for p in positional)))
    try:
        rank = operator.index(root)
    except TypeError:
        rank = -1
    if not 0 <= rank < comm.size:
        raise ValueError('scatter_dataset: root={!r} is not a rank of this job (0 to {}): '
                         'give the rank that has the dataset'.format(root, comm.size - 1))
    root = rank
    lengths = comm.allgather_obj(None if dataset is None else len(dataset),
                                 what='scatter_dataset (who has data)')
    n = lengths[root]
    if n is None:
        raise ValueError('scatter_dataset: rank {} (the root) has no dataset'.format(root))
    everywhere = None not in lengths
    if not everywhere and any(h is not None for r, h in enumerate(lengths) if r != root):
        raise ValueError('scatter_dataset: give the dataset on every rank, or on the '
                         'root only (None elsewhere); ranks {} have one'.format(
                             [r for r, h in enumerate(lengths) if h is not None]))
    if everywhere and len(set(lengths)) > 1:
        raise ValueError('scatter_dataset: the ranks have datasets of {} examples: every rank '
                         'must build the same dataset (or pass it on rank {} only and None '
                         'elsewhere)'.format(lengths, root))
    per_rank = n // comm.size
    if per_rank == 0:
        raise ValueError('a dataset of {} examples cannot give each of {} ranks one'
                         .format(n, comm.size))
    if everywhere and comm.size > 1:
        _check_same(dataset, comm, root)
    if shuffle:
        seed = numpy.random.randint(2 ** 31) if seed is None else seed
        seed = comm.bcast_obj(seed, root=root, what='scatter_dataset (seed)')
        order = numpy.random.RandomState(seed).permutation(n)
    else:
        order = numpy.arange(n)
    start = comm.rank * per_rank
    if everywhere or comm.size == 1:
        shard = chainer.datasets.SubDataset(dataset, start, start + per_rank, order=order)
    else:
        from fastchain.distributed._sending import send
        shard = send(dataset, comm, root, order, per_rank)
    dropped = n - per_rank * comm.size
    if dropped and comm.rank == root:   # after the last collective: -W error strands no rank
        from fastchain.config._warning import FastchainWarning
        warnings.warn('scatter_dataset: {} of {} examples are left out so that the {} '
                      'shards have equal size'.format(dropped, n, comm.size), FastchainWarning,
                      stacklevel=2)
    return shard


def _check_same(dataset, comm, root):
    """Refuse, on every rank, copies that differ from the root's (by their
    digests: nothing is read, so no example fails and no generator moves)."""
    prints = comm.allgather_obj(_digest(dataset), what='scatter_dataset (same dataset?)')
    if prints[root] is None:
        return          # nothing on the root that can be told (a dataset of its own kind)
    differ = [r for r, p in enumerate(prints) if p is not None and p != prints[root]]
    if differ:
        raise ValueError(
            "scatter_dataset: every rank passed a dataset, but rank{} {}'s differ{} from rank "
            "{}'s: the ranks' shards would overlap and miss examples. Fix: build the same "
            'dataset on every rank (a random split with a fixed seed: '
            'chainer.datasets.split_dataset_random(data, n, seed=0)), or build it on rank {} '
            'only and pass None on the others'.format(
                's' if len(differ) > 1 else '', ', '.join(map(str, differ)),
                '' if len(differ) > 1 else 's', root, root))


def _digest(dataset):
    """What ``dataset`` is made of, as a digest, or None when nothing in it
    can be told (only Chainer's and fastchain's dataset classes are looked
    into: a class of the script's own may hold what differs between ranks
    by design, a rank number, a generator)."""
    h = hashlib.sha256()
    try:
        told = _walk(h, dataset, 0)
    except Exception:       # noqa: BLE001 - a digest that cannot be made checks nothing
        return None
    return h.hexdigest() if told else None


def _walk(h, d, depth):
    from chainer import datasets
    from fastchain.data._images import _ImageDataset
    if depth > 8:
        return False
    kind = type(d)
    h.update(b'<' + kind.__qualname__.encode() + b'>')
    if kind is datasets.SubDataset:
        h.update('{} {}'.format(d._start, d._finish).encode())
        _value(h, d._order)
        _walk(h, d._dataset, depth + 1)
        return True     # its order and range are told, whatever it holds
    if kind in (datasets.TupleDataset, datasets.ConcatenatedDataset):
        return any([_walk(h, x, depth + 1) for x in d._datasets])
    if kind is datasets.DictDataset:
        return any([_walk(h, d._datasets[k], depth + 1) for k in sorted(d._datasets)])
    if kind is datasets.TransformDataset:
        return _walk(h, d._dataset, depth + 1)
    # files by their paths under the dataset's folder, not the folder itself:
    # the same files staged to another place on another node are the same
    if kind in (datasets.LabeledImageDataset, datasets.ImageDataset):
        return _walk(h, d._pairs if kind is datasets.LabeledImageDataset else d._paths, depth)
    if isinstance(d, _ImageDataset):
        return _walk(h, _relative(d._entries), depth)
    if kind in (numpy.ndarray, list, tuple):
        n = len(d)
        h.update('{} {}'.format(n, getattr(d, 'shape', '')).encode())
        for i in sorted({0, n // 2, n - 1} if n else ()):
            _value(h, d[i])
        return True
    return False


def _relative(entries):
    """The sampled ``(path, label)`` entries, their paths relative to the
    folder the samples share."""
    import os
    n = len(entries)
    picked = [entries[i] for i in sorted({0, n // 2, n - 1} if n else ())]
    paths = [e[0] if isinstance(e, tuple) else e for e in picked]
    if not all(isinstance(p, str) for p in paths):
        return picked
    top = os.path.dirname(os.path.commonpath(paths)) if len(set(paths)) == 1 \
        else os.path.commonpath(paths)
    return [(os.path.relpath(p, top),) + tuple(e[1:]) if isinstance(e, tuple)
            else os.path.relpath(p, top) for p, e in zip(paths, picked)]


def _value(h, x):
    """A digest of a value that is the same in every process: arrays by
    dtype, shape and bytes (objects element by element), containers item by
    item, a set in sorted order."""
    if isinstance(x, (numpy.ndarray, numpy.generic)):
        a = numpy.asarray(x)
        h.update('a{}{}'.format(a.dtype.str, a.shape).encode())
        if a.dtype.hasobject:
            for item in a.ravel().tolist():
                _value(h, item)
        else:
            h.update(numpy.ascontiguousarray(a).tobytes())
    elif isinstance(x, (tuple, list)):
        h.update('{}{}('.format(type(x).__name__, len(x)).encode())
        for item in x:
            _value(h, item)
    elif isinstance(x, dict):
        h.update('d{}('.format(len(x)).encode())
        for key in sorted(x, key=repr):
            h.update(repr(key).encode())
            _value(h, x[key])
    elif isinstance(x, (set, frozenset)):
        h.update('s{}('.format(len(x)).encode())
        for item in sorted(repr(i) for i in x):
            h.update(item.encode())
    elif x is None or isinstance(x, (str, bytes, int, float, complex)):
        h.update(repr(x).encode())
    else:       # an object of its own kind: only its class is compared
        h.update(type(x).__qualname__.encode())
