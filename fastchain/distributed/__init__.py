"""Data-parallel training over MPI processes (ChainerMN's model, with
DDP-style overlap of the gradient allreduce with backward).

The seven changes of a ChainerMN script, in fastchain form::

    comm = distributed.create_communicator()            # 1. a communicator
    device = comm.device(); device.use()                # 2. GPU by local rank
    optimizer = distributed.create_multi_node_optimizer(  # 3. average gradients
        chainer.optimizers.MomentumSGD(), comm).setup(model)
    train = distributed.scatter_dataset(train, comm, shuffle=True)   # 4. shards
    evaluator = distributed.create_multi_node_evaluator(             # 5. mean metrics
        extensions.Evaluator(test_iter, model), comm)
    if comm.rank == 0: trainer.extend(extensions.LogReport())        # 6. rank 0 reports
    $ mpiexec -n 4 python train.py    (or: fastchain-run -n 4 train.py)  # 7. launch

Beyond the exact mean gradient every step, a learner (one argument of
``create_multi_node_optimizer``) sends fewer bytes or synchronises less
often: ``learner=distributed.QuantizedSGD(bits=1)`` (1-bit SGD with error
feedback), ``distributed.BlockMomentum(block_size)`` (BMUF),
``distributed.ModelAveraging(block_size)``; ``distributed_after=N`` is a
warm start (see ``_learners``).
"""

from fastchain.distributed._base import CollectiveTimeout, CommunicatorBase
from fastchain.distributed._dataset import scatter_dataset
from fastchain.distributed._evaluator import create_multi_node_evaluator
from fastchain.distributed._factory import create_communicator
from fastchain.distributed._mpi import MpiCommunicator
from fastchain.distributed._blocks import BlockMomentum, ModelAveraging
from fastchain.distributed._learners import AllReduce, Learner
from fastchain.distributed._quantize import QuantizedSGD
from fastchain.distributed._optimizer import create_multi_node_optimizer, learner_of
from fastchain.distributed._snapshot import multi_node_snapshot
from fastchain.distributed._sync import GradientSync
from fastchain.distributed._updater import DataParallelUpdater

__all__ = ['AllReduce', 'BlockMomentum', 'CollectiveTimeout', 'CommunicatorBase',
           'DataParallelUpdater', 'GradientSync', 'Learner', 'ModelAveraging',
           'MpiCommunicator', 'QuantizedSGD', 'create_communicator',
           'create_multi_node_evaluator', 'create_multi_node_optimizer', 'learner_of',
           'multi_node_snapshot', 'scatter_dataset']
