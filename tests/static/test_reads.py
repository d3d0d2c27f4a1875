"""A forward that reads values in Python is refused when it is recorded, not
replayed wrong once the verified steps are over."""

import re
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer.reporter import report as imported_report

from fastchain.static import StaticGraphFallback, cache_state, cache_static_graph
from tests.helpers import copies

pytestmark = pytest.mark.usefixtures('fresh_fixes')


class Branchy(chainer.Chain):
    """Which head runs depends on the data's sign."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.a = L.Linear(4, 3)
            self.b = L.Linear(4, 3)

    def forward(self, x):
        if float(x.array.mean()) > 0:
            return self.a(x)
        return self.b(x)


class ShapeOnly(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.a = L.Linear(4, 3)

    def forward(self, x):
        n = x.shape[0]              # a shape, not a value
        return F.reshape(self.a(x), (n, 3))


def train(model, optimizer, x, t):
    optimizer.update(lambda: F.softmax_cross_entropy(model(chainer.Variable(x)), t))


def test_a_branch_on_the_data_after_the_verified_steps_is_refused_when_recorded():
    plain, cached = copies(Branchy)
    cache_static_graph(cached)
    opts = [chainer.optimizers.SGD(0.1).setup(m) for m in (plain, cached)]
    t = numpy.zeros(2, numpy.int32)
    signs = [1.0, 1.0, 1.0, 1.0, -1.0, 1.0]     # flips after 2 verified replays
    with pytest.warns(StaticGraphFallback, match=r"reads a variable's values in Python "
                                                 r'\(test_reads.py:\d+\)'):
        for sign in signs:
            x = numpy.full((2, 4), sign, numpy.float32)
            for model, opt in zip((plain, cached), opts):
                train(model, opt, x, t)
            for (name, p), (_, q) in zip(sorted(plain.namedparams()),
                                         sorted(cached.namedparams())):
                numpy.testing.assert_array_equal(q.array, p.array, err_msg=name)
    assert cache_state(cached)['cause'] == 'not static'


def test_the_getters_are_chainers_again_after_recording():
    before = (chainer.Variable.__dict__['array'], chainer.Variable.__dict__['data'])
    _, cached = copies(ShapeOnly)
    cache_static_graph(cached)
    opt = chainer.optimizers.SGD(0.1).setup(cached)
    train(cached, opt, numpy.ones((2, 4), numpy.float32), numpy.zeros(2, numpy.int32))
    assert (chainer.Variable.__dict__['array'], chainer.Variable.__dict__['data']) == before


class ItemBranchy(Branchy):
    def forward(self, x):
        return self.a(x) if F.mean(x).item() > 0 else self.b(x)


def test_a_value_read_through_item_counts_as_a_read():
    _, cached = copies(ItemBranchy)
    cache_static_graph(cached)
    opt = chainer.optimizers.SGD(0.1).setup(cached)
    with pytest.warns(StaticGraphFallback, match=r'test_reads.py:\d+'):
        for _ in range(2):      # the first call runs define-by-run, the second records
            train(cached, opt, numpy.ones((2, 4), numpy.float32),
                  numpy.zeros(2, numpy.int32))


class ReadsShapes(ShapeOnly):
    def forward(self, x):
        h = self.a(x)
        n, k = h.data.shape[0], h.array.ndim        # shapes through the arrays
        return F.reshape(h, (n, 3 * (k - 1)))


@pytest.mark.parametrize('make', [ShapeOnly, ReadsShapes])
def test_reading_shapes_is_not_reading_values(make):
    _, cached = copies(make)
    cache_static_graph(cached)
    opt = chainer.optimizers.SGD(0.1).setup(cached)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphFallback)
        for _ in range(4):
            train(cached, opt, numpy.ones((2, 4), numpy.float32),
                  numpy.zeros(2, numpy.int32))
    assert cache_state(cached)['fallback'] is None


def test_reads_on_another_thread_do_not_count_against_a_recording():
    import threading
    from fastchain.static import _reads
    other = chainer.Variable(numpy.ones(3, numpy.float32))
    with _reads.watching() as reads:
        t = threading.Thread(target=lambda: float(other.array.sum()))
        t.start()
        t.join()
        assert reads == []
        float(other.array.sum())
        assert len(reads) == 1


def test_what_is_not_a_chain_is_refused_with_the_fix():
    import fastchain
    with pytest.raises(TypeError, match='Linear is a single link: wrap it in a Chain'):
        fastchain.static_graph(L.Linear(4, 3))
    with pytest.raises(TypeError, match='Sequential is a ChainList'):
        fastchain.static_graph(chainer.Sequential(L.Linear(4, 3)))
    with pytest.raises(TypeError):
        fastchain.static_graph(42)
    # the lower-level call too (it fell back at the first call with Chainer's
    # bare AssertionError)
    with pytest.raises(TypeError, match='Sequential is a ChainList: wrap it in a Chain'):
        cache_static_graph(chainer.Sequential(L.Linear(4, 3)))


def test_enable_skips_a_model_that_is_not_a_chain_and_says_so():
    import fastchain
    with fastchain.enable(static_graph=True, loader_workers=0):
        with pytest.warns(StaticGraphFallback, match='Sequential is a ChainList'):
            model = L.Classifier(chainer.Sequential(L.Linear(4, 3)))
            chainer.optimizers.SGD().setup(model)
    assert 'forward' not in vars(model) and 'forward' not in vars(model.predictor)


class _Reporting(chainer.Chain):
    def __init__(self, how):
        super().__init__()
        self.how = how
        with self.init_scope():
            self.l1 = L.Linear(3, 4)

    def forward(self, x):
        h = self.l1(x)
        if self.how == 'chainer.report':
            chainer.report({'mean': F.mean(h)}, self)
        elif self.how == 'reporter.report':
            chainer.reporter.report({'mean': F.mean(h)}, self)
        elif self.how == 'imported':
            imported_report({'mean': F.mean(h)}, self)
        else:
            chainer.reporter.get_current_reporter().report({'mean': F.mean(h)}, self)
        return h


@pytest.mark.parametrize('how, in_scope', [
    ('chainer.report', True), ('reporter.report', True), ('Reporter.report', True),
    ('chainer.report', False), ('reporter.report', False), ('imported', True),
    ('imported', False)])
def test_a_forward_that_reports_is_refused_and_every_step_reports(how, in_scope):
    """Before, a replay reported nothing: 'main/mean' was in the observation
    of the recording and verified steps only (3 of 6), silently. A report
    with no reporter current does nothing, but a later step may have one
    (``Reporter.report`` is called on a current reporter only; a name imported
    before the watch was put on is not the watched one: a review found it
    missed when the recording step had no reporter)."""
    ordinary, cached = copies(lambda: _Reporting(how))
    cache_static_graph(cached)
    observed = {id(ordinary): [], id(cached): []}
    rng = numpy.random.RandomState(0)
    fallbacks = []
    for step in range(6):
        x = rng.rand(2, 3).astype(numpy.float32)
        for model in (ordinary, cached):
            reporter = chainer.Reporter()
            reporter.add_observer('main', model)
            observation = {}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                if in_scope or step > 0:
                    with reporter.scope(observation):
                        F.sum(model(x)).backward()
                else:
                    F.sum(model(x)).backward()
            fallbacks += [str(w.message) for w in caught if w.category is StaticGraphFallback]
            observed[id(model)].append(float(observation['main/mean'].array)
                                       if 'main/mean' in observation else None)
    assert observed[id(cached)] == observed[id(ordinary)]
    assert observed[id(ordinary)][1:] == [v for v in observed[id(ordinary)][1:] if v is not None]
    assert len(fallbacks) == 1 and 'reports values from inside its forward' in fallbacks[0]
    assert re.search(r'chainer\.report at test_reads\.py:\d+', fallbacks[0]), fallbacks[0]
    assert cache_state(cached)['cause'] == 'unsupported'


class _TakesState(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 3)

    def forward(self, x, h, scale=1.0):
        h = h['h'] if isinstance(h, dict) else h
        return self.l1(x) * scale + (0 if h is None else h)


@pytest.mark.parametrize('call, named', [
    (lambda m, x: m(x, None), 'this call has argument 2: None'),
    (lambda m, x: m(x, x, scale=2.0), 'this call has keyword arguments (scale)'),
    (lambda m, x: m(x, {'h': x}), 'this call has argument 2, a dict'),
])
def test_an_argument_the_cache_cannot_replay_is_named(call, named):
    """(A new-user trial: an LSTM's usual None initial state was 'another
    argument'.)"""
    model = _TakesState()
    cache_static_graph(model)
    x = numpy.ones((2, 3), numpy.float32)
    with pytest.warns(StaticGraphFallback, match=re.escape(named)):
        call(model, x)
    assert cache_state(model)['cause'] == 'unsupported'


class _Noise(chainer.Chain):
    """Chainer's DCGAN discriminator adds noise drawn in Python."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 3)

    def forward(self, x):
        h = self.l1(x)
        return h + 0.1 * numpy.random.randn(*h.shape)


def test_noise_drawn_in_python_is_named_without_chainers_error_after_it():
    model = _Noise()
    cache_static_graph(model)
    with pytest.warns(StaticGraphFallback) as caught:
        model(numpy.ones((2, 3), numpy.float32))
    said = [str(w.message) for w in caught if w.category is StaticGraphFallback]
    assert len(said) == 1 and "NumPy's random state advanced in the call" in said[0]
    assert 'Error' not in said[0], said[0]
