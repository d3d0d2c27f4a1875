#!/usr/bin/env python
"""A plain Chainer MNIST training script (one process), for comparison with
train_mnist.py, its fastchain data-parallel form."""

import argparse


import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
from chainer.training import extensions

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


def main():
    parser = argparse.ArgumentParser(description='Chainer example: MNIST')
    parser.add_argument('--batchsize', '-b', type=positive, default=100)
    parser.add_argument('--epoch', '-e', type=positive, default=20)
    parser.add_argument('--device', '-d', default='@numpy')
    parser.add_argument('--out', '-o', default='result')
    parser.add_argument('--unit', '-u', type=positive, default=1000)
    parser.add_argument('--data', default='digits',
                        help="'digits' (they ship with scikit-learn), a folder of "
                        "MNIST's four files, or an .npz (see mnist_data.py)")
    args = parser.parse_args()

    device = chainer.get_device(args.device)
    device.use()

    model = L.Classifier(MLP(args.unit, 10))
    model.to_device(device)
    optimizer = chainer.optimizers.Adam()
    optimizer.setup(model)

    train, test = load(args.data)
    train_iter = chainer.iterators.SerialIterator(train, args.batchsize)
    test_iter = chainer.iterators.SerialIterator(test, args.batchsize,
                                                 repeat=False, shuffle=False)
    updater = training.StandardUpdater(train_iter, optimizer, device=device)
    trainer = training.Trainer(updater, (args.epoch, 'epoch'), out=args.out)
    evaluator = extensions.Evaluator(test_iter, model, device=device)
    trainer.extend(evaluator)

    trainer.extend(extensions.snapshot(), trigger=(args.epoch, 'epoch'))
    trainer.extend(extensions.LogReport())
    trainer.extend(extensions.PrintReport(
        ['epoch', 'main/loss', 'validation/main/loss',
         'main/accuracy', 'validation/main/accuracy', 'elapsed_time']))
    trainer.extend(extensions.ProgressBar())

    trainer.run()


if __name__ == '__main__':
    main()
