"""Binds a loss scaler and fp32 master weights to one Chainer optimizer.

``GradientMethod.update`` is a template: after backward it calls
``check_nan_in_grads()``, then applies the update only if
``is_safe_to_update()``, then calls ``update_loss_scale()``, and it seeds
backward with ``self._loss_scale``. Attaching puts fp16 layers on those
methods of the optimizer *instance* (the class is untouched) through the
owning handle's :class:`~fastchain.config._patches.Changes`, so disabling
that handle takes exactly them off again.
"""

import functools
import threading
import warnings
import weakref

import numpy

import chainer

from fastchain.config import _patches
from fastchain.config._warning import FastchainWarning
from fastchain.precision._scaler import FP16_SAFE_SCALE
from fastchain.precision import _snapshot

SCALER = 'loss_scaler'              # attachment key: the optimizer's scaler
ALL_RANKS_ANY = 'all_ranks_any'     # attachment key: data-parallel agreement


def scaler_of(optimizer):
    """The :class:`DynamicLossScaler` fastchain attached to ``optimizer``, or None."""
    return _patches.attached(optimizer, SCALER)


def attach(optimizer, scaler, changes, fp32_update=True):
    """Attach ``scaler`` (or only fp32 master weights if it is None),
    recording every change in ``changes``."""
    if scaler_of(optimizer) is not None:
        return      # set up twice: keep the first attachment
    target = optimizer.target
    if fp32_update:
        _use_fp32_update(optimizer, target, changes)
    ref = weakref.ref(optimizer)
    if scaler is None:
        if fp32_update:         # fp32 masters only: they go into snapshots all the same
            changes.wrap(optimizer, 'serialize', 'fp16', lambda next_, serializer:
                         _snapshot.serialize(ref(), None, next_, serializer))
            changes.wrap(optimizer, 'update', 'fp16', functools.partial(_update, ref))
        return
    changes.attach(optimizer, SCALER, scaler)
    _set_loss_scale(optimizer, scaler, changes)

    step = {'fp16_grads': [], 'warned': False, 'stats_warned': False, 'own_warned': False}

    def check_nan_in_grads(next_):
        opt = ref()
        if not step['own_warned']:
            step['own_warned'] = _warn_own_scaling(opt, scaler)
        # A parameter two links hold is listed twice: unscaled once.
        params = list({id(p): p for p in opt.target.params() if p.grad is not None}.values())
        # Unscale here, before the optimizer's hooks (GradientClipping,
        # WeightDecay, ...) see the gradients, with the arithmetic Chainer's
        # UpdateRule would apply later (fp16: astype(float32), then /= scale;
        # fp32: /= scale in place), and tell the rules it is done
        # (param._loss_scale = None). The scale is the one the backward used
        # (none for a script's own loss.backward()). The overflow check reads
        # what the hooks and the update will see.
        scales = _backward_scales(opt, params, step)
        step['fp16_grads'] = _unscale(params, scales)
        scaler.cap = FP16_SAFE_SCALE if getattr(_local, 'fp16_loss', False) else None
        scaler.step((p.grad for p in params),
                    reduce=_patches.attached(opt, ALL_RANKS_ANY))

    def call_hooks(next_, timing='pre'):
        if timing != 'pre' or not step['fp16_grads']:
            return next_(timing)
        step['masters'] = {id(param): param for param, _ in step['fp16_grads']}
        try:
            return next_(timing)
        finally:
            step['masters'] = None

    def call_hook(next_, hook):
        masters = step.get('masters')
        if not masters or not getattr(hook, 'call_for_each_param', False):
            return next_(hook)
        return next_(_OnMasters(hook, masters))

    def is_safe_to_update(next_):
        return bool(scaler.stepped)

    def update_loss_scale(next_):
        opt = ref()
        # After the update: the fp16 parameters get their own (scaled)
        # gradient arrays back, as Chainer leaves them.
        for param, grad in step['fp16_grads']:
            param._set_grad_without_check(grad)
        step['fp16_grads'] = []
        if not scaler.stepped and not step['stats_warned']:
            step['stats_warned'] = _warn_nonfinite_statistics(opt.target)
        opt._loss_scale = scaler.update()
        _report({'loss_scale': opt._loss_scale,
                 'skipped_steps': scaler.skipped_steps}, opt.target)

    def serialize(next_, serializer):
        opt = ref()
        _snapshot.serialize(opt, scaler, next_, serializer)
        opt._loss_scale = scaler.scale

    for name, fn in (('update', functools.partial(_update, ref)),
                     ('check_nan_in_grads', check_nan_in_grads),
                     ('call_hooks', call_hooks),
                     ('call_hook', call_hook),
                     ('is_safe_to_update', is_safe_to_update),
                     ('update_loss_scale', update_loss_scale),
                     ('serialize', serialize)):
        changes.wrap(optimizer, name, 'fp16', fn)


def _update(ref, next_, *args, **kwargs):
    """``update``: masters kept through a load are checked first
    (:func:`verify_masters`); dtype errors named (:func:`_name_dtype_errors`)."""
    _snapshot.verify_masters(ref())
    return _name_dtype_errors(next_, *args, **kwargs)


class _OnMasters:
    """A per-parameter 'pre' hook (WeightDecay, Lasso, GradientHardClipping,
    GradientLARS) given, for each fp16 parameter whose gradient the
    unscaling made fp32, its fp32 master (the rule's, made now where the
    rule has none yet, as its update would make it) holding that gradient:
    the weight and gradient the update uses, of one dtype, as Chainer gives
    its rule-level hooks. With the fp16 weight, Chainer's WeightDecay and
    Lasso kernels on a GPU, which take one type for both, raise, and on the
    CPU rate * weight in float16 is subnormal for a typical rate. A gradient
    the hook replaces is the parameter's after it. Hooks called with the
    optimizer see the model as it is (a forward works)."""

    call_for_each_param = True

    def __init__(self, hook, masters):
        self.hook = hook
        self.masters = masters

    def __call__(self, rule, param):
        if id(param) not in self.masters or rule is None:
            return self.hook(rule, param)
        master = rule._fp32_param
        if master is None or master.array is None:
            master = chainer.Parameter(param.array.astype(numpy.float32), name=param.name)
            if rule.enabled:
                rule._fp32_param = master       # (what its update would make)
        grad = param.grad
        if grad is not None and grad.dtype != master.dtype:
            # refilled by reallocate_cleared_grads after an earlier hook's
            # cleargrad (float16 zeros): one dtype for the hook
            grad = grad.astype(master.dtype)
            param._set_grad_without_check(grad)
        master._set_grad_without_check(grad)
        master.update_rule = rule       # (a hook may read it, as on the parameter)
        try:
            return self.hook(rule, master)
        finally:
            if master.grad is not grad:
                param._set_grad_without_check(master.grad)
            master._set_grad_without_check(None)
            master.update_rule = None


def _warn_own_scaling(optimizer, scaler):
    """The script set Chainer's own loss scaling on an optimizer the scaler
    scales (``loss_scaling()``, ``set_loss_scale()``, ``_loss_scale = ...``):
    the scaler's goes on from the next step. Says so; returns whether it did."""
    dynamic = optimizer.__dict__.get('_loss_scaling_is_dynamic', False)
    if not dynamic and optimizer._loss_scale == scaler.scale:
        return False
    say_own_scaling_replaced(optimizer, scaler, dynamic)
    return True


def say_own_scaling_replaced(optimizer, scaler, dynamic):
    warnings.warn(
        "fastchain: fp16's DynamicLossScaler scales this {}'s loss; the script's own loss "
        'scaling ({}) is replaced by its scale ({:g}) from the next backward. Choose the scaling '
        "with fastchain.enable(fp16=True, loss_scale={{'init_scale': ..., "
        "'growth_interval': ...}}) (a fixed scale S: init_scale, min_scale and max_scale S), "
        "or leave it to Chainer with loss_scale=False (fp32 masters only)".format(
            type(optimizer).__name__, 'optimizer.loss_scaling()' if dynamic else
            'a loss scale of {!r}'.format(optimizer._loss_scale), scaler.scale),
        FastchainWarning, stacklevel=_patches.user_stacklevel())


def _warn_nonfinite_statistics(target):
    """A skipped step whose forward left inf/NaN in a link's running
    statistics (updated in the forward, before the overflow check, as in
    plain Chainer and PyTorch: the weights are safe, they are not). Says so
    once; returns whether it did."""
    import chainer
    bad = []
    for path, link in sorted(target.namedlinks()):
        for name in sorted(link._persistent):
            value = getattr(link, name, None)
            if getattr(value, 'dtype', None) is not None and value.dtype.kind == 'f' and \
                    not bool(chainer.backend.get_array_module(value).isfinite(value).all()):
                bad.append('{}/{}'.format(path, name))
    if bad:
        warnings.warn(
            'fastchain: fp16: a skipped step\'s forward put inf/NaN into {} (running '
            'statistics are updated in the forward, before the overflow check, as in plain '
            'Chainer: the weights are safe, they are not), so the model outputs NaN in test '
            'mode until they are reset. Its float16 activations overflowed there: keep that '
            'layer\'s inputs in range, or compute it in float32'.format(', '.join(bad[:3]) + (
                ' and {} more'.format(len(bad) - 3) if len(bad) > 3 else '')),
            FastchainWarning, stacklevel=_patches.user_stacklevel())
    return bool(bad)


DTYPE_NOTE = (
    'fastchain: fp16 is on (chainer.mixed16): the model computes in float16 and the batches '
    'from the converter are cast to float16. An array the script makes itself (a GAN\'s '
    'noise, a mask, a constant) stays as made: make it with dtype=chainer.get_dtype(). A '
    'model built before fastchain.enable(fp16=True) keeps float32 weights: build it after.')


def _name_dtype_errors(next_, *args, **kwargs):
    """``update``: Chainer's type error between float16 and float32 in the
    step gets a note saying what fp16 changed and the fixes (the error is
    Chainer's, raised as it was)."""
    from chainer.utils.type_check import InvalidType
    try:
        return next_(*args, **kwargs)
    except InvalidType as e:
        text = str(e)
        if 'float16' in text and 'float32' in text and DTYPE_NOTE not in \
                getattr(e, '__notes__', ()):
            e.add_note(DTYPE_NOTE)
        raise


_local = threading.local()


def record_backward_scale(next_, variable, *args, **kwargs):
    """The ``fp16`` layer of ``Variable.backward``: notes the loss scale the
    backward seeds its gradient with, and whether its loss is float16 (a
    scale above 2**15 makes its seed inf). Chainer notes the scale on each
    leaf it reaches (``param._loss_scale``), which is what counts for a
    parameter; this note serves parameters whose gradients a hook attached
    without making them leaves (Chainer's own ``@static_graph``)."""
    scale = kwargs.get('loss_scale', args[2] if len(args) > 2 else None)
    _local.scale = scale
    if scale is not None:
        _local.fp16_loss = getattr(variable, 'dtype', None) == numpy.float16
    return next_(variable, *args, **kwargs)


def carried_scale(params):
    """The loss scale the gradients of ``params`` carry now, before the
    update unscales them (what :func:`_backward_scales` will find): None for
    a script's own unscaled ``loss.backward()``."""
    return next((x for x in _scales_of(params) if x is not None), None)


def _scales_of(params):
    """Each parameter's: the one Chainer noted on it, else the last
    backward's in this thread (two optimizers' backwards, or a backward of
    something else before the update, each keep their own: a new-user trial
    had one optimizer's gradients divided by the other's scale, and an
    unrelated unscaled backward cancel the unscaling, a 1024x step)."""
    last = getattr(_local, 'scale', None)
    return [p._loss_scale if p._loss_scale is not None else last for p in params]


def _backward_scales(optimizer, params, step):
    """The loss scale each parameter's gradient carries (``_scales_of``; not
    the optimizer's: a script's own ``loss.backward()`` scales nothing).
    Warns once (``step['warned']``) when an fp16 optimizer's gradients carry
    none."""
    scales = _scales_of(params)
    if not step['warned'] and params and all(x is None for x in scales):
        step['warned'] = True
        warnings.warn(
            'fastchain: fp16 is on for this {} but its gradients were not loss-scaled '
            '(loss.backward() without loss_scale), so small fp16 gradients can vanish. '
            'Use optimizer.update(lossfun, *inputs), or '
            'loss.backward(loss_scale=optimizer._loss_scale)'.format(type(optimizer).__name__),
            FastchainWarning, stacklevel=_patches.user_stacklevel())
    return scales


def _unscale(params, scales):
    """Divide each gradient by its scale as Chainer's UpdateRule would, set
    ``param._loss_scale = None`` so the rule does not divide again; returns
    [(fp16 parameter, its original gradient)] for those given an fp32 one."""
    replaced = []
    for param, scale in zip(params, scales):
        param._loss_scale = None
        if scale is None:
            continue
        grad = param.grad
        rule = getattr(param, 'update_rule', None)
        if grad.dtype == numpy.float16 and rule is not None and rule._use_fp32_update:
            # UpdateRule: fp32_param.grad = param.grad.astype(float32); then
            # fp32_param.grad /= loss_scale. The rule copies this fp32 array
            # again (exactly) and, with _loss_scale None, divides no more.
            unscaled = grad.astype(numpy.float32)
            unscaled /= scale
            replaced.append((param, grad))
            param._set_grad_without_check(unscaled)
        else:
            grad /= scale
    return replaced


def _set_loss_scale(optimizer, scaler, changes):
    """``optimizer._loss_scale`` follows the scaler; put back the old value on
    undo if it still does."""
    ref = weakref.ref(optimizer)
    old = vars(optimizer).get('_loss_scale', _patches.MISSING)
    optimizer._loss_scale = scaler.scale

    def undo():
        opt = ref()
        if opt is None or opt.__dict__.get('_loss_scale') != scaler.scale:
            return
        if old is _patches.MISSING:
            del opt._loss_scale
        else:
            opt._loss_scale = old
    changes.call('optimizer._loss_scale', undo)


def _use_fp32_update(optimizer, target, changes):
    # GradientMethod.use_fp32_update(False) would still switch every rule on
    # (it calls rule.use_fp32_update() without the flag), so undo by hand.
    ref = weakref.ref(optimizer)
    old = optimizer.__dict__.get('_use_fp32_update', False)
    rules = [p.update_rule for p in target.params()
             if getattr(p, 'update_rule', None) is not None]
    old_rules = [(weakref.ref(r), r._use_fp32_update) for r in rules]
    optimizer.use_fp32_update()

    def undo():
        opt = ref()
        if opt is not None and opt.__dict__.get('_use_fp32_update') is True:
            opt._use_fp32_update = old
        for rule_ref, flag in old_rules:
            rule = rule_ref()
            if rule is not None and rule._use_fp32_update is True:
                rule.use_fp32_update(flag)
    changes.call('optimizer.use_fp32_update', undo)


def check_model_dtype(link):
    """Warn when fp16 is on but the model was built before it (fp32 params).
    Not counted: parameters not made yet (made in the dtype in force at their
    first call) and those mixed16 keeps in float32 (BatchNormalization's and
    GroupNormalization's)."""
    import chainer.links as L
    kept = (L.BatchNormalization, L.GroupNormalization)
    dtypes = {sub.__dict__[name].dtype for sub in link.links() if not isinstance(sub, kept)
              for name in sub._params if sub.__dict__[name].array is not None}
    if dtypes and numpy.dtype(numpy.float16) not in dtypes:
        # (it said the model 'trains in float32'; the batches are cast to
        # float16 all the same, and the first step failed: a new-user trial)
        import chainer
        hidden = chainer.config.dtype is not chainer.mixed16
        warnings.warn(
            'fastchain: fp16 is enabled but {} has no float16 parameters ({}): its weights '
            "stay {}, while the batches are cast to float16, so the first step fails with "
            "Chainer's 'float32 != float16' type error unless the model casts its inputs "
            'itself. {}.'.format(
                type(link).__name__, hidden_dtype() if hidden else
                'it was built before fastchain.enable(fp16=True)',
                ', '.join(sorted(d.name for d in dtypes)),
                'Build the model where chainer.get_dtype() is mixed16' if hidden else
                'Build the model after fastchain.enable(fp16=True)'),
            FastchainWarning, stacklevel=_patches.user_stacklevel())


def hidden_dtype():
    """Why this thread's ``chainer.config.dtype`` is not fp16's mixed16."""
    import chainer
    return ('chainer.config.dtype is {} in this thread (chainer.config.dtype = ..., or a '
            "using_config('dtype', ...)), which hides the chainer.global_config.dtype = "
            'mixed16 that enable(fp16=True) set: del chainer.config.dtype, or leave that '
            'using_config'.format(getattr(chainer.config.dtype, '__name__',
                                          chainer.config.dtype)))


def _report(values, observer):
    import chainer
    try:
        chainer.report(values, observer)
    except KeyError:        # the target is not registered with the reporter
        chainer.report(values)
