"""StandardUpdater for data-parallel training."""

import chainer
from chainer.training import updaters

from fastchain.distributed._optimizer import communicator_of, create_multi_node_optimizer


class DataParallelUpdater(updaters.StandardUpdater):
    """A StandardUpdater whose optimizer averages gradients over ``comm``.

    Each rank feeds its own shard (:func:`scatter_dataset`) at the same
    batch size; the update is the same on every rank, so the models stay
    identical. Keyword arguments are StandardUpdater's, plus
    ``bucket_cap_mb``, ``fp16_allreduce``, ``learner`` and
    ``distributed_after`` (see :func:`create_multi_node_optimizer`).
    """

    def __init__(self, iterator, optimizer, comm, bucket_cap_mb=25,
                 fp16_allreduce=False, learner=None, distributed_after=0, **kwargs):
        device = kwargs.get('device')
        target = getattr(optimizer, 'target', None)
        if device is not None and target is not None:
            # before the parameters are broadcast: NCCL's collectives take
            # the device's arrays (StandardUpdater would move them after)
            target.to_device(chainer.get_device(device))
        if communicator_of(optimizer) is None:
            create_multi_node_optimizer(optimizer, comm, bucket_cap_mb, fp16_allreduce,
                                        learner=learner, distributed_after=distributed_after)
        elif communicator_of(optimizer) is not comm:
            raise ValueError('the optimizer is data-parallel over another communicator')
        self.comm = comm
        super().__init__(iterator, optimizer, **kwargs)
