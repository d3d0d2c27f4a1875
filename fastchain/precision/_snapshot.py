"""What fp16 training adds to an optimizer's snapshot, and what it tolerates
in one: the fp32 master weights (Chainer keeps only the update rules'
state), and rules saved before their first update (the loss scaler may skip
every step before a snapshot)."""

import numpy

import chainer


def saved_before_first_update(optimizer, serializer):
    """Loading: the update rules the snapshot says had no state (saved with
    ``t == 0``: the scaler skipped every step before it). Chainer's
    ``UpdateRule.serialize`` looks for their state and raises ``KeyError``
    ('W/m is not a file in the archive'); such a rule is to be as in the run
    saved: without state (dropped, where a run going back to the snapshot
    has made some since), its state made at its first update."""
    if not isinstance(serializer, chainer.serializer.Deserializer):
        return []
    out = []
    for name, param in optimizer.target.namedparams():
        rule = getattr(param, 'update_rule', None)
        if rule is None or not rule.enabled or rule in out:
            continue
        try:
            t = serializer[name[1:]]('t', None)
        except (KeyError, ValueError):
            continue
        if t is not None and int(t) == 0:
            rule._state = None
            out.append(rule)
    return out


def serialize_masters(optimizer, serializer):
    """Save or load the fp32 master weight of every fp16 parameter updated in
    fp32 (Chainer's UpdateRule.serialize keeps only the rule's state: a
    resumed run would start its masters from the fp16 weights). Returns
    whether a loaded snapshot lacked any (a non-strict load gives None)."""
    loading = isinstance(serializer, chainer.serializer.Deserializer)
    absent = False
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
            try:
                master = serializer(key, None)
            except KeyError:
                if made:
                    raise
                continue        # (saved before it was made: none to take)
            if master is None:
                absent = absent or made     # keep this rule's master as it is
                continue
            # its own array: a snapshot read from memory (a dict) hands out
            # its own, which the next update would change under it
            sent = param.device.send(master)
            master = sent.astype(numpy.float32, copy=sent is master)
            rule._fp32_param = chainer.Parameter(master, name=param.name)
        else:
            master = rule._fp32_param.array if rule._fp32_param is not None \
                else param.array.astype(numpy.float32)
            serializer(key, master)
    return absent
