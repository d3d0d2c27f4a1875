#!/usr/bin/env python
"""MNIST with fastchain, on one process or N: `mpiexec -n N python train_mnist.py`
(or `fastchain-run -n N train_mnist.py`). Compare with train_mnist_plain.py."""

import argparse


import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
from chainer.training import extensions

import fastchain
from fastchain import distributed
from mnist_data import load, positive


class MLP(chainer.Chain):
    def __init__(self, n_units, n_out):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(None, n_units)
            self.l2 = L.Linear(None, n_units)
            self.l3 = L.Linear(None, n_out)

    def forward(self, x):
        h1 = F.relu(self.l1(x))
        h2 = F.relu(self.l2(h1))
        return self.l3(h2)


LEARNERS = {           # blocks of 4 steps for the block learners
    'allreduce': lambda batch: 'allreduce',
    '1bit': lambda batch: distributed.QuantizedSGD(bits=1),
    'block_momentum': lambda batch: distributed.BlockMomentum(block_size=4 * batch),
    'model_averaging': lambda batch: distributed.ModelAveraging(block_size=4 * batch),
}


def main():
    parser = argparse.ArgumentParser(description='Chainer example: MNIST')
    parser.add_argument('--batchsize', '-b', type=positive, default=100)
    parser.add_argument('--epoch', '-e', type=positive, default=20)
    parser.add_argument('--out', '-o', default='result')
    parser.add_argument('--unit', '-u', type=positive, default=1000)
    parser.add_argument('--data', default='digits',
                        help="'digits' (they ship with scikit-learn), a folder of "
                        "MNIST's four files, or an .npz (see mnist_data.py)")
    parser.add_argument('--resume', '-r', default=None, help='a snapshot to resume from')
    parser.add_argument('--learner', default='allreduce', choices=sorted(LEARNERS),
                        help='how the ranks combine their work (README: Learners)')
    parser.add_argument('--distributed-after', type=int, default=0, metavar='SAMPLES',
                        help='warm start: average exactly for the first SAMPLES samples')
    args = parser.parse_args()

    comm = distributed.create_communicator()                        # 1
    device = comm.device()                                          # 2
    device.use()
    fastchain.enable()                          # the one line: what helps on this device

    model = L.Classifier(MLP(args.unit, 10))
    model.to_device(device)
    optimizer = distributed.create_multi_node_optimizer(            # 3
        chainer.optimizers.Adam(), comm, learner=LEARNERS[args.learner](args.batchsize),
        distributed_after=args.distributed_after)
    optimizer.setup(model)

    train, test = load(args.data) if comm.rank == 0 else (None, None)
    train = distributed.scatter_dataset(train, comm, shuffle=True)  # 4
    test = distributed.scatter_dataset(test, comm)
    train_iter = chainer.iterators.SerialIterator(train, args.batchsize)
    test_iter = chainer.iterators.SerialIterator(test, args.batchsize,
                                                 repeat=False, shuffle=False)
    updater = training.StandardUpdater(train_iter, optimizer, device=device)
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), out=args.out)
    evaluator = extensions.Evaluator(test_iter, model, device=device)
    evaluator = distributed.create_multi_node_evaluator(evaluator, comm)  # 5
    trainer.extend(evaluator)

    trainer.extend(distributed.multi_node_snapshot(comm, extensions.snapshot()),
                   trigger=(args.epoch, 'epoch'))     # every rank's part, one file
    if comm.rank == 0:                                              # 6
        trainer.extend(extensions.LogReport())
        trainer.extend(extensions.PrintReport(
            ['epoch', 'main/loss', 'validation/main/loss',
             'main/accuracy', 'validation/main/accuracy', 'elapsed_time']))
        trainer.extend(extensions.ProgressBar())
    if args.resume:
        chainer.serializers.load_npz(args.resume, trainer)

    trainer.run()                                                   # 7: mpiexec -n N
    if comm.rank == 0:
        print('learner:', distributed.learner_of(optimizer).report())


if __name__ == '__main__':
    main()
