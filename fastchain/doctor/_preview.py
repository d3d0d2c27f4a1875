"""What ``fastchain.enable()`` would do on this machine, found by doing it.

``fastchain doctor`` runs in a process of its own where nothing is enabled,
so "active" there says nothing. Instead it calls the real ``enable()``, reads
the handle's states (the same code that resolves every option's default and
decides what goes in force) and disables it again; then, for each accelerator
available here that ``enable()`` leaves off, it tries each value that asks for
it (``enable(fp16=True)``, ``enable(fp16='auto')``, ...) the same way, keeping
the warnings ``enable()`` gives. No table of defaults is kept here.
"""

import warnings

from fastchain.config import _enable, _options, _patches

# Values of an option that ask for nothing: not worth a trial.
_OFF = (False, 'never')


def _same(a, b):
    return type(a) is type(b) and a == b


def option_of(state_name, options):
    """The ``enable()`` option that switches the accelerator ``state_name``."""
    name = _enable._STATE_OPTION.get(state_name, state_name)
    return options.get(name)


def _trial(**options):
    """({accelerator: State}, [warning messages]) of ``enable(**options)`` here,
    undone before returning; raises if anything of it stays in force."""
    before = (_patches.points(), _patches.value_labels())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always', _enable.FastchainWarning)
        handle = _enable.enable(**options)
        try:
            states = handle.states
        finally:
            handle.disable()
    if (_patches.points(), _patches.value_labels()) != before:
        raise RuntimeError('fastchain doctor: enable({}) left changes in force after '
                           'disable()'.format(_call(options)))
    messages = [str(w.message) for w in caught
                if issubclass(w.category, _enable.FastchainWarning)]
    return states, messages


def _call(options):
    return ', '.join('{}={!r}'.format(k, v) for k, v in options.items())


def _outcome(state, messages):
    return {'active': state.active, 'why': state.why, 'fix': state.fix,
            'note': state.note, 'setting': state.setting, 'warnings': messages}


def _asking_values(option):
    """The values of ``option`` that ask for its accelerator, other than its
    default (``fp16``: ``True`` and ``'auto'``)."""
    if not option.choices:
        return []
    default = option.normalize(option.default)
    return [v for v in option.choices
            if not any(_same(v, off) for off in _OFF) and not _same(v, default)]


def preview():
    """{accelerator: dict} for each accelerator of ``enable()``:

    * ``option``: the ``enable()`` keyword that switches it;
    * ``default``: that keyword's declared default (``None``: decided by
      ``enable()`` from what this machine offers);
    * ``enable_here``: what ``enable()`` with no arguments does here
      (``active``, ``why``, ``fix``, ``note``, ``setting``, ``warnings``);
    * ``on_by_default``: whether ``enable()`` with no arguments turns it on:
      as found here where it is available, else from the declared default
      (``None`` means "on where available");
    * ``requested_here``: for one available here that ``enable()`` leaves
      off, ``{"fp16=True": outcome, ...}``: what asking for it would do.

    Raises:
        RuntimeError: a handle is enabled (a trial would stack on it).
    """
    with _enable._lock:
        if _enable.active_handles():
            raise RuntimeError('fastchain doctor: the preview of enable() runs only '
                               'where no handle is enabled')
        options = _options.all_options()
        states, messages = _trial()
        found = {}
        for name, state in states.items():
            option = option_of(name, options)
            entry = {
                'option': option.name if option else None,
                'default': option.default if option else None,
                'enable_here': _outcome(state, messages),
                'on_by_default': state.active if state.available else
                (option is not None and option.default is None),
                'requested_here': {},
            }
            if option is not None and state.available and not state.active:
                for value in _asking_values(option):
                    call = _call({option.name: value})
                    try:
                        tried, said = _trial(**{option.name: value})
                    except Exception as e:      # refused: say so, as enable() would
                        entry['requested_here'][call] = {
                            'active': False, 'why': '{}: {}'.format(type(e).__name__, e),
                            'fix': None, 'note': None, 'setting': value, 'warnings': []}
                        continue
                    entry['requested_here'][call] = _outcome(tried[name], said)
            found[name] = entry
        return found
