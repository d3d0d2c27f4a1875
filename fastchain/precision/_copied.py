"""A copy of an fp16 optimizer (``copy.deepcopy``, pickle, ``copy.copy``).

A copy is a plain Chainer optimizer (fastchain's layers stay with the
original: ``_patches``, copies). It was one with the loss scale frozen, and
an overflowing step put NaN in its weights where the original skipped the
step (a new-user trial). Now it carries, as Python numbers (a pickle loads
without fastchain), the scaler's settings and state, and Chainer's own
dynamic loss scaling at the scale of the moment: used where fp16 is not in
force it scales, skips an overflowing step and halves the scale as plain
Chainer does; a script's own ``backward(loss_scale=optimizer._loss_scale)``
seeds with the scale of the moment. Its first update while fp16 is in
force (:func:`take_up`) hands the scaling to a scaler made from what it
carries, under the handle in force (``loss_scale=False`` there: fp32
masters only, Chainer's scaling kept).
"""

import functools
import weakref

from fastchain.config import _patches
from fastchain.precision import _attach
from fastchain.precision._scaler import DynamicLossScaler

CARRIED = '_fastchain_loss_scaler'      # a copy's attribute: what it takes up
# Chainer's dynamic loss scaling (GradientMethod.loss_scaling()), as a copy has it
CHAINERS = ('_loss_scale', '_loss_scaling_is_dynamic', '_loss_scaling_multiplier',
            '_loss_scaling_isnan_ever')


def attach(optimizer, scaler, changes):
    """``_attach.attach``, and copies of ``optimizer`` then carry the
    scaler's settings and state (recorded in ``changes``: until its handle
    lets it go)."""
    _attach.attach(optimizer, scaler, changes)
    if scaler is None or _attach.scaler_of(optimizer) is not scaler:
        return      # (set up twice: the first attachment stays, and its carry)
    ref = weakref.ref(optimizer)
    _patches.carry_into_copies(optimizer, functools.partial(_carried, scaler))
    changes.call('copies carry the scaler', lambda: ref() is not None and
                 _patches.carry_into_copies(ref(), None))


def _carried(scaler):
    settings = {name: getattr(scaler, name) for name in (
        'growth_factor', 'backoff_factor', 'growth_interval', 'min_scale', 'max_scale')}
    return {'_loss_scale': scaler.scale, '_loss_scaling_is_dynamic': True,
            '_loss_scaling_multiplier': 2.0 ** (1.0 / scaler.growth_interval),
            '_loss_scaling_isnan_ever': True,       # (grows by the multiplier)
            CARRIED: {'settings': settings, 'state': scaler.state_dict()}}


def take_up(next_, optimizer, *args, loss_scale, changes, **kwargs):
    """The fp16 layer of ``GradientMethod.update``: a copy takes up what it
    carries, and this update is already an fp16 one."""
    if not _take_up(optimizer, loss_scale, changes):
        return next_(optimizer, *args, **kwargs)
    # inward (update() again would run the outer layers twice); its own
    # update layer, which names dtype errors, applies from its next update
    return _attach._name_dtype_errors(functools.partial(next_, optimizer), *args, **kwargs)


def take_up_to_serialize(next_, optimizer, serializer, *, loss_scale, changes):
    """The fp16 layer of ``GradientMethod.serialize``: a copy that loads or
    saves a snapshot before its first update takes up what it carries first
    (the scaler's state and the fp32 masters are then loaded or saved)."""
    if not _take_up(optimizer, loss_scale, changes):
        return next_(optimizer, serializer)
    return optimizer.serialize(serializer)      # through its own fp16 layer now


def forget(optimizer):
    """``optimizer`` is set up again: what it carried is not taken up."""
    own = optimizer.__dict__
    if own.pop(CARRIED, None) is not None:
        for name in CHAINERS:
            own.pop(name, None)


def _take_up(optimizer, loss_scale, changes):
    own = optimizer.__dict__
    carried = own.pop(CARRIED, None)
    if carried is None or _attach.scaler_of(optimizer) is not None:
        return False
    scaler = None
    if loss_scale is not False:
        # (the carried scale as init_scale: a fixed scale below the default
        # one was refused by min_scale <= init_scale <= max_scale; a review)
        scaler = DynamicLossScaler(init_scale=carried['state']['scale'],
                                   **carried['settings'])
        scaler.load_state_dict(carried['state'])
        mine = _carried(scaler)
        if any(own.get(name) != mine[name] for name in CHAINERS):
            # the script set Chainer's own scaling on the copy (or used it
            # where fp16 was not in force): replaced, as on the original;
            # loss_scaling() starts over (isnan_ever False), whatever its interval
            restarted = not own.get('_loss_scaling_isnan_ever') or own.get(
                '_loss_scaling_multiplier') != mine['_loss_scaling_multiplier']
            _attach.say_own_scaling_replaced(
                optimizer, scaler, own.get('_loss_scaling_is_dynamic') and restarted)
        for name in CHAINERS:       # the scaler's from now on (undone: Chainer's defaults)
            own.pop(name, None)
    attach(optimizer, scaler, changes)
    return True
