"""Models and training helpers shared by the kernel, static-graph and loader
tests, and process checks shared by the tests that start process groups."""

import contextlib
import os
import time
import warnings

import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from fastchain.distributed import CommunicatorBase
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
        for (_, a), (_, b) in zip(persistents(first), persistents(m)):
            if isinstance(a, numpy.ndarray):
                b[...] = a
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


def persistents(model):
    """[(path, value)] of every persistent value of every link in ``model``."""
    return [(path.rstrip('/') + '/' + name, link.__dict__[name])
            for path, link in model.namedlinks() for name in sorted(link._persistent)]


def side_by_side(ordinary, cached, batches, step=None, lr=0.05):
    """Train ``ordinary`` (define-by-run) and ``cached`` on the same batches
    with MomentumSGD and assert, after each step, that the losses, gradients,
    parameters, persistent values and NumPy's random state are exactly equal.
    ``step(model, *batch)`` returns the loss variable (default: softmax cross
    entropy). Returns the messages of the fallback warnings."""
    import warnings
    from fastchain.static import StaticGraphFallback
    step = step or (lambda model, x, t: F.softmax_cross_entropy(model(x), t))
    optimizers = [chainer.optimizers.MomentumSGD(lr).setup(m) for m in (ordinary, cached)]
    caught = []
    for i, batch in enumerate(batches):
        seen = []
        for model, optimizer in zip((ordinary, cached), optimizers):
            numpy.random.seed(i)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter('always')
                optimizer.update(lambda *b: step(model, *b), *batch)
            caught += [str(m.message) for m in w if m.category is StaticGraphFallback]
            seen.append(numpy.random.get_state()[1].copy())
        numpy.testing.assert_array_equal(seen[1], seen[0], err_msg='random state')
        assert_same(ordinary, cached, 'step {}'.format(i))
    return caught


def assert_same(ordinary, cached, where=''):
    """Gradients, parameters and persistent values exactly equal."""
    for (name, p), (_, q) in zip(sorted(ordinary.namedparams()),
                                 sorted(cached.namedparams())):
        numpy.testing.assert_array_equal(q.grad, p.grad, err_msg='grad {} {}'.format(
            name, where))
        numpy.testing.assert_array_equal(q.array, p.array, err_msg='{} {}'.format(name, where))
    for (name, a), (_, b) in zip(persistents(ordinary), persistents(cached)):
        numpy.testing.assert_array_equal(b, a, err_msg='{} {}'.format(name, where))


def pretend_installed(monkeypatch, installed):
    """``importlib.metadata.version`` answers as if only ``installed``
    ({distribution: version}) were installed."""
    import importlib.metadata

    def version(name):
        if name in installed:
            return installed[name]
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, 'version', version)


class Indexed(chainer.dataset.DatasetMixin):
    """Deterministic: example i is (an array of i, i), 12 of them."""

    def __len__(self):
        return 12

    def get_example(self, i):
        return numpy.full(3, i, numpy.float32), numpy.int32(i)


class Noisy(Indexed):
    """Draws from NumPy's global RNG, as an augmentation does."""

    def get_example(self, i):
        x, t = super().get_example(i)
        return x + numpy.random.rand(3).astype(numpy.float32), t


class OneRank(CommunicatorBase):
    """A data-parallel communicator of one process (no MPI): the optimizer's
    layers are real, the averaging is the identity."""

    name = 'one'

    def __init__(self):
        self.rank, self.size, self.intra_rank, self.intra_size = 0, 1, 0, 1
        self.timeout = 10.0

    def allgather_obj(self, obj, what=''):
        return [obj]

    def any(self, flag, what=''):
        return bool(flag)

    def bcast(self, array, root=0, what=''):
        return array

    def allreduce_start(self, array, what):
        return None

    def allreduce_wait(self, handle):
        pass

    def allgather(self, array, what=''):
        return array[None].copy()

    def device(self):
        return chainer.get_device('@numpy')


def alive(pid):
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:        # a zombie still answers kill(0): ask /proc whether it runs
        with open('/proc/{}/stat'.format(pid)) as f:
            return f.read().split(')')[-1].split()[0] != 'Z'
    except OSError:
        return True


def gone(pid, seconds=10):
    """Whether ``pid`` stops running within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def train_classifier(dataset, steps, batch_size, shuffle, optimizer, options, init=None):
    """``steps`` updates of ``L.Classifier(L.Linear(3, 12))`` on ``dataset``
    (a SerialIterator, NumPy seeded 0 first), under ``fastchain.enable(
    **options)`` unless ``options`` is empty; ``init(model)`` may set its
    weights. Returns the loader's draw warnings as (step, message), step -1
    while the updater is made, and the parameters."""
    import fastchain
    numpy.random.seed(0)
    model = L.Classifier(L.Linear(3, 12))
    if init is not None:
        init(model)
    optimizer = optimizer.setup(model)
    said = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with fastchain.enable(**options) if options else contextlib.nullcontext():
            updater = chainer.training.StandardUpdater(
                chainer.iterators.SerialIterator(dataset, batch_size, shuffle=shuffle), optimizer)

        def note(step):
            said.extend((step, str(w.message)) for w in caught
                        if 'draw random numbers' in str(w.message))
            del caught[:]
        note(-1)
        try:
            for step in range(steps):
                updater.update()
                note(step)
        finally:
            updater.finalize()
    return said, [p.array.copy() for p in model.params()]

