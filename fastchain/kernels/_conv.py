"""fastchain's CPU convolution kernels in define-by-run (``cpu_conv``).

The kernels of :mod:`fastchain.kernels._bind` are planned per call here: the
plan is made from the call's arrays and run at once. Define-by-run thus gets
what does not depend on a schedule (no ``numpy.pad``, the im2col columns
copied once instead of twice, ``numpy.matmul`` instead of ``numpy.dot``, which
zero-fills its output before BLAS writes it), and a cached schedule adds
planning once (its bound kernels). Results stay bitwise equal to Chainer's
(tested): the same BLAS products of equal operands, the same accumulation.

Only ``_forward_cpu_core`` of the three convolution functions gets a layer
(``cpu_conv``), so Chainer's type checks, layouts and dispatch (GPU, iDeep,
grouped) stay Chainer's; inside, anything the kernels do not plan for (iDeep,
``cover_all``, non-standard layouts, non-NumPy arrays) goes to Chainer's code.

With ``autotune`` (:mod:`fastchain.tune`), each call key (the function,
the shapes and dtypes of its arrays, stride, padding, dilation) runs the
faster of the two kernels, measured on its first calls: both give the same
bits, and which one is faster depends on the key and the BLAS. Where the
``onednn`` option allows it (not bitwise equal: :mod:`fastchain.kernels._onednn`),
oneDNN's kernel runs instead, for every call it qualifies for.
"""

from fastchain.kernels import _bind, _onednn
from fastchain.kernels._keys import call_key, describe
from fastchain.tune import _tuner


def planned_layer(planner, next_, node, *arrays):
    """The ``cpu_conv`` layer of ``_forward_cpu_core``: oneDNN's kernel where
    ``onednn`` allows it and the call qualifies, else ``planner``'s plan for
    this call (or Chainer's code, where autotune measured it faster), or
    Chainer's code where the planners do not apply."""
    inputs = tuple(a for a in arrays if a is not None)     # no bias: (x, W)
    if _bind.chainers_kernel or not (_bind._plain_node(node) and _bind._plain(inputs)):
        return next_(node, *arrays)

    def fastchain():
        plan = planner(node, inputs, {})
        return next_(node, *arrays) if plan is None else plan(inputs)
    onednn = _onednn.convolution_kernel(node, inputs)
    if onednn is not None:
        return onednn()         # allowed by the user: not measured (_onednn, "Autotune")
    if not _tuner.enabled:
        return fastchain()
    key = call_key(node, inputs)
    # once decided, run the pick directly (define-by-run makes ~160 of these
    # calls a ResNet-50 step, each on a new node: the pick is kept per key)
    kept = _picks.get(key)
    if kept is not None and kept[0] == _tuner.generation and not _tuner.forced:
        return fastchain() if kept[1] == 'fastchain' else next_(node, *arrays)
    generation = _tuner.generation      # before the pick: a forget() between
    out = _tuner.call('cpu_conv', key, (('fastchain', fastchain),
                                        ('chainer', lambda: next_(node, *arrays))),
                      label=lambda: describe(key))
    picked = _tuner.pick('cpu_conv', key)
    if picked is not None:
        _picks[key] = (generation, picked)
    return out


_picks = {}     # autotune's decided alternative per call key: (generation, name)


def onednn_layer(next_, node, *arrays):
    """The ``onednn`` layer of ``_forward_cpu_core`` where ``cpu_conv`` is off
    (with ``cpu_conv`` on, its layer calls oneDNN first): oneDNN's kernel
    where the call qualifies, else Chainer's."""
    inputs = tuple(a for a in arrays if a is not None)
    kernel = None
    if _bind._plain_node(node) and _bind._plain(inputs):
        kernel = _onednn.convolution_kernel(node, inputs)
    return next_(node, *arrays) if kernel is None else kernel()


def functions():
    """(function class, planner) for the three convolution functions."""
    return _bind.planners().items()
