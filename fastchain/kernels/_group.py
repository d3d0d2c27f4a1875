"""The CPU-kernel group of ``fastchain.enable``: ``cpu_conv``, ``fused_update``
and ``onednn``."""

import functools
import weakref

from fastchain.config import _patches
from fastchain.config._options import Group, State, boolean

BIND_FLAG = 'fastchain.kernels._bind.enabled'
ONEDNN_FLAG = 'fastchain.kernels._onednn.enabled'
BLAS_THREADS = "NumPy's BLAS threads"
NOT_BITWISE = ("PyTorch {}'s oneDNN convolutions and BatchNormalization kernels {}: "
               "results are NOT bitwise equal to Chainer's (each convolution output "
               "within 2**-16 of the sum of the magnitudes it adds up; a training run within the "
               "differential suite's tolerance, README 'The same training'); NumPy's "
               "BLAS runs on one thread meanwhile, leaving the cores to oneDNN's")
IN_FORCE = 'are in force'
WHEN_ON = 'are used with onednn=True (not now)'


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
        boolean('onednn', "compute float32 CPU convolutions (forward and both gradients) "
                "with oneDNN and BatchNormalization with PyTorch's CPU kernels, from "
                "PyTorch's CPU build; NOT bitwise equal to Chainer: each convolution "
                "output within 2**-16 of the sum of the magnitudes it adds up; used for "
                "every call it qualifies for, not measured by autotune; default: off",
                default=False),
    )

    def probe(self):
        return [State('cpu_conv', True, False), State('fused_update', True, False),
                _onednn_probe(in_force=False)]

    def plan(self, values, explicit, plan):
        from fastchain.kernels import _bind, _conv, _onednn
        onednn = values['onednn'] is True and _onednn.status(load=True)[0]
        if onednn:
            from fastchain.kernels import _onednn_bn
            plan.value(ONEDNN_FLAG, lambda: _onednn.enabled,
                       lambda v: setattr(_onednn, 'enabled', v), True)
            plan.value(BLAS_THREADS, _onednn.blas_threads, _onednn.set_blas_threads,
                       _onednn.one_blas_thread())
            for owner, name, layer in _onednn_bn.functions():
                plan.wrap(owner, name, 'onednn', layer)
        if values['cpu_conv'] is not False:
            for cls, planner in _conv.functions():
                plan.wrap(cls, '_forward_cpu_core', 'cpu_conv',
                          functools.partial(_conv.planned_layer, planner))
        else:
            if onednn:
                for cls, _ in _conv.functions():
                    plan.wrap(cls, '_forward_cpu_core', 'onednn', _conv.onednn_layer)
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
        layer = _patches.in_force(GradientMethod, 'setup', 'fused_update')
        fused = layer is not None
        update = State('fused_update', True, fused, setting=values['fused_update'],
                       requested='fused_update' in explicit and values['fused_update'] is True)
        if fused:
            update.calls = _rules(layer.args[0])
            if not update.calls['fused'] and update.calls['kept']:
                # (a review: active and requested, none fused, nothing said)
                update.note = ('no update rule is fused: it takes the SGD and MomentumSGD rules '
                               "of parameters on the CPU; those set up keep Chainer's update "
                               '({})'.format(', '.join('{} {}'.format(k, n) for k, n in sorted(
                                   update.calls['kept'].items()))))
        return [State('cpu_conv', True, conv, setting=values['cpu_conv'],
                      requested='cpu_conv' in explicit and values['cpu_conv'] is True),
                update, self._onednn_state(values, explicit)]

    def _onednn_state(self, values, explicit):
        from fastchain.kernels import _onednn, _onednn_bn
        active = _onednn.enabled and all(
            _patches.in_force(owner, name, 'onednn') is not None
            for owner, name, _ in _onednn_bn.functions())
        state = _onednn_probe(in_force=active)
        state.setting = values['onednn']
        state.requested = 'onednn' in explicit and values['onednn'] is True
        state.active = active
        if state.active:
            state.calls = dict(_onednn.calls)     # operation -> calls so far
        elif state.available and values['onednn'] is not True:
            state.why = 'onednn=False (the default: it is not bitwise equal to Chainer)'
        return state


def _onednn_probe(in_force):
    """The onednn state as this machine offers it; its note says what the
    kernels change, as in force now or as what onednn=True would do."""
    from fastchain.kernels import _onednn
    available, version, why, fix = _onednn.status()
    return State('onednn', available, False, why=why, fix=fix, note=None if not available
                 else NOT_BITWISE.format(version, IN_FORCE if in_force else WHEN_ON))


_SET_UP = weakref.WeakKeyDictionary()      # optimizer set up -> the layer's Changes


def _fuse_layer(changes, next_, optimizer, link):
    """While in force, every optimizer set up gets the fused update kernel."""
    from fastchain.kernels._update import fuse
    result = next_(optimizer, link)
    fuse(optimizer, changes)
    _SET_UP[optimizer] = changes
    return result


def _rules(changes):
    """{'fused': rules with the fused kernel, 'kept': {why: rules}} of the
    optimizers set up under the layer in force now (its ``changes``; not
    under an earlier handle's) that still live (a parameter on a GPU keeps
    Chainer's GPU kernel; other rules are kept by their class)."""
    import numpy
    from fastchain.kernels._update import is_fused
    fused, kept = 0, {}
    for optimizer in [o for o, c in list(_SET_UP.items()) if c.current() is changes]:
        for param in optimizer.target.params():
            rule = param.update_rule
            if rule is None:
                continue
            if is_fused(rule) and param.device.xp is numpy:
                fused += 1
            else:
                why = type(rule).__name__ if not is_fused(rule) else 'on a GPU'
                kept[why] = kept.get(why, 0) + 1
    return {'fused': fused, 'kept': kept}


GROUP = KernelGroup()
