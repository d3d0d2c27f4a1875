"""``scatter_dataset`` from the root only: how each rank gets its shard.

- ``examples``: an in-memory dataset; the root indexes each rank's examples
  and sends them (a list on that rank).
- ``transform``: a TransformDataset over an in-memory dataset; the root sends
  each rank its examples of the base and the transform, which runs on that
  rank, drawing its augmentations there, anew each epoch. A transform that
  does not pickle falls back to ``examples`` (the base is in memory, so that
  is cheap), said on the root: the other ranks' augmentations are then drawn
  once, there.
- ``whole``: any other dataset (files decoded in ``get_example``); pickled
  once and sent to every rank, as ChainerMN does; each rank reads its own.
  One that does not pickle is refused on every rank: the root reading every
  rank's files first would take as long as an epoch, with the others waiting.

Every failure is known to every rank before any returns: what the root
could not pickle (refused in the mode it broadcasts), an example it could
not read (sent in a shard's place), what a rank could not unpickle (an
allgather of the outcome at the end).
"""

import pickle
import warnings

import chainer


class _Failed:
    """Sent in a shard's place: the root could not make it."""

    def __init__(self, why):
        self.why = why


def send(dataset, comm, root, order, per_rank):
    plan = _plan(dataset, root) if comm.rank == root else None
    mode, said = comm.bcast_obj(plan[:2] if plan else None, root=root,
                                what='scatter_dataset (how to send)')
    if mode == 'refused':
        raise ValueError(said)
    start = comm.rank * per_rank
    value = None        # what the root pickled, on the other ranks
    if mode in ('whole', 'transform'):
        blob = comm.bcast_obj(plan[2] if plan else None, root=root,
                              what='scatter_dataset (the {})'.format(
                                  'dataset' if mode == 'whole' else 'transform'))
        why = None
        if comm.rank != root:
            try:
                value = pickle.loads(blob)
            except Exception as e:      # noqa: BLE001 - named on every rank below
                why = '{}: {}'.format(type(e).__name__, e)
        _all_fine(comm, why, "could not unpickle rank {}'s {}".format(
            root, 'dataset' if mode == 'whole' else 'transform'))
        if mode == 'whole':
            whole = dataset if comm.rank == root else value
            return chainer.datasets.SubDataset(whole, start, start + per_rank, order=order)
    why = None
    if comm.rank == root:
        base = dataset._dataset if mode == 'transform' else dataset
        failed = None
        for r in range(comm.size):
            if r == root:
                continue
            shard = failed
            if failed is None:
                try:
                    # indexed with NumPy's ints, as the root's SubDataset and Chainer index
                    shard = [base[i] for i in order[r * per_rank:(r + 1) * per_rank]]
                except Exception as e:      # noqa: BLE001 - sent to every rank as the error
                    shard = failed = _Failed('rank {} could not read an example of rank {}\'s '
                                             'shard: {}: {}'.format(root, r, type(e).__name__,
                                                                    e))
            comm.send_obj(shard, r, what='scatter_dataset (shard to rank {})'.format(r))
        why = failed.why if failed is not None else None
        mine = chainer.datasets.SubDataset(dataset, start, start + per_rank, order=order)
    else:
        try:
            shard = comm.recv_obj(root, what='scatter_dataset (shard from rank {})'.format(root))
            why = shard.why if isinstance(shard, _Failed) else None
        except Exception as e:      # noqa: BLE001 - a shard that does not unpickle here
            why = "rank {} could not unpickle its shard: {}: {}".format(
                comm.rank, type(e).__name__, e)
        if why is None:
            mine = chainer.datasets.TransformDataset(shard, value) \
                if mode == 'transform' else shard
    _all_fine(comm, why, None)
    if said and comm.rank == root:      # after the last collective: -W error strands no rank
        from fastchain.config._warning import FastchainWarning
        warnings.warn(said, FastchainWarning, stacklevel=3)
    return mine


def _all_fine(comm, why, what):
    """Raise on every rank the first failure any rank had."""
    failed = [(r, w) for r, w in enumerate(comm.allgather_obj(
        why, what='scatter_dataset (every rank has its shard?)')) if w is not None]
    if failed:
        r, w = failed[0]
        raise ValueError(
            'scatter_dataset: {}. Every rank needs the classes and functions the dataset is '
            'made of importable (not defined in an interactive session), and the root its '
            'examples readable; or build the dataset on every rank and pass it on every '
            'rank'.format('rank {} {} ({})'.format(r, what, w) if what else w))


def _plan(dataset, root):
    """(mode, what to say, pickled bytes or None), decided on the root."""
    from fastchain.data._group import in_memory
    if in_memory(dataset):
        return 'examples', None, None
    transform = type(dataset) is chainer.datasets.TransformDataset and \
        in_memory(dataset._dataset)
    try:
        return ('transform' if transform else 'whole'), None, pickle.dumps(
            dataset._transform if transform else dataset, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:      # noqa: BLE001 - any pickling failure, said
        why = '{}: {}'.format(type(e).__name__, e)
    fix = ("a module's top level, or a class; not a lambda or a closure), or build the dataset "
           'on every rank and pass it on every rank')
    if transform:
        return 'examples', (
            "scatter_dataset: the transform of rank {}'s TransformDataset cannot be pickled "
            "({}), so rank {} ran it on every rank's examples and sent them: the other ranks' "
            'augmentations were drawn once, there, and are kept every epoch. Fix: a transform '
            'that pickles (a function defined at {}'.format(root, why, root, fix)), None
    return 'refused', (
        "scatter_dataset: rank {}'s {} is not in memory, so it is sent whole and every rank "
        'reads its own examples, but it cannot be pickled ({}); the root reading every rank\'s '
        'examples instead would take an epoch\'s time while the others wait. Fix: a dataset '
        "that pickles (its transform a function defined at {}".format(
            root, type(dataset).__name__, why, fix)), None
