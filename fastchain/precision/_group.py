"""The fp16 accelerator group of ``fastchain.enable``."""

from fastchain.backends import cuda
from fastchain.config._options import Group, Option, State
from fastchain.precision import _attach
from fastchain.precision._scaler import DynamicLossScaler

# cuDNN's TensorCore algorithms want room; Chainer's default is 8 MiB.
FP16_WORKSPACE = 512 * 2 ** 20


def _loss_scale(value):
    if value == 'dynamic' or value is False:
        return value
    if isinstance(value, dict):
        DynamicLossScaler(**value)      # validates now, not at the first step
        return dict(value)
    raise ValueError("expected 'dynamic', False, or a dict of "
                     "DynamicLossScaler arguments")


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

    def apply(self, values, explicit, recorder):
        fp16 = values['fp16']
        state = State('fp16', True, False, requested='fp16' in explicit and fp16 is True,
                      setting=fp16)
        if fp16 == 'auto':
            fp16 = cuda.tensor_cores_available()
            if not fp16:
                state.why = ('auto: no GPU with TensorCores here, and fp16 is '
                             'slower than fp32 on a CPU')
        if not fp16:
            return [state]
        import chainer
        recorder.set_config('dtype', chainer.mixed16)
        _wrap_setup(recorder, values['loss_scale'])
        _wrap_converter(recorder)
        if cuda.cudnn_status().available:
            # TensorCores need fp16 data (now the default dtype) and cuDNN's
            # 'auto' TensorCore mode; give their algorithms workspace.
            if 'tensor_cores' not in explicit:
                recorder.set_config('use_cudnn_tensor_core', 'auto')
            if 'workspace_size' not in explicit:
                import chainer.backends.cuda as chainer_cuda
                from fastchain.cudnn._group import set_workspace
                if chainer_cuda.get_max_workspace_size() < FP16_WORKSPACE:
                    set_workspace(recorder, FP16_WORKSPACE)
            state.note = None
        else:
            state.note = ('fp16 runs on the CPU through NumPy, which is slower '
                          'than fp32 there; it pays off on a GPU with TensorCores')
        state.active = True
        return [state]


def _wrap_setup(recorder, loss_scale):
    """While enabled, every optimizer set up gets fp32 masters and a scaler."""
    from chainer.optimizer import GradientMethod
    setup = GradientMethod.setup

    def setup_with_fp16(self, link):
        result = setup(self, link)
        _attach.check_model_dtype(link)
        if loss_scale is False:
            scaler = None
        else:
            scaler = DynamicLossScaler(**(loss_scale if isinstance(loss_scale, dict) else {}))
        _attach.attach(self, scaler, recorder)
        return result

    setup_with_fp16.__wrapped__ = setup
    setup_with_fp16.__doc__ = setup.__doc__
    recorder.set_attr(GradientMethod, 'setup', setup_with_fp16,
                      label='GradientMethod.setup')


def _wrap_converter(recorder):
    """Cast floating batches to the fp16 compute dtype after the converter.

    Chainer's StandardUpdater and Evaluator both turn a batch into arrays
    through ``chainer.dataset.convert._call_converter``, whatever converter
    the script passes: the arrays arrive on the device in the dtype the
    dataset made (fp32: no NumPy fp16 arithmetic on the host) and are cast
    there. Integer arrays (labels, uint8 images) pass unchanged.
    """
    from chainer.dataset import convert
    call_converter = convert._call_converter

    def call_converter_then_cast(converter, batch, device):
        return cast_floating(call_converter(converter, batch, device))

    call_converter_then_cast.__wrapped__ = call_converter
    recorder.set_attr(convert, '_call_converter', call_converter_then_cast,
                      label='chainer.dataset.convert._call_converter')


def cast_floating(arrays, dtype=None):
    """Cast the floating arrays in ``arrays`` (array, tuple, list or dict) to
    ``dtype`` (default: Chainer's compute dtype), on the device they are on."""
    import chainer
    if dtype is None:
        dtype = chainer.get_dtype()
    if isinstance(arrays, tuple):
        return tuple(cast_floating(a, dtype) for a in arrays)
    if isinstance(arrays, list):
        return [cast_floating(a, dtype) for a in arrays]
    if isinstance(arrays, dict):
        return {k: cast_floating(a, dtype) for k, a in arrays.items()}
    kind = getattr(getattr(arrays, 'dtype', None), 'kind', None)
    if kind == 'f' and arrays.dtype != dtype:
        return arrays.astype(dtype)
    return arrays


GROUP = Fp16Group()
