"""What a cached chain's links hold, set from outside between calls.

A replay runs none of the forward's Python, so what the forward reads from
its links' attributes is frozen at what the recording saw: a weight it
multiplies by (``self.alpha``, a KL beta), a flag it branches on, an array it
was given (``self.mask = new``, a persistent rebound), a parameter added with
``add_param``. The verified calls catch what the forward itself changes
(:mod:`fastchain.static._state`); a change the training loop made after them
was replayed stale, silently (a new-user trial measured it: a loss 0.16 off
from the step a flag was set, the layer behind the flag never trained).

While a chain is cached, Chainer's ``Link.__setattr__`` and ``__delattr__``
carry a layer that notes the watched links set (Chainer's own schedule
attributes aside): nothing but the configs below is looked at on a call
unless one was. A cached call then takes what the set links hold
(:func:`stamp`: values by value, configs by what they hold, tuples and lists
of up to 1024 items item by item, longer ones by their items' identities
(up to 65536) or length, anything else by identity) and keys its schedule
by the state: a state not seen before records and is verified like a new
input shape, and one seen before replays
its own schedules (a flag toggled back and forth keeps two). What the
forward changes on a call that runs it (a constant made on the first call)
belongs to the state the call started in. Past :data:`MAX_STATES` states the
chain runs define-by-run, naming what kept changing.

A ``ChainList`` or ``Sequential`` whose links or layers are added,
replaced or removed (``append``, ``insert``, ``del``, ``seq[i] = f``) counts
as set too. Lists, dicts and configs a link holds, changed in place
(``self.cfg['beta'] = ...``, ``self.args.alpha = ...``, a callable object
among a ``Sequential``'s layers), set nothing on the link: they are looked
at on every call, each object once (:mod:`fastchain.static._configs`).

NumPy arrays the links hold (persistent values included, parameters not),
changed in place between calls (a pruning mask ``self.mask[:k] = False``, a
0-d persistent ``load_npz`` copies a snapshot's value into), set nothing
either: a replay reads an array in place where a function takes it, but
not what the forward computed from it in Python (``self.mask.astype(...)``,
``float(self.temperature)``), which it froze (a new-user trial: 0.08 off
from the step the mask changed). They are compared by a digest at the end
of each call and at the start of the next (what a call changes, such as
BatchNormalization's running statistics, is the call's); a change between
calls starts a new state. Not looked at: the arrays a recorded function
takes as an input (or a view of them), which the replay reads in place (a
memory bank, EMA weights the loop updates: they would start a state on every
step), those of Chainer's own links (passed to functions), arrays of objects,
CuPy arrays (a digest would copy them to the host), arrays deeper than one
level in a list, tuple or dict a link holds (or in one of more than 64
items), one over 1 MiB, and past 4 MiB in all, the rest (every array looked at is
digested twice a call).

Not seen: an attribute set around ``__setattr__`` (``vars(link)[name] =
...``), a change inside an object that holds links or other objects (an
optimizer), a class attribute, and state outside the links (a module's
global).
"""

import hashlib
import weakref

import numpy
from chainer.backend import Device

from fastchain.config import _patches
from fastchain.static import _configs
from fastchain.static._keys import CHAINER_ATTRIBUTES

MAX_STATES = 6      # states of one cached chain's attributes before it gives up
_LONG = 1024        # a tuple or list up to this long is taken item by item
_HUGE = 1 << 16     # up to this long, by its items' identities; longer, by its length
_DIGESTED = 4 << 20     # bytes of NumPy arrays a digest pass looks at, in all
_DIGESTED_ONE = 1 << 20     # bytes: a larger array is not looked at
_CONTAINED = 64             # a list, tuple or dict a link holds: its arrays, up to this many items
_VALUES = _configs.VALUES
_IGNORED = frozenset(CHAINER_ATTRIBUTES)

_generation = [0]
_set_at = weakref.WeakKeyDictionary()   # watched link -> the generation it was last set at
_watched = weakref.WeakSet()


def _note(link, name):
    if name not in _IGNORED and link in _watched:
        _generation[0] += 1
        _set_at[link] = _generation[0]


def setattr_layer(next_, link, name, value):
    """``Link.__setattr__`` (all links, while a chain is cached)."""
    next_(link, name, value)
    _note(link, name)


def delattr_layer(next_, link, name):
    """``Link.__delattr__``."""
    next_(link, name)
    _note(link, name)


def noted_layer(next_, link, *args, **kwargs):
    """``Link.serialize`` and ``Link.add_persistent``, which write the
    link's ``__dict__`` directly (a snapshot loaded into the model, a
    persistent value added), and ``insert``, ``__setitem__`` and
    ``__delitem__`` of ``ChainList`` and ``Sequential``, which change the
    links or layers the forward runs without setting an attribute of the
    list (``append`` names only the new link, which is not watched yet):
    the link counts as set."""
    result = next_(link, *args, **kwargs)
    _note(link, '')
    return result


class _Same:
    """An object compared by identity: held weakly where it can be (a
    link, anything a model may point back from), else strongly. By ``id``
    alone, a freed object's id given to a later one made a new state look
    like an old, verified one, which replayed the old value (a review:
    ``model.opts = SimpleNamespace(beta=v)`` every few steps, 0.73 off)."""

    __slots__ = ('kind', 'ref', 'key')

    def __init__(self, value):
        self.kind = type(value).__name__
        self.key = id(value)
        try:
            self.ref = weakref.ref(value)
        except TypeError:
            self.ref = lambda value=value: value

    def __eq__(self, other):
        if not isinstance(other, _Same):
            return NotImplemented
        mine = self.ref()
        return mine is not None and mine is other.ref()

    def __hash__(self):
        return self.key


def _value(value, nested=False):
    try:
        return _taken(value, nested)
    except Exception:       # asking a dead weakref proxy anything raises
        return _Same(value)


def _taken(value, nested):
    # (a Device by value: to_device makes a new one each time)
    if isinstance(value, _VALUES) or isinstance(value, Device):
        return value
    if _configs.is_config(value):
        inside = _configs.content(value, _Same)
        if inside is not None:
            return (_configs._kind(value), _Same(value), inside)
    if nested:
        return _Same(value)
    if isinstance(value, (tuple, list)):
        # Each item too (values by value, configs by what they hold, the
        # rest by identity): a list changed in place holds what the forward
        # runs (Sequential's layers). A longer one: its length.
        items = tuple(_value(v, True) for v in value) if len(value) <= _LONG else \
            tuple(map(_Same, value)) if len(value) <= _HUGE else ('length', len(value))
        return (type(value).__name__, _Same(value) if isinstance(value, list) else None, items)
    return _Same(value)


def _skipped(link, name):
    return name in _IGNORED or _patches.is_ours(link, name)


def stamp(link, watched=()):
    """What ``link``'s attributes hold, to compare (hashable); at the
    ``watched`` places (:func:`_configs.places`), what a config holds even
    after an entry stopped being plain."""
    whole = {name for name, index in watched if index is None}
    items = {}
    for name, index in watched:
        if index is not None:
            items.setdefault(name, set()).add(index)
    taken = []
    for name, value in vars(link).items():
        if _skipped(link, name):
            continue
        if name in whole:
            taken.append((name, _held(value)))
        elif name in items and isinstance(value, (list, tuple)) and len(value) <= _LONG:
            taken.append((name, (type(value).__name__, _Same(value), tuple(
                _held(v) if i in items[name] else _value(v, True)
                for i, v in enumerate(value)))))
        else:
            taken.append((name, _value(value)))
    return tuple(sorted(taken, key=lambda item: item[0]))


def _held(value):
    inside = _configs.content(value, _Same)
    if inside is None:
        return _value(value)
    return (_configs._kind(value), _Same(value), inside)


def _shown(value):
    if isinstance(value, _Same):
        return '<{} object>'.format(value.kind)
    text = repr(value[-1] if isinstance(value, tuple) and len(value) == 3 else value)
    return text if len(text) <= 40 else text[:37] + '...'


def difference(path, before, after):
    """``'path/name: before -> after'`` for the first attribute that differs."""
    a, b = dict(before), dict(after)
    for name in sorted(set(a) | set(b)):
        if a.get(name, _patches.MISSING) != b.get(name, _patches.MISSING):
            old, new = a.get(name, _patches.MISSING), b.get(name, _patches.MISSING)
            if _config(old) and _config(new) and old[:2] == new[:2]:
                # the same config, changed inside: its first item that differs
                return difference(_join(path, name), _items(old), _items(new))
            return '{}: {} -> {}'.format(
                _join(path, name), 'absent' if name not in a else _shown(a[name]),
                'absent' if name not in b else _shown(b[name]))
    return path


def _join(path, name):
    if name.startswith(('[', '.')) or path.endswith('/'):
        return path + name
    return path + '/' + name


def _config(value):
    # a stamp's value of a dict or an object with attributes (_held):
    # (kind, _Same, ((key, value), ...))
    return isinstance(value, tuple) and len(value) == 3 and value[0] not in (
        'list', 'tuple', 'set', 'length') and isinstance(value[2], tuple) and all(
        isinstance(item, tuple) and len(item) == 2 for item in value[2])


def _items(value):
    form = '[{!r}]' if value[0] == 'dict' else '.{}'
    return [(form.format(k), v) for k, v in value[2]]


class Watch:
    """One cached chain's states: the key part of each call (:meth:`state`)."""

    def __init__(self, chain):
        self.ref = weakref.ref(chain)
        self.links = []
        self.stamps = {}        # path -> stamp
        self.states = {}        # the stamps of every link, in order -> state number
        self.current = 0
        self.count = 1          # states numbered (more stamps may map to one)
        self.seen = _generation[0]
        self.last_change = None
        self.configs = _configs.Configs(_Same)
        self.replayed = False   # set by a call that ran none of the forward's Python
        self.moves = 0          # arrays changed in place between calls: times
        # ids of the arrays recorded functions take as inputs: a replay reads
        # them in place (a memory bank F.matmul takes, EMA weights F.linear takes)
        self.read_in_place = set()
        self.pending = None     # such a change noted around an uncached call
        self._take(chain)
        self.after = self._digests()
        self.states[self._whole()] = 0

    def _take(self, chain):
        # weakly: the cache that holds this may be held globally (the lease)
        links = [(path.rstrip('/') or '/', link) for path, link in chain.namedlinks()]
        for _, link in links:
            _watched.add(link)
        self.links = [(path, weakref.ref(link)) for path, link in links]
        # the configs the links hold, changed inside with nothing set on a
        # link: looked at on every call (_configs)
        self.configs.take(links, _skipped)
        self.stamps = {path: stamp(link, self.configs.places.get(path, ()))
                       for path, link in links}

    def _whole(self):
        return tuple(self.stamps[path] for path, _ in self.links) + (('moves', self.moves),)

    def _digests(self):
        """{(path, name): digest} of the NumPy arrays the links of the
        user's own classes hold in attributes (persistent values included,
        parameters not). Chainer's links pass theirs to functions, which a
        replay reads in place (BatchNormalization's running statistics:
        ResNet-50's 106 would cost milliseconds a call)."""
        found, budget = {}, _DIGESTED
        for path, ref in self.links:
            link = ref()
            if link is None or type(link).__module__.startswith('chainer.'):
                continue
            params = link._params
            for name, value in list(vars(link).items()):
                if name in params or _skipped(link, name):
                    continue
                places = [(name, value)]
                if type(value) in (list, tuple, dict):      # (by type: a dead proxy raises)
                    # one level into a list or dict (self.masks['l1'])
                    try:
                        items = list(value.items() if type(value) is dict else
                                     enumerate(value))[:_CONTAINED + 1]
                    except Exception:       # one that answers oddly (a lazy list)
                        items = []
                    if len(items) <= _CONTAINED:
                        places = [('{}[{!r}]'.format(name, k), v) for k, v in items]
                for place, array in places:
                    if type(array) is not numpy.ndarray or array.dtype.hasobject or \
                            id(array) in self.read_in_place or \
                            array.nbytes > min(budget, _DIGESTED_ONE):
                        continue
                    budget -= array.nbytes
                    try:
                        found[(path, place)] = (array.shape, array.dtype.str, hashlib.blake2b(
                            numpy.ascontiguousarray(array).view(numpy.uint8)).digest())
                    except Exception:       # an array that cannot be read as bytes
                        continue
        return found

    def _moved(self):
        """The first array changed since the last call ended ('path/name'), or None."""
        now = self._digests()
        for place in sorted(set(now) | set(self.after)):
            if now.get(place) != self.after.get(place):
                return _join(*place)
        return None

    def outside_call(self):
        """Around a call that is not cached (evaluation, no backprop): what
        changed before it is noted for the next cached call; what it changes
        (running statistics in train mode) is the call's."""
        moved = self._moved()
        if moved is not None:
            self.pending = self.pending or moved

    def after_outside_call(self):
        self.after = self._digests()

    def state(self):
        """The state this call starts in (a number), or None past
        :data:`MAX_STATES` (:attr:`last_change` names the last change)."""
        inside = self.configs.changed() if self.configs.watched else []
        moved, self.pending = self._moved() or self.pending, None
        if _generation[0] == self.seen and not inside and moved is None:
            return self.current
        chain = self.ref()
        changed = inside + [path for path, ref in self.links
                            if ref() is None or _set_at.get(ref(), 0) > self.seen]
        self.seen = _generation[0]
        if chain is None or not (changed or moved):
            return self.current
        before = dict(self.stamps)
        self._take(chain)       # a link may have been added or replaced
        if moved is not None:
            # a new state, not one seen before: an array's earlier contents
            # are not kept to tell them again
            self.moves += 1
            self.last_change = '{}: changed in place between calls'.format(moved)
        elif not _configs._differ(self.stamps, before):
            return self.current
        else:
            path = next((p for p, _ in self.links
                         if _configs._differ(self.stamps.get(p), before.get(p))), changed[0])
            try:
                self.last_change = difference(path, before.get(path, ()),
                                              self.stamps.get(path, ()))
            except Exception:   # a value that cannot be compared or shown
                self.last_change = path
        whole = self._whole()
        try:
            number = self.states.get(whole)
        except Exception:   # a key whose == answers with an array: a new state
            number = None
        if number is None:
            if self.count >= MAX_STATES:
                return None
            try:
                self.states[whole] = self.count
            except Exception:   # (the same): safe, define-by-run from now on
                return None
            number = self.count
            self.count += 1
        self.current = number
        return number

    def settle(self):
        """After a call that ran the forward's Python (recording, verified
        or define-by-run): what it set belongs to the state it started in."""
        replayed, self.replayed = self.replayed, False
        self.after = self._digests()    # what the call changed is the call's
        if _generation[0] == self.seen and (
                replayed or not self.configs.watched or not self.configs.changed()):
            return
        self.seen = _generation[0]
        chain = self.ref()
        if chain is not None:
            self._take(chain)
            try:
                self.states.setdefault(self._whole(), self.current)
            except Exception:   # a key whose == answers with an array
                pass
