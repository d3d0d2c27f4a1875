"""fastchain's CPU convolution kernels in define-by-run (``cpu_conv``).

The kernels of :mod:`fastchain.kernels._bind` are planned per call here: the
plan is made from the call's arrays and run at once. Define-by-run thus gets
what does not depend on a schedule (no ``numpy.pad``, the im2col columns
copied once instead of twice, ``numpy.matmul`` instead of ``numpy.dot``, which
zero-fills its output before BLAS writes it), and a cached schedule adds
planning once (its bound kernels). Results stay bitwise equal to Chainer's
(tested): the same BLAS products of equal operands, the same accumulation.

Only ``_forward_cpu_core`` of the three convolution functions is replaced,
so Chainer's type checks, layouts and dispatch (GPU, iDeep, grouped) stay
Chainer's; inside, anything the kernels do not plan for (iDeep, ``cover_all``,
non-standard layouts, non-NumPy arrays) goes to Chainer's code.
"""

from fastchain.kernels import _bind


def _planned(original, planner):
    """``_forward_cpu_core`` that runs ``planner``'s plan for this call, or
    Chainer's ``original`` where the planners do not apply."""
    def _forward_cpu_core(self, *arrays):
        inputs = tuple(a for a in arrays if a is not None)     # no bias: (x, W)
        plan = None
        if _bind._plain_node(self) and _bind._plain(inputs):
            plan = planner(self, inputs, {})
        if plan is None:
            return original(self, *arrays)
        return plan(inputs)
    _forward_cpu_core.__wrapped__ = original
    return _forward_cpu_core


def _functions():
    return _bind.planners().items()


def install(recorder):
    """Give the three convolution functions fastchain's CPU kernels (and let
    schedules bind them); undone with ``recorder``."""
    for cls, planner in _functions():
        core = cls._forward_cpu_core
        if getattr(core, 'fastchain_cpu_conv', False):
            continue            # an enclosing handle installed it already
        new = _planned(core, planner)
        new.fastchain_cpu_conv = True
        recorder.set_attr(cls, '_forward_cpu_core', new,
                          label='{}._forward_cpu_core (cpu_conv)'.format(cls.__name__))
    recorder.set_attr(_bind, 'enabled', True, label='static schedules bind kernels (cpu_conv)')


def remove(recorder):
    """``cpu_conv=False``: Chainer's kernels, also where an enclosing handle
    installed fastchain's, and schedules built from now on replay Chainer's
    code; undone with ``recorder``."""
    for cls, _ in _functions():
        core = cls._forward_cpu_core
        if getattr(core, 'fastchain_cpu_conv', False):
            recorder.set_attr(cls, '_forward_cpu_core', core.__wrapped__,
                              label='{}._forward_cpu_core (cpu_conv=False)'.format(
                                  cls.__name__))
    recorder.set_attr(_bind, 'enabled', False,
                      label='static schedules bind kernels (cpu_conv=False)')
