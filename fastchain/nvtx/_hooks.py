"""Where the ranges come from: each phase of a Chainer training step.

Everything is installed through the handle's recorder, so disabling removes
it: scoped wrappers of ``StandardUpdater.__init__`` (the step and the wait
for data), ``convert._call_converter`` (conversion and copy),
``GradientMethod.setup`` (forward, backward, loss-scale check and update, on
the optimizer instance) and ``Trainer.run`` (each extension), plus, in
per-link mode, a LinkHook and a FunctionHook.
"""

import os
import weakref

import chainer

from fastchain.nvtx._annotator import annotator


class _AnnotatedIterator:
    """The updater's iterator, with ``next()`` inside a 'data' range."""

    def __init__(self, iterator):
        self._iterator = iterator

    def __next__(self):
        ann = annotator()
        ann.push('data', 'data')
        try:
            return self._iterator.next()
        finally:
            ann.pop()

    next = __next__

    def __iter__(self):
        return self

    def __getattr__(self, name):
        return getattr(self._iterator, name)


def capture_window():
    """``FASTCHAIN_CAPTURE=first:last`` -> (first, last) iterations, 1-based,
    inclusive: a 'capture' range spans them, for ``nsys profile
    --capture-range=nvtx --nvtx-capture=capture@fastchain``."""
    text = os.environ.get('FASTCHAIN_CAPTURE')
    if not text:
        return None
    try:
        first, last = (int(v) for v in text.split(':'))
        if not 1 <= first <= last:
            raise ValueError
    except ValueError:
        raise ValueError('FASTCHAIN_CAPTURE={!r}: expected FIRST:LAST iterations, '
                         'e.g. 100:120'.format(text)) from None
    return first, last


def wrap_updater_init(recorder):
    from chainer.training.updaters import StandardUpdater
    init = StandardUpdater.__init__
    window = capture_window()

    def init_with_ranges(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._iterators['main'] = _AnnotatedIterator(self._iterators['main'])
        update = self.update        # bound: the class's (or a subclass's)

        def annotated_update():
            ann = annotator()
            iteration = self.iteration + 1
            if window is not None and iteration == window[0]:
                ann.push('capture', 'step')
            ann.push('step', 'step')
            try:
                update()
            finally:
                ann.pop()
                if window is not None and iteration == window[1]:
                    ann.pop()
            if self.is_new_epoch:
                ann.mark('epoch {}'.format(self.epoch))
        self.update = annotated_update

    init_with_ranges.__wrapped__ = init
    recorder.set_attr(StandardUpdater, '__init__', init_with_ranges,
                      label='StandardUpdater.__init__ (nvtx)')


def wrap_converter(recorder):
    from chainer.dataset import convert
    call_converter = convert._call_converter

    def call_converter_in_range(converter, batch, device):
        with annotator().range('convert', 'convert'):
            return call_converter(converter, batch, device)

    call_converter_in_range.__wrapped__ = call_converter
    recorder.set_attr(convert, '_call_converter', call_converter_in_range,
                      label='chainer.dataset.convert._call_converter (nvtx)')


def wrap_optimizer_setup(recorder, link_paths):
    """Optimizers set up while enabled get forward/backward/update ranges."""
    from chainer.optimizer import GradientMethod
    setup = GradientMethod.setup

    def setup_with_ranges(self, link):
        result = setup(self, link)
        annotate_optimizer(self, recorder)
        if link_paths is not None:
            link_paths.add_model(link)
        return result

    setup_with_ranges.__wrapped__ = setup
    recorder.set_attr(GradientMethod, 'setup', setup_with_ranges,
                      label='GradientMethod.setup (nvtx)')


def annotate_optimizer(optimizer, recorder):
    """Ranges on GradientMethod.update's template steps, on the instance.

    update(lossfun): [forward] lossfun -> [backward] loss.backward ->
    reallocate_cleared_grads -> [loss_scale] check_nan_in_grads ->
    [update] call_hooks('pre') ... params ... call_hooks('post') ->
    [loss_scale] update_loss_scale.
    """
    if getattr(optimizer, '_fastchain_nvtx', False):
        return
    ann = annotator()
    state = {'backward': False}
    update = optimizer.update
    reallocate = optimizer.reallocate_cleared_grads
    check = optimizer.check_nan_in_grads
    call_hooks = optimizer.call_hooks
    update_loss_scale = optimizer.update_loss_scale

    def annotated_update(lossfun=None, *args, **kwds):
        if lossfun is not None:
            inner = lossfun

            def lossfun(*a, **k):
                ann.push('forward', 'forward')
                try:
                    loss = inner(*a, **k)
                finally:
                    ann.pop()
                ann.push('backward', 'backward')
                state['backward'] = True
                return loss
        try:
            return update(lossfun, *args, **kwds)
        finally:
            if state['backward']:       # an exception inside backward
                state['backward'] = False
                ann.pop()

    def annotated_reallocate():
        if state['backward']:
            state['backward'] = False
            ann.pop()
        return reallocate()

    def scaling():
        return getattr(optimizer, '_fastchain_scaler', None) is not None or \
            getattr(optimizer, '_loss_scaling_is_dynamic', False)

    def annotated_check():
        if not scaling():       # Chainer's no-op: no range to show
            return check()
        with ann.range('loss_scale check', 'loss_scale'):
            check()
        scaler = getattr(optimizer, '_fastchain_scaler', None)
        if scaler is not None and scaler.stepped is False:
            ann.mark('skipped step (loss scale {:g})'.format(scaler.scale))

    def annotated_call_hooks(timing='pre'):
        if timing == 'pre':
            ann.push('update', 'update')
            return call_hooks(timing)
        try:
            return call_hooks(timing)
        finally:
            if timing == 'post':
                ann.pop()

    def annotated_update_loss_scale():
        if not scaling():
            return update_loss_scale()
        with ann.range('loss_scale update', 'loss_scale'):
            return update_loss_scale()

    recorder.set_attr(optimizer, '_fastchain_nvtx', True, label='optimizer._fastchain_nvtx')
    for name, fn in (('update', annotated_update),
                     ('reallocate_cleared_grads', annotated_reallocate),
                     ('check_nan_in_grads', annotated_check),
                     ('call_hooks', annotated_call_hooks),
                     ('update_loss_scale', annotated_update_loss_scale)):
        recorder.set_attr(optimizer, name, fn, label='optimizer.{} (nvtx)'.format(name))


class _AnnotatedExtension:
    """An extension called inside an 'extension' range named after it."""

    def __init__(self, extension, name):
        self._extension = extension
        self._message = 'extension {}'.format(name)

    def __call__(self, trainer):
        with annotator().range(self._message, 'extension'):
            return self._extension(trainer)

    def __getattr__(self, name):
        return getattr(self._extension, name)


def wrap_trainer_run(recorder):
    from chainer.training import trainer as trainer_module
    Trainer = trainer_module.Trainer
    run = Trainer.run

    def run_with_ranges(self, *args, **kwargs):
        entries = list(self._extensions.items())
        for name, entry in entries:
            entry.extension = _AnnotatedExtension(entry.extension, name)
        try:
            return run(self, *args, **kwargs)
        finally:
            for name, entry in entries:
                if isinstance(entry.extension, _AnnotatedExtension):
                    entry.extension = entry.extension._extension

    run_with_ranges.__wrapped__ = run
    recorder.set_attr(Trainer, 'run', run_with_ranges, label='Trainer.run (nvtx)')


class LinkPaths:
    """Names links by their path in the model (``res3/a/conv1``)."""

    def __init__(self):
        self._paths = weakref.WeakKeyDictionary()

    def add_model(self, model):
        root = model
        prefix = ''
        # L.Classifier wraps the network as 'predictor': name from inside it.
        if isinstance(model, chainer.links.Classifier):
            root = model.predictor
        for name, link in root.namedlinks(skipself=True):
            self._paths[link] = prefix + name.lstrip('/')

    def get(self, link):
        return self._paths.get(link)


class LinkRanges(chainer.LinkHook):
    """Per-link forward ranges; tags each function node with its link."""

    name = 'fastchain_nvtx_links'

    def __init__(self, paths):
        self.paths = paths
        self.stack = []

    def forward_preprocess(self, args):
        path = self.paths.get(args.link)
        self.stack.append(path)
        if path is not None:
            annotator().push(path, 'link')

    def forward_postprocess(self, args):
        if self.stack.pop() is not None:
            annotator().pop()

    def current(self):
        for path in reversed(self.stack):
            if path is not None:
                return path
        return None


class FunctionLinkRanges(chainer.FunctionHook):
    """Per-link backward ranges: each function's backward is named after the
    link whose forward created it."""

    name = 'fastchain_nvtx_functions'

    def __init__(self, link_ranges):
        self.link_ranges = link_ranges
        self.owner = weakref.WeakKeyDictionary()
        self.pushed = []

    def forward_postprocess(self, function, in_data):
        path = self.link_ranges.current()
        if path is not None:
            try:
                self.owner[function] = path
            except TypeError:
                pass

    def backward_preprocess(self, function, in_data, out_grad):
        path = self.owner.get(function)
        self.pushed.append(path)
        if path is not None:
            annotator().push(path + ' backward', 'link')

    def backward_postprocess(self, function, in_data, out_grad):
        if self.pushed and self.pushed.pop() is not None:
            annotator().pop()


def install_link_hooks(recorder, paths):
    link_hook = LinkRanges(paths)
    function_hook = FunctionLinkRanges(link_hook)
    for hook in (link_hook, function_hook):
        recorder.call('chainer hook ' + hook.name, hook.__enter__,
                      lambda hook=hook: hook.__exit__(None, None, None))
