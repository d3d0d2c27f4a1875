"""Binds a loss scaler and fp32 master weights to one Chainer optimizer.

``GradientMethod.update`` is a template: after backward it calls
``check_nan_in_grads()``, then applies the update only if
``is_safe_to_update()``, then calls ``update_loss_scale()``, and it seeds
backward with ``self._loss_scale``. Attaching sets those four on the
optimizer *instance* (the class is untouched) through the handle's recorder,
so disabling fastchain restores the optimizer exactly.
"""

import warnings

import numpy

SERIAL_KEY = 'fastchain_loss_scaler'


def attach(optimizer, scaler, recorder, fp32_update=True):
    """Attach ``scaler`` (or only fp32 master weights if it is None)."""
    if getattr(optimizer, '_fastchain_scaler', None) is not None:
        return      # set up twice: keep the first attachment
    target = optimizer.target
    if fp32_update:
        _use_fp32_update(optimizer, target, recorder)
    if scaler is None:
        return
    recorder.set_attr(optimizer, '_fastchain_scaler', scaler,
                      label='optimizer._fastchain_scaler')
    recorder.set_attr(optimizer, '_loss_scale', scaler.scale,
                      label='optimizer._loss_scale')

    def check_nan_in_grads():
        params = list(target.params())
        # The update rules unscale each gradient by param._loss_scale, which
        # Variable.backward sets, but Chainer's static_graph backward does not
        # (measured: the updates were loss_scale times too large, then NaN).
        # Say it here for every parameter, whoever ran the backward.
        for p in params:
            p._loss_scale = optimizer._loss_scale
        scaler.step(p.grad for p in params)

    def is_safe_to_update():
        return bool(scaler.stepped)

    def update_loss_scale():
        optimizer._loss_scale = scaler.update()
        _report({'loss_scale': optimizer._loss_scale,
                 'skipped_steps': scaler.skipped_steps}, target)

    serialize_optimizer = optimizer.serialize

    def serialize(serializer):
        serialize_optimizer(serializer)
        try:
            scaler.serialize(serializer[SERIAL_KEY])
        except KeyError:
            # A snapshot written without fastchain's scaler: keep its state.
            warnings.warn('fastchain: the snapshot has no loss-scaler state; '
                          'starting from {!r}'.format(scaler), stacklevel=2)
        optimizer._loss_scale = scaler.scale

    for name, fn in (('check_nan_in_grads', check_nan_in_grads),
                     ('is_safe_to_update', is_safe_to_update),
                     ('update_loss_scale', update_loss_scale),
                     ('serialize', serialize)):
        recorder.set_attr(optimizer, name, fn, label='optimizer.' + name)


def _use_fp32_update(optimizer, target, recorder):
    # GradientMethod.use_fp32_update(False) would still switch every rule on
    # (it calls rule.use_fp32_update() without the flag), so undo by hand.
    old = optimizer.__dict__.get('_use_fp32_update', False)
    rules = [p.update_rule for p in target.params()
             if getattr(p, 'update_rule', None) is not None]
    old_rules = [r._use_fp32_update for r in rules]

    def undo():
        optimizer._use_fp32_update = old
        for rule, flag in zip(rules, old_rules):
            rule.use_fp32_update(flag)

    recorder.call('optimizer.use_fp32_update', optimizer.use_fp32_update, undo,
                  old=old, new=True)


def check_model_dtype(link):
    """Warn when fp16 is on but the model was built before it (fp32 params)."""
    dtypes = {p.dtype for p in link.params() if p.array is not None}
    if dtypes and numpy.dtype(numpy.float16) not in dtypes:
        warnings.warn(
            'fastchain: fp16 is enabled but {} has no float16 parameters, so it '
            'trains in {}. Build the model after fastchain.enable(fp16=True).'
            .format(type(link).__name__, ', '.join(sorted(d.name for d in dtypes))),
            stacklevel=4)


def _report(values, observer):
    import chainer
    try:
        chainer.report(values, observer)
    except KeyError:        # the target is not registered with the reporter
        chainer.report(values)
