"""The static-graph group of ``fastchain.enable``."""

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

    def apply(self, values, explicit, recorder):
        state = State('static_graph', True, bool(values['static_graph']),
                      requested='static_graph' in explicit, setting=values['static_graph'])
        if not values['static_graph']:
            return [state]
        from fastchain.static import _fixes
        if _fixes.install():
            recorder.call('chainer static_graph fixes', lambda: None, _fixes.uninstall)
        _wrap_setup(recorder)
        return [state]


def _wrap_setup(recorder):
    import chainer
    from chainer.optimizer import GradientMethod
    from fastchain.static._cache import cache_static_graph
    setup = GradientMethod.setup

    def setup_with_cache(self, link):
        result = setup(self, link)
        chain = getattr(link, 'predictor', None)
        if not isinstance(chain, chainer.Chain):
            chain = link
        if 'forward' not in vars(chain):
            undo = cache_static_graph(chain)
            recorder.call('static graph of {}'.format(type(chain).__name__),
                          lambda: None, undo)
        return result

    setup_with_cache.__wrapped__ = setup
    recorder.set_attr(GradientMethod, 'setup', setup_with_cache,
                      label='GradientMethod.setup (static_graph)')


GROUP = StaticGraphGroup()
