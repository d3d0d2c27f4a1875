"""Applies the cuDNN options through Chainer's own configuration."""

from fastchain.backends import cuda
from fastchain.config._options import Group, Option, State, boolean

_MODES = ('always', 'auto', 'never')


def _workspace(value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError('expected a whole number of bytes')
    if value < 0:
        raise ValueError('must be >= 0 bytes')
    return value


class CudnnGroup(Group):
    name = 'cudnn'
    options = (
        Option('cudnn', "cuDNN use: 'always', 'auto', 'never' (True = 'always')",
               choices=_MODES, aliases={True: 'always', False: 'never'}),
        boolean('autotune', 'search the fastest cuDNN convolution algorithm '
                'on first call (default: on where cuDNN is available)'),
        Option('tensor_cores', "TensorCore math: 'always', 'auto', 'never'",
               choices=_MODES, aliases={True: 'always', False: 'never'}),
        Option('workspace_size', 'bytes of cuDNN workspace (Chainer: 8 MiB)',
               check=_workspace),
    )

    def probe(self):
        status = cuda.cudnn_status()
        tc_ok = status.available and cuda.tensor_cores_available()
        return [
            State('cudnn', status.available, False, why=status.why, fix=status.fix),
            State('autotune', status.available, False, why=status.why, fix=status.fix),
            State('tensor_cores', tc_ok, False,
                  why=status.why or (None if tc_ok else
                                     'no GPU with compute capability >= 7.0'),
                  fix=status.fix or (None if tc_ok else
                                     'use a Volta or newer GPU')),
        ]

    def apply(self, values, explicit, recorder):
        states = {s.name: s for s in self.probe()}

        def settle(name, setting, wants):
            # `wants`: the setting asks for the accelerator to be on.
            s = states[name]
            s.setting = setting
            s.requested = name in explicit and wants
            s.active = wants and s.available
            return s

        mode = values['cudnn']
        if mode is not None:
            recorder.set_config('use_cudnn', mode)
        settle('cudnn', mode, mode != 'never')   # None: Chainer's 'auto'

        autotune = values['autotune']
        if autotune is None and states['autotune'].available:
            autotune = True                       # default: on where it works
        if autotune is not None:
            recorder.set_config('autotune', autotune)
        settle('autotune', autotune, bool(autotune))

        tc = values['tensor_cores']
        if tc is not None:
            recorder.set_config('use_cudnn_tensor_core', tc)
        settle('tensor_cores', tc, tc != 'never')  # None: Chainer's 'auto'

        size = values['workspace_size']
        if size is not None:
            set_workspace(recorder, size)
            cudnn = states['cudnn']
            states['workspace_size'] = State(
                'workspace_size', cudnn.available, cudnn.available,
                requested=True, why=cudnn.why, fix=cudnn.fix, setting=size)
        return list(states.values())


def set_workspace(recorder, size):
    """Set cuDNN's workspace through Chainer, recorded for the handle's undo."""
    import chainer.backends.cuda as chainer_cuda
    old = chainer_cuda.get_max_workspace_size()
    recorder.call('chainer.backends.cuda.max_workspace_size',
                  lambda: chainer_cuda.set_max_workspace_size(size),
                  lambda: chainer_cuda.set_max_workspace_size(old),
                  old=old, new=size)
    return old


GROUP = CudnnGroup()
