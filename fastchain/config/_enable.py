"""``fastchain.enable``: one call that turns the accelerators on, and its handle."""

import threading
import warnings

from fastchain.config import _options
from fastchain.config._recorder import Recorder

_lock = threading.RLock()
_stack = []     # active handles, oldest first


class FastchainWarning(UserWarning):
    """An option was asked for but cannot take effect here."""


class Handle:
    """What ``enable()`` returns: the record of its changes, and their undo.

    Use it as a context manager or call :meth:`disable`. Handles nest like
    scopes: disabling one also disables every handle enabled after it (their
    changes were made on top of its own), so the settings always return to
    exactly what they were before the disabled handle's ``enable()``.
    """

    def __init__(self, options, states, recorder):
        self.options = options      # resolved {name: value}
        self.states = states        # {accelerator: State}
        self._recorder = recorder
        self.active = True

    @property
    def changes(self):
        """[(setting, old value, new value)] in the order they were made."""
        return list(self._recorder.changes)

    def disable(self):
        """Undo every change this handle (and any handle after it) made."""
        with _lock:
            if not self.active:
                return
            while _stack:
                handle = _stack.pop()
                handle.active = False
                handle._recorder.undo()
                if handle is self:
                    break

    def report(self):
        """{accelerator: state dict} for this handle."""
        return {name: s.as_dict() for name, s in self.states.items()}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.disable()
        return False

    def __repr__(self):
        on = sorted(n for n, s in self.states.items() if s.active)
        return '<fastchain.Handle {} active=[{}]>'.format(
            'enabled' if self.active else 'disabled', ', '.join(on))


def enable(**options):
    """Turn on fastchain's accelerators; returns a :class:`Handle`.

    Each keyword belongs to one accelerator group; see the README for the
    full table. A keyword left out takes its default, which is "on where
    available" for the safe speed-ups and "off" for those that change
    numerics (``fp16``) or execution (``static_graph``).

    An option given explicitly that cannot take effect here (``autotune``
    with no cuDNN, say) gives one :class:`FastchainWarning` saying why and
    how to get it, and shows as inactive in ``handle.report()``.

    Raises:
        TypeError: an unknown keyword (the message lists the valid ones).
        ValueError: a keyword with a value it does not accept.
    """
    known = _options.all_options()
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError('fastchain.enable() got unknown option(s) {}; valid '
                        'options are: {}'.format(', '.join(unknown),
                                                 ', '.join(known)))
    resolved = {}
    for name, option in known.items():
        given = options.get(name, option.default)
        resolved[name] = option.normalize(given)
    explicit = {name for name, value in options.items() if value is not None}

    with _lock:
        recorder = Recorder()
        states = {}
        try:
            for group in _options.groups():
                values = {o.name: resolved[o.name] for o in group.options}
                for state in group.apply(values, explicit, recorder):
                    states[state.name] = state
        except BaseException:
            recorder.undo()
            raise
        handle = Handle(resolved, states, recorder)
        _stack.append(handle)

    for state in states.values():
        if state.requested and not state.available:
            warnings.warn(
                'fastchain: {} cannot take effect here: {}. To get it: {}'
                .format(state.name, state.why, state.fix),
                FastchainWarning, stacklevel=2)
        elif state.active and state.note:
            warnings.warn('fastchain: {}: {}'.format(state.name, state.note),
                          FastchainWarning, stacklevel=2)
    return handle


def active_handles():
    """The handles currently enabled, oldest first."""
    with _lock:
        return list(_stack)


def current_states():
    """{accelerator: State}: from the newest enabled handle, else probed."""
    states = {}
    for group in _options.groups():
        for state in group.probe():
            states[state.name] = state
    for handle in active_handles():
        states.update(handle.states)
    return states
