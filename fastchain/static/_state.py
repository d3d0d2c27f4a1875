"""State a cached chain's forward keeps in Python, which a replay never runs.

A replay runs the recorded functions only: a counter the forward advances
(``self.calls += 1``), a list it appends to, a dict it fills, an array it
changes in place, a generator of its own it draws from (``self.rng.normal``)
stay as the recording left them, and whatever the forward computes from them
is frozen too (a branch every tenth call that the verified steps never see).
:class:`PythonState` takes what each link's attributes hold (other than its
parameters, persistent values and child links, which the cache handles) before
a verified call (and their persistent values that are not arrays, such as
BatchNormalization's ``N``, which ``finetune=True`` counts in Python);
:meth:`PythonState.changes` names what the recording or the
reference run changed, and :meth:`PythonState.restore` puts it back, so the
define-by-run call that follows starts where plain Chainer's would.

What is looked at: attributes rebound, added or removed (one that was None or
absent and is made by the recording call, and left alone by the reference run
after it, is a constant made on the first call, not a change); values; arrays
(NumPy, CuPy) and variables' arrays by value (a NumPy array over 16 MiB by a
digest, which cannot be put back); the items of lists, tuples (one made again
with equal items is the same), deques, dicts and sets, and the attributes and
slots of objects of the user's own classes (callable ones too), 4 levels down,
at most 10,000 values an attribute (past that a container by its length);
NumPy's ``RandomState`` and ``Generator`` and ``random.Random`` by their
state. Anything else (a module, a function, another link, an object of a
library such as ``itertools.count``) by identity. Random generators outside
the links are looked at by their state too (:mod:`fastchain.static._draws`).
Other state outside the links (a module's other globals, a closure's other
values) is not seen; what is not seen is advanced by both the recording and the reference
run on a verified call (as before).
"""

import collections
import hashlib
import random
import types
import weakref

import numpy

import chainer

from fastchain.config import _patches
from fastchain.static import _configs, _draws
from fastchain.static._keys import CHAINER_ATTRIBUTES

_DEPTH = 4          # how far into containers and objects
_BUDGET = 10000     # values looked at per attribute (then containers by length)
_COPIED = 16 << 20  # bytes: a larger NumPy array is compared by a digest (not put back)
_SCALARS = (type(None), bool, int, float, complex, str, bytes, numpy.generic)
_NOT_OBJECTS = (chainer.Link, type, types.FunctionType, types.MethodType,
                types.BuiltinFunctionType, types.ModuleType)


class _Node:
    __slots__ = ('kind', 'obj', 'saved')

    def __init__(self, kind, obj, saved=None):
        self.kind, self.obj, self.saved = kind, obj, saved


_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)


def _own_object(value):
    """An object of a user's class (looked into), not a library's."""
    module = type(value).__module__ or ''
    return not isinstance(value, _NOT_OBJECTS) and \
        module.split('.')[0] not in _draws.LIBRARIES


def _array(value):
    if isinstance(value, numpy.ndarray) and value.nbytes > _COPIED:
        return _Node('digest', value, (value.shape, value.dtype, _digest(value)))
    return _Node('array', value, value.copy())


def _digest(array):
    return hashlib.blake2b(numpy.ascontiguousarray(array).view(numpy.uint8)).digest()


def _take(value, depth, budget, seen):
    try:
        return _taken(value, depth, budget, seen)
    except Exception:   # something that answers oddly (a list whose __iter__ raises)
        return _Node('ref', value)


def _taken(value, depth, budget, seen):
    budget[0] -= 1
    if type(value) in _PROXIES:     # held by identity (a dead one answers nothing)
        return _Node('ref', value)
    if isinstance(value, _SCALARS):
        return _Node('value', value)
    if id(value) in seen:
        return _Node('ref', value)
    if isinstance(value, chainer.get_array_types()):
        return _array(value)
    if isinstance(value, chainer.Variable):
        array = value.array
        return _Node('variable', value, None if array is None else _array(array))
    if isinstance(value, numpy.random.RandomState):
        return _Node('random', value, value.get_state())
    if isinstance(value, numpy.random.Generator):
        return _Node('generator', value, value.bit_generator.state)
    if isinstance(value, random.Random):
        return _Node('pyrandom', value, value.getstate())
    sized = isinstance(value, (list, tuple, dict, set, frozenset, collections.deque))
    if sized and (depth >= _DEPTH or len(value) > budget[0]):
        return _Node('sized', value, len(value))
    if depth >= _DEPTH or budget[0] <= 0:
        return _Node('ref', value)
    seen = seen | {id(value)}
    if isinstance(value, (list, tuple, collections.deque)):
        return _Node('list', value, [_take(v, depth + 1, budget, seen) for v in value])
    if isinstance(value, dict):
        return _Node('dict', value, {k: _take(v, depth + 1, budget, seen)
                                     for k, v in list(value.items())})
    if isinstance(value, (set, frozenset)):
        return _Node('set', value, frozenset(value))
    if _own_object(value):
        return _Node('object', value, {k: _take(v, depth + 1, budget, seen)
                                       for k, v in _object_items(value).items()})
    return _Node('ref', value)


def _same_value(a, b):
    """Two saved states (scalars, dicts of them, arrays) are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if hasattr(a, 'shape') or hasattr(b, 'shape'):
        return _same_array(a, b)
    return type(a) is type(b) and (a is b or a == b)


def _same_array(a, b):
    if not (hasattr(a, 'shape') and hasattr(b, 'shape')) or type(a) is not type(b) \
            or a.shape != b.shape or a.dtype != b.dtype:
        return False
    xp = chainer.backend.get_array_module(a)
    nan = a.dtype.kind in 'fc'
    return bool(xp.array_equal(a, b, equal_nan=nan)) if nan else bool(xp.array_equal(a, b))


def _change(node, now):
    """What changed (words), or None; ``now``: what the place holds now."""
    if node.kind == 'value':
        if type(now) is type(node.obj) and (now is node.obj or _same_value(now, node.obj)):
            return None
        return 'was {!r}, is {!r}'.format(_short(node.obj), _short(now))
    if now is not node.obj and not (isinstance(now, tuple) and type(now) is type(node.obj)
                                    and node.kind == 'list'):
        # (a tuple made again with the same items is the same value)
        return 'rebound (a {} before, a {} now)'.format(type(node.obj).__name__,
                                                        type(now).__name__)
    kind = node.kind
    if kind == 'array':
        return None if _same_array(now, node.saved) else 'an array changed in place'
    if kind == 'digest':
        return None if (now.shape, now.dtype, _digest(now)) == node.saved else \
            'an array changed in place'
    if kind == 'variable':
        array = now.array
        if (array is None) == (node.saved is None) and (
                array is None or _change(node.saved, array) is None):
            return None
        return "a variable's array changed in place"
    if kind == 'sized':
        return None if len(now) == node.saved else 'a {} of {} items, {} now'.format(
            type(now).__name__, node.saved, len(now))
    if kind == 'pyrandom':
        return None if now.getstate() == node.saved else \
            'a random.Random the forward draws random numbers from'
    if kind == 'random':
        return None if _same_value(now.get_state(), node.saved) else \
            'a RandomState the forward draws random numbers from'
    if kind == 'generator':
        return None if _same_value(now.bit_generator.state, node.saved) else \
            'a Generator the forward draws random numbers from'
    if kind == 'list':
        if len(now) != len(node.saved):
            return 'a {} of {} items, {} now'.format(type(now).__name__, len(node.saved),
                                                     len(now))
        for i, (child, item) in enumerate(zip(node.saved, now)):
            found = _change(child, item)
            if found is not None:
                return '[{}] {}'.format(i, found)
        return None
    if kind == 'dict':
        if now.keys() != node.saved.keys():
            added = [k for k in now if k not in node.saved]
            removed = [k for k in node.saved if k not in now]
            return 'a dict whose keys changed ({})'.format(', '.join(
                ['+{!r}'.format(_short(k)) for k in added[:2]]
                + ['-{!r}'.format(_short(k)) for k in removed[:2]]))
        for k, child in node.saved.items():
            found = _change(child, now[k])
            if found is not None:
                return '[{!r}] {}'.format(_short(k), found)
        return None
    if kind == 'set':
        return None if frozenset(now) == node.saved else 'a set whose items changed'
    if kind == 'object':
        return _attributes_change(node.saved, _object_items(now), '.')
    return None


def _object_items(value):
    # (read around __getattr__, which may raise anything)
    return dict(_configs.entries(value) or ())


def _attributes_change(saved, now, dot):
    for name in now:
        if name not in saved:
            return '{}{} added'.format(dot, name)
    for name, child in saved.items():
        if name not in now:
            return '{}{} removed'.format(dot, name)
        found = _change(child, now[name])
        if found is not None:
            return '{}{}: {}'.format(dot, name, found)
    return None


def _short(value):
    text = repr(value)
    return value if len(text) <= 40 else text[:37] + '...'


def _put_back(node):
    """Undo changes inside ``node.obj`` (its binding is the caller's)."""
    kind, obj = node.kind, node.obj
    if kind == 'array':
        if obj.shape == node.saved.shape and obj.flags.writeable:
            obj[...] = node.saved
    elif kind == 'variable':
        if node.saved is not None and obj.array is not None:
            _put_back(_Node(node.saved.kind, obj.array, node.saved.saved))
    elif kind == 'random':
        obj.set_state(node.saved)
    elif kind == 'generator':
        obj.bit_generator.state = node.saved
    elif kind == 'pyrandom':
        obj.setstate(node.saved)
    elif kind == 'list':
        if isinstance(obj, list):
            obj[:] = [child.obj for child in node.saved]
        elif isinstance(obj, collections.deque):
            obj.clear()
            obj.extend(child.obj for child in node.saved)
        for child in node.saved:
            _put_back(child)
    elif kind == 'dict':
        obj.clear()
        obj.update((k, child.obj) for k, child in node.saved.items())
        for child in node.saved.values():
            _put_back(child)
    elif kind == 'set' and isinstance(obj, set):
        obj.clear()
        obj.update(node.saved)
    elif kind == 'object':
        own = vars(obj) if hasattr(obj, '__dict__') else {}
        for name in [n for n in own if n not in node.saved]:
            del own[name]
        for name, child in node.saved.items():
            object.__setattr__(obj, name, child.obj)    # (a slot too; no __setattr__ of its own)
            _put_back(child)


def child_names(link):
    """The attributes holding ``link``'s child links (a Chain's; a
    ChainList keeps its links in a list)."""
    children = getattr(link, '_children', ())
    return children if isinstance(children, set) else set()


def _attributes(link):
    """The attributes to look at: all but the parameters, the persistent
    arrays (the functions update them, the verification compares them; one
    not made yet is None), the child links, Chainer's schedules and
    fastchain's own dispatchers. A persistent value that is not an array
    (BatchNormalization's ``N``) only Python code changes."""
    skip = link._params | child_names(link) | set(CHAINER_ATTRIBUTES)
    items = vars(link)
    skip |= {name for name in link._persistent
             if items.get(name) is None or isinstance(items.get(name),
                                                      chainer.get_array_types())}
    return {name: value for name, value in items.items()
            if name not in skip and not _patches.is_ours(link, name)}


class PythonState:
    """What the attributes of ``chain``'s links hold, and the random
    generators outside them (:mod:`fastchain.static._draws`), to compare and
    put back."""

    def __init__(self, chain):
        self.links = []
        for path, link in chain.namedlinks():
            saved = {name: _take(value, 1, [_BUDGET], frozenset())
                     for name, value in _attributes(link).items()}
            self.links.append((link, path.rstrip('/') or '/', saved))
        self.generators = [(label, _take(value, 1, [_BUDGET], frozenset()))
                            for label, value in _draws.global_generators(chain)]
        self.draws = _draws.Draws(lambda g: _take(g, 1, [_BUDGET], frozenset()))

    def changes(self, made=False):
        """``'path/name: what'`` for each link whose state changed (the first
        change each). ``made``: an attribute that was None or absent and now
        holds a value is not a change (a constant a forward makes on its
        first call, ``if self.pe is None: self.pe = ...``; the recording
        call is that call, and the verified calls after it see a forward
        that makes it again)."""
        found = []
        for link, path, saved in self.links:
            now = _attributes(link)
            if made:
                saved = {n: c for n, c in saved.items()
                         if not (c.kind == 'value' and c.obj is None)}
                now = {n: v for n, v in now.items() if n in saved}
            change = _attributes_change(saved, now, '')
            if change is not None:
                found.append('{}{}{}'.format(path, '' if path.endswith('/') else '/', change))
        for label, node in self.generators + self.draws.taken():
            if _change(node, node.obj) is not None:
                found.append('{}: {}'.format(label, _draws.DRAWN))
        return found

    def restore(self):
        for _, node in self.generators + self.draws.taken():
            _put_back(node)
        for link, _, saved in self.links:
            now = vars(link)
            for name in [n for n in _attributes(link) if n not in saved]:
                del now[name]
            for name, child in saved.items():
                now[name] = child.obj
                _put_back(child)
