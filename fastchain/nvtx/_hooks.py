"""Where the ranges come from: each phase of a Chainer training step.

Everything is a layer named ``nvtx`` (:mod:`fastchain.config._patches`),
outermost on every point it shares: ``StandardUpdater.__init__`` (then, on
the updater built, its ``update`` as the step and its iterator's ``next`` as
the wait for data), ``convert._call_converter`` (conversion and copy),
``GradientMethod.setup`` (then, on the optimizer set up: forward, backward,
loss-scale check and update), ``Trainer.run`` (each extension), plus, in
per-link mode, a LinkHook and a FunctionHook. What is put on an updater or an
optimizer is recorded in the handle's changes and leaves with it.
"""

import functools
import os
import weakref

import chainer

from fastchain.config import _patches
from fastchain.nvtx._annotator import annotator


def _data_layer(next_):
    """The iterator's ``next()`` inside a 'data' range."""
    with annotator().range('data', 'data'):
        return next_()


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


def updater_layer(setting, next_, updater, *args, **kwargs):
    """Updaters built while in force get 'step' and 'data' ranges."""
    changes, window = setting
    next_(updater, *args, **kwargs)
    changes.wrap(updater._iterators['main'], 'next', 'nvtx', _data_layer)
    changes.wrap(updater, 'update', 'nvtx',
                 functools.partial(_step_layer, weakref.ref(updater), window, {}))


def _step_layer(ref, window, capture, next_):
    """A 'step' range; the capture window's range (``capture``: its depth,
    while open) opens before the first step of the window that runs and
    closes after its last step done: a step that raised and is run again
    (a script's retry) stays inside the one range."""
    updater = ref()
    ann = annotator()
    iteration = updater.iteration + 1
    if window is not None and 'depth' not in capture and \
            window[0] <= iteration <= window[1]:
        capture['depth'] = ann.depth()
        ann.push('capture', 'step')
    try:
        with ann.range('step', 'step'):
            return next_()
    finally:
        if 'depth' in capture and updater.iteration >= window[1]:
            ann.unwind(capture.pop('depth') + 1)
            ann.pop()
        if updater.is_new_epoch:
            ann.mark('epoch {}'.format(updater.epoch))


def converter_layer(next_, converter, batch, device):
    with annotator().range('convert', 'convert'):
        return next_(converter, batch, device)


def setup_layer(setting, next_, optimizer, link):
    """Optimizers set up while in force get forward/backward/update ranges."""
    changes, link_paths = setting
    result = next_(optimizer, link)
    annotate_optimizer(optimizer, changes)
    if link_paths is not None:
        link_paths.add_model(link)
    return result


def annotate_optimizer(optimizer, changes):
    """Ranges on GradientMethod.update's template steps, on the instance.

    update(lossfun): [forward] lossfun -> [backward] loss.backward ->
    reallocate_cleared_grads -> [loss_scale] check_nan_in_grads ->
    [update] call_hooks('pre') ... params ... call_hooks('post') ->
    [loss_scale] update_loss_scale.
    """
    from fastchain.precision._attach import scaler_of
    if 'nvtx' in _patches.layers(optimizer, 'update'):
        return
    ann = annotator()
    state = {'backward': False}
    ref = weakref.ref(optimizer)

    def annotated_update(next_, lossfun=None, *args, **kwds):
        # Not twice: the data-parallel optimizer's first update of a lazily
        # shaped model calls the loss once without backward, then update()
        # again with the same (already annotated) loss function.
        if lossfun is not None and not getattr(lossfun, '_fastchain_nvtx', False):
            inner = lossfun

            def lossfun(*a, **k):
                if state['backward']:     # a loss computed earlier had no backward
                    state['backward'] = False
                    ann.pop()
                ann.push('forward', 'forward')
                try:
                    loss = inner(*a, **k)
                finally:
                    ann.pop()
                ann.push('backward', 'backward')
                state['backward'] = True
                return loss
            lossfun._fastchain_nvtx = True
        depth = ann.depth()
        try:
            return next_(lossfun, *args, **kwds)
        finally:
            # An exception inside the forward, backward or update: close what
            # it left open (the backward range, the update range, a link's).
            state['backward'] = False
            ann.unwind(depth)

    def annotated_reallocate(next_):
        if state['backward']:
            state['backward'] = False
            ann.pop()
        return next_()

    def scaling():
        opt = ref()
        return scaler_of(opt) is not None or getattr(opt, '_loss_scaling_is_dynamic', False)

    def annotated_check(next_):
        if not scaling():       # Chainer's no-op: no range to show
            return next_()
        with ann.range('loss_scale check', 'loss_scale'):
            next_()
        scaler = scaler_of(ref())
        if scaler is not None and scaler.stepped is False:
            ann.mark('skipped step (loss scale {:g})'.format(scaler.scale))

    def annotated_call_hooks(next_, timing='pre'):
        if timing == 'pre':
            ann.push('update', 'update')
            return next_(timing)
        try:
            return next_(timing)
        finally:
            if timing == 'post':
                ann.pop()

    def annotated_update_loss_scale(next_):
        if not scaling():
            return next_()
        with ann.range('loss_scale update', 'loss_scale'):
            return next_()

    for name, fn in (('update', annotated_update),
                     ('reallocate_cleared_grads', annotated_reallocate),
                     ('check_nan_in_grads', annotated_check),
                     ('call_hooks', annotated_call_hooks),
                     ('update_loss_scale', annotated_update_loss_scale)):
        changes.wrap(optimizer, name, 'nvtx', fn)


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


def trainer_run_layer(next_, trainer, *args, **kwargs):
    """Each extension of a run called inside an 'extension' range."""
    entries = list(trainer._extensions.items())
    for name, entry in entries:
        entry.extension = _AnnotatedExtension(entry.extension, name)
    try:
        result = next_(trainer, *args, **kwargs)
    finally:
        for name, entry in entries:
            if isinstance(entry.extension, _AnnotatedExtension):
                entry.extension = entry.extension._extension
    _check_capture(trainer.updater)         # a run that ended normally
    return result


def _check_capture(updater):
    """At the end of a trainer's run: a capture window its annotated updater
    never opened (or left open) is said, as nsys would record nothing (or
    an open range)."""
    window = capture_window()
    if window is None or 'nvtx' not in _patches.layers(updater, 'update') or \
            updater.iteration >= window[1]:
        return
    iteration = updater.iteration
    first, last = window
    why = ('before the window opened: nothing was captured (nsys profile '
           '--capture-range=nvtx records nothing)' if iteration < first else
           'inside the window: its capture range was left open (nsys records on to the '
           "process's end)")
    import warnings
    from fastchain.config import FastchainWarning
    warnings.warn('fastchain: FASTCHAIN_CAPTURE={}:{}: the run ended at iteration {}, {}; '
                  'choose iterations the run reaches'.format(first, last, iteration, why),
                  FastchainWarning, stacklevel=_patches.user_stacklevel())


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
    """Per-link forward ranges; tags each function node with its link.

    A link's forward that raises never reaches its postprocess: the range
    around it (the step, ``optimizer.update``) closes the link's range. One
    that raises in a script's own forward outside both, and is caught, stays
    open: nothing around it knows of it (Chainer's hooks see no exception).
    """

    name = 'fastchain_nvtx_links'

    def __init__(self, paths):
        self.paths = paths
        self.stack = []

    def forward_preprocess(self, args):
        ann = annotator()
        generation = ann.generation()
        _drop_stale(self.stack, generation)
        path = self.paths.get(args.link)
        self.stack.append((path, generation))
        if path is not None:
            ann.push(path, 'link')

    def forward_postprocess(self, args):
        if _pop_current(self.stack) is not None:
            annotator().pop()

    def current(self):
        _drop_stale(self.stack, annotator().generation())
        for path, _ in reversed(self.stack):
            if path is not None:
                return path
        return None


def _drop_stale(stack, generation):
    """A link's forward (or a function's backward) that raised never reached
    its postprocess: its entry stays, and the range around the step closed its
    range (:meth:`Annotator.unwind`). Entries of an older generation go."""
    while stack and stack[-1][1] != generation:
        stack.pop()


def _pop_current(stack):
    """The path of the entry this postprocess closes (None: nothing to close:
    no range, or one an unwind closed already)."""
    if not stack:
        return None
    path, generation = stack.pop()
    return path if generation == annotator().generation() else None


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
        ann = annotator()
        generation = ann.generation()
        _drop_stale(self.pushed, generation)
        path = self.owner.get(function)
        self.pushed.append((path, generation))
        if path is not None:
            ann.push(path + ' backward', 'link')

    def backward_postprocess(self, function, in_data, out_grad):
        if _pop_current(self.pushed) is not None:
            annotator().pop()


def link_hooks(paths):
    """The (LinkHook, FunctionHook) pair naming ranges after ``paths``."""
    link_hook = LinkRanges(paths)
    return link_hook, FunctionLinkRanges(link_hook)


def installed_link_hooks():
    """The pair installed in this thread (Chainer's global hooks), or MISSING."""
    link = chainer._get_link_hooks().get(LinkRanges.name)
    function = chainer.get_function_hooks().get(FunctionLinkRanges.name)
    return _patches.MISSING if link is None and function is None else (link, function)


def install_link_hooks(hooks):
    """Install the pair ``hooks`` (MISSING: remove the installed pair)."""
    installed = installed_link_hooks()
    if installed is not _patches.MISSING:
        for hook in installed:
            if hook is not None:
                hook.__exit__(None, None, None)
    if hooks is not _patches.MISSING:
        for hook in hooks:
            hook.__enter__()
