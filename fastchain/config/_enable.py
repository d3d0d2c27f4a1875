"""``fastchain.enable``: one call that turns the accelerators on, and its handle.

Handles are layers of options. Each enabled handle gives some options
explicitly (the keywords it was called with) and the defaults for the rest;
for each option, the one in force is the newest enabled handle's explicit
value, else the default. After every ``enable()`` and ``disable()`` the groups
*plan* what the options in force ask for (layers on Chainer's entry points,
``chainer.config`` values, ...), and :mod:`fastchain.config._patches` puts
exactly that in place: nothing is undone by replaying a record, so handles
can be disabled in any order, and one handle's disable never removes what
another handle, the data-parallel optimizer, a chain cached with
``fastchain.static_graph`` or the user put there.

What an option does to objects set up while it is in force (a loss scaler on
an optimizer, a cached forward on a chain, fused kernels on its rules) belongs
to the handle whose option it was; it is undone when that handle is disabled,
unless the same option is still in force from another handle, which then
takes it over. An inner ``enable(fp16=False)`` thus makes new models fp32 and
new optimizers plain inside its scope, and leaves an optimizer set up outside
as it was.
"""

import threading
import warnings

from fastchain.config import _options, _patches, _set_up_before
from fastchain.config._warning import FastchainWarning  # noqa: F401  (re-exported)

_lock = threading.RLock()
_handles = []           # enabled, oldest first
_applied_wraps = {}     # (owner, name, layer) -> point
_applied_values = set()
_in_force = {}          # feature -> handle owning what it does to objects


class Plan:
    """What the options in force ask for; filled in by the groups' ``plan``."""

    def __init__(self, providers):
        self._providers = providers
        self.wraps = {}         # (owner, name, layer) -> fn
        self.values = {}        # label -> (get, set, value)
        self.features = {}      # feature -> handle

    def changes(self, feature, option):
        """The :class:`~fastchain.config._patches.Changes` that the layer of
        ``feature`` records its changes to objects in: those of the handle
        that gave ``option``."""
        handle = self._providers[option]
        self.features[feature] = handle
        return handle._changes_for(feature)

    def handle(self, option):
        """The handle whose value of ``option`` is in force."""
        return self._providers[option]

    def wrap(self, owner, name, layer, fn):
        self.wraps[(owner, name, layer)] = fn

    def value(self, label, get, set_, value):
        self.values[label] = (get, set_, value)

    def config(self, key, value):
        """``chainer.global_config.<key>`` (the process-wide default)."""
        import chainer
        cfg = chainer.global_config

        def get():
            return cfg.__dict__.get(key, _patches.MISSING)

        def set_(v):
            if v is _patches.MISSING:
                cfg.__dict__.pop(key, None)
            else:
                setattr(cfg, key, v)
        self.value('chainer.config.' + key, get, set_, value)


class Handle:
    """What ``enable()`` returns: one layer of options, and its undo.

    Use it as a context manager or call :meth:`disable`. Handles may be
    disabled in any order: each removes only its own options, and the options
    of the handles still enabled stay in force.
    """

    def __init__(self, options, explicit):
        self.options = options                  # resolved {name: value}
        self.explicit = frozenset(explicit)     # the names given
        self.active = True
        self.resources = {}                     # per-handle objects (timeline)
        self._changes = {}                      # feature -> Changes
        self._closers = []
        self._failure = []

    def _changes_for(self, feature):
        changes = self._changes.get(feature)
        if changes is None:
            changes = self._changes[feature] = _patches.Changes(feature)
        return changes

    def on_disable(self, fn, label):
        """Call ``fn()`` when this handle is disabled (after its options left)."""
        self._closers.append((label, fn))

    def on_failure(self, fn):
        """Call ``fn()`` if the ``enable()`` making this handle fails after its
        groups opened (what they set up to happen at exit is taken back)."""
        self._failure.append(fn)

    def disable(self):
        """Remove this handle's options; undo what they did to objects.

        Everything is attempted even when one part fails; the handle ends
        disabled either way, and one ``RuntimeError`` names what could not
        be restored.
        """
        with _lock:
            if not self.active:
                return
            self.active = False
            _handles.remove(self)
            errors = _reconcile_collecting()
            for feature, changes in self._changes.items():
                heir = _in_force.get(feature)
                if heir is not None:
                    heir._changes_for(feature).adopt(changes)
                else:
                    errors += changes.undo()
            self._changes = {}
            for label, fn in reversed(self._closers):
                try:
                    fn()
                except Exception as e:
                    errors.append('{}: {}: {}'.format(label, type(e).__name__, e))
            self._closers = []
        if errors:
            raise RuntimeError('fastchain: disable() could not restore everything: '
                               + '; '.join(errors))

    @property
    def states(self):
        """{accelerator: State}: what is in force now (``requested``: this
        handle asked for it); all inactive once disabled."""
        return _states(self)

    def report(self):
        """{accelerator: state dict}, see :attr:`states`."""
        return {name: s.as_dict() for name, s in self.states.items()}

    def __enter__(self):
        if not self.active:     # it would run the block with none of its options
            raise RuntimeError('fastchain: this handle was disabled, and a disabled handle '
                               'cannot be enabled again: use `with fastchain.enable(...):`')
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
    numerics (``fp16``, ``onednn``) or execution (``static_graph``), and for
    ``timeline`` (a trace file written on disable). Inside the handle's
    scope its explicit keywords override those of handles enabled before.

    An option given explicitly that cannot take effect here (``cudnn``
    without cuDNN, say) gives one :class:`FastchainWarning` saying why and
    how to get it, and shows as inactive in ``handle.report()``.

    Raises:
        TypeError: an unknown keyword (the message lists the valid ones).
        ValueError: a keyword with a value it does not accept, alone or with
            the others (checked before anything changes).
    """
    known = _options.all_options()
    unknown = sorted(set(options) - set(known))
    if unknown:
        import difflib
        close = {u: difflib.get_close_matches(u, known, n=1) for u in unknown}
        raise TypeError('fastchain.enable() got unknown option(s) {}{}; valid '
                        'options are: {}'.format(', '.join(unknown), ''.join(
                            ' ({!r}: did you mean {!r}?)'.format(u, c[0])
                            for u, c in close.items() if c), ', '.join(known)))
    resolved = {}
    for name, option in known.items():
        resolved[name] = option.normalize(options.get(name, option.default))
    explicit = {name for name, value in options.items() if value is not None}
    groups = _options.groups()
    for group in groups:
        group.check(_of(group, resolved), explicit)
    _check_files(resolved)

    handle = Handle(resolved, explicit)
    with _lock:
        try:
            for group in groups:
                group.open(handle, _of(group, resolved))
            _handles.append(handle)
            errors = _reconcile_collecting(raise_plan=True)
        except BaseException:
            _abandon(handle)
            raise
        if errors:
            _abandon(handle)
            raise RuntimeError('fastchain.enable() could not apply its options: '
                               + '; '.join(errors))

    # Warnings turned into errors (-W error, a test suite's filterwarnings)
    # raise here: the options are taken out again, not left in force with
    # no handle to disable them.
    try:
        for state in handle.states.values():
            if state.requested and not state.available:
                warnings.warn(
                    'fastchain: {} cannot take effect here: {}. To get it: {}'
                    .format(state.name, state.why, state.fix),
                    FastchainWarning, stacklevel=2)
            elif state.requested and not state.active:
                # Available, asked for, yet not in force: another option in force
                # (this handle's or an earlier one's) keeps it out.
                warnings.warn('fastchain: {} is not in force: {}{}'.format(
                    state.name, state.why or 'another option in force keeps it out',
                    '. To get it: {}'.format(state.fix) if state.fix else ''),
                    FastchainWarning, stacklevel=2)
            elif state.requested and state.active and state.note:
                warnings.warn('fastchain: {}: {}'.format(state.name, state.note),
                              FastchainWarning, stacklevel=2)
        for group in _options.groups():
            for message in group.unused(_of(group, _effective()[0]), handle.explicit):
                warnings.warn('fastchain: ' + message, FastchainWarning, stacklevel=2)
        _set_up_before.warn(handle)
    except BaseException:
        _forget(handle)
        try:
            handle.disable()
        except Exception:       # noqa: BLE001 - the warning raised is the error to see
            pass
        raise
    return handle


def _forget(handle):
    """Nothing written for an enable() that failed: no trace, no autotune
    cache, now or at exit."""
    handle._closers = []
    for fn in handle._failure:
        try:
            fn()
        except Exception:       # noqa: BLE001 - best effort: the failure is the error to see
            pass
    handle._failure = []


def _abandon(handle):
    """Take a handle that could not be enabled out again, quietly."""
    if handle in _handles:
        _handles.remove(handle)
    handle.active = False
    _reconcile_collecting()
    for changes in handle._changes.values():
        changes.undo()
    _forget(handle)     # (it ran the closers: a trace and a cache for a failed enable())


def _check_files(values):
    """The files written at disable() must differ: the timeline's trace,
    summary and chart, and the autotune cache (one replaced another)."""
    import os
    cache, timeline = values.get('tune_cache'), values.get('timeline')
    if cache is None or timeline is None:
        return
    base = os.path.splitext(os.path.abspath(timeline))[0]
    if os.path.abspath(cache) in (os.path.abspath(timeline), base + '.txt', base + '.png'):
        raise ValueError('tune_cache={!r} is one of the files the timeline {!r} writes (its '
                         'trace, and its summary and chart beside it): give the autotune '
                         'cache another path'.format(cache, timeline))


def _of(group, values):
    return {o.name: values[o.name] for o in group.options}


def _effective():
    """(values in force, the names given explicitly, {name: providing handle})."""
    values, explicit, providers = {}, set(), {}
    for name, option in _options.all_options().items():
        provider = next((h for h in reversed(_handles) if name in h.explicit), None)
        if provider is not None:
            explicit.add(name)
        else:
            provider = _handles[0] if _handles else None
        providers[name] = provider
        values[name] = provider.options[name] if provider is not None else \
            option.normalize(option.default)
    return values, explicit, providers


def _reconcile_collecting(raise_plan=False):
    """Put in place what the enabled handles' options ask for; returns the
    list of what failed (a failing plan raises when ``raise_plan``)."""
    errors = []
    try:
        plan = _plan()
    except Exception as e:
        if raise_plan:
            raise
        errors.append('planning: {}: {}'.format(type(e).__name__, e))
        plan = Plan({})         # take everything out
    for key in list(_applied_wraps):
        if key not in plan.wraps:
            point = _applied_wraps.pop(key)
            try:
                _patches.unwrap(*key, point=point)
            except Exception as e:
                errors.append('{} ({}): {}'.format(point.label, key[2], e))
    for key, fn in plan.wraps.items():
        try:
            _applied_wraps[key] = _patches.wrap(*key, fn)
        except Exception as e:
            errors.append('{}.{} ({}): {}'.format(key[0], key[1], key[2], e))
    for label in sorted(_applied_values - set(plan.values)):
        _applied_values.discard(label)
        try:
            _patches.clear_value(label)
        except Exception as e:
            errors.append('{}: {}'.format(label, e))
    for label, (get, set_, value) in plan.values.items():
        try:
            _patches.set_value(label, get, set_, value)
            _applied_values.add(label)
        except Exception as e:
            errors.append('{}: {}'.format(label, e))
    _in_force.clear()
    _in_force.update(plan.features)
    _patches.sweep()
    return errors


def _plan():
    if not _handles:
        return Plan({})
    values, explicit, providers = _effective()
    plan = Plan(providers)
    for group in _options.groups():
        group.plan(_of(group, values), explicit, plan)
    return plan


def _states(handle=None):
    values, explicit, _ = _effective()
    states = {}
    for group in _options.groups():
        if handle is not None and not handle.active:
            for state in group.probe():
                states[state.name] = state
            continue
        for state in group.states(_of(group, values), explicit):
            states[state.name] = state
    if not _handles:
        for state in states.values():
            if not state.active and state.available and state.why is None:
                state.why = 'no fastchain.enable() handle is enabled'
    if handle is not None:
        for name, state in states.items():
            option = _STATE_OPTION.get(name, name)
            state.requested = state.requested and option in handle.explicit
            if not handle.active:
                state.setting = handle.options.get(option)
    return states


# State names that are not option names.
_STATE_OPTION = {'loader': 'loader_workers'}


def active_handles():
    """The handles currently enabled, oldest first."""
    with _lock:
        return list(_handles)


def current_states():
    """{accelerator: State}: what is in force now, read from the real state."""
    with _lock:
        return _states()
