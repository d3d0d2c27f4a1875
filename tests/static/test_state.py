"""State a cached forward keeps in Python (fastchain/static/_state.py): a
replay runs none of the forward's Python, so a counter, a list, a dict, an
array changed in place, a generator of the model's own or an object of the
user's that the forward changes would stay as the recording left it. The
cache refuses such a model on its first verified call, puts the state back,
and the model trains as plain Chainer does, its state included."""

import collections
import copy
import pickle
import random
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from fastchain.static import StaticGraphFallback, cache_state, cache_static_graph
from fastchain.static import _state, static_graph as fastchain_static_graph

from tests.helpers import copies, side_by_side

pytestmark = pytest.mark.usefixtures('fresh_fixes')


class _Meter:
    """A plain object of the user's, held by the model."""

    def __init__(self):
        self.n = 0


class _Schedule:
    """A callable helper of the user's (a review: skipped as callable, it
    advanced twice on the recording step and the refusal left it there)."""

    def __init__(self):
        self.step = 0

    def __call__(self):
        self.step += 1
        return self.step


class _Slotted:
    __slots__ = ('n',)

    def __init__(self):
        self.n = 0


class _Outer:
    def __init__(self):
        self.inner = _Meter()
        self.inner.log = []


class Stateful(chainer.Chain):
    """A small network whose forward keeps state of the kind ``kind`` and
    (for most kinds) computes from it, on a period no verified step sees."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        with self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.l2 = L.Linear(4, 3)
        self.calls = 0
        self.seen = []
        self.stats = {}
        self.total = numpy.zeros(1, numpy.float32)
        self.rng = numpy.random.RandomState(5)
        self.gen = numpy.random.default_rng(5)
        self.meter = _Meter()
        self.nested = {'inner': [0]}
        self.recent = collections.deque(maxlen=3)
        self.pyrng = random.Random(5)
        self.schedule = _Schedule()
        self.slotted = _Slotted()
        self.outer = _Outer()
        if kind == 'budget':
            # a large table of values before the state that changes
            self.vocabulary = {'w{}'.format(i): i for i in range(25000)}

    def forward(self, x):
        h = F.tanh(self.l1(x))
        kind = self.kind
        scale = 1.0
        if kind == 'counter':
            self.calls += 1
            scale = 2.0 if self.calls % 6 == 0 else 1.0     # after the verified steps
        elif kind == 'list':
            self.seen.append(len(x))
        elif kind == 'dict':
            self.stats['calls'] = self.stats.get('calls', 0) + 1
        elif kind == 'array':
            self.total += len(x)
            scale = float(self.total[0] % 12 == 0) + 1.0
        elif kind == 'random':
            h = h + self.rng.normal(0, 0.1, h.shape).astype(numpy.float32)
        elif kind == 'generator':
            h = h + self.gen.normal(0, 0.1, h.shape).astype(numpy.float32)
        elif kind == 'object':
            self.meter.n += 1
        elif kind == 'nested':
            self.nested['inner'][0] += 1
        elif kind == 'deque':
            self.recent.append(len(x))
        elif kind == 'pyrandom':
            scale = 1.0 + self.pyrng.random()
        elif kind == 'callable':
            scale = 2.0 if self.schedule() % 6 == 0 else 1.0
        elif kind == 'slots':
            self.slotted.n += 1
        elif kind == 'deep':
            self.outer.inner.log.append(1)
        elif kind == 'budget':
            self.l2.seen = getattr(self.l2, 'seen', 0) + 1
        return self.l2(h) * scale


KINDS = {'counter': 'calls', 'list': 'seen', 'dict': 'stats', 'array': 'total',
         'random': 'rng', 'generator': 'gen', 'object': 'meter', 'nested': 'nested',
         'deque': 'recent', 'pyrandom': 'pyrng', 'callable': 'schedule', 'slots': 'slotted',
         'deep': 'outer', 'budget': 'l2/seen'}


def _python_state(model):
    return (model.calls, list(model.seen), dict(model.stats), model.total.copy(),
            model.rng.get_state()[2], model.gen.bit_generator.state['state'],
            model.meter.n, model.nested['inner'][0], list(model.recent),
            model.pyrng.getstate()[1], model.schedule.step, model.slotted.n,
            len(model.outer.inner.log), getattr(model.l2, 'seen', 0))


def _batches(steps=8):
    rng = numpy.random.RandomState(0)
    return [(rng.rand(2, 3).astype(numpy.float32), rng.randint(0, 3, 2).astype(numpy.int32))
            for _ in range(steps)]


@pytest.mark.parametrize('kind', sorted(KINDS))
def test_a_forward_that_changes_python_state_trains_as_plain_chainer(kind):
    ordinary, cached = copies(lambda: Stateful(kind))
    cache_static_graph(cached)
    caught = side_by_side(ordinary, cached, _batches())
    state = cache_state(cached)
    assert state['cause'] == 'not static'
    assert '/{}'.format(KINDS[kind]) in state['fallback'], state['fallback']
    assert 'keeps state in Python' in state['fallback']
    assert len(caught) == 1
    for got, expected in zip(_python_state(cached), _python_state(ordinary)):
        numpy.testing.assert_array_equal(got, expected)


class Holder(chainer.Chain):
    """Python state the forward reads but never changes: nothing to refuse."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 3)
        self.sizes = [1.0, 2.0]
        self.table = {'scale': 0.5}
        self.rng = numpy.random.RandomState(0)
        self.meter = _Meter()
        self.offset = numpy.ones(3, numpy.float32)

    def forward(self, x):
        return self.l1(x) * self.table['scale'] + self.sizes[1] + float(self.offset.sum())


def test_state_the_forward_only_reads_keeps_the_model_cached():
    ordinary, cached = copies(Holder)
    cache_static_graph(cached)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphFallback)
        side_by_side(ordinary, cached, _batches(6))
    state = cache_state(cached)
    assert state['fallback'] is None and sum(state['verified'].values()) == 2


def test_the_state_is_put_back_exactly_and_changes_are_named():
    model = Stateful('list')
    model.stats['k'] = [numpy.arange(3.0)]
    model.meter.extra = {'a': 1}
    taken = _state.PythonState(model)
    assert taken.changes() == []
    model.calls = 7
    model.seen.append(1)
    model.stats['k'][0][1] = 9.0
    model.stats['new'] = 1
    model.total += 1
    model.rng.rand()
    model.gen.random()
    model.meter.extra['a'] = 2
    model.meter.fresh = True
    model.l1.note = 'made by the call'
    changes = taken.changes()
    assert len(changes) == 2, changes
    assert changes[0].startswith('/calls: was 0, is 7'), changes
    assert changes[1].startswith('/l1/note added'), changes
    taken.restore()
    assert taken.changes() == []
    assert model.calls == 0 and model.seen == [] and set(model.stats) == {'k'}
    numpy.testing.assert_array_equal(model.stats['k'][0], numpy.arange(3.0))
    numpy.testing.assert_array_equal(model.total, [0])
    assert numpy.random.RandomState(5).rand() == model.rng.rand()
    assert model.meter.extra == {'a': 1} and not hasattr(model.meter, 'fresh')
    assert 'note' not in vars(model.l1)


@pytest.mark.parametrize('change, words', [
    (lambda m: m.seen.append(3), 'a list of 0 items, 1 now'),
    (lambda m: m.stats.update(a=1), "a dict whose keys changed (+'a')"),
    (lambda m: m.total.__iadd__(1), 'an array changed in place'),
    (lambda m: m.rng.rand(), 'a RandomState the forward draws random numbers from'),
    (lambda m: m.gen.random(), 'a Generator the forward draws random numbers from'),
    (lambda m: setattr(m.meter, 'n', 1), '.n: was 0, is 1'),
    (lambda m: m.nested['inner'].append(1), "['inner'] a list of 1 items, 2 now"),
    (lambda m: setattr(m, 'seen', []), 'rebound (a list before, a list now)'),
])
def test_each_kind_of_change_is_named(change, words):
    model = Stateful('list')
    taken = _state.PythonState(model)
    change(model)
    changes = taken.changes()
    assert len(changes) == 1 and changes[0].endswith(words), changes


def test_what_the_cache_and_chainer_keep_on_the_chain_is_not_state():
    """Chainer's static graph keeps its schedules on the chain; parameters
    and persistent arrays change by design (the verification compares the
    latter); a persistent value that is not an array only Python changes."""
    model = Stateful('counter')
    model.add_persistent('count', 0)
    model.add_persistent('running', numpy.zeros(2, numpy.float32))
    taken = _state.PythonState(model)
    model.static_schedule = object()
    model.schedule_manager = object()
    model.l1.W.array += 1
    model.running += 1
    assert taken.changes() == []
    model.count = 3
    assert taken.changes() == ['/count: was 0, is 3']


def test_batch_normalizations_finetune_count_is_named():
    """``finetune=True`` counts the batches in ``N`` in Python: the replay
    would not count them (the verification caught the decay computed from
    it, blaming data read in Python)."""
    class Finetuned(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.l1 = L.Linear(3, 4)
                self.bn = L.BatchNormalization(4)

        def forward(self, x):
            return self.bn(self.l1(x), finetune=True)

    ordinary, cached = copies(Finetuned)
    cache_static_graph(cached)
    caught = side_by_side(ordinary, cached, _batches(4))
    assert len(caught) == 1 and '/bn/N: was 0, is ' in caught[0], caught
    assert cached.bn.N == ordinary.bn.N == 4


class Small(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 4)

    def forward(self, x):
        return self.l1(x)


@fastchain_static_graph
class _Decorated(Small):
    pass


class _MethodCached(Small):
    @fastchain_static_graph
    def forward(self, x):
        return self.l1(x)


def _copy(model, how):
    if how == 'pickle':
        return pickle.loads(pickle.dumps(model))
    if how == 'deepcopy':
        return copy.deepcopy(model)
    return model.copy(how)


@pytest.mark.parametrize('how', ['share', 'copy', 'init', 'deepcopy', 'pickle'])
@pytest.mark.parametrize('make', [Small, _Decorated, _MethodCached])
@pytest.mark.parametrize('called', [False, True])
def test_a_copy_of_a_cached_model_computes_with_its_own_parameters(how, make, called):
    """The copy carried the original's cached forward: ``model.copy('init')``
    computed with the original's parameters (silently), and a deep copy of a
    model that had been called raised (``cannot pickle 'module' object``)."""
    numpy.random.seed(0)
    model = make()
    if make is Small:
        cache_static_graph(model)
    x = numpy.random.rand(2, 3).astype(numpy.float32)
    if called:
        for _ in range(4):
            model.cleargrads()
            F.sum(model(x)).backward()
    dup = _copy(model, how)
    dup.l1.b.array = dup.l1.b.array + 10       # its own (a new array: 'share' keeps W)
    for _ in range(4):
        dup.cleargrads()
        y = dup(x)
        F.sum(y).backward()
        numpy.testing.assert_array_equal(y.array, dup.l1(x).array)
        assert dup.l1.W.grad is not None
    # nothing of the original's left on the copy (a cached copy has its own)
    guard = vars(dup).get('__reduce_ex__')
    assert guard is None or guard._ref() is dup
    assert 'forward' not in vars(dup)
    for name in ('schedule_manager', 'static_schedule'):
        assert vars(dup).get(name) is not vars(model).get(name) or name not in vars(dup)
    if called:
        assert cache_state(model)['fallback'] is None
        numpy.testing.assert_array_equal(model(x).array, model.l1(x).array)


def test_disabling_the_cache_leaves_nothing_on_the_chain():
    model = Small()
    before = set(vars(model))
    undo = cache_static_graph(model)
    assert '__reduce_ex__' in vars(model)
    model(numpy.ones((2, 3), numpy.float32))
    undo()
    assert set(vars(model)) == before


class _Quiet(chainer.Chain):
    """Python state a static model legitimately keeps (a review found each
    refused): a constant made on the first call, a shape stored again each
    call, a child whose forward is cached on its own."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.inner = _MethodCached()
        self.scale = None
        self.shape = None

    def forward(self, x):
        if self.scale is None:
            self.scale = numpy.full((1, 4), 0.5, numpy.float32)
        self.shape = x.shape
        return self.inner(x) * self.scale


def test_state_a_static_model_keeps_leaves_it_cached():
    ordinary, cached = copies(_Quiet)
    cache_static_graph(cached)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphFallback)
        assert side_by_side(ordinary, cached, _batches(6)) == []
    state = cache_state(cached)
    assert state['fallback'] is None and sum(state['verified'].values()) == 2
