"""Options of ``fastchain.enable`` and the accelerator groups that own them."""

import abc
import dataclasses
import importlib
import os
import tempfile

# Each accelerator group lives in its own module and exposes ``GROUP``.
# Imported on the first enable()/report(), never at ``import fastchain``.
GROUP_MODULES = (
    'fastchain.cudnn._group',
    'fastchain.tune._group',
    'fastchain.precision._group',
    'fastchain.data._group',
    'fastchain.static._group',
    'fastchain.kernels._group',
    'fastchain.nvtx._group',
)


def unwritable(path):
    """Why the file ``path`` could not be written where it is (a new file
    refused in its folder, or the file itself refused), or None. Tries it:
    ``os.access`` answers as if every permission held for root, whom /proc,
    /sys and read-only mounts still refuse."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, probe = tempfile.mkstemp(prefix='.fastchain-probe-', dir=folder)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.remove(probe)
    if os.path.exists(path):
        try:
            with open(path, 'a'):
                pass
        except OSError as e:
            return e.strerror or str(e)
    return None


class Option:
    """One keyword of ``enable()``.

    Args:
        name (str): the keyword.
        doc (str): one line for the error messages and the docs.
        default: the value when the keyword is not given. ``None`` means
            "on where available, without a warning where not".
        choices (tuple): allowed values (after ``aliases``), if a finite set.
        aliases (dict): accepted spellings mapped to a choice (``True`` ->
            ``'always'``).
        check (callable): ``value -> value`` that raises ``ValueError``, for
            open-ended values.
    """

    def __init__(self, name, doc, default=None, choices=None, aliases=None,
                 check=None):
        self.name = name
        self.doc = doc
        self.default = default
        self.choices = choices
        self.aliases = aliases or {}
        self.check = check

    def normalize(self, value):
        if value is None:
            return None
        import numpy
        if isinstance(value, numpy.generic):
            # numpy.True_, numpy.str_('auto'), numpy.int64(2) (from a config file,
            # an array's test or element): as Python's, each refused or taken as that
            value = value.item()
        for alias, target in self.aliases.items():
            # `True == 1` in Python; compare types too so 1 is not True.
            if type(value) is type(alias) and value == alias:
                value = target
                break
        if self.choices is not None:
            if not any(type(value) is type(c) and value == c
                       for c in self.choices):
                raise ValueError('fastchain.enable({}={!r}): expected one of {}'
                                 .format(self.name, value, self._spellings()))
            return value
        if self.check is not None:
            try:
                return self.check(value)
            except (TypeError, ValueError) as e:
                raise ValueError('fastchain.enable({}={!r}): {}'.format(
                    self.name, value, e)) from None
        return value

    def _spellings(self):
        return ', '.join(repr(v) for v in list(self.choices) + list(self.aliases))


def boolean(name, doc, default=None):
    return Option(name, doc, default=default, choices=(True, False))


@dataclasses.dataclass
class State:
    """How one accelerator stands after ``enable()`` (or before any).

    ``requested`` is true when the user asked for it explicitly; only then
    does an unavailable accelerator warn.
    """

    name: str
    available: bool
    active: bool
    requested: bool = False
    why: str = None
    fix: str = None
    setting: object = None
    note: str = None        # a caveat worth a warning even when active
    choices: dict = None    # autotune: {kind: what was measured and picked}
    calls: dict = None      # onednn: {operation: calls that ran its kernels}

    def as_dict(self):
        return dataclasses.asdict(self)


class Group(abc.ABC):
    """A set of options that one accelerator module applies together.

    A group never changes Chainer itself: :meth:`plan` declares, for the
    options in force, the layers and values it wants (through the
    :class:`~fastchain.config._enable.Plan`), and ``enable()``/``disable()``
    put exactly those in place through :mod:`fastchain.config._patches`.
    :meth:`states` reads what is really in force.

    ``values`` are the options in force (for each, the newest enabled handle
    that gave it, else the default); ``explicit`` the names some handle gave.
    """

    name = None
    options = ()

    def check(self, values, explicit):
        """Validate one handle's own options together, at ``enable()``
        (raise ``ValueError`` naming the option and the fix)."""

    def open(self, handle, values):
        """Create what belongs to one handle for its life (a timeline)."""

    def unused(self, values, own):
        """Messages for the options in ``own`` (one handle's explicit names)
        that do nothing under the options in force ``values``: one that
        configures an accelerator which is off (``loss_scale`` without fp16).
        Each is one warning at ``enable()``."""
        return []

    @abc.abstractmethod
    def plan(self, values, explicit, plan):
        """Declare the layers and values ``values`` ask for."""

    @abc.abstractmethod
    def states(self, values, explicit):
        """A list of State: what is in force now, read from the real state."""

    @abc.abstractmethod
    def probe(self):
        """A list of State (all inactive) describing what is available."""


def groups():
    return [importlib.import_module(m).GROUP for m in GROUP_MODULES]


def all_options():
    """{name: Option} over every group, in declaration order."""
    found = {}
    for group in groups():
        for option in group.options:
            if option.name in found:
                raise RuntimeError('option {!r} declared twice'.format(option.name))
            found[option.name] = option
    return found
