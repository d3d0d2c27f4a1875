"""``scatter_dataset`` from the root only: how each rank gets its shard.

- ``examples``: an in-memory dataset; the root indexes each rank's examples
  and sends them (a list on that rank).
- ``transform``: a TransformDataset over an in-memory dataset; the root sends
  each rank its examples of the base and the transform, which runs on that
  rank, drawing its augmentations there, anew each epoch.
- ``whole``: any other dataset (files decoded in ``get_example``); pickled
  once and sent to every rank, as ChainerMN does; each rank reads its own.

A dataset or transform that does not pickle falls back to ``examples``, said
on the root: the other ranks' augmentations are then drawn once, there. A
rank that cannot unpickle what it got is named on every rank (no rank is left
waiting for it).
"""

import pickle
import warnings

import chainer


def send(dataset, comm, root, order, per_rank):
    mode = blob = None
    if comm.rank == root:
        mode, blob = _plan(dataset, root)
    mode = comm.bcast_obj(mode, root=root, what='scatter_dataset (how to send)')
    start = comm.rank * per_rank
    if mode == 'whole':
        blob = comm.bcast_obj(blob, root=root, what='scatter_dataset (the dataset)')
        whole = dataset if comm.rank == root else _agreed(comm, root, blob)
        if comm.rank == root:
            _agreed(comm, root, None)
        return chainer.datasets.SubDataset(whole, start, start + per_rank, order=order)
    transform = None
    if mode == 'transform':
        blob = comm.bcast_obj(blob, root=root, what='scatter_dataset (the transform)')
        transform = dataset._transform if comm.rank == root else _agreed(comm, root, blob)
        if comm.rank == root:
            _agreed(comm, root, None)
    if comm.rank == root:
        base = dataset._dataset if mode == 'transform' else dataset
        for r in range(comm.size):
            if r != root:
                # indexed with NumPy's ints, as the root's SubDataset and Chainer index
                shard = [base[i] for i in order[r * per_rank:(r + 1) * per_rank]]
                comm.send_obj(shard, r, what='scatter_dataset (shard to rank {})'.format(r))
        return chainer.datasets.SubDataset(dataset, start, start + per_rank, order=order)
    shard = comm.recv_obj(root, what='scatter_dataset (shard from rank {})'.format(root))
    return chainer.datasets.TransformDataset(shard, transform) if mode == 'transform' \
        else shard


def _plan(dataset, root):
    """(mode, pickled bytes or None), decided on the root."""
    from fastchain.data._group import in_memory
    if in_memory(dataset):
        return 'examples', None
    what = dataset
    mode = 'whole'
    if type(dataset) is chainer.datasets.TransformDataset and in_memory(dataset._dataset):
        what, mode = dataset._transform, 'transform'
    try:
        return mode, pickle.dumps(what, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:      # noqa: BLE001 - any pickling failure, said
        from fastchain.config._warning import FastchainWarning
        thing = ("the transform of rank {}'s TransformDataset" if mode == 'transform' else
                 "rank {}'s " + type(dataset).__name__).format(root)
        warnings.warn(
            "scatter_dataset: {} cannot be pickled ({}: {}), so rank {} reads every rank's "
            "examples and sends them: the other ranks' augmentations are drawn once, there, "
            'and kept every epoch. Fix: a {} that pickles (a function defined at a '
            "module's top level, or a class; not a lambda or a closure), or build the dataset "
            'on every rank and pass it on every rank'.format(
                thing, type(e).__name__, e, root,
                'transform' if mode == 'transform' else 'dataset'),
            FastchainWarning, stacklevel=4)
        return 'examples', None


def _agreed(comm, root, blob):
    """The object in ``blob`` (None on the root), once every rank has said
    whether it could unpickle its copy."""
    value = why = None
    if blob is not None:
        try:
            value = pickle.loads(blob)
        except Exception as e:      # noqa: BLE001 - named on every rank below
            why = '{}: {}'.format(type(e).__name__, e)
    failed = [(r, w) for r, w in enumerate(comm.allgather_obj(
        why, what='scatter_dataset (unpickled?)')) if w is not None]
    if failed:
        raise ValueError(
            "scatter_dataset: rank {} could not unpickle rank {}'s dataset ({}). Every rank "
            'needs the classes and functions it is made of importable (not defined in an '
            "interactive session); or build the dataset on every rank and pass it on every "
            'rank'.format(failed[0][0], root, failed[0][1]))
    return value
