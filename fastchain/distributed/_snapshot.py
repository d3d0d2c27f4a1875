"""A snapshot that holds every rank's own state: its learner's, its
iterators' places and orders, its models' persistent values
(:mod:`fastchain.distributed._rank_state`).

Chainer's snapshot extension runs on rank 0 (the ``if comm.rank == 0``
of a data-parallel script) and writes what rank 0 has. That is the whole
training state when the ranks are identical (the exact allreduce), but the
quantized learner's residuals and a block-momentum block's local models
differ from rank to rank. Added on every rank, :func:`multi_node_snapshot`
gathers them (one collective at each snapshot) and rank 0 writes one file
that holds them all; ``load_npz(path, trainer)`` on every rank then gives
each rank its own part back.
"""

import chainer
from chainer.training import extension

from fastchain.distributed import _rank_state
from fastchain.distributed._held import HeldLayer


def _ranks_first(next_, trainer, serializer, *args, **kwargs):
    """Loading a trainer with a multi-node snapshot: the number of ranks the
    snapshot holds is checked before Chainer restores anything, and each
    rank's own state goes over rank 0's once Chainer has restored that.
    Chainer restores the updater's iterators first, and another number of
    ranks failed there, on an order of another shard's length ("could not
    broadcast input array from shape (748,) into shape (1497,)"). Applied
    here, not when the run starts: an extension whose trigger has finished
    (a ManualScheduleTrigger past its last point) is not initialized."""
    if not isinstance(serializer, chainer.serializer.Deserializer):
        return next_(trainer, serializer, *args, **kwargs)
    sections = serializer['extensions']
    ours = [(name, entry.extension) for name, entry in list(trainer._extensions.items())
            if isinstance(entry.extension, _MultiNodeSnapshot)]
    for name, made in ours:
        _rank_state.check_ranks(sections[name], made.comm)
    result = next_(trainer, serializer, *args, **kwargs)
    held = False
    for name, made in ours:
        state = _rank_state.read(sections[name], made.comm, trainer)
        if state is not None:
            _rank_state.apply(state, trainer)
            held = True
    if ours and not held:   # (one said, not each: the file is written by one of them)
        _rank_state.say_rank0_only(ours[0][1].comm)
    return result


def multi_node_snapshot(comm, snapshot=None, **kwargs):
    """Wrap Chainer's snapshot extension so that the snapshot rank 0 writes
    holds every rank's learner state. Add it on **every** rank, with the
    trigger you would give the snapshot::

        trainer.extend(distributed.multi_node_snapshot(comm, extensions.snapshot()),
                       trigger=(1, 'epoch'))

    Args:
        comm: the communicator of the data-parallel optimizers.
        snapshot: a snapshot extension (default: ``extensions.snapshot(**kwargs)``).
    """
    if snapshot is None:
        from chainer.training import extensions
        snapshot = extensions.snapshot(**kwargs)
    elif kwargs:
        raise TypeError('give either a snapshot extension or its keyword arguments, '
                        'not both')
    if getattr(snapshot, 'autoload', False):
        raise ValueError(
            'multi_node_snapshot: autoload=True would load the newest snapshot on rank 0 '
            'only (rank 0 writes it); make the snapshot without autoload and load it on '
            'every rank: chainer.serializers.load_npz(path, trainer)')
    made = _MultiNodeSnapshot(comm, snapshot)
    _ranks_first_layer.acquire(made)     # Trainer.serialize's, while it lives
    return made


class _MultiNodeSnapshot(extension.Extension):

    def __init__(self, comm, snapshot):
        self.comm = comm
        self.snapshot = snapshot
        self.trigger = getattr(snapshot, 'trigger', (1, 'epoch'))
        self.priority = getattr(snapshot, 'priority', extension.PRIORITY_READER)
        self.name = 'multi_node_' + getattr(snapshot, 'default_name',
                                             type(snapshot).__name__)
        self._gathered = None

    def initialize(self, trainer):
        if self.comm.rank == 0 and hasattr(self.snapshot, 'initialize'):
            self.snapshot.initialize(trainer)

    def __call__(self, trainer):
        from fastchain.config import _patches
        from fastchain.distributed._optimizer import LEARNER
        for optimizer in trainer.updater.get_all_optimizers().values():
            learner = _patches.attached(optimizer, LEARNER)
            if learner is not None:
                learner.gather_for_snapshot()
        self._gathered = _rank_state.gather(self.comm, trainer)
        try:
            if self.comm.rank == 0:
                self.snapshot(trainer)
        finally:
            self._gathered = None

    def serialize(self, serializer):
        """Every rank's iterators and persistent values (gathered just
        before rank 0 writes); on load, each rank takes its own, read and
        applied by the trainer's load (:func:`_ranks_first`), which has the
        trainer to apply it to."""
        if not isinstance(serializer, chainer.serializer.Deserializer) and \
                self._gathered is not None:
            _rank_state.save(serializer, self._gathered)

    def on_error(self, trainer, exc, tb):
        if self.comm.rank == 0 and hasattr(self.snapshot, 'on_error'):
            self.snapshot.on_error(trainer, exc, tb)

    def finalize(self):
        if self.comm.rank == 0 and hasattr(self.snapshot, 'finalize'):
            self.snapshot.finalize()


_ranks_first_layer = HeldLayer('serialize', _ranks_first)
