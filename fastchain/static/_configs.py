"""What a cached chain's links hold that the loop changes in place.

``model.cfg['beta'] = 0.5``, ``model.args.alpha = 0.1`` (an
``argparse.Namespace``), ``model.weights[0] = 0.25`` or
``model.post.append(F.sigmoid)`` set nothing on the link, so the watch's layer
on ``Link.__setattr__`` (:mod:`fastchain.static._watch`) never hears of it,
and the replay kept what the recording saw. So these are looked at on every
call, each object once however many links hold it, and not again after a
replay:

- a link's list and dict attributes, and the lists and dicts in its tuple
  attributes;
- its configs: objects with attributes (``__dict__`` or ``__slots__``: a
  namespace, a dataclass, a callable object among a ``Sequential``'s
  layers) holding only values, the kinds compared by identity below, lists,
  tuples, dicts and configs (3 levels deep, :data:`ITEMS` entries at most).

What they hold is compared: values (numbers, strings, Enums, paths) by
value, lists, tuples and dicts item by item, configs entry by entry (3 levels
deep), and functions, classes, dtypes, devices, modules and arrays (read in
place by the replay) by identity; anything else by identity too. Once
watched, an attribute stays watched. Not a config: a link (watched itself),
a random generator (its state moves with every draw, read or not), or an
object holding anything else (an optimizer, a communicator), whose changes
go unseen. Chainer's own containers (a ChainList's children, a Sequential's
layers, parameter names) change only through methods the watch layers.
"""

import enum
import functools
import pathlib
import random
import types
import weakref

import numpy

import chainer
from chainer.backend import Device

ITEMS = 1024        # entries of a config or items of a list, at most
DEPTH = 3           # levels of configs, lists and dicts looked into
VALUES = (type(None), bool, int, float, complex, str, bytes, numpy.generic)
_PLAIN = VALUES + (enum.Enum, pathlib.PurePath)
# held by a config, compared by identity: fixed, or read in place by the replay
_IDENTITY = (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
             functools.partial, type, types.ModuleType, numpy.dtype, Device, numpy.ndarray)
# never a config
OPAQUE = (chainer.Link, chainer.Variable, Device, type, types.ModuleType, types.FunctionType,
          types.MethodType, types.BuiltinFunctionType, functools.partial,
          numpy.random.RandomState, numpy.random.Generator, random.Random, numpy.ndarray)
CHAINERS = frozenset(('_children', '_layers', '_params', '_persistent',
                      '_overridden_to_methods', '_local_link_hooks'))


def _kept_by_identity(value):
    return isinstance(value, _IDENTITY) or type(value).__module__.split('.')[0] == 'cupy'


def entries(value):
    """A dict's items, or an object's attributes (``__dict__``, then
    ``__slots__``), as a list; None for anything else, or where they cannot
    be read."""
    try:
        if isinstance(value, dict):
            return list(dict.items(value))
        if isinstance(value, OPAQUE):
            return None
        try:
            attributes = object.__getattribute__(value, '__dict__')
        except AttributeError:
            attributes = None
        found = list(attributes.items()) if isinstance(attributes, dict) else []
        slots = [name for cls in type(value).__mro__
                 for name in _slot_names(cls) if name not in ('__dict__', '__weakref__')]
        for name in slots:
            try:
                found.append((name, object.__getattribute__(value, name)))
            except AttributeError:
                pass        # an empty slot
        return found if isinstance(attributes, dict) or slots else None
    except Exception:       # a dead proxy, a property or __getattr__ that raises
        return None


def _slot_names(cls):
    slots = cls.__dict__.get('__slots__', ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _fits(value, depth):
    """Whether a config may hold ``value``."""
    if isinstance(value, _PLAIN) or _kept_by_identity(value):
        return True
    if depth >= DEPTH:
        return False
    if isinstance(value, (list, tuple, frozenset)):
        return len(value) <= ITEMS and all(_fits(v, depth + 1) for v in value)
    return is_config(value, depth + 1)


def is_config(value, depth=0):
    """Whether ``value`` is a config (see the module; a dict is one)."""
    found = entries(value)
    return found is not None and len(found) <= ITEMS and all(
        _fits(v, depth) for _, v in found)


def content(value, same, depth=0):
    """What ``value`` (a dict, a list, a tuple or an object with attributes)
    holds, to compare; None for anything else."""
    if isinstance(value, (list, tuple)):
        if len(value) > ITEMS:
            return ('ids', tuple(map(id, value)))
        return tuple(_entry(v, same, depth) for v in value)
    found = entries(value)
    if found is None or len(found) > ITEMS:
        return None
    return tuple((k, _entry(v, same, depth)) for k, v in found)


def _entry(value, same, depth):
    if isinstance(value, _PLAIN):
        return value
    if depth < DEPTH and (isinstance(value, (list, tuple, dict)) or (
            not _kept_by_identity(value) and is_config(value, depth + 1))):
        return (type(value).__name__, same(value), content(value, same, depth + 1))
    return same(value)


def _in_place(value):
    """Whether ``value`` may be changed in place and is worth looking at
    (not a list of parameters or links: NStepLSTM's weights)."""
    if isinstance(value, list):
        return not _structural(value)
    return isinstance(value, dict) or is_config(value)


def _structural(value):
    return all(isinstance(v, (chainer.Link, chainer.Variable)) or (
        isinstance(v, (list, tuple)) and _structural(v)) for v in value) and bool(value)


def places(link, skip):
    """Where ``link`` holds what may change in place: ``(name, None)`` for
    an attribute, ``(name, i)`` for item ``i`` of a tuple attribute or of a
    ``Sequential``'s layers."""
    found = []
    for name, value in list(vars(link).items()):
        try:
            found += _places_of(link, name, value, skip)
        except Exception:   # asking a dead weakref proxy anything raises
            pass
    return found


def _places_of(link, name, value, skip):
    if skip(link, name):
        return []
    if name in CHAINERS:
        if name == '_layers' and type(value) is list:     # callable objects
            return [(name, i) for i, item in enumerate(value[:ITEMS]) if is_config(item)]
        return []
    if type(value) is tuple:
        return [(name, i) for i, item in enumerate(value[:ITEMS]) if _in_place(item)]
    return [(name, None)] if _in_place(value) else []


def at(link, place):
    name, index = place
    value = vars(link).get(name)
    if index is None:
        return value
    return value[index] if isinstance(value, (list, tuple)) and index < len(value) else None


class Configs:
    """What one cached chain's links hold that may change in place, looked
    at on every call."""

    def __init__(self, same):
        self.same = same
        self.places = {}    # path -> the places watched on that link (kept once watched)
        self.watched = []   # (path, link ref, places, what they held)

    def take(self, links, skip):
        """Note where each link holds such things now, and what they hold."""
        self.watched = []
        for path, link in links:
            mine = self.places.setdefault(path, [])
            mine += [p for p in places(link, skip) if p not in mine]
            if mine:    # (weakly: the cache that holds this may be held globally)
                self.watched.append((path, weakref.ref(link), list(mine),
                                     self._held(link, mine, {})))

    def _held(self, link, places, memo):
        held = []
        for place in places:
            value = at(link, place)
            key = id(value)
            if key not in memo:
                memo[key] = content(value, self.same)
            held.append(memo[key])
        return tuple(held)

    def changed(self):
        """The paths of the links whose watched things hold something else now."""
        memo = {}       # one look per object, however many links hold it
        return [path for path, ref, places, held in self.watched
                if ref() is not None and self._held(ref(), places, memo) != held]
