"""What the MPI scenario scripts (dp_script.py, learners_script.py) share;
they run as scripts, with this folder on sys.path."""

import warnings

import numpy

import chainer
import chainer.functions as F

import fastchain


def data(n=64, seed=0):
    """A learnable toy task: 6 features, 3 classes."""
    rng = numpy.random.RandomState(seed)
    x = rng.randn(n, 6).astype(numpy.float32)
    t = (x[:, 0] + x[:, 1] > 0).astype(numpy.int32) + (x[:, 2] > 1).astype(numpy.int32)
    return chainer.datasets.TupleDataset(x, t)


class Poison(chainer.FunctionNode):
    """Identity whose backward yields NaN on the rank told to (``bad``)."""

    def __init__(self, bad):
        self.bad = bad

    def forward(self, inputs):
        return inputs[0].copy(),

    def backward(self, indexes, grads):
        return grads[0] * (grads[0].dtype.type('nan') if self.bad else 1),


def enable_fp16():
    """``fastchain.enable(fp16=True)`` on the CPU, its warnings (fp16 is slow
    here) silenced; returns the handle."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return fastchain.enable(fp16=True, loader_workers=0)


def poison_mlp(net, rank, bad_rank=1, bad_step=2):
    """Make ``net`` (an MLP with l1, l2, l3) yield a NaN gradient on
    ``bad_rank`` at ``bad_step``; returns the dict whose ``'k'`` the caller
    sets to the step it runs."""
    step = {'k': 0}

    def forward(x):
        h, = Poison(rank == bad_rank and step['k'] == bad_step).apply((net.l1(x),))
        return net.l3(F.relu(net.l2(F.relu(h))))
    net.forward = forward
    return step
