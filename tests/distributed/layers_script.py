"""Run under mpiexec by test_layers_mpi.py: what an enabled handle's disable
does to a data-parallel optimizer set up while it was enabled.

Each rank's model is one weight w = 0 and the loss is ``g * w`` with
``g = -(rank + 1) * 2`` (rank 0: -2, rank 1: -4), so one SGD step of lr 1 gives
w = -g: 2 and 4 without averaging, 3 on every rank with it.
"""

import sys
import warnings

import numpy

import chainer

import fastchain
from fastchain.config import FastchainWarning
from fastchain import distributed

SCENARIO, OUT = sys.argv[1], sys.argv[2]
comm = distributed.create_communicator('mpi')


class One(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.w = chainer.Parameter(numpy.zeros(1, numpy.float32))

    def forward(self, g):
        return chainer.functions.sum(self.w * g)


g = numpy.full(1, -2.0 * (comm.rank + 1), numpy.float32)
model = One()
with warnings.catch_warnings():
    warnings.simplefilter('ignore', FastchainWarning)
    handle = fastchain.enable(nvtx=True, loader_workers=0)
# Made data-parallel and set up while the handle is enabled.
optimizer = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(lr=1.0), comm)
optimizer.setup(model)
if SCENARIO == 'disable_first':
    handle.disable()            # before any step
    optimizer.update(model, g)
else:                           # 'step_then_disable'
    optimizer.update(model, g)
    handle.disable()
    optimizer.update(model, g)
w = float(model.w.array[0])
expected = 3.0 if SCENARIO == 'disable_first' else 6.0
if w != expected:
    raise SystemExit('rank {}: w = {} after the disable, expected {} (averaged over ranks)'
                     .format(comm.rank, w, expected))
open('{}/ok.{}'.format(OUT, comm.rank), 'w').close()
