"""The one owner of every place fastchain changes Chainer.

A *point* is one attribute fastchain changes: a class's method, a module's
function, an object's method, or a value (a ``chainer.config`` key, cuDNN's
workspace size, a module flag). A function point is replaced at most once, by
a dispatcher that calls the *layers* on it now, outermost first, around what
was there before (Chainer's code, or someone else's patch). Adding a layer
and removing it never touches another layer, and a point goes back to what
was there only when its last layer leaves and the attribute still holds
fastchain's dispatcher; if something else replaced it meanwhile (a user's own
patch that calls ours), the dispatcher stays as a pass-through inside that
patch and is taken out at the next enable() or disable() after the
attribute holds it again.

Layers run in one fixed order on every point (``ORDER``, outermost first):

============  ==============================================================
layer         why it sits where it does
============  ==============================================================
nvtx          observes: its ranges must cover all the work inside them (the
              fp16 cast in a conversion, the data-parallel averaging after
              backward), and it annotates optimizers and updaters after every
              other layer has set them up
autotune      a clock: on ``GradientMethod.update`` it marks where each step
              starts, on ``Evaluator.evaluate`` that an evaluation came
              between two steps, for the check of the per-call picks over
              whole steps (``fastchain/tune/_steps.py``); it changes nothing
              it wraps
distributed   averages gradients after backward and before the overflow
              check, so every later step sees what all ranks see
static_graph  caches a model's forward once the optimizer is set up, on the
              parameters fp16 made
fused_update  replaces update kernels of rules the inner layers have set up
cpu_conv      replaces convolution kernels (nothing runs inside it)
onednn        replaces convolution kernels where cpu_conv is off, and
              BatchNormalization's (nothing runs inside it)
cudnn         runs GPU convolutions (and, with FASTCHAIN_CUDNN_BN=1,
              BatchNormalization) through cuDNN graphs where CuPy has no
              cuDNN; on the BatchNormalization
              points it passes CPU arrays on to Chainer, as onednn passes
              GPU arrays, so the two never both act on one call
fp16          innermost on ``GradientMethod.setup``: fp32 master weights and
              the loss scaler are attached first, so the layers outside see
              the finished optimizer; inside nvtx on the converter, so the
              'convert' range covers the cast
loader        innermost on ``StandardUpdater.__init__``: the iterator is
              replaced first, and nvtx annotates the one that will run
============  ==============================================================

The points (see DEVELOPERS.md for the map of one training step):

=========================================  ==========================================
point                                      layers
=========================================  ==========================================
``GradientMethod.setup``                   nvtx, static_graph, fused_update, fp16
``GradientMethod.update``,                 autotune
``Evaluator.evaluate``
``chainer.dataset.convert._call_converter``  nvtx, fp16
``StandardUpdater.__init__``               nvtx, loader
``chainer.Variable.backward``              fp16
``Trainer.run``                            nvtx, distributed (held while a block
                                           learner lives: its ``finish()`` after a run)
``Trainer.serialize``                      distributed (held while a
                                           ``multi_node_snapshot`` lives: a load checks
                                           the snapshot's number of ranks first)
``<Convolution/Deconvolution>._forward_cpu_core``  cpu_conv, onednn (only one of them)
``BatchNormalization.forward``,            onednn, cudnn
``FixedBatchNormalization.forward``
``Convolution2DFunction.forward_gpu``,     cudnn
``Deconvolution2DFunction.forward_gpu``,
``Convolution2DGradW.forward_gpu``
``BatchNormalization.backward``,           static_graph (held while a chain is cached)
``FixedBatchNormalization.backward``,
``StaticScheduleFunction.build_schedule``,
``StaticScheduleFunction.apply``,
``StaticScheduleFunction.backward``,
``static_graph.print``
``Variable.array``, ``Variable.data``      static_graph (while a key is recorded)
(getters), ``chainer.report``
``ShuffleOrderSampler.__call__``           static_graph (while a call is verified)
optimizer instance: ``update``,            nvtx, distributed, fp16
``reallocate_cleared_grads``,
``check_nan_in_grads``, ``call_hooks``,
``is_safe_to_update``,
``update_loss_scale``, ``serialize``,
``setup``
rule instance ``update_core_cpu``          fused_update
chain instance ``forward``                 static_graph
updater ``update``, iterator ``next``      nvtx
evaluator ``evaluate``                     distributed
=========================================  ==========================================

A layer is ``fn(next, *args, **kwargs)``: ``next`` continues inward. On a
class point ``args`` starts with ``self``; on an object's own point it does
not (the call was already bound).

A copy of an object with a point on it (``copy.copy``, ``copy.deepcopy``,
``Link.copy``, pickle) is a plain object: its state leaves the dispatchers
out (they are bound to the original), through an ``__reduce_ex__`` of the
object's own that fastchain keeps there while a point is installed; an
owner may give copies attributes to be taken up by (``carry_into_copies``:
an fp16 optimizer's copy carries its scaler).

Objects are held weakly: points on objects, attachments (``attached()``, the
explicit lookups that replace marker attributes) and the :class:`Changes`
a handle keeps all let their objects be collected.
"""

from fastchain.config._patches._common import MISSING, lock, user_stacklevel
from fastchain.config._patches._objects import Changes, attach, attached, detach
from fastchain.config._patches._copies import carry_into_copies, is_ours, leave_out_of_copies
from fastchain.config._patches._points import (ORDER, Point, in_force, layers, points, sweep,
                                               unwrap, wrap)
from fastchain.config._patches._values import (clear_value, original_value, set_value,
                                               value_labels)

__all__ = ['Changes', 'MISSING', 'ORDER', 'Point', 'attach', 'attached', 'carry_into_copies',
           'clear_value', 'detach', 'in_force', 'is_ours', 'layers', 'leave_out_of_copies',
           'lock', 'original_value', 'points', 'set_value', 'sweep', 'unwrap',
           'user_stacklevel', 'value_labels', 'wrap']
