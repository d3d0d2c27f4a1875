"""Changes to objects: attachments (explicit lookups instead of marker
attributes) and :class:`Changes`, what one owner did to objects, held weakly."""

import weakref

from fastchain.config._patches._common import MISSING as _MISSING, lock as _lock
from fastchain.config._patches._points import unwrap, wrap

_attachments = weakref.WeakKeyDictionary()      # obj -> {key: value}


def attach(obj, key, value):
    """Associate ``value`` with ``obj`` under ``key`` (held as long as ``obj``)."""
    with _lock:
        table = _attachments.get(obj)
        if table is None:
            table = _attachments[obj] = {}
        table[key] = value


def attached(obj, key, default=None):
    """What :func:`attach` associated with ``obj`` under ``key``."""
    table = _attachments.get(obj)
    return default if table is None else table.get(key, default)


def detach(obj, key, value=_MISSING):
    """Remove ``key`` from ``obj`` (only if it is ``value``, when given)."""
    with _lock:
        table = _attachments.get(obj)
        if table is None or key not in table:
            return False
        if value is not _MISSING and table[key] is not value:
            return False
        del table[key]
        return True


def _weak(obj):
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class Changes:
    """What one owner (a handle's option) did to objects set up while it was
    in force: layers on their methods, attributes, attachments. Undone newest
    first, each only where it still holds what was set; objects held weakly."""

    def __init__(self, label):
        self.label = label
        self._entries = []
        self.heir = None

    def __len__(self):
        return len(self._entries)

    def wrap(self, obj, name, layer, fn):
        point = wrap(obj, name, layer, fn)
        self._entries.append(('wrap', _weak(obj), name, layer, weakref.ref(point)))
        return point

    def attach(self, obj, key, value):
        attach(obj, key, value)
        self._entries.append(('attach', _weak(obj), key, _weak_value(value), None))

    def call(self, label, undo):
        """Run ``undo()`` on undo (it must not hold the objects strongly)."""
        self._entries.append(('call', None, label, undo, None))

    def adopt(self, other):
        """Take over ``other``'s entries (they are undone with this owner's;
        ``other.heir`` says where they went)."""
        self._entries.extend(other._entries)
        other._entries = []
        other.heir = self

    def current(self):
        """The Changes holding this one's entries now (itself, or its heir's)."""
        changes = self
        while changes.heir is not None:
            changes = changes.heir
        return changes

    def undo(self):
        """Undo everything; returns the list of what could not be undone."""
        errors = []
        while self._entries:
            kind, ref, name, value, extra = self._entries.pop()
            try:
                _undo_one(kind, ref, name, value, extra)
            except Exception as e:      # keep undoing the rest
                errors.append('{} ({}): {}: {}'.format(name, self.label, type(e).__name__, e))
        return errors


def _weak_value(value):
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


def _undo_one(kind, ref, name, value, extra):
    if kind == 'call':
        value()
        return
    obj = ref()
    if obj is None:
        return
    if kind == 'wrap':
        unwrap(obj, name, value, point=extra())
    elif kind == 'attach':
        detach(obj, name, value())
