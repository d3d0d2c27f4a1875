"""The static-graph group of ``fastchain.enable``: the static-subgraph cache."""

import collections
import functools
import weakref

from fastchain.config import _patches
from fastchain.config._options import Group, State, boolean


class StaticGraphGroup(Group):
    name = 'static_graph'
    options = (
        boolean('static_graph', "cache the static subgraph of each optimizer's model "
                '(its predictor, for L.Classifier) to cut per-iteration Python '
                'overhead (default: off)', default=False),
    )

    def probe(self):
        return [State('static_graph', True, False)]

    def plan(self, values, explicit, plan):
        if values['static_graph']:
            from chainer.optimizer import GradientMethod
            changes = plan.changes('static_graph', 'static_graph')
            plan.wrap(GradientMethod, 'setup', 'static_graph',
                      functools.partial(_setup_layer, changes))

    def states(self, values, explicit):
        from chainer.optimizer import GradientMethod
        on = _patches.in_force(GradientMethod, 'setup', 'static_graph') is not None
        state = State('static_graph', True, on, requested='static_graph' in explicit
                      and bool(values['static_graph']), setting=values['static_graph'])
        state.calls = models()
        return [state]


def _add(fell, name, why):
    """``fell[name] = why``; two models of one class that fell back for
    different reasons are 'Net' and 'Net (2)' (one hid the other's reason)."""
    k, key = 1, name
    while key in fell and fell[key] != why:
        k += 1
        key = '{} ({})'.format(name, k)
    fell[key] = why


def models():
    """{'cached': models replaying (or still verifying) their schedules,
    'define_by_run': {model: why} for those that fell back, 'not_bitwise':
    {model: why} for cached models whose parameters get gradient terms from
    outside the call (:mod:`fastchain.static._outside`)}, over the live
    caches (an option's or ``fastchain.static_graph``'s); None if none."""
    from fastchain.static import _cache
    live = [c for c in list(_cache.LIVE) if c.ref() is not None]
    refused = list(_NOT_CACHED.items())
    if not live and not refused:
        return None
    fell = {}
    for name, why in ([(type(link).__name__, why) for link, why in refused]
                      + [(c.name, c.state['fallback']) for c in live
                         if c.state['fallback'] is not None]):
        _add(fell, name, why)
    kept = [c for c in live if c.state['fallback'] is None]
    # autotune decided define-by-run for every structure it measured: the
    # model trains define-by-run (it read "cached", a new-user trial)
    tuned_out = [c for c in kept if _tuned_out(c)]
    for c in tuned_out:
        _add(fell, c.name, TUNED_OUT)
    names = collections.Counter(c.name for c in kept if c not in tuned_out)
    order = {c.name: c.state['not_bitwise'] for c in kept if c.state.get('not_bitwise')}
    return {'cached': dict(sorted(names.items())), 'define_by_run': fell,
            'not_bitwise': order}


TUNED_OUT = ('autotune measured define-by-run faster over whole steps (or it is forced), so '
             "it trains define-by-run (fastchain.tune.choices('static_graph') has the times)")


def _tuned_out(cache):
    """autotune has this model train define-by-run now: it is on (off, the
    cache replays whatever was picked) and forces or picked it for every
    structure measured."""
    from fastchain.tune import _tuner
    if not _tuner.enabled or not cache.structures:
        return False
    forced = _tuner.forced.get('static_graph')
    if forced is not None:
        return forced == 'define-by-run'
    picks = {_tuner.pick('static_graph', s) for s in cache.structures.values()}
    return picks == {'define-by-run'}


# Models an optimizer was set up with that the cache cannot take (a single
# link), with why: for the report, as long as they live.
_NOT_CACHED = weakref.WeakKeyDictionary()


def chain_of(target):
    """The model the cache takes for an optimizer's target: for a
    Classifier, its predictor (the loss is not part of the static graph)."""
    import chainer.links as L
    return target.predictor if isinstance(target, L.Classifier) else target


def not_cached(chain, stacklevel):
    """``chain`` (a Link that is not a Chain) trains define-by-run: kept for
    the report and said."""
    import warnings
    from fastchain.static._cache import StaticGraphFallback
    from fastchain.static._mark import not_a_chain
    _NOT_CACHED[chain] = not_a_chain(chain)
    warnings.warn(_NOT_CACHED[chain] + '; it trains define-by-run', StaticGraphFallback,
                  stacklevel=stacklevel + 1)


def _setup_layer(changes, next_, optimizer, link):
    """While in force, the model of every optimizer set up is cached."""
    import chainer
    from fastchain.static._cache import is_cached
    from fastchain.static._mark import cache_static_graph
    result = next_(optimizer, link)
    chain = chain_of(link)
    if not isinstance(chain, chainer.Chain):
        not_cached(chain, _patches.user_stacklevel())
    elif not is_cached(chain) and 'forward' not in vars(chain):
        cache_static_graph(chain, changes=changes)
    return result


GROUP = StaticGraphGroup()
