"""A dataset's own random generators in the loader's workers
(fastchain/data/_generators.py): seeded per example like NumPy's global RNG,
so every worker count draws the same numbers and no two workers repeat each
other's; said when the loader takes the dataset under enable()."""

import functools
import random
import warnings

import numpy
import pytest

import chainer
import chainer.links as L

import fastchain
from fastchain import data
from fastchain.data import _draws, _generators
from tests.data import augment_module
from tests.data.augment_module import shift as imported_shift
from tests.helpers import Indexed, train_classifier


def _make(kind, seed=0):
    return {'RandomState': lambda: numpy.random.RandomState(seed),
            'Generator': lambda: numpy.random.default_rng(seed),
            'Random': lambda: random.Random(seed)}[kind]()


def _draw(generator):
    return generator.random() if not isinstance(generator, numpy.random.RandomState) \
        else generator.rand()


class OwnNoisy(Indexed):
    """Augments from a generator of its own, as many scripts do
    (``self.rng = numpy.random.RandomState(seed)``)."""

    def __init__(self, kind='RandomState'):
        self.rng = _make(kind)

    def get_example(self, i):
        x, t = super().get_example(i)
        return x + numpy.float32(_draw(self.rng)), t


class Augment:
    def __init__(self, kind):
        self.generator = _make(kind)

    def __call__(self, example):
        x, t = example
        return x + numpy.float32(_draw(self.generator)), t


def _transformed(kind, how):
    """The generator held by a transform: a bound object's, a closure's, a
    partial's argument."""
    if how == 'object':
        transform = Augment(kind)
    elif how == 'closure':
        generator = _make(kind)

        def transform(example):
            x, t = example
            return x + numpy.float32(_draw(generator)), t
    else:
        transform = functools.partial(
            lambda example, g: (example[0] + numpy.float32(_draw(g)), example[1]),
            g=_make(kind))
    return chainer.datasets.TransformDataset(Indexed(), transform)


def test_the_generators_a_dataset_holds_are_found_with_their_paths():
    dataset = OwnNoisy()
    assert [p for p, _ in _generators.find(dataset)] == ['dataset.rng']
    closure = _transformed('Generator', 'closure')
    assert [p for p, _ in _generators.find(closure)] == ['dataset._transform.<generator>']
    bound = chainer.datasets.TransformDataset(Indexed(), Augment('Random').__call__)
    assert [p for p, _ in _generators.find(bound)] == [
        'dataset._transform.__self__.generator']
    # the global generators are seeded as themselves; a long list is not entered;
    # a cycle ends
    dataset.globals = [numpy.random.mtrand._rand, random._inst]
    dataset.files = [numpy.random.RandomState(1)] + list(range(100))
    dataset.me = dataset
    assert [p for p, _ in _generators.find(dataset)] == ['dataset.rng']
    assert _generators.find(Indexed()) == []


def _values(it, batches=3):
    try:
        return [[float(x[0]) - float(t) for x, t in it.next()] for _ in range(batches)]
    finally:
        it.finalize()


@pytest.mark.parametrize('kind, how', [
    ('RandomState', 'attribute'), ('Generator', 'attribute'), ('Random', 'attribute'),
    ('RandomState', 'object'), ('Generator', 'closure'), ('Random', 'partial')])
def test_a_datasets_own_generator_draws_the_same_for_any_number_of_workers(kind, how):
    """Every worker held a copy of the generator in the state it had: with 2
    workers, pairs of examples got the same draw, and each worker count gave
    another run. Seeded per example: the same for any count and without
    workers (rng='seed'), different from example to example, and the main
    process's generator untouched."""
    def run(workers):
        dataset = OwnNoisy(kind) if how == 'attribute' else _transformed(kind, how)
        kept = [_generators._state(g) for _, g in _generators.find(dataset)]
        values = _values(data.MultiprocessIterator(dataset, 4, seed=11, n_workers=workers))
        after = [_generators._state(g) for _, g in _generators.find(dataset)]
        assert all(_generators._same(a, b) for a, b in zip(after, kept))
        return values
    one = run(1)
    assert run(0) == one and run(2) == one and run(3) == one
    drawn = [v for batch in one for v in batch]
    assert len(set(drawn)) == len(drawn)


def test_the_dataset_generators_are_not_the_global_streams():
    """Each generator gets a stream of its own: seeded with the example's
    seed itself, a dataset's RandomState drew the numbers NumPy's global RNG
    gives the same example."""
    own, mine = [('a', numpy.random.RandomState())], numpy.random.RandomState()
    _generators.seed_example(5, own)
    mine.seed(5)
    assert own[0][1].rand() != mine.rand()
    _generators.seed_example(5, own)
    assert numpy.random.rand() == numpy.random.RandomState(5).rand()


@pytest.mark.parametrize('kind', ['RandomState', 'Generator', 'Random'])
def test_the_loader_taking_a_dataset_with_its_own_generator_says_so(kind):
    """Under enable() the loader takes a SerialIterator's place: a dataset
    drawing from ``self.rng`` trained differently from plain Chainer, with
    nothing said (the look saw only the global generators)."""
    dataset = OwnNoisy(kind)
    state = _generators._state(dataset.rng)
    model = L.Classifier(L.Linear(3, 2))
    optimizer = chainer.optimizers.SGD(0.1).setup(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with fastchain.enable(loader_workers=1, prefetch_to_device=False):
            updater = chainer.training.StandardUpdater(
                chainer.iterators.SerialIterator(dataset, 4), optimizer)
    updater.finalize()
    said = [str(w.message) for w in caught if 'draw random numbers' in str(w.message)]
    assert said == [data._group.DRAWS_RANDOM.format(
        'its own {} (dataset.rng)'.format(type(dataset.rng).__name__))]
    assert _generators._same(_generators._state(dataset.rng), state)    # put back


class _Slotted(Indexed):
    __slots__ = ('rng',)

    def __init__(self):
        self.rng = numpy.random.RandomState(0)


class _ClassLevel(Indexed):
    rng = numpy.random.RandomState(0)


class _Wrap:
    def __init__(self, inner):
        self.inner = inner


def test_generators_in_slots_class_attributes_defaults_and_deep_are_found():
    """A review's cases the first walk missed (each worker then repeated
    the others' draws, with nothing said)."""
    assert [p for p, _ in _generators.find(_Slotted())] == ['dataset.rng']
    assert [p for p, _ in _generators.find(_ClassLevel())] == ['dataset.rng']
    rng = numpy.random.RandomState(0)
    defaults = chainer.datasets.TransformDataset(
        Indexed(), lambda e, rng=rng: (e[0] + numpy.float32(rng.rand()), e[1]))
    assert [p for p, _ in _generators.find(defaults)] == ['dataset._transform.<default 0>']
    deep = rng
    for _ in range(8):
        deep = _Wrap(deep)
    assert [p for p, _ in _generators.find(deep)] == ['dataset' + '.inner' * 8]


class _DictRaises:
    @property
    def __dict__(self):
        raise RuntimeError('no')


def test_what_cannot_be_seeded_or_walked_loads_as_before():
    """A SystemRandom has no state (it was taken, and getstate raised, also
    under enable()); a RandomState over PCG64 cannot be seed()ed (the
    worker died); a dead weakref proxy and an object whose __dict__ raises
    broke the walk."""
    import weakref
    dataset = OwnNoisy()
    dataset.system = random.SystemRandom()
    dataset.rng = numpy.random.RandomState(numpy.random.PCG64(0))
    dataset.gone = weakref.proxy(Augment('Random'))     # dead at once
    dataset.odd = _DictRaises()
    assert [p for p, _ in _generators.find(dataset)] == ['dataset.rng']
    runs = [_values(data.MultiprocessIterator(dataset, 4, seed=11, n_workers=workers))
            for workers in (0, 1, 2)]
    assert runs[1] == runs[0] and runs[2] == runs[0]


_MODULE_RNG = numpy.random.default_rng(0)      # NumPy's recommended style


class _GlobalNoisy(Indexed):
    def get_example(self, i):
        x, t = super().get_example(i)
        return x + numpy.float32(_MODULE_RNG.random()), t


def _module_transform(example):
    return example[0] + numpy.float32(_MODULE_RNG.random()), example[1]


@pytest.mark.parametrize('how', ['get_example', 'transform'])
def test_a_module_global_generator_the_dataset_draws_from_is_found(how):
    """A second review: a generator at module level (``RNG =
    numpy.random.default_rng(0)``) drawn in get_example or a transform was
    not found: with 2 workers batches 0 and 1 drew alike, nothing said, and
    the main process lost a draw to the look."""
    def make():
        return _GlobalNoisy() if how == 'get_example' else \
            chainer.datasets.TransformDataset(Indexed(), _module_transform)
    found = [p for p, _ in _generators.find(make())]
    assert found == (['dataset.get_example.<global _MODULE_RNG>'] if how == 'get_example'
                     else ['dataset._transform.<global _MODULE_RNG>'])
    _seeded_per_example(make, _MODULE_RNG)


def _seeded_per_example(make, generator):
    """Loaded from ``make()`` with 0, 1 and 2 workers: the same draws, each
    example its own, and ``generator`` in this process as it was."""
    state = _generators._state(generator)
    runs = [_values(data.MultiprocessIterator(make(), 4, seed=11, n_workers=workers))
            for workers in (0, 1, 2)]
    assert runs[1] == runs[0] and runs[2] == runs[0]
    drawn = [v for batch in runs[0] for v in batch]
    assert len(set(drawn)) == len(drawn)
    assert _generators._same(_generators._state(generator), state)


class _WithBuiltins(OwnNoisy):
    """Static methods without code of their own (a builtin, a ufunc)."""
    as_array = staticmethod(numpy.asarray)
    size = staticmethod(len)
    squash = staticmethod(numpy.tanh)


def test_a_class_with_builtin_static_methods_keeps_its_generators_found():
    """A third review: the look into a class's methods for module globals
    raised on a builtin (no __code__), and the whole dataset was taken to
    hold nothing: its own rng unseeded, each worker count another run."""
    assert [p for p, _ in _generators.find(_WithBuiltins())] == ['dataset.rng']


class _SeedsItsOwn(Indexed):
    """Seeds its own generator per example (``self.rng.seed(i)``), as
    scripts make an augmentation repeatable; ``before``: a draw ahead of the
    seeding, which carries the generator's state from example to example."""

    def __init__(self, kind='RandomState', before=False):
        self.rng, self.before = _make(kind), before

    def get_example(self, i):
        x, t = super().get_example(i)
        shift = _draw(self.rng) if self.before else 0.0
        self.rng.seed(int(i))
        return x + numpy.float32(_draw(self.rng) + shift), t


class _SeedsTheGlobal(Indexed):
    def get_example(self, i):
        x, t = super().get_example(i)
        numpy.random.seed(int(i))
        return x + numpy.float32(numpy.random.rand()), t


class _OneOfTwo(_SeedsItsOwn):
    """Seeds ``rng`` per example; ``other`` carries on."""

    def __init__(self):
        super().__init__()
        self.other = numpy.random.RandomState(1)

    def get_example(self, i):
        x, t = super().get_example(i)
        return x + numpy.float32(self.other.rand()), t


def _train(dataset, **options):
    """Eight steps (two epochs and more, shuffled) of a classifier on
    ``dataset``; its parameters, and the loader warnings said."""
    def init(model):
        model.predictor.W.array[...] = numpy.linspace(-1, 1, 36, dtype=numpy.float32).reshape(
            12, 3)
    said, params = train_classifier(dataset, 8, 5, True, chainer.optimizers.MomentumSGD(0.1),
                                    options, init)
    return params, [message for step, message in said if step < 0]


LOADER = dict(loader_workers=2, prefetch_to_device=False)


@pytest.mark.parametrize('kind', ['RandomState', 'Random'])
def test_a_dataset_seeding_its_own_generator_per_example_trains_as_plain_chainer_unwarned(kind):
    """A new-user trial: such a dataset's batches are plain Chainer's under
    the loader's workers (it overwrites their seeding), yet it was warned
    "not bitwise plain Chainer's training"."""
    plain, _ = _train(_SeedsItsOwn(kind))
    dataset = _SeedsItsOwn(kind)
    state = _generators._state(dataset.rng)
    mine, said = _train(dataset, **LOADER)
    assert said == []
    assert all(numpy.array_equal(a, b) for a, b in zip(plain, mine))
    assert _generators._same(_generators._state(dataset.rng), state)    # the probe put it back


def test_a_dataset_drawing_before_it_seeds_or_seeding_the_global_rng_is_still_warned():
    """What carries over from example to example is still said: a draw
    ahead of the seeding, a second generator left unseeded (only it is
    named), and NumPy's global RNG seeded in get_example, which in plain
    Chainer also moves the next epoch's order (here it trains otherwise)."""
    _, said = _train(_SeedsItsOwn(before=True), **LOADER)
    assert said == [data._group.DRAWS_RANDOM.format('its own RandomState (dataset.rng)')]
    _, said = _train(_OneOfTwo(), **LOADER)
    assert said == [data._group.DRAWS_RANDOM.format('its own RandomState (dataset.other)')]
    plain, _ = _train(_SeedsTheGlobal())
    mine, said = _train(_SeedsTheGlobal(), **LOADER)
    assert said == [data._group.DRAWS_RANDOM.format('numpy.random')]
    assert not all(numpy.array_equal(a, b) for a, b in zip(plain, mine))


def test_the_per_example_probe_keeps_a_generator_it_cannot_tell():
    """An example that fails to load, or one that is not comparable, keeps
    the generator named."""
    rng = numpy.random.RandomState(0)

    def fails():
        rng.seed(1)
        rng.rand()
        raise ValueError('a corrupt example')

    def opaque():
        rng.seed(1)
        return object(), rng.rand()

    def seeded():
        rng.seed(1)
        return {'x': numpy.full(2, rng.rand())}

    own = [('dataset.rng', rng)]
    assert _draws.seeded_per_example(fails, own) == []
    assert _draws.seeded_per_example(opaque, own) == []
    assert _draws.seeded_per_example(seeded, own) == own


def _through_a_module(how):
    from tests.data import augment_module as local     # held by the closure
    transform = {
        'attribute': lambda e: (e[0] + numpy.float32(augment_module._rng.rand()), e[1]),
        'function': lambda e: (augment_module.shift(e[0]), e[1]),
        'imported': lambda e: (imported_shift(e[0]), e[1]),
        'decorated': lambda e: (augment_module.logged_shift(e[0]), e[1]),
        'factory': lambda e: (augment_module.factory_shift(e[0]), e[1]),
        'closure': lambda e: (local.shift(e[0]), e[1]),
        'bound method': lambda e: (e[0] + numpy.float32(augment_module.uniform()), e[1]),
        'partial': lambda e: (augment_module.partial_shift(e[0]), e[1]),
        'class': lambda e: (augment_module.RandomShift()(e[0]), e[1]),
        'object': lambda e: (augment_module.AUGMENTER.jitter(e[0]), e[1])}[how]
    return chainer.datasets.TransformDataset(Indexed(), transform)


@pytest.mark.parametrize('how, path', [
    ('attribute', '<global augment_module._rng>'),
    ('function', '<global augment_module.shift>.<global _rng>'),
    ('imported', '<global imported_shift>.<global _rng>'),
    ('decorated', '<global augment_module.logged_shift>.<f>.<global shift>.<global _rng>'),
    ('factory', '<global augment_module.factory_shift>.<rng>'),
    ('closure', '<local.shift>.<global _rng>'),
    ('bound method', '<global augment_module.uniform>.__self__'),
    ('partial', '<global augment_module.partial_shift>.func.<global _rng>'),
    ('class', '<global augment_module.RandomShift>.__call__.<global _rng>'),
    ('object', '<global augment_module.AUGMENTER>.rng')])
def test_a_generator_in_a_module_the_transform_calls_into_is_found(how, path):
    """A new-user trial: a transform calling ``augment.random_crop_flip(img)``,
    whose module holds ``_rng``, was not found: each worker drew the same
    numbers (40 of 80 draws distinct over 10 batches of 8), another run for
    another worker count, nothing said."""
    found = _generators.find(_through_a_module(how))
    assert [p for p, _ in found] == ['dataset._transform.' + path]
    generator = found[0][1]
    assert generator is {'factory': augment_module.factory_shift.__closure__[0].cell_contents,
                         'object': augment_module.AUGMENTER.rng}.get(how, augment_module._rng)
    _seeded_per_example(lambda: _through_a_module(how), generator)


class _DecoratedNoisy(Indexed):
    @augment_module._logged
    def get_example(self, i):
        x, t = super().get_example(i)
        return augment_module.shift(x), t


class _PropertyNoisy(Indexed):
    @property
    def noise(self):
        return numpy.float32(augment_module._rng.rand())

    def get_example(self, i):
        x, t = super().get_example(i)
        return x + self.noise, t


class _CachedNoisy(Indexed):
    def get_example(self, i):
        x, t = super().get_example(i)
        return x + numpy.float32(augment_module.cached_offset(0)), t


class _WithUnaskable(OwnNoisy):
    def get_example(self, i):
        if augment_module.current is None:
            pass
        return super().get_example(i)


@pytest.mark.parametrize('make, path', [
    (_DecoratedNoisy, 'dataset.get_example.<f>.<global augment_module.shift>.<global _rng>'),
    (_PropertyNoisy, 'dataset.noise.<global augment_module._rng>'),
    (_CachedNoisy, 'dataset.get_example.<global augment_module.cached_offset>.__wrapped__'
                   '.<global _rng>'),
    (_WithUnaskable, 'dataset.rng')])
def test_a_generator_behind_a_decorated_method_a_property_or_a_cache_is_found(make, path):
    """A review's cases: a decorated get_example (its closure), a property,
    an lru_cache'd function; and an object a module holds whose
    ``__class__`` raises (a lazy proxy) made the whole look of the dataset
    fail, its own ``self.rng`` unseeded."""
    assert [p for p, _ in _generators.find(make())] == [path]


def test_a_pcg64_randomstate_reseeded_keeps_no_gaussian_from_before():
    """A review: reseeding a RandomState over PCG64 set its bit generator's
    state only, and the Gaussian it had cached from the example before came
    out first (each example then depended on which worker loaded what)."""
    generator = numpy.random.RandomState(numpy.random.PCG64(0))
    firsts = []
    for _ in range(2):
        _generators._reseed(generator, 5)
        firsts.append(generator.randn())    # the second of the pair stays cached
    assert firsts[0] == firsts[1]


class _Logged(OwnNoisy):
    def get_example(self, i):
        augment_module.writer.add_scalar('i', i)
        return super().get_example(i)


class _HoldsAReshape(OwnNoisy):
    """Holds a variable made by F.reshape: the walk reaches its node, the
    node's type check and Chainer's ``type_check`` expression objects, whose
    ``__getattr__`` makes a new expression on each call."""

    def __init__(self):
        super().__init__()
        self.feature = chainer.functions.reshape(
            chainer.Variable(numpy.zeros((2, 3), numpy.float32)), (3, 2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize('make', [_Logged, _HoldsAReshape])
def test_the_look_ends_on_objects_that_wrap_without_end(make):
    """A review: taking wrappers off (``__wrapped__``) went on for ever on
    an object answering any attribute with a callable (a logger stub,
    Chainer's type-check expressions reached through a variable a dataset
    holds): the loader's construction hung. At most 8 wrappers, each once."""
    assert [p for p, _ in _generators.find(make())] == ['dataset.rng']


class _UsesSecond(Indexed):
    def get_example(self, i):
        x, t = super().get_example(i)
        return x + numpy.float32(augment_module.Second().use()), t


class _UsesFirst(Indexed):
    def get_example(self, i):
        x, t = super().get_example(i)
        return x + numpy.float32(augment_module.First().draw()), t


class _KeywordPartial(Indexed):
    def get_example(self, i):
        x, t = super().get_example(i)
        return augment_module.keyword_shift(x), t


@pytest.mark.parametrize('order', [(_UsesFirst, _UsesSecond), (_UsesSecond, _UsesFirst)])
def test_classes_reaching_each_other_are_found_in_either_order(order):
    """A review: with the classes cached per process, the second of two
    classes that reach each other kept the first's half-made list (nothing
    found, its draws unseeded) when the first was asked first."""
    for make in order:
        assert [g for _, g in _generators.find(make())] == [augment_module._rng]


def test_a_partials_keyword_generator_reached_through_a_module_is_found():
    assert [p for p, _ in _generators.find(_KeywordPartial())] == [
        'dataset.get_example.<global augment_module.keyword_shift>.keywords']


def test_what_counts_as_a_library_class():
    """Classes of installed packages and of Python are not followed into
    (too many; Chainer's alone made a look take seconds); a script's are,
    wherever it runs (a file, ``__main__`` without one: a notebook,
    ``python -c``; a module gone from ``sys.modules``: ``runpy``)."""
    assert _generators._library(chainer.Link) and _generators._library(numpy.random.RandomState)
    assert _generators._library(functools.partial) and _generators._library(int)
    assert not _generators._library(augment_module.First)
    for module in ('__main__', '<run_path>'):
        script = type('Script', (), {'__module__': module})
        assert not _generators._library(script)
