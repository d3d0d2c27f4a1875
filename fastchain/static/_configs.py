"""Configs a cached chain's links hold, changed inside between calls.

``model.cfg['beta'] = 0.5`` or ``model.args.alpha = 0.1`` (an
``argparse.Namespace``) sets nothing on the link, so the watch's layer on
``Link.__setattr__`` (:mod:`fastchain.static._watch`) never hears of it, and
the replay kept the value the recording saw. A config is a dict, or an object
with attributes (its ``__dict__`` or ``__slots__``: a namespace, a dataclass,
a small class, a callable object used as a ``Sequential`` layer), of at most
:data:`ITEMS` entries, each plain: a number, a string, an Enum, a path, or a
tuple, list or frozenset of up to 64 of those. The configs a link holds (as
attributes, or as items of a list attribute) are looked at on every call,
each object once however many links hold it; once watched, an attribute
stays watched even if an entry stops being plain (a value by value, anything
else by identity). Random generators are never configs (their state moves on
every draw whether the forward reads it or not).
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

ITEMS = 256         # entries of a config, at most
_SEQUENCE = 64      # a tuple, list or frozenset entry of up to this many plain values
_LONG = 1024        # a list attribute whose items are looked at, at most this long
VALUES = (type(None), bool, int, float, complex, str, bytes, numpy.generic)
_PLAIN = VALUES + (enum.Enum, pathlib.PurePath)
# never a config: watched themselves, or not one
OPAQUE = (chainer.Link, chainer.Variable, Device, type, types.ModuleType, types.FunctionType,
          types.MethodType, types.BuiltinFunctionType, functools.partial,
          numpy.random.RandomState, numpy.random.Generator, random.Random, numpy.ndarray)


def _plain(value):
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, (tuple, list, frozenset)) and len(value) <= _SEQUENCE and all(
        isinstance(v, _PLAIN) for v in value)


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


def is_config(value):
    """Whether ``value`` is a config (see the module)."""
    found = entries(value)
    return found is not None and len(found) <= ITEMS and all(
        isinstance(k, VALUES) and _plain(v) for k, v in found)


def content(value, same):
    """What ``value`` holds, to compare: an entry plain by value, anything
    else as ``same(entry)`` (identity); None where it has no entries."""
    found = entries(value)
    if found is None or len(found) > ITEMS:
        return None
    return tuple((k, _entry(v, same)) for k, v in found)


def _entry(value, same):
    if isinstance(value, _PLAIN):
        return value
    if _plain(value):
        return (type(value).__name__, frozenset(value) if isinstance(value, frozenset)
                else tuple(value))
    return same(value)


def places(link, ignored):
    """Where ``link`` holds configs: ``(name, None)`` for an attribute,
    ``(name, i)`` for item ``i`` of a list attribute (``Sequential``'s
    layers)."""
    found = []
    for name, value in vars(link).items():
        if name in ignored:
            continue
        if type(value) is list and len(value) <= _LONG:
            found += [(name, i) for i, item in enumerate(value) if is_config(item)]
        elif is_config(value):
            found.append((name, None))
    return found


def at(link, place):
    name, index = place
    value = vars(link).get(name)
    if index is None:
        return value
    return value[index] if type(value) is list and index < len(value) else None


class Configs:
    """The configs of one cached chain's links, looked at on every call."""

    def __init__(self, same):
        self.same = same
        self.places = {}    # path -> the places watched on that link (kept once watched)
        self.watched = []   # (path, link ref, places, what they held)

    def take(self, links, ignored):
        """Note where each link holds a config now, and what they hold."""
        self.watched = []
        for path, link in links:
            mine = self.places.setdefault(path, [])
            mine += [p for p in places(link, ignored) if p not in mine]
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
        """The paths of the links whose configs hold something else now."""
        memo = {}       # one look per object, however many links hold it
        return [path for path, ref, places, held in self.watched
                if ref() is not None and self._held(ref(), places, memo) != held]
