"""autotune: measure and choose between bitwise-equal alternatives.

The machinery with made-up costs (which alternative runs when, what is
picked, what it costs), then each choice fastchain makes, on real models,
against plain Chainer bit for bit while the alternatives take turns and
after one is picked, whichever it is.
"""

import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import fastchain
from fastchain.kernels import _bind
from fastchain.tune import _steps, _tuner


def test_each_alternative_warms_up_then_takes_turns_then_the_fastest_stays(tuner, monkeypatch):
    monkeypatch.setattr(_tuner, 'enabled', True)
    tuner.update(a=3.0, b=1.0, c=2.0)
    ran = []
    alternatives = tuple((n, lambda n=n: ran.append(n) or n) for n in 'abc')
    got = [_tuner.call('k', ('key',), alternatives) for _ in range(12)]
    assert got == ran
    # one untimed call each, then TRIALS timed calls each, in turns
    assert ran[:9] == list('abc') * 3
    assert ran[9:] == ['b'] * 3
    [c] = _tuner.choices('k')
    assert c['picked'] == 'b' and c['trials'] == {'a': 2, 'b': 2, 'c': 2}
    assert c['median_ms'] == {'a': 3000.0, 'b': 1000.0, 'c': 2000.0}
    # another key is measured on its own
    _tuner.call('k', ('other',), alternatives)
    assert [x['picked'] for x in _tuner.choices('k')] == ['b', None]


def test_the_default_wins_a_tie_and_off_means_the_default_alone(tuner, monkeypatch):
    monkeypatch.setattr(_tuner, 'enabled', True)
    tuner.update(a=1.0, b=1.0)
    alternatives = (('a', lambda: 'a'), ('b', lambda: 'b'))
    for _ in range(6):
        _tuner.call('k', 1, alternatives)
    assert _tuner.choices()[0]['picked'] == 'a'
    monkeypatch.setattr(_tuner, 'enabled', False)
    assert {_tuner.call('k', 2, (('a', lambda: 'a'), ('b', lambda: 'b')))
            for _ in range(6)} == {'a'}
    assert [c['key'] for c in _tuner.choices()] == ['1']    # nothing measured off


def test_forced_takes_one_side_without_measuring(tuner, monkeypatch):
    monkeypatch.setattr(_tuner, 'enabled', True)
    monkeypatch.setitem(_tuner.forced, 'k', 'b')
    assert {_tuner.call('k', 1, (('a', lambda: 'a'), ('b', lambda: 'b')))
            for _ in range(6)} == {'b'}
    assert _tuner.choices() == []
    with pytest.raises(KeyError, match=r"forced 'z' for k, which has no such alternative "
                       r"\(it has a, b\)"):
        monkeypatch.setitem(_tuner.forced, 'k', 'z')
        _tuner.call('k', 1, (('a', lambda: 'a'), ('b', lambda: 'b')))


class ConvNet(chainer.Chain):
    """Every convolution function fastchain plans, with and without bias."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 8, 3, pad=1)
            self.bn = L.BatchNormalization(8)
            self.c2 = L.Convolution2D(8, 8, 3, stride=2, pad=1, nobias=True)
            self.d3 = L.Deconvolution2D(8, 4, 2, stride=2)
            self.fc = L.Linear(None, 5)

    def forward(self, x):
        h = F.relu(self.bn(self.c1(x)))
        return self.fc(F.relu(self.d3(F.relu(self.c2(h)))))


@pytest.mark.parametrize('settle,timed', [(0, 1), (2, 2)])
def test_turns_time_each_alternatives_own_steps(monkeypatch, settle, timed):
    """Over whole steps, each alternative's time is that of the steps it ran
    after settling, never a neighbour's: a step under 'a' lasts 3 s, under
    'b' 1 s, and the first step after a switch 10 s more (what the previous
    alternative left in flight)."""
    monkeypatch.setattr(_tuner, 'TRIALS', 2)
    _tuner.forget()
    clock = [0.0]
    monkeypatch.setattr(_tuner.time, 'perf_counter', lambda: clock[0])
    turns = _tuner.Turns(settle=settle, timed=timed)
    ran = []
    for _ in range(40):
        name = turns.step('k', 1, ('a', 'b'))
        clock[0] += {'a': 3.0, 'b': 1.0}[name] + (10.0 if ran and ran[-1] != name else 0)
        ran.append(name)
    [c] = _tuner.choices('k')
    assert c['picked'] == 'b' and ran[-1] == 'b'
    if settle:      # settling absorbs the switch
        assert c['median_ms'] == {'a': 3000.0, 'b': 1000.0}
    else:           # one step a turn: the switch is part of it (the static cache's case)
        assert c['median_ms'] == {'a': 13000.0, 'b': 11000.0}
    # (1 untimed + TRIALS timed) turns each of settle + timed steps
    assert ran[:(settle + timed) * 6].count('a') == (settle + timed) * 3
    _tuner.forget()


def convnet():
    return L.Classifier(ConvNet())


def train(options, steps, seed=0, inspect=None, steps_then=None):
    """(model, optimizer) after ``steps`` MomentumSGD steps, with fastchain's
    ``options`` (None: plain Chainer); ``inspect(model)`` is called before
    the handle is disabled, and before it ``steps_then(model, optimizer, x,
    t)``, which may take 4 more steps of the last batch."""
    rng = numpy.random.RandomState(seed)
    batches = [(rng.randn(4, 3, 12, 12).astype(numpy.float32),
                rng.randint(0, 5, 4).astype(numpy.int32)) for _ in range(steps)]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        handle = None if options is None else fastchain.enable(loader_workers=0, **options)
        try:
            numpy.random.seed(seed)
            model = convnet()
            model(*batches[0])          # shapes the Linear layer
            model.cleargrads()
            optimizer = chainer.optimizers.MomentumSGD(0.05)
            optimizer.setup(model)
            for x, t in batches:
                optimizer.update(model, x, t)
            if steps_then is not None:
                steps_then(model, optimizer, x, t)
            if inspect is not None:
                inspect(model)
        finally:
            if handle is not None:
                handle.disable()
    return model, optimizer


def assert_bitwise(a, b):
    (ma, oa), (mb, ob) = a, b
    for (name, p), (_, q) in zip(sorted(ma.namedparams()), sorted(mb.namedparams())):
        assert p.array.tobytes() == q.array.tobytes(), name
        assert p.grad.tobytes() == q.grad.tobytes(), name
        assert p.update_rule.state['v'].tobytes() == q.update_rule.state['v'].tobytes(), name
    assert oa.t == ob.t
    for la, lb in zip(ma.links(), mb.links()):
        if isinstance(la, L.BatchNormalization):
            assert la.avg_mean.tobytes() == lb.avg_mean.tobytes()
            assert la.avg_var.tobytes() == lb.avg_var.tobytes()


@pytest.mark.parametrize('faster', ['fastchain', 'chainer'])
def test_convolutions_and_the_update_pick_per_key_and_train_as_chainer(tuner, faster):
    slower = {'fastchain': 'chainer', 'chainer': 'fastchain'}[faster]
    fused = 'fused' if faster == 'fastchain' else 'chainer'
    tuner.update({('cpu_conv', faster): 0.5, ('cpu_conv', slower): 1.0,
                  ('fused_update', fused): 0.5,
                  ('fused_update', {'fused': 'chainer', 'chainer': 'fused'}[fused]): 1.0})
    plain = train(None, 8)
    got = train({'cpu_conv': True, 'fused_update': True}, 8)
    assert_bitwise(plain, got)
    conv = _tuner.choices('cpu_conv')
    update = _tuner.choices('fused_update')
    # forward, input and weight gradients, each shape its own key
    kinds = {c['key'].split()[0] for c in conv}
    assert kinds == {'forward', 'weight-grad', 'input-grad/deconv'} and len(conv) >= 6
    assert {c['picked'] for c in conv} == {faster}
    assert len(update) >= 4 and {c['picked'] for c in update} == {fused}


def _count_plans(monkeypatch):
    """A list that grows by one each time fastchain plans a convolution."""
    planned = []
    planner = _bind._convolution

    def counting(*args):
        planned.append(1)
        return planner(*args)
    monkeypatch.setattr(_bind, '_convolution', counting)
    return planned


def test_after_the_pick_only_the_picked_kernel_runs(tuner, monkeypatch):
    tuner.update(fastchain=1.0, chainer=0.5)
    planned = _count_plans(monkeypatch)
    train({'cpu_conv': True}, 8)
    forward = [c for c in _tuner.choices('cpu_conv') if c['key'].startswith('forward')]
    assert forward and all(c['picked'] == 'chainer' for c in forward)
    # one untimed and TRIALS timed calls each, then only Chainer's kernel
    assert len(planned) == len(forward) * (1 + _tuner.TRIALS)


def test_the_static_cache_is_dropped_where_define_by_run_is_faster(tuner):
    from fastchain.static import cache_state
    tuner.update({'cached': 2.0, 'define-by-run': 1.0})
    plain = train(None, 14)
    states, calls = [], []

    def inspect(model):
        states.append(dict(cache_state(model.predictor)))
        calls.append(fastchain.report()['accelerators']['static_graph']['calls'])
        with fastchain.enable(autotune=False):      # the cache replays whatever was picked
            calls.append(fastchain.report()['accelerators']['static_graph']['calls'])
    got = train({'static_graph': True, 'cpu_conv': True, 'fused_update': True}, 14,
                inspect=inspect)
    assert_bitwise(plain, got)
    [c] = _tuner.choices('static_graph')
    assert c['picked'] == 'define-by-run' and c['trials'] == {'cached': 2, 'define-by-run': 2}
    # not a fallback: the cache stays, verified; this key just runs define-by-run
    assert states[0]['fallback'] is None and list(states[0]['verified'].values()) == [2]
    # and the report says so (it listed the model as cached: a new-user trial)
    assert calls[0]['cached'] == {}
    assert 'autotune measured define-by-run faster' in calls[0]['define_by_run']['ConvNet']
    assert calls[1]['cached'] == {'ConvNet': 1} and calls[1]['define_by_run'] == {}


def test_the_static_cache_stays_where_it_is_faster(tuner):
    tuner.update({'cached': 1.0, 'define-by-run': 2.0})
    plain = train(None, 14)
    got = train({'static_graph': True}, 14)
    assert_bitwise(plain, got)
    [c] = _tuner.choices('static_graph')
    assert c['picked'] == 'cached'
    # a model of the same structure built again takes the choice made
    assert_bitwise(plain, train({'static_graph': True}, 14))
    assert _tuner.choices('static_graph') == [c]


def test_an_evaluation_between_steps_is_not_timed(tuner):
    from fastchain.static import cache_static_graph
    numpy.random.seed(0)
    model = convnet()
    x, t = numpy.ones((4, 3, 12, 12), numpy.float32), numpy.zeros(4, numpy.int32)
    model(x, t)
    cache_static_graph(model.predictor)
    optimizer = chainer.optimizers.SGD().setup(model)
    with fastchain.enable(loader_workers=0):
        for _ in range(12):
            optimizer.update(model, x, t)
            with chainer.using_config('train', False):
                model.predictor(x)
    [c] = _tuner.choices('static_graph')
    # each period ends at the evaluation: none was timed; the same alternative
    # runs again (then, after VOIDED_LIMIT periods, the cache is kept)
    assert c['trials'] == {'cached': 0, 'define-by-run': 0} and c['picked'] is None
    from fastchain.static import _cache
    with fastchain.enable(loader_workers=0):
        for _ in range(_cache.VOIDED_LIMIT + 2):
            optimizer.update(model, x, t)
            with chainer.using_config('train', False):
                model.predictor(x)
    [c] = _tuner.choices('static_graph')
    assert c['picked'] == 'cached' and c['trials'] == {'cached': 0, 'define-by-run': 0}


def test_a_bound_entrys_chainer_side_runs_chainers_kernel(tuner, monkeypatch):
    """In a cached schedule, the 'chainer' alternative of a bound entry is
    Chainer's kernel, not the define-by-run layer's choice (which would
    measure fastchain's kernel under Chainer's name)."""
    from fastchain.kernels import _bind
    monkeypatch.setitem(_tuner.forced, 'cpu_conv_bound', 'chainer')
    monkeypatch.setitem(_tuner.forced, 'cpu_conv', 'fastchain')
    planned = []      # for each planning: inside a bound entry's Chainer side?
    planner = _bind._convolution
    monkeypatch.setattr(_bind, '_convolution',
                        lambda *args: planned.append(_bind.chainers_kernel) or planner(*args))
    plain = train(None, 6)
    got = train({'static_graph': True, 'cpu_conv': True}, 6)
    assert_bitwise(plain, got)
    assert _tuner.forced_calls.get('cpu_conv_bound') and planned
    assert not any(planned)


def test_the_report_shows_what_was_picked_and_the_times(tuner):
    tuner.update(fastchain=0.002, chainer=0.001)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with fastchain.enable(loader_workers=0, cpu_conv=True) as h:
            model = convnet()
            optimizer = chainer.optimizers.SGD().setup(model)
            x, t = numpy.ones((4, 3, 12, 12), numpy.float32), numpy.zeros(4, numpy.int32)
            for _ in range(6):
                optimizer.update(model, x, t)
            choices = h.report()['autotune']['choices']
    conv = choices['cpu_conv']
    n = conv['keys']
    assert n >= 6 and conv['decided'] == n and conv['picked'] == {'chainer': n}
    assert conv['ms'] == {'fastchain': 2.0 * n, 'chainer': 1.0 * n}
    lines = fastchain.tune.describe(choices)
    assert 'cpu_conv: {} of {} keys decided: chainer {}; sum of medians: fastchain ' \
        '{:.1f} ms, chainer {:.1f} ms'.format(n, n, n, 2.0 * n, 1.0 * n) in lines


def test_a_kind_with_plans_of_its_own_per_key_is_summed_not_listed(tuner, monkeypatch):
    """cuDNN's plans are alternatives of one key each: the first GPU run's
    ladder report listed 136 keys' plans by name (80,000 characters on one
    line). Such a kind gets its most picked and what the picks saved over
    the defaults."""
    monkeypatch.setattr(_tuner, 'enabled', True)
    for k in range(12):
        # key k: its own three plans; the default (first) 3 ms, the others 1 and 2 ms
        names = ['k{} plan {}'.format(k, i) for i in range(3)]
        tuner.update({names[0]: 0.003, names[1]: 0.001, names[2]: 0.002})
        alternatives = tuple((n, lambda n=n: n) for n in names)
        for _ in range(40):
            _tuner.call('plans', (k,), alternatives)
    summary = _tuner.summary()['plans']
    assert summary['decided'] == summary['compared'] == 12
    assert summary['picked_ms'] == pytest.approx(12 * 1.0)
    assert summary['default_ms'] == pytest.approx(12 * 3.0)
    line, = _tuner.describe({'plans': summary})
    assert line == ('plans: 12 of 12 keys decided: 12 different picks, the most: k0 plan 1 1, '
                    'k1 plan 1 1, k2 plan 1 1, k3 plan 1 1, k4 plan 1 1, ...; sum of medians '
                    'over the 12 keys where both ran: the picks 12.0 ms, the defaults '
                    "(each key's first) 36.0 ms")


def test_a_kind_decided_before_any_trial_says_none_was_timed(tuner, monkeypatch):
    """Not '0.0 ms' for alternatives never timed (the GPU ladder's loader
    depth, decided when its tuning ran out)."""
    monkeypatch.setattr(_tuner, 'enabled', True)
    alternatives = tuple((n, lambda n=n: n) for n in 'ab')
    _tuner.call('k', ('two',), alternatives)            # warm-up only: nothing timed
    _tuner.decide_now(('k',))
    assert _tuner.summary()['k']['ms'] == {}
    assert _tuner.describe(_tuner.summary()) == [
        'k: 1 of 1 keys decided: a 1; sum of medians: none timed (the default kept)']


def test_decide_now_takes_the_fastest_timed_so_far_or_the_default(tuner, monkeypatch):
    monkeypatch.setattr(_tuner, 'enabled', True)
    tuner.update(a=3.0, b=1.0, c=2.0)
    alternatives = tuple((n, lambda n=n: n) for n in 'abc')
    # key 1: warmed up, then a and b timed once; c not yet
    for _ in range(5):
        _tuner.call('k', ('one',), alternatives)
    _tuner.call('k', ('two',), alternatives)            # warm-up only: nothing timed
    _tuner.call('other', ('x',), alternatives)          # another kind: left measuring
    got = _tuner.decide_now(('k',))
    assert [(d['key'], d['picked'], d['trials']) for d in got] == [
        ("('one',)", 'b', {'a': 1, 'b': 1, 'c': 0}),
        ("('two',)", 'a', {'a': 0, 'b': 0, 'c': 0})]
    assert [_tuner.call('k', ('one',), alternatives) for _ in range(3)] == ['b'] * 3
    assert [c['picked'] for c in _tuner.choices('other')] == [None]
    assert _tuner.decide_now(('k',)) == []              # nothing left to decide


@pytest.mark.parametrize('cached', [True, False])
@pytest.mark.parametrize('faster', ['fastchain', 'chainer'])
def test_a_decided_call_site_runs_its_pick_without_asking_again(tuner, monkeypatch, faster,
                                                                cached):
    """Once a convolution's (bound in a cached schedule, or define-by-run)
    or the fused update's key is decided, the call site runs the pick
    directly (a step makes ~300 such calls); forget() makes it measure
    again. Bit for bit plain Chainer throughout."""
    conv = 'cpu_conv_bound' if cached else 'cpu_conv'
    slower = {'fastchain': 'chainer', 'chainer': 'fastchain'}[faster]
    fused = 'fused' if faster == 'fastchain' else 'chainer'
    tuner.update({(conv, faster): 0.5, (conv, slower): 1.0,
                  ('fused_update', fused): 0.5,
                  ('fused_update', {'fused': 'chainer', 'chainer': 'fused'}[fused]): 1.0,
                  'cached': 0.5, 'define-by-run': 1.0})
    asked = []
    call = _tuner.call
    monkeypatch.setattr(_tuner, 'call', lambda kind, *a, **k: asked.append(kind) or
                        call(kind, *a, **k))
    kinds = (conv, 'fused_update')
    after = {}

    def inspect(model, optimizer, x, t):
        decided = {c['kind']: c['measured'] for c in _tuner.choices() if c['kind'] in kinds}
        assert decided == {conv: faster, 'fused_update': fused}
        assert all(c['picked'] is not None for c in _tuner.choices(conv))
        after['steps'] = 4
        for _ in range(40):     # the picks' check over whole steps, where they differ
            if not _steps.pending():
                break
            optimizer.update(model, x, t)
            after['steps'] += 1
        assert not _steps.pending()
        # trained on: no call site asks the tuner again
        before = len(asked)
        for _ in range(3):
            optimizer.update(model, x, t)
        after['decided'] = [k for k in asked[before:] if k in kinds]
        _tuner.forget()         # measured again from the next call
        before = len(asked)
        optimizer.update(model, x, t)
        after['forgotten'] = set(asked[before:]) & set(kinds)

    def as_many(model, optimizer, x, t):
        for _ in range(after['steps']):
            optimizer.update(model, x, t)
    got = train({'static_graph': cached, 'cpu_conv': True, 'fused_update': True}, 16,
                steps_then=inspect)
    plain = train(None, 16, steps_then=as_many)
    assert {k: after[k] for k in ('decided', 'forgotten')} == {'decided': [],
                                                               'forgotten': set(kinds)}
    assert_bitwise(plain, got)


def _picks_costs(step_faster):
    """Per call Chainer's kernels and update measure faster; over whole
    steps ``step_faster`` ('picks' or 'defaults') does."""
    other = {'picks': 'defaults', 'defaults': 'picks'}[step_faster]
    return {('cpu_conv', 'chainer'): 0.5, ('cpu_conv', 'fastchain'): 1.0,
            ('fused_update', 'chainer'): 0.5, ('fused_update', 'fused'): 1.0,
            ('per_call_picks', step_faster): 1.0, ('per_call_picks', other): 2.0}


@pytest.mark.parametrize('step_faster', ['picks', 'defaults'])
def test_the_per_call_picks_are_checked_over_whole_steps(tuner, monkeypatch, step_faster):
    """Picks faster alone but slower over whole steps give way to the
    defaults (fastchain's kernels); picks faster over whole steps stay.
    Bit for bit plain Chainer either way, while the two take turns too."""
    monkeypatch.setattr(_steps, 'TRIALS', 2)
    tuner.update(_picks_costs(step_faster))
    ran = _count_plans(monkeypatch)
    steps = 24
    got = train({'cpu_conv': True, 'fused_update': True}, steps,
                steps_then=lambda m, o, x, t: (ran.clear(), o.update(m, x, t)))
    plain = train(None, steps, steps_then=lambda m, o, x, t: o.update(m, x, t))
    assert_bitwise(plain, got)
    [check] = _tuner.choices('per_call_picks')
    assert check['picked'] == step_faster and check['trials'] == {'picks': 2, 'defaults': 2}
    per_call = _tuner.choices('cpu_conv') + _tuner.choices('fused_update')
    assert {c['measured'] for c in per_call} == {'chainer'}
    expected = {'picks': 'chainer', 'defaults': None}[step_faster]
    assert {c['picked'] for c in per_call} == (
        {'chainer'} if step_faster == 'picks' else {'fastchain', 'fused'})
    line = next(l for l in _tuner.describe(_tuner.summary()) if l.startswith('cpu_conv:'))
    assert ('picks overruled by the check over whole steps' in line) == (
        step_faster == 'defaults')
    # the last step ran fastchain's convolutions exactly where the check said so
    assert bool(ran) == (expected is None)
    assert not _steps.pending()


def test_picks_equal_to_the_defaults_are_not_checked(tuner):
    tuner.update({('cpu_conv', 'fastchain'): 0.5, ('cpu_conv', 'chainer'): 1.0,
                  ('fused_update', 'fused'): 0.5, ('fused_update', 'chainer'): 1.0})
    train({'cpu_conv': True, 'fused_update': True}, 12)
    assert _tuner.choices('cpu_conv') and _tuner.choices('per_call_picks') == []
    assert not _steps.pending()


def test_the_checks_verdict_is_kept_in_the_tune_cache(tuner, monkeypatch, tmp_path):
    """The file keeps what ran: a second run with it measures nothing and
    checks nothing, and runs the defaults the check kept."""
    monkeypatch.setattr(_steps, 'TRIALS', 2)
    tuner.update(_picks_costs('defaults'))
    cache = str(tmp_path / 'tune.json')
    train({'cpu_conv': True, 'fused_update': True, 'tune_cache': cache}, 24)
    [first] = _tuner.choices('per_call_picks')
    assert first['picked'] == 'defaults'
    _tuner.forget()
    ran = []
    monkeypatch.setattr(_tuner.Choice, 'record', lambda self, name, s: ran.append(self.kind))
    train({'cpu_conv': True, 'fused_update': True, 'tune_cache': cache}, 6)
    assert ran == []                            # nothing measured: all from the file
    assert _tuner.choices('per_call_picks') == [] and not _steps.pending()
    conv = _tuner.choices('cpu_conv')
    assert conv and {(c['picked'], c['from_cache']) for c in conv} == {('fastchain', True)}


def test_a_paired_choice_decides_by_the_ratios_of_neighbouring_times(monkeypatch):
    """The machine slowing down under one alternative's turns would mislead
    the medians of the times; the median of the i-th times' ratios is not."""
    monkeypatch.setattr(_tuner, 'TRIALS', 3)
    for paired, expected in ((True, 'p'), (False, 'd')):
        c = _tuner.Choice('k', 1, ('d', 'p'), 'k', paired=paired)
        for d, p in ((100, 99), (100, 297), (300, 297)):
            c.record('d', d)
            c.record('p', p)
        assert c.picked == expected
    tie = _tuner.Choice('k', 1, ('d', 'p'), 'k', paired=True)
    for _ in range(3):
        tie.record('d', 5.0)
        tie.record('p', 5.0)
    assert tie.picked == 'd'        # the first named wins a tie


def _model_and_data(seed=0):
    numpy.random.seed(seed)
    model = convnet()
    rng = numpy.random.RandomState(seed)
    x = rng.randn(4, 3, 12, 12).astype(numpy.float32)
    t = rng.randint(0, 5, 4).astype(numpy.int32)
    model(x, t)
    model.cleargrads()
    optimizer = chainer.optimizers.MomentumSGD(0.05).setup(model)
    return model, optimizer, x, t


def _until_turns(model, optimizer, x, t, limit=40):
    for _ in range(limit):
        optimizer.update(model, x, t)
        if _steps._check.phase == 'turns':
            return
    raise AssertionError('no check opened')


def test_a_check_whose_clock_stops_or_goes_is_given_up_and_comes_back(tuner, monkeypatch):
    """An optimizer that stops updating (another trains on) or is collected
    mid-check: its choices run their picks again, the unfinished check is
    dropped (nothing left undecided), and a later check takes them."""
    import gc
    monkeypatch.setattr(_steps, 'TRIALS', 4)
    tuner.update(_picks_costs('defaults'))
    with warnings.catch_warnings(), fastchain.enable(cpu_conv=True, fused_update=True,
                                                     loader_workers=0):
        warnings.simplefilter('ignore')
        first = _model_and_data()
        _until_turns(*first)
        checked = _steps._check.choices
        assert checked and _tuner.choices('per_call_picks')[0]['picked'] is None
        second = _model_and_data(1)             # trains on; the first stays alive
        for _ in range(_steps.IDLE_LIMIT + 1):
            second[1].update(second[0], *second[2:])
        assert _steps._check.phase in (None, 'collect')
        assert all(c.picked == c.measured for c in checked)     # their picks again
        assert _tuner.choices('per_call_picks') == []           # not left undecided
        for _ in range(40):                     # the second model's steps check them
            second[1].update(second[0], *second[2:])
            if not _steps.pending():
                break
        [check] = _tuner.choices('per_call_picks')
        assert check['picked'] == 'defaults'
        assert all(c.picked == c.names[0] for c in checked)
        # collected mid-check: the same
        _tuner.forget()
        third = _model_and_data(2)
        _until_turns(*third)
        checked = _steps._check.choices
        del third
        gc.collect()
        fourth = _model_and_data(3)
        fourth[1].update(fourth[0], *fourth[2:])
        assert all(c.picked == c.measured for c in checked)
        assert _tuner.choices('per_call_picks') == []


def test_an_evaluation_or_autotune_switched_off_voids_the_turn_it_falls_in(tuner, monkeypatch):
    monkeypatch.setattr(_steps, 'TRIALS', 2)
    tuner.update(_picks_costs('defaults'))
    with warnings.catch_warnings(), fastchain.enable(cpu_conv=True, fused_update=True,
                                                     loader_workers=0):
        warnings.simplefilter('ignore')
        model, optimizer, x, t = _model_and_data()
        _until_turns(model, optimizer, x, t)
        optimizer.update(model, x, t)           # the first turn starts, untimed
        from chainer.training.extensions import Evaluator
        data = chainer.datasets.TupleDataset(x, t)
        reporter = chainer.Reporter()
        reporter.add_observer('main', model)
        for _ in range(6):
            with reporter.scope({}):
                Evaluator(chainer.iterators.SerialIterator(data, 4, repeat=False,
                                                           shuffle=False), model).evaluate()
            optimizer.update(model, x, t)
        [check] = _tuner.choices('per_call_picks')
        assert check['trials'] == {'defaults': 0, 'picks': 0}   # every period voided
        with fastchain.enable(autotune=False):
            optimizer.update(model, x, t)
        optimizer.update(model, x, t)           # the period across the switch
        [check] = _tuner.choices('per_call_picks')
        assert check['trials'] == {'defaults': 0, 'picks': 0}


def test_a_cache_saved_mid_check_keeps_the_picks_and_a_shared_key_keeps_its_verdict(
        tuner, monkeypatch, tmp_path):
    monkeypatch.setattr(_steps, 'TRIALS', 3)
    tuner.update(_picks_costs('defaults'))
    from fastchain.tune import _cache
    with warnings.catch_warnings(), fastchain.enable(cpu_conv=True, fused_update=True,
                                                     loader_workers=0):
        warnings.simplefilter('ignore')
        model, optimizer, x, t = _model_and_data()
        _until_turns(model, optimizer, x, t)
        for _ in range(3):                      # the defaults' turn or the picks'
            optimizer.update(model, x, t)
        path = str(tmp_path / 'tune.json')
        _cache.save(path)
        import json
        stored = json.load(open(path))
        (machine,) = stored['machines'].values()
        assert {c['picked'] for c in machine['choices']['cpu_conv'].values()} == {'chainer'}
        for _ in range(40):
            if not _steps.pending():
                break
            optimizer.update(model, x, t)
        # another model of the same shapes: its keys are the first's, checked
        other = _model_and_data(1)
        for _ in range(12):
            other[1].update(other[0], *other[2:])
        assert len(_tuner.choices('per_call_picks')) == 1 and not _steps.pending()


def test_decide_now_decides_a_paired_choice_by_its_pairs_or_the_default(tuner):
    c = _tuner.choice('per_call_picks', 'k', ('defaults', 'picks'), paired=True)
    c.times['defaults'] += [1.0, 3.0, 5.0]
    c.times['picks'] += [0.9, 3.3, 4.5]         # medians: picks 3.3 > 3.0; pairs: 0.9 a side
    assert _tuner.decide_now(['per_call_picks'])[0]['picked'] == 'picks'
    d = _tuner.choice('per_call_picks', 'j', ('defaults', 'picks'), paired=True)
    d.times['picks'] += [0.1]                   # no pair: the default
    assert _tuner.decide_now(['per_call_picks'])[0]['picked'] == 'defaults'
