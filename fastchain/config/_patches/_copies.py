"""Copies of an object fastchain has a point on: plain objects.

A point on an object puts its dispatcher in the object's ``__dict__``, bound
to that object; these guards keep it (and what an owner asks) out of copies.
"""

import weakref

from fastchain.config._patches._common import carried as _carried, left_out as _left_out, \
    lock as _lock, object_points as _object_points


class _CopyGuard:
    """An object's own ``__reduce_ex__`` while fastchain has a point on it.

    A point on an object puts a dispatcher in the object's ``__dict__``,
    bound to that very object: a copy (``copy.copy``, ``copy.deepcopy``,
    ``Link.copy``, pickle: all reduce through ``__reduce_ex__``, looked up on
    the object) carried it, and a call of the copy's method ran the
    original's (a copied cached model computed with the original's
    parameters, silently; a deep copy raised on what Chainer's static graph
    keeps). The copy's state leaves out the dispatchers, this guard and the
    names given to :func:`leave_out_of_copies`: a copy is a plain object,
    without fastchain's layers, with what :func:`carry_into_copies` gives it.
    """

    __slots__ = ('_ref', '__weakref__')

    def __init__(self, obj):
        self._ref = weakref.ref(obj)

    def __call__(self, protocol):
        obj = self._ref()
        reduced = type(obj).__reduce_ex__(obj, protocol)
        if not isinstance(reduced, tuple) or len(reduced) < 3:
            return reduced
        state = reduced[2]
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        if not isinstance(state, dict):
            return reduced
        ours = {id(self)}
        deep = vars(obj).get('__deepcopy__')
        if isinstance(deep, _DeepCopyGuard):
            ours.add(id(deep))
        for point in (_object_points.get(obj) or {}).values():
            ours.update((id(point.value), id(point.dispatch)))
        names = _left_out.get(obj, ())
        state = {k: v for k, v in state.items() if id(v) not in ours and k not in names}
        for k, v in list(state.items()):
            if isinstance(v, dict) and any(id(x) in ours for x in v.values()):
                # a __getstate__ that nests the __dict__ (MultiprocessIterator's)
                state[k] = {a: b for a, b in v.items() if id(b) not in ours and a not in names}
        carried = _carried.get(obj)
        if carried is not None:
            state.update(carried())
        if slots is not None:
            state = (state, slots)
        return reduced[:2] + (state,) + reduced[3:]


class _DeepCopyGuard:
    """An object's own ``__deepcopy__`` while guarded, where its class has
    one (``copy.deepcopy`` looks it up on the object, before
    ``__reduce_ex__``): the class's runs with fastchain's attributes taken
    out of the object for the while (a class's own ``__deepcopy__`` that
    copies ``__dict__`` carried the dispatchers bound to the original)."""

    __slots__ = ('_ref', '__weakref__')

    def __init__(self, obj):
        self._ref = weakref.ref(obj)

    def __call__(self, memo):
        obj = self._ref()
        own = vars(obj)
        names = set(_left_out.get(obj, ()))
        taken = {name: own.pop(name) for name in list(own)
                 if name in names or is_ours(obj, name)}
        try:
            return type(obj).__deepcopy__(obj, memo)
        finally:
            own.update(taken)


def _guard(obj):
    own = vars(obj)
    if not isinstance(own.get('__reduce_ex__'), _CopyGuard):
        own['__reduce_ex__'] = _CopyGuard(obj)
    if getattr(type(obj), '__deepcopy__', None) is not None and \
            not isinstance(own.get('__deepcopy__'), _DeepCopyGuard):
        own['__deepcopy__'] = _DeepCopyGuard(obj)


def _unguard(obj):
    """Take the guard away once nothing of fastchain's is left on ``obj``."""
    if _left_out.get(obj) or _carried.get(obj):
        return
    if any(point.installed() for point in (_object_points.get(obj) or {}).values()):
        return
    own = vars(obj)
    if isinstance(own.get('__reduce_ex__'), _CopyGuard):
        del own['__reduce_ex__']
    if isinstance(own.get('__deepcopy__'), _DeepCopyGuard):
        del own['__deepcopy__']


def is_ours(obj, name):
    """``obj.name`` (its own attribute) is fastchain's: a point's dispatcher
    or the copy guard."""
    value = vars(obj).get(name)
    if value is None:
        return False
    if type(value) in (_CopyGuard, _DeepCopyGuard):     # (isinstance asks a dead proxy)
        return True
    point = (_object_points.get(obj) or {}).get(name)
    return point is not None and value is point.value


def leave_out_of_copies(obj, names):
    """Copies of ``obj`` (see :class:`_CopyGuard`) leave out its attributes
    ``names`` (what they hold belongs to ``obj`` alone); ``()`` ends it."""
    with _lock:
        if names:
            _left_out[obj] = frozenset(names)
            _guard(obj)
        else:
            _left_out.pop(obj, None)
            _unguard(obj)


def carry_into_copies(obj, values):
    """Copies of ``obj`` (see :class:`_CopyGuard`) get the attributes
    ``values()`` returns at each copy ({name: value}; copied as the rest of
    the state is, so a shallow copy shares them: make them anew there): what
    a copy needs to be taken up again as ``obj`` was; None ends it."""
    with _lock:
        if values is not None:
            _carried[obj] = values
            _guard(obj)
        else:
            _carried.pop(obj, None)
            _unguard(obj)
