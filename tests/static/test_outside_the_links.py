"""What a cached forward reads from outside its links' attributes, or from
their arrays changed in place between calls: each of these trained
differently from plain Chainer without a word in a new-user trial (session
31). Python's ``random`` module and a module-level generator drawn from in
the forward (stochastic depth, input noise); an entry of ``chainer.config``
that is not Chainer's, branched on; a mask the training loop prunes in
place and a 0-d persistent ``load_npz`` copies a value into, read in Python;
and a batch shape new on every step (the cost, not the result). Each trains
exactly as plain Chainer, the model cached where it can be, a fallback named
where it cannot."""

import io
import random
import warnings
import weakref

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from fastchain.static import StaticGraphFallback, cache_state, cache_static_graph
from fastchain.static import _cache

from tests.helpers import assert_same, copies

pytestmark = pytest.mark.usefixtures('fresh_fixes')

NOISE = numpy.random.default_rng(0)     # a module-level generator


def _depth_draw():
    rng = numpy.random.RandomState(0)       # a closure's generator

    def draw(self):
        return rng.rand()
    return draw


class Net(chainer.Chain):
    DEPTH = numpy.random.RandomState(0)     # a class attribute's
    closure_depth = _depth_draw()

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        with self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.l2 = L.Linear(4, 4)
            self.l3 = L.Linear(4, 3)
        self.mask = numpy.ones(4, bool)
        self.masks = {'l1': numpy.ones(4, bool)}
        self.add_persistent('temperature', numpy.array(1.0, numpy.float32))

    def forward(self, x):
        h = F.relu(self.l1(x))
        kind = self.kind
        if kind == 'stochastic depth' and random.random() < 0.9:
            h = h + F.relu(self.l2(h))
        elif kind == 'class generator' and self.DEPTH.rand() < 0.9:
            h = h + F.relu(self.l2(h))
        elif kind == 'closure generator' and self.closure_depth() < 0.9:
            h = h + F.relu(self.l2(h))
        elif kind == 'module generator':
            h = h + NOISE.normal(0, 0.1, h.shape).astype(numpy.float32)
        elif kind == 'user config' and getattr(chainer.config, 'use_aux', False):
            h = h + F.tanh(self.l2(h))
        elif kind == 'mask':
            h = h * self.mask.astype(numpy.float32)
        elif kind == 'mask in a dict':
            h = h * self.masks['l1'].astype(numpy.float32)
        elif kind == 'temperature':
            h = h / float(self.temperature)
        return self.l3(h)


def _train(models, steps, between=None, shape=lambda i: 4):
    """Both models on the same batches, each step seeded alike (NumPy's and
    Python's random); ``between(i, model)`` runs before step i's update of
    each. Returns the fallback warnings' messages."""
    rng = numpy.random.RandomState(0)
    optimizers = [chainer.optimizers.MomentumSGD(0.1).setup(m) for m in models]
    caught = []
    for i in range(steps):
        n = shape(i)
        x, t = rng.rand(n, 3).astype(numpy.float32), rng.randint(0, 3, n).astype(numpy.int32)
        for model, optimizer in zip(models, optimizers):
            numpy.random.seed(i)
            random.seed(i)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter('always')
                with chainer.using_config('use_aux', i >= 5):
                    if between is not None:
                        between(i, model)
                    optimizer.update(lambda: F.softmax_cross_entropy(model(x), t))
            caught += [str(m.message) for m in w if m.category is StaticGraphFallback]
        assert_same(models[0], models[1], 'step {}'.format(i))
        assert random.getstate() is not None
    return caught


@pytest.mark.parametrize('kind, named', [
    ('stochastic depth', "Python's random module"),
    ('module generator', __name__ + '.NOISE'),
    # stochastic depth from NumPy's generators the class reaches: 2 of 6 seeds
    # trained differently without a word before they were looked at
    ('class generator', 'Net.DEPTH (a class attribute)'),
    ('closure generator', 'a closure of Net.closure_depth')])
def test_a_draw_outside_the_links_falls_back_naming_the_generator(kind, named):
    ordinary, cached = copies(lambda: Net(kind))
    cache_static_graph(cached)
    draws = []

    def between(i, model):
        global NOISE
        NOISE = numpy.random.default_rng(i)     # the same draws for both models
        Net.DEPTH.seed(i)
        Net.closure_depth.__closure__[0].cell_contents.seed(i)
        draws.append(random.random())
    caught = _train((ordinary, cached), 8, between)
    assert len(caught) == 1 and named in caught[0], caught
    assert 'draws random numbers from' in caught[0]
    assert cache_state(cached)['cause'] == 'not static'
    # the recording's and the reference run's draws were put back: the
    # script's own draws after each step are plain Chainer's
    assert draws[0::2] == draws[1::2]


def test_a_users_config_entry_is_in_the_key():
    ordinary, cached = copies(lambda: Net('user config'))
    cache_static_graph(cached)
    assert _train((ordinary, cached), 9) == []
    assert cache_state(cached)['fallback'] is None
    assert len(cache_state(cached)['sequences']) == 2       # one per value of use_aux


@pytest.mark.parametrize('kind', ['mask', 'mask in a dict', 'temperature'])
def test_an_array_changed_in_place_between_calls_is_a_new_state(kind):
    ordinary, cached = copies(lambda: Net(kind))
    cache_static_graph(cached)
    snapshot = io.BytesIO()
    changed = Net(kind)
    changed.temperature[...] = 2.5
    chainer.serializers.save_npz(snapshot, changed)

    def between(i, model):
        if i == 5 and kind == 'mask':
            model.mask[:2] = False          # pruned in place
        if i == 5 and kind == 'mask in a dict':
            model.masks['l1'][:2] = False
        if i == 5 and kind == 'temperature':
            snapshot.seek(0)
            params = {n: p.array.copy() for n, p in model.namedparams()}
            chainer.serializers.load_npz(snapshot, model)   # copies into the 0-d array
            for n, p in model.namedparams():
                p.array[...] = params[n]
    assert _train((ordinary, cached), 9, between) == []
    assert cache_state(cached)['fallback'] is None
    assert sum(cache_state(cached)['verified'].values()) > 2   # the new state verified too


def test_a_shape_new_on_every_step_falls_back_past_the_keys_it_keeps():
    ordinary, cached = copies(lambda: Net('plain'))
    cache_static_graph(cached)
    caught = _train((ordinary, cached), _cache.MAX_KEYS + 3, shape=lambda i: 2 + i)
    assert len(caught) == 1, caught
    assert 'more than {} different keys ({} input shapes'.format(
        _cache.MAX_KEYS, _cache.MAX_KEYS + 1) in caught[0]
    assert 'Bucket the inputs into a few shapes' in caught[0]
    assert cache_state(cached)['fallback'] is not None


class DictOut(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 3)

    def forward(self, x):
        return {'y': self.l1(x)}


class LossIn(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 3)

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.l1(x), t)


def test_what_a_cache_cannot_replay_is_named_with_the_fix():
    """A dict returned, a loss computed in the model; two models of one class
    that fell back for different reasons are both in the report."""
    import fastchain
    x = numpy.ones((2, 3), numpy.float32)
    t = numpy.zeros(2, numpy.int32)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        with fastchain.enable(static_graph=True, autotune=False, loader_workers=0) as h:
            out, loss = DictOut(), LossIn()
            cache_static_graph(out)
            cache_static_graph(loss)
            F.sum(out(x)['y']).backward()
            loss(x, t).backward()
            other = DictOut()
            cache_static_graph(other)
            other.l1(x)     # nothing cached from this one: it stays cached
            fell = h.report()['static_graph']['calls']['define_by_run']
    messages = [str(m.message) for m in w if m.category is StaticGraphFallback]
    assert any("returns a dict" in m and 'Return a tuple' in m for m in messages), messages
    assert any('compute the loss outside the cached chain' in m for m in messages), messages
    assert set(fell) == {'DictOut', 'LossIn'}


def test_two_models_of_one_class_keep_both_reasons_in_the_report():
    from fastchain.static import _group
    fell = {}
    _group._add(fell, 'Net', 'one reason')
    _group._add(fell, 'Net', 'one reason')
    _group._add(fell, 'Net', 'another reason')
    assert fell == {'Net': 'one reason', 'Net (2)': 'another reason'}


class Bank(chainer.Chain):
    """A memory bank the loop updates in place and the forward passes to a
    function (read in place by a replay), an array of objects, a class
    attribute generator."""

    rng = random.Random(0)

    def __init__(self, draw=False):
        super().__init__()
        self.draw = draw
        with self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.l3 = L.Linear(4, 3)
        self.queue = numpy.ones((4, 4), numpy.float32)
        self.labels = numpy.array(['cat', None], dtype=object)

    def forward(self, x):
        h = F.matmul(F.relu(self.l1(x)), self.queue)
        if self.draw and self.rng.random() < 0.5:
            h = h * 2
        return self.l3(h)


def test_a_bank_updated_in_place_and_read_by_a_function_stays_cached():
    ordinary, cached = copies(lambda: Bank())
    cache_static_graph(cached)

    def between(i, model):
        model.queue *= 0.9                  # in place, every step
    assert _train((ordinary, cached), 9, between) == []
    assert cache_state(cached)['fallback'] is None


def test_a_class_attribute_generator_falls_back_and_is_put_back():
    ordinary, cached = copies(lambda: Bank(draw=True))
    cache_static_graph(cached)

    def between(i, model):
        Bank.rng.seed(i)                    # the same draws for both models
    caught = _train((ordinary, cached), 6, between)
    assert len(caught) == 1 and 'a random.Random (drawn from at test_outside_the_links.py' \
        in caught[0], caught


def test_another_threads_draws_are_not_the_forwards():
    """A data thread drawing from Python's random meanwhile (a
    MultithreadIterator's augmentation) neither makes the model fall back
    nor is rewound."""
    import threading
    stop = threading.Event()

    def augment():
        while not stop.is_set():
            random.random()
    thread = threading.Thread(target=augment, daemon=True)
    thread.start()
    try:
        ordinary, cached = copies(lambda: Net('plain'))
        cache_static_graph(cached)
        assert _train((ordinary, cached), 6) == []
    finally:
        stop.set()
        thread.join()
    assert cache_state(cached)['fallback'] is None


def test_a_config_dict_changed_in_place_is_a_new_key():
    class Opts(Net):
        def forward(self, x):
            h = F.relu(self.l1(x))
            if chainer.config.opts['aux']:
                h = h + F.tanh(self.l2(h))
            return self.l3(h)
    ordinary, cached = copies(lambda: Opts('plain'))
    cache_static_graph(cached)
    opts = {'aux': False}

    def between(i, model):
        opts['aux'] = i >= 4                # the same dict, changed in place
    with chainer.using_config('opts', opts):
        assert _train((ordinary, cached), 8, between) == []
    assert cache_state(cached)['fallback'] is None
    # aux off; on (step 4); on with _train's use_aux (from step 5)
    assert len(cache_state(cached)['sequences']) == 3


def _dead_proxy():
    class Thing:
        pass
    thing = Thing()
    proxy = weakref.proxy(thing)
    del thing
    return proxy


_WITH_DEAD_PROXY = """
DEAD = dead_proxy()         # a module global of the model's module


class WithDeadProxy(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 3)

    def forward(self, x):
        return self.l1(x)


WithDeadProxy.dead = dead_proxy()   # a class attribute (set after: abc's class creation trips)
"""


def test_a_dead_weak_proxy_the_model_reaches_is_left_alone():
    """Every verified step raised ReferenceError (a review). (The model's
    module is made here: pytest's collection trips on a dead proxy too.)"""
    namespace = {'__name__': 'model_module', 'chainer': chainer, 'L': L,
                 'dead_proxy': _dead_proxy}
    exec(_WITH_DEAD_PROXY, namespace)
    ordinary, cached = copies(namespace['WithDeadProxy'])
    cache_static_graph(cached)
    opts = [chainer.optimizers.SGD(0.1).setup(m) for m in (ordinary, cached)]
    for _ in range(3):
        for model, opt in zip((ordinary, cached), opts):
            opt.update(lambda: F.sum(model(numpy.ones((2, 3), numpy.float32))))
    assert_same(ordinary, cached)
    assert cache_state(cached)['fallback'] is None
