"""Run under mpiexec by test_data_parallel.py: each rank trains every case of
a JSON file on its half of each combined batch, data-parallel with fastchain,
and saves its final weights to OUT/rank<r>.npz (case<i>/<param>)."""

import json
import sys
import warnings

import numpy

import chainer
import chainer.functions as F

import fastchain
from fastchain import distributed

from tests.differential.models import batches, build, make_optimizer

CASES, OUT = sys.argv[1], sys.argv[2]
comm = distributed.create_communicator('mpi')
results = {}
for i, case in enumerate(json.load(open(CASES))):
    spec = dict(case['model'], input=tuple(case['model']['input']),
                layers=tuple(tuple(layer) for layer in case['model']['layers']))
    half = spec['input'][0]
    combined = dict(spec, input=(2 * half,) + spec['input'][1:])
    data = batches(combined, case['steps'], seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        handle = fastchain.enable(loader_workers=0, **case['options'])
        numpy.random.seed(1234)
        model = build(spec)
        optimizer, hooks = make_optimizer(tuple(case['optimizer']), case['hooks'])
        distributed.create_multi_node_optimizer(optimizer, comm).setup(model)
        for hook in hooks:
            optimizer.add_hook(hook)
        for batch in data:
            mine = tuple(a[comm.rank * half:(comm.rank + 1) * half] for a in batch)

            def lossfun(*arrays):
                x = chainer.Variable(arrays[0])
                return F.softmax_cross_entropy(model(x, *arrays[1:-1]), arrays[-1])
            optimizer.update(lossfun, *mine)
        handle.disable()
    for name, p in model.namedparams():
        results['case{}{}'.format(i, name)] = p.array
numpy.savez(OUT + '/rank{}.npz'.format(comm.rank), **results)
