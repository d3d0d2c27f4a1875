"""The fp16 accelerator group of ``fastchain.enable``."""

import functools
import warnings

from fastchain.backends import cuda
from fastchain.config import _patches
from fastchain.config._options import Group, Option, State
from fastchain.config._warning import FastchainWarning
from fastchain.precision import _attach, _copied, _snapshot
from fastchain.precision._scaler import DynamicLossScaler

# cuDNN's TensorCore algorithms want room; Chainer's default is 8 MiB.
FP16_WORKSPACE = 512 * 2 ** 20


def _loss_scale(value):
    if value == 'dynamic' or value is False:
        return value
    if isinstance(value, dict):
        import inspect
        known = list(inspect.signature(DynamicLossScaler).parameters)
        unknown = sorted(set(value) - set(known), key=str)
        if unknown:
            raise ValueError('DynamicLossScaler has no argument {}; its arguments are {}'
                             .format(', '.join(map(repr, unknown)), ', '.join(known)))
        DynamicLossScaler(**value)      # validates now, not at the first step
        return dict(value)
    fixed = ''
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        fixed = (' (a fixed scale is the dict {{\'init_scale\': {0}, \'min_scale\': {0}, '
                 '\'max_scale\': {0}}}: steps that overflow are still skipped)'.format(value))
    raise ValueError("expected 'dynamic', False, or a dict of "
                     "DynamicLossScaler arguments" + fixed)


class Fp16Group(Group):
    name = 'fp16'
    options = (
        Option('fp16', 'fp16 compute with fp32 master weights and dynamic loss '
               "scaling: True, False (default), or 'auto' (on where a GPU with "
               'TensorCores is present)', default=False, choices=(True, False, 'auto')),
        Option('loss_scale', "with fp16: 'dynamic' (default), a dict of "
               'DynamicLossScaler arguments, or False for none',
               default='dynamic', check=_loss_scale),
    )

    def probe(self):
        return [State('fp16', True, False)]

    def unused(self, values, own):
        # 'auto' off on this machine is the user's choice, made per machine
        if 'loss_scale' in own and values['fp16'] is False:
            return ['loss_scale={!r} has no effect: fp16 is off, and loss scaling is '
                    "part of fp16's training (give fp16=True with it)".format(
                        values['loss_scale'])]
        return []

    def plan(self, values, explicit, plan):
        from chainer.optimizer import GradientMethod
        if not _wanted(values['fp16']):
            # a snapshot of an fp16 run, loaded: its masters are not read, said
            plan.wrap(GradientMethod, 'serialize', 'fp16', _masters_not_read)
            return
        import chainer
        from chainer.dataset import convert
        plan.config('dtype', chainer.mixed16)
        changes = plan.changes('fp16', 'fp16')
        plan.wrap(GradientMethod, 'setup', 'fp16', functools.partial(
            _setup_layer, loss_scale=values['loss_scale'], changes=changes))
        for name, layer in (('update', _copied.take_up),
                            ('serialize', _copied.take_up_to_serialize)):
            plan.wrap(GradientMethod, name, 'fp16', functools.partial(
                layer, loss_scale=values['loss_scale'], changes=changes))
        plan.wrap(convert, '_call_converter', 'fp16', _cast_layer)
        plan.wrap(convert._ArbitraryCallableConverter, '__call__', 'fp16', _direct_cast_layer)
        plan.wrap(chainer.Variable, 'backward', 'fp16', _attach.record_backward_scale)
        from fastchain.cudnn._group import graph_status
        if cuda.cudnn_status().available or graph_status().available:
            # TensorCores need fp16 data (now the default dtype) and cuDNN's
            # 'auto' TensorCore mode; give their algorithms workspace.
            if 'tensor_cores' not in explicit:
                plan.config('use_cudnn_tensor_core', 'auto')
            if 'workspace_size' not in explicit:
                from fastchain.cudnn._group import WORKSPACE, workspace_accessors
                get, set_ = workspace_accessors()
                if _patches.original_value(WORKSPACE, get) < FP16_WORKSPACE:
                    plan.value(WORKSPACE, get, set_, FP16_WORKSPACE)

    def states(self, values, explicit):
        import chainer
        from chainer.optimizer import GradientMethod
        fp16 = values['fp16']
        state = State('fp16', True, False, requested='fp16' in explicit and fp16 is True,
                      setting=fp16)
        if fp16 == 'auto' and not _wanted(fp16):
            state.why = ('auto: no GPU with TensorCores here, and fp16 is '
                         'slower than fp32 on a CPU')
        layer = _patches.in_force(GradientMethod, 'setup', 'fp16')
        if layer is None:
            return [state]
        if chainer.global_config.dtype is not chainer.mixed16:
            state.why = ('chainer.config.dtype was changed to {} after enable(fp16=True)'
                         .format(chainer.global_config.dtype))
            return [state]
        if chainer.config.dtype is not chainer.mixed16:
            state.why = _attach.hidden_dtype()
            return [state]
        state.active = True
        if not cuda.available():
            state.note = ('fp16 runs on the CPU through NumPy, which has no fast fp16 '
                          'matrix multiply, so it is slower than fp32 there; it is meant '
                          'for GPUs with TensorCores')
        return [state]


def _wanted(fp16):
    return cuda.tensor_cores_available() if fp16 == 'auto' else bool(fp16)


def _setup_layer(next_, optimizer, link, *, loss_scale, changes):
    """While fp16 is in force, every optimizer set up gets fp32 masters and a scaler."""
    result = next_(optimizer, link)
    _copied.forget(optimizer)
    _attach.check_model_dtype(link)
    if loss_scale is False:
        scaler = None
    else:
        scaler = DynamicLossScaler(**(loss_scale if isinstance(loss_scale, dict) else {}))
    _copied.attach(optimizer, scaler, changes)     # (and what a copy of it takes up)
    return result


def _cast_layer(next_, converter, batch, device):
    """Cast floating batches to the fp16 compute dtype after the converter.

    Chainer's StandardUpdater and Evaluator both turn a batch into arrays
    through ``chainer.dataset.convert._call_converter``, whatever converter
    the script passes: the arrays arrive on the device in the dtype the
    dataset made (fp32: no NumPy fp16 arithmetic on the host) and are cast
    there. Integer arrays (labels, uint8 images) pass unchanged.
    """
    return cast_floating(next_(converter, batch, device))


def _direct_cast_layer(next_, converter, *args, **kwargs):
    """A converter called directly casts too: a custom updater's
    ``self.converter(batch, device)`` and a script's own loop calling
    ``concat_examples`` (Chainer's DCGAN and custom-loop examples) bypass
    ``_call_converter``, and their float32 batches met float16 layers
    (Chainer's 'float16 != float32' type error). Converters made with
    ``chainer.dataset.converter()`` (``concat_examples`` is one) are these;
    a plain function called directly is not seen."""
    return cast_floating(next_(converter, *args, **kwargs))


def cast_floating(arrays, dtype=None):
    """Cast the floating arrays in ``arrays`` (array, tuple, list or dict) to
    ``dtype`` (default: Chainer's compute dtype), on the device they are on."""
    import chainer
    if dtype is None:
        dtype = chainer.get_dtype()
    if isinstance(arrays, tuple):
        cast = [cast_floating(a, dtype) for a in arrays]
        return arrays._make(cast) if hasattr(arrays, '_make') else type(arrays)(cast)
    if isinstance(arrays, list):
        return [cast_floating(a, dtype) for a in arrays]
    if isinstance(arrays, dict):
        return {k: cast_floating(a, dtype) for k, a in arrays.items()}
    kind = getattr(getattr(arrays, 'dtype', None), 'kind', None)
    if kind == 'f' and arrays.dtype != dtype:
        return arrays.astype(dtype)
    return arrays


GROUP = Fp16Group()


def _masters_not_read(next_, optimizer, serializer):
    """fp16 off (the ``serialize`` layer then): a snapshot an fp16 run wrote
    holds its fp32 master weights, which this load does not read (the model
    takes the snapshot's float16 weights); said, with the fix (a review:
    nothing was said)."""
    import chainer
    result = next_(optimizer, serializer)
    if (isinstance(serializer, chainer.serializer.Deserializer)
            and _attach.scaler_of(optimizer) is None
            and not optimizer.__dict__.get('_use_fp32_update')):
        from fastchain.distributed._rank_state import saved_keys
        try:
            keys = saved_keys(serializer[_snapshot.SERIAL_MASTERS])
        except (KeyError, ValueError):
            keys = None
        if keys:
            warnings.warn(
                'fastchain: this snapshot was written with fp16=True and holds the fp32 master '
                'weights of {} parameter{}; fp16 is off now, so they are not read, and the '
                "model starts from the snapshot's float16-rounded weights: the run does not "
                'continue as the fp16 run would. Resume under fastchain.enable(fp16=True) to '
                'continue it'.format(len(keys), 's' if len(keys) > 1 else ''),
                FastchainWarning, stacklevel=_patches.user_stacklevel())
    return result
