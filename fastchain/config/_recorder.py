"""Records every setting a handle changes, so that it can be undone exactly."""

_MISSING = object()


class Recorder:
    """Applies changes and remembers how to undo each, newest first.

    Every change an accelerator group makes goes through one of these
    methods; nothing else writes global state. :meth:`undo` restores the
    recorded old values in reverse order.
    """

    def __init__(self):
        self._undo = []     # [(description, callable)]
        self.changes = []   # [(description, old, new)] for the report

    def set_config(self, key, value):
        """Set ``chainer.global_config.<key>`` (process-wide default)."""
        import chainer
        cfg = chainer.global_config
        old = cfg.__dict__.get(key, _MISSING)
        setattr(cfg, key, value)

        def undo():
            if old is _MISSING:
                cfg.__dict__.pop(key, None)
            else:
                setattr(cfg, key, old)
        self._push('chainer.config.' + key, old, value, undo)

    def set_attr(self, obj, name, value, label=None):
        """Set ``obj.<name>``; the undo deletes it again if it was absent."""
        old = obj.__dict__.get(name, _MISSING) if hasattr(obj, '__dict__') \
            else getattr(obj, name, _MISSING)
        setattr(obj, name, value)

        def undo():
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._push(label or '{}.{}'.format(_name(obj), name), old, value, undo)

    def call(self, label, do, undo, old=None, new=None):
        """Run ``do()`` now and ``undo()`` on restore (for setter functions)."""
        do()
        self._push(label, old, new, undo)

    def undo(self):
        errors = []
        while self._undo:
            label, fn = self._undo.pop()
            try:
                fn()
            except Exception as e:  # keep restoring the rest
                errors.append('{}: {}'.format(label, e))
        self.changes = []
        if errors:
            raise RuntimeError('fastchain could not restore: ' + '; '.join(errors))

    def _push(self, label, old, new, undo):
        self._undo.append((label, undo))
        self.changes.append((label, None if old is _MISSING else old, new))


def _name(obj):
    return getattr(obj, '__qualname__', None) or getattr(
        obj, '__name__', None) or type(obj).__name__
