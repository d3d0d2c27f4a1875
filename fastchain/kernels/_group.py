"""The CPU-kernel group of ``fastchain.enable``: ``cpu_conv`` and ``fused_update``."""

import functools

from fastchain.config import _patches
from fastchain.config._options import Group, State, boolean

BIND_FLAG = 'fastchain.kernels._bind.enabled'


class KernelGroup(Group):
    name = 'kernels'
    options = (
        boolean('cpu_conv', "compute CPU convolutions (forward and both gradients) "
                "with fastchain's kernels, bitwise equal to Chainer's, and bind them "
                'into cached schedules (default: on; GPU convolutions are left to '
                'Chainer)'),
        boolean('fused_update', 'update SGD/MomentumSGD parameters on the CPU with a '
                "fused, cache-blocked kernel, bitwise equal to Chainer's (default: on; "
                "Chainer's GPU kernel is left as it is)"),
    )

    def probe(self):
        return [State('cpu_conv', True, False), State('fused_update', True, False)]

    def plan(self, values, explicit, plan):
        from fastchain.kernels import _bind, _conv
        if values['cpu_conv'] is not False:
            for cls, planner in _conv.functions():
                plan.wrap(cls, '_forward_cpu_core', 'cpu_conv',
                          functools.partial(_conv.planned_layer, planner))
        else:
            # Schedules built while cpu_conv=False is in force replay Chainer's code.
            plan.value(BIND_FLAG, lambda: _bind.enabled,
                       lambda v: setattr(_bind, 'enabled', v), False)
        if values['fused_update'] is not False:
            from chainer.optimizer import GradientMethod
            changes = plan.changes('fused_update', 'fused_update')
            plan.wrap(GradientMethod, 'setup', 'fused_update',
                      functools.partial(_fuse_layer, changes))

    def states(self, values, explicit):
        from chainer.optimizer import GradientMethod
        from fastchain.kernels import _conv
        conv = all(_patches.in_force(cls, '_forward_cpu_core', 'cpu_conv') is not None
                   for cls, _ in _conv.functions())
        fused = _patches.in_force(GradientMethod, 'setup', 'fused_update') is not None
        return [State('cpu_conv', True, conv, setting=values['cpu_conv'],
                      requested='cpu_conv' in explicit and values['cpu_conv'] is True),
                State('fused_update', True, fused, setting=values['fused_update'],
                      requested='fused_update' in explicit and values['fused_update'] is True)]


def _fuse_layer(changes, next_, optimizer, link):
    """While in force, every optimizer set up gets the fused update kernel."""
    from fastchain.kernels._update import fuse
    result = next_(optimizer, link)
    fuse(optimizer, changes)
    return result


GROUP = KernelGroup()
