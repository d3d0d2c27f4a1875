"""Value points: settings fastchain sets (``chainer.config`` keys, cuDNN's
workspace, module flags), put back only where they still hold its value."""

from fastchain.config._patches._common import MISSING as _MISSING, lock as _lock

_values = {}                                    # label -> _ValueState


def _same(a, b):
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


class _ValueState:
    __slots__ = ('get', 'set', 'original', 'last')

    def __init__(self, get, set_):
        self.get, self.set = get, set_
        self.original = get()
        self.last = _MISSING


def set_value(label, get, set_, value):
    """Make ``value`` the one in force at ``label`` (``get()``/``set_(v)`` read
    and write it; ``set_(_MISSING)`` deletes). The value before fastchain's
    first is kept for :func:`clear_value`. A value someone else set since
    fastchain's last is left alone unless fastchain's wish changes."""
    with _lock:
        state = _values.get(label)
        if state is None:
            state = _values[label] = _ValueState(get, set_)
        elif _same(state.last, value):
            return
        state.set(value)
        state.last = value


def clear_value(label):
    """fastchain no longer sets ``label``: put back the value from before,
    unless the current value is no longer fastchain's."""
    with _lock:
        state = _values.pop(label, None)
        if state is not None and _same(state.get(), state.last):
            state.set(state.original)


def original_value(label, get):
    """The value at ``label`` from before fastchain set it (``get()`` if it
    does not)."""
    with _lock:
        state = _values.get(label)
        return get() if state is None else state.original


def value_labels():
    with _lock:
        return sorted(_values)
