"""What fp16 training adds to an optimizer's snapshot, and what it tolerates
in one: the fp32 master weights (Chainer keeps only the update rules'
state), and rules saved before their first update (the loss scaler may skip
every step before a snapshot)."""

import warnings
import weakref

import numpy

import chainer

from fastchain.config import _patches
from fastchain.config._warning import FastchainWarning

SERIAL_KEY = 'fastchain_loss_scaler'
SERIAL_MASTERS = 'fastchain_fp32_masters'

# rules whose master was kept through a load of a snapshot without it
_unverified = weakref.WeakKeyDictionary()


def serialize(opt, scaler, next_, serializer):
    """``serialize`` of an fp16 optimizer: Chainer's, rules saved before their
    first update tolerated, then the scaler's state (``scaler``: None for
    fp32 masters only) and the fp32 master weights."""
    unstarted = saved_before_first_update(opt, serializer)
    for rule, _ in unstarted:   # Chainer's load: missing state raises unless disabled
        rule.enabled = False
    try:
        next_(serializer)
    except BaseException:       # (a wrong file: the rules keep the state they had)
        for rule, state in unstarted:
            rule._state = state
        raise
    finally:
        for rule, _ in unstarted:
            rule.enabled = True
    missing = []
    if scaler is not None:
        try:
            scaler.serialize(serializer[SERIAL_KEY])
        except (KeyError, ValueError):      # (HDF5: 'Inexistent group is specified')
            missing.append('loss-scaler state (going on from {!r})'.format(scaler))
    try:
        masters = serializer[SERIAL_MASTERS]
    except KeyError:
        masters = None
    absent = serialize_masters(opt, masters)
    if absent:
        missing.append('fp32 master weight{} of {}{} (kept where the fp16 weights are still '
                       "the masters' rounded, else made from them at the next update, as plain "
                       'Chainer makes them: a resumed run is not bit for bit)'.format(
                           's' if len(absent) > 1 else '', ', '.join(absent[:3]),
                           ' and {} more'.format(len(absent) - 3) if len(absent) > 3 else ''))
    if missing:
        # A snapshot written without fastchain's fp16 (or before it kept
        # the masters): keep what is here for what it lacks.
        warnings.warn('fastchain: the snapshot has no ' + ' and no '.join(missing),
                      FastchainWarning, stacklevel=_patches.user_stacklevel())


def saved_before_first_update(optimizer, serializer):
    """Loading: the update rules the snapshot says had no state (saved with
    ``t == 0``: the scaler skipped every step before it). Chainer's
    ``UpdateRule.serialize`` looks for their state and raises ``KeyError``
    ('W/m is not a file in the archive'); such a rule is to be as in the run
    saved: without state (dropped, where a run going back to the snapshot
    has made some since), its state made at its first update. Returns
    [(rule, the state it had)]."""
    if not isinstance(serializer, chainer.serializer.Deserializer):
        return []
    out = []
    for name, param in optimizer.target.namedparams():
        rule = getattr(param, 'update_rule', None)
        if rule is None or not rule.enabled or any(rule is r for r, _ in out):
            continue
        try:
            t = serializer[name[1:]]('t', None)
        except (KeyError, ValueError):
            continue
        if t is not None and int(t) == 0:
            out.append((rule, rule._state))
            rule._state = None
    return out


def serialize_masters(optimizer, serializer):
    """Save or load the fp32 master weight of every fp16 parameter updated in
    fp32 (Chainer's UpdateRule.serialize keeps only the rule's state: a
    resumed run would start its masters from the fp16 weights). Loading,
    ``serializer`` None: the snapshot has no masters' section. Returns the
    names of the parameters whose master a loaded snapshot lacked (a master
    the rule has is then checked at the next update: :func:`verify_masters`)."""
    loading = serializer is None or isinstance(serializer, chainer.serializer.Deserializer)
    if not loading:
        verify_masters(optimizer)       # a save right after such a load
    absent = []
    for name, param in optimizer.target.namedparams():
        rule = getattr(param, 'update_rule', None)
        if rule is None or not rule._use_fp32_update:
            continue
        made = param.array is not None
        if made and param.dtype != numpy.float16 or not made and not loading:
            continue
        key = name.lstrip('/').replace('/', '.')
        if loading:
            # A parameter not made yet (L.Linear(None, n): StandardUpdater
            # loads the optimizer before the model) takes a master the
            # snapshot has for it: its first update starts from it.
            master = None
            if serializer is not None:
                try:
                    master = serializer(key, None)
                except (KeyError, ValueError):      # a strict load without it (HDF5:
                    pass                            # 'Inexistent group is specified')
            if master is None:
                if made:
                    absent.append(name.lstrip('/'))
                    if rule._fp32_param is not None:
                        _unverified[rule] = True
                continue
            # its own array: a snapshot read from memory (a dict) hands out
            # its own, which the next update would change under it
            sent = param.device.send(master)
            master = sent.astype(numpy.float32, copy=sent is master)
            rule._fp32_param = chainer.Parameter(master, name=param.name)
            _unverified.pop(rule, None)
        else:
            master = rule._fp32_param.array if rule._fp32_param is not None \
                else param.array.astype(numpy.float32)
            serializer(key, master)
    return absent


def verify_masters(optimizer):
    """At the update after a load that lacked masters: a master the rule kept
    stays where its parameter's fp16 weight is still the master rounded (only
    the optimizer was loaded); where the weight is another (the model was
    loaded too: StandardUpdater loads it after the optimizer) the master is
    dropped, to be made from that weight by the update, as Chainer makes it.
    Kept, it would undo the model's load at this update."""
    if not _unverified:
        return
    for param in optimizer.target.params():
        rule = getattr(param, 'update_rule', None)
        if rule is None or _unverified.pop(rule, None) is None:
            continue
        master = rule._fp32_param
        if master is None or master.array is None or param.array is None:
            continue
        xp = chainer.backend.get_array_module(param.array)
        if not bool(xp.array_equal(master.array.astype(param.dtype), param.array)):
            rule._fp32_param = None
