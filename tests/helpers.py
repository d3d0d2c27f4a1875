"""Models and training helpers shared by the kernel and static-graph tests."""

import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from fastchain.kernels import _bind


class ConvZoo(chainer.Chain):
    """Every convolution setting the binder plans for, and two it leaves alone."""

    def __init__(self, dtype=numpy.float32):
        super().__init__()
        init = chainer.initializers.Normal(0.1, dtype=dtype)
        with self.init_scope():
            self.c7 = L.Convolution2D(3, 6, 7, stride=2, pad=3, initialW=init,
                                      initial_bias=init)
            self.c1 = L.Convolution2D(6, 8, 1, nobias=True, initialW=init)
            self.c1s = L.Convolution2D(8, 8, 1, stride=2, nobias=True, initialW=init)
            self.c3 = L.Convolution2D(8, 8, 3, pad=1, initialW=init, initial_bias=init)
            self.rect = L.Convolution2D(8, 6, (3, 2), stride=(2, 1), pad=(1, 0),
                                        initialW=init, initial_bias=init)
            self.dil = L.Convolution2D(6, 6, 3, pad=(2, 1), dilate=(2, 1), nobias=True,
                                       initialW=init)
            self.grouped = L.Convolution2D(6, 6, 3, pad=1, groups=2, initialW=init,
                                           initial_bias=init)
            self.cover_W = chainer.Parameter(init, (4, 6, 2, 2))

    def forward(self, x):
        h = F.relu(self.c7(x))
        h = F.relu(self.c1(h))
        h = self.c3(self.c1s(h)) + h[:, :, ::2, ::2]
        h = self.dil(F.relu(self.rect(h)))
        h = F.convolution_2d(self.grouped(h), self.cover_W, stride=2, cover_all=True)
        return F.sum(h, axis=(2, 3))


def copies(make, n=2):
    """n models with the same parameters and statistics."""
    numpy.random.seed(0)
    first = make()
    models = [first]
    for _ in range(n - 1):
        m = make()
        m.copyparams(first)
        for a, b in zip(first.links(), m.links()):
            if isinstance(a, L.BatchNormalization):
                b.avg_mean[...] = a.avg_mean
                b.avg_var[...] = a.avg_var
        models.append(m)
    return models


def schedules(model):
    """Every schedule a cached model has built: forward, then its backward."""
    for forwards in model.schedule_manager.schedules.values():
        for forward in forwards:
            yield forward
            yield forward.backward_schedule_func


def bound_entries(model):
    return [i.func for schedule in schedules(model) for i in schedule.schedule_info_list
            if isinstance(i.func, _bind._Lazy)]


def train(model, optimizer, x, t):
    model.cleargrads()
    loss = F.softmax_cross_entropy(model(x), t)
    loss.backward()
    optimizer.update()
