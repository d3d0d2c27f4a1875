"""What a cached chain's links hold that the loop changes in place.

``model.cfg['beta'] = 0.5``, ``model.args.alpha = 0.1`` (an
``argparse.Namespace``), ``model.weights[0] = 0.25`` or
``model.post.append(F.sigmoid)`` set nothing on the link, so the watch's layer
on ``Link.__setattr__`` (:mod:`fastchain.static._watch`) never hears of it,
and the replay kept what the recording saw. So these are looked at on every
call, each object once however many links hold it, and not again after a
replay:

- a link's list, tuple-held, set, deque, bytearray and dict attributes;
- its configs: a namespace (``SimpleNamespace``, ``argparse.Namespace``) or
  a dataclass, whatever it holds, and an object with attributes
  (``__dict__`` or ``__slots__``: a callable object among a
  ``Sequential``'s layers) holding only values, the kinds compared by
  identity below, containers and configs;

compared entry by entry within :data:`ITEMS` entries in all, nested ones
included, and :data:`DEPTH` levels; a container bigger than that alone
counts by its identity and size, and a holder whose entries together pass it
by its size (a vocabulary of 100k words looked at item by item cost a small
model 5x its step).

What they hold is compared: values (numbers, strings, Enums, paths) by
value, containers item by item, configs entry by entry, and functions,
classes, dtypes, devices, modules and arrays (read in place by the replay)
by identity; anything else by identity too (a back-reference included).
Once watched, an attribute stays watched. Not a config: a link (watched
itself), a random generator (its state moves with every draw, read or not),
or an object of another kind holding anything else (an optimizer, a
communicator: their counters would make every step a new state), whose
changes go unseen. Chainer's own containers (a ChainList's children, a
Sequential's layers, link hooks, parameter names) change only through
methods the watch layers.
"""

import argparse
import collections
import dataclasses
import enum
import functools
import pathlib
import random
import types
import weakref

import numpy

import chainer
from chainer.backend import Device

ITEMS = 1024        # entries, nested ones included, of a thing looked at on every call
DEPTH = 6           # levels of configs, lists and dicts looked into
_SEQUENCES = (list, tuple, collections.deque)
_NAMESPACES = (types.SimpleNamespace, argparse.Namespace)
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
    return isinstance(value, _IDENTITY) or \
        (type(value).__module__ or '').split('.')[0] == 'cupy'


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


class _TooBig(Exception):
    pass


def _kind(value):
    if isinstance(value, dict):
        return 'dict'
    if isinstance(value, (list, collections.deque)):
        return 'list'
    if isinstance(value, tuple):
        return 'tuple'
    if isinstance(value, (set, frozenset)):
        return 'set'
    return type(value).__name__


def _spend(left, n):
    if n > left[0]:
        raise _TooBig       # (before a dict's items are copied)
    left[0] -= n


def _size(value):
    try:
        return len(value) if isinstance(value, _SEQUENCES + (dict, set, frozenset)) \
            else len(entries(value) or ())
    except Exception:
        return -1


def _fits(value, left, depth, seen):
    """Whether a config may hold ``value`` (a back-reference does)."""
    if isinstance(value, _PLAIN) or _kept_by_identity(value) or id(value) in seen:
        return True
    if depth >= DEPTH:
        return False
    seen = seen | {id(value)}
    if isinstance(value, _SEQUENCES):
        _spend(left, len(value))
        return all(_fits(v, left, depth + 1, seen) for v in value)
    return _strict(value, left, depth + 1, seen)


def _entries_within(value, left):
    """:func:`entries`, paid for out of ``left`` (a dict's before its items
    are copied); None for what has none."""
    if isinstance(value, dict):
        _spend(left, len(value))
    found = entries(value)
    if found is not None and not isinstance(value, dict):
        _spend(left, len(found))
    return found


def _strict(value, left, depth, seen):
    found = _entries_within(value, left)
    return found is not None and all(_fits(v, left, depth, seen) for _, v in found)


def is_config(value):
    """Whether ``value`` is a config: a dict, a namespace or a dataclass
    (whatever they hold), or an object with attributes that hold only what
    fits (see the module), :data:`ITEMS` of them at most in all."""
    try:
        if isinstance(value, _NAMESPACES) or dataclasses.is_dataclass(value) and \
                not isinstance(value, type):
            return entries(value) is not None
        return _strict(value, [ITEMS], 0, frozenset({id(value)}))
    except Exception:       # too big, or something that answers oddly
        return False


def content(value, same):
    """What ``value`` (a list, tuple, set, deque, dict or object with
    attributes) holds, to compare, :data:`ITEMS` entries at most in all;
    None for anything else, or more."""
    try:
        return _content(value, same, [ITEMS], 0, frozenset({id(value)}))
    except _TooBig:         # its size only: an item added or removed is seen
        return ('big', _size(value))
    except Exception:       # something that answers oddly
        return None


def _content(value, same, left, depth, seen):
    if isinstance(value, bytearray):
        _spend(left, 1)
        return bytes(value)
    if isinstance(value, (set, frozenset)):
        _spend(left, len(value))
        return frozenset(v if isinstance(v, _PLAIN) else same(v) for v in value)
    if isinstance(value, _SEQUENCES):
        _spend(left, len(value))
        return tuple(_entry(v, same, left, depth, seen) for v in value)
    found = _entries_within(value, left)
    if found is None:
        return None
    return tuple((k, _entry(v, same, left, depth, seen)) for k, v in found)


def _entry(value, same, left, depth, seen):
    if isinstance(value, _PLAIN):
        return value
    if depth >= DEPTH or id(value) in seen or _kept_by_identity(value):
        return same(value)
    if isinstance(value, _SEQUENCES + (dict, set, frozenset)) or is_config(value):
        try:
            inside = _content(value, same, left, depth + 1, seen | {id(value)})
        except _TooBig:
            if _size(value) <= ITEMS:
                raise       # the whole holder is too big: its size only (content)
            inside = ('big', _size(value))  # one too big alone: its identity and size
        return (_kind(value), same(value), inside)
    return same(value)


def _in_place(value):
    """Whether ``value`` may be changed in place and is worth looking at:
    a container or a config within :data:`ITEMS` entries (not a list of
    parameters or links: NStepLSTM's weights)."""
    if isinstance(value, (list, collections.deque)) and _structural(value):
        return False
    if not (isinstance(value, _SEQUENCES + (dict, set, bytearray)) or is_config(value)):
        return False
    return content(value, id) is not None


def _structural(value):
    return bool(value) and len(value) <= ITEMS and all(
        isinstance(v, (chainer.Link, chainer.Variable)) or (
            isinstance(v, (list, tuple)) and _structural(v)) for v in value)


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
                if ref() is not None and _differ(self._held(ref(), places, memo), held)]


def _differ(a, b):
    try:
        return bool(a != b)
    except Exception:   # a key whose == answers with an array: a change, to be safe
        return True
