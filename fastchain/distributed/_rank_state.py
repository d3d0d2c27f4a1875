"""What a rank holds of its own besides the learner: the iterators' places
and orders, and the models' persistent values (BatchNormalization's running
statistics, which each rank computes from its own batches).

Chainer's snapshot on rank 0 holds rank 0's, and every rank loaded them: a
rank whose iterator shuffles with a seed of its own walked its shard in rank
0's order after a resume (some examples twice, some not at all within the
epoch), and each rank's statistics became rank 0's (a new-user trial: the
weights 2.7e-2 of the largest off 7 steps after the resume; rank 1's
``avg_mean`` 0.19 off, the validation loss changed). :func:`gather` collects
them at each snapshot into rank 0's file; :func:`restore` gives each rank its
own back when the file is loaded.
"""

import numpy

import chainer
from chainer import backend


def _host(value):
    if isinstance(value, chainer.get_array_types()):
        return backend.CpuDevice().send(value)
    return numpy.asarray(value)


def local(trainer):
    """This rank's own state: {key: host array}."""
    from chainer.serializers import DictionarySerializer
    state = {}
    for name, iterator in _iterators(trainer):
        saved = {}
        iterator.serialize(DictionarySerializer(saved))
        for key, value in saved.items():
            if value is not None:
                state['iterators/{}/{}'.format(name, key)] = _host(value)
    for key, link, name in _persistents(trainer):
        value = link.__dict__.get(name)
        if value is not None:
            state[key] = _host(value)
    return state


def _iterators(trainer):
    """The updater's iterators by name (Chainer's StandardUpdater keeps them
    in ``_iterators``; it has no public way to list them)."""
    return sorted(getattr(trainer.updater, '_iterators', {}).items())


def _persistents(trainer):
    for oname, optimizer in sorted(trainer.updater.get_all_optimizers().items()):
        target = getattr(optimizer, 'target', None)
        if target is None:
            continue
        for path, link in target.namedlinks():
            for name in sorted(link._persistent):
                yield 'persistents/{}{}/{}'.format(oname, path.rstrip('/'), name), link, name


def gather(comm, trainer):
    """Collective: every rank's :func:`local` state, on rank 0 (None elsewhere)."""
    mine = local(trainer)
    if comm.rank != 0:
        comm.send_obj(mine, 0, what="snapshot: sending rank 0 this rank's iterators and "
                      'statistics')
        return None
    return [mine] + [comm.recv_obj(r, what="snapshot: rank {}'s iterators and statistics"
                                   .format(r)) for r in range(1, comm.size)]


def save(serializer, states):
    serializer('ranks_saved', len(states))
    for rank, state in enumerate(states):
        sub = serializer['rank{}'.format(rank)]
        for key in sorted(state):
            sub(key, state[key])


def check_ranks(serializer, comm):
    """Loading: the number of ranks whose state the snapshot holds (None:
    it holds none), refused unless it is this job's."""
    try:
        saved = int(serializer('ranks_saved', 0))
    except (KeyError, ValueError):      # npz, HDF5: not there (a non-strict load: 0)
        return None
    if not saved:
        return None
    if saved != comm.size:
        raise ValueError('this snapshot holds the iterators and statistics of {} ranks, and '
                         'this job has {}: resume it with mpiexec -n {}'.format(
                             saved, comm.size, saved))
    return saved


def read(serializer, comm, trainer):
    """Loading: this rank's own state from the snapshot, or None where it
    holds none (written before, by rank 0's snapshot alone, or on an error:
    rank 0's stays, as before; :func:`say_rank0_only`). Where the
    deserializer does not list its keys, those ``trainer``'s state has now
    are read."""
    if check_ranks(serializer, comm) is None:
        return None
    sub = serializer['rank{}'.format(comm.rank)]
    keys = saved_keys(sub)
    if keys is None:
        keys = sorted(local(trainer))
    state = {}
    for key in keys:
        try:
            state[key] = numpy.asarray(sub(key, None))
        except (KeyError, ValueError):      # not saved (None then, or not there yet)
            pass
    return state


def say_rank0_only(comm):
    """On rank 0 of a job of several ranks: the snapshot loaded holds rank 0's
    state only."""
    if comm.size < 2 or comm.rank != 0:
        return
    import warnings
    from fastchain.config import _patches
    from fastchain.config._warning import FastchainWarning
    warnings.warn(
        "fastchain: this snapshot holds rank 0's iterators and statistics only (written on "
        "an error, by snapshot_on_error, when the other ranks could not send theirs; or "
        "written without distributed.multi_node_snapshot): every rank resumes with rank 0's "
        "iterator order and BatchNormalization statistics, so the run does not continue "
        "identically. Resume from a snapshot multi_node_snapshot wrote at its trigger",
        FastchainWarning, stacklevel=_patches.user_stacklevel())


def saved_keys(sub):
    """The keys saved under the deserializer section ``sub`` (an npz file's,
    a dict's or an HDF5 group's), or None where it does not show them."""
    group = getattr(sub, 'group', None)
    if group is not None and hasattr(group, 'visititems'):      # h5py: '/' makes groups
        keys = []
        group.visititems(lambda name, obj: keys.append(name) if hasattr(obj, 'dtype')
                         else None)
        return sorted(keys)
    npz, path = getattr(sub, 'npz', None), getattr(sub, 'path', None)
    if npz is None or path is None:
        return None
    names = npz.files if hasattr(npz, 'files') else list(npz)
    return sorted(k[len(path):] for k in names if k.startswith(path))


def apply(state, trainer):
    """This rank's own ``state`` (:func:`read`) over rank 0's, which the
    trainer loaded: before its first update."""
    from chainer.serializers import NpzDeserializer
    for name, iterator in _iterators(trainer):
        prefix = 'iterators/{}/'.format(name)
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if own:
            iterator.serialize(NpzDeserializer(own))
    for key, link, name in _persistents(trainer):
        if key not in state:
            continue
        value, current = state[key], link.__dict__.get(name)
        if isinstance(current, chainer.get_array_types()):
            current[...] = backend.get_device_from_array(current).send(value)
        elif current is None or numpy.ndim(value):
            link.__dict__[name] = value
        else:
            link.__dict__[name] = type(current)(value.item())
