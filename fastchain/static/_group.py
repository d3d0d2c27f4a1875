"""The per-iteration host-time group of ``fastchain.enable``: the static-graph
cache, fastchain's CPU convolution kernels and the fused CPU update."""

from fastchain.config._options import Group, State, boolean


class StaticGraphGroup(Group):
    name = 'static_graph'
    options = (
        boolean('static_graph', "cache the static subgraph of each optimizer's model "
                '(its predictor, for L.Classifier) to cut per-iteration Python '
                'overhead (default: off)', default=False),
        boolean('cpu_conv', "compute CPU convolutions (forward and both gradients) "
                "with fastchain's kernels, bitwise equal to Chainer's, and bind them "
                'into cached schedules (default: on; GPU convolutions are left to '
                'Chainer)'),
        boolean('fused_update', 'update SGD/MomentumSGD parameters on the CPU with a '
                "fused, cache-blocked kernel, bitwise equal to Chainer's (default: on; "
                "Chainer's GPU kernel is left as it is)"),
    )

    def probe(self):
        return [State('static_graph', True, False), State('cpu_conv', True, False),
                State('fused_update', True, False)]

    def apply(self, values, explicit, recorder):
        static = State('static_graph', True, bool(values['static_graph']),
                       requested='static_graph' in explicit, setting=values['static_graph'])
        fused = State('fused_update', True, values['fused_update'] is not False,
                      requested='fused_update' in explicit, setting=values['fused_update'])
        conv = State('cpu_conv', True, values['cpu_conv'] is not False,
                     requested='cpu_conv' in explicit, setting=values['cpu_conv'])
        from fastchain.kernels import _conv
        if conv.active:
            _conv.install(recorder)
        else:
            _conv.remove(recorder)
        if static.active:
            from fastchain.static import _fixes
            if _fixes.install():
                recorder.call('chainer static_graph fixes', lambda: None, _fixes.uninstall)
        if static.active or fused.active:
            _wrap_setup(recorder, static.active, fused.active)
        return [static, conv, fused]


def _wrap_setup(recorder, static, fused):
    import chainer
    from chainer.optimizer import GradientMethod
    from fastchain.static._cache import cache_static_graph
    from fastchain.kernels._update import fuse
    setup = GradientMethod.setup

    def setup_and_apply(self, link):
        result = setup(self, link)
        if fused:
            undo, n = fuse(self)
            if n:
                recorder.call('fused update of {} rules of {}'.format(
                    n, type(self).__name__), lambda: None, undo)
        if static:
            chain = getattr(link, 'predictor', None)
            if not isinstance(chain, chainer.Chain):
                chain = link
            if 'forward' not in vars(chain):
                undo = cache_static_graph(chain)
                recorder.call('static graph of {}'.format(type(chain).__name__),
                              lambda: None, undo)
        return result

    setup_and_apply.__wrapped__ = setup
    recorder.set_attr(GradientMethod, 'setup', setup_and_apply,
                      label='GradientMethod.setup (static_graph, fused_update)')


GROUP = StaticGraphGroup()
