"""The random generators an example's augmentation draws from, seeded per
example where the loader's workers load it.

Each worker is a fork of the main process (or an unpickled copy of the
dataset): a generator it holds starts, in every worker, from the state it
had there. Unseeded, every worker draws the same numbers: two examples of a
batch got the same crop from 2 workers (Python's ``random``, a new-user
trial), and a dataset's own ``self.rng = numpy.random.RandomState(0)`` did
too, and gave another run for another worker count. So each example is
loaded with NumPy's global RNG, Python's ``random`` and the generators the
dataset holds itself (:func:`find`: a ``RandomState``, a ``Generator``, a
``random.Random``, reached through its attributes, a transform's closure or
bound object, lists and dicts) seeded from the example's seed: the same for
any number of workers, repeatable under ``numpy.random.seed``.
"""

import functools
import os
import random
import sys
import sysconfig
import threading
import types

import numpy

_OWN = (numpy.random.RandomState, numpy.random.Generator, random.Random)
_DEPTH = 10         # attribute hops from the dataset
_NODES = 4000       # objects looked at, at most
_ITEMS = 64         # a longer list, tuple or dict (file names, labels) is not entered
_HOPS = 4           # functions followed from a function through the globals it calls
_FUNCTIONS = 256    # functions looked into that way, at most, from one function
_CLASSES = 8        # classes followed one inside another, at most
_UNWRAP = 8         # wrappers taken off one value, at most
_walk = threading.local()   # find()'s memo: id(class) -> its generators (while it runs)
_LEAVES = (str, bytes, int, float, complex, bool, type(None), numpy.ndarray, numpy.generic,
           type, types.ModuleType, types.BuiltinFunctionType)


def _is_global(generator):
    # NumPy's global RandomState and Python's module-level Random: seeded
    # as themselves (seed_example); a SystemRandom has no state to seed
    return generator is numpy.random.mtrand._rand or generator is random._inst or \
        isinstance(generator, random.SystemRandom)


def _children(value):
    try:
        return _parts(value)
    except Exception:       # a dead proxy, a property or __getattr__ that raises
        return []


def _parts(value):
    if isinstance(value, (list, tuple)):
        return [('[{}]'.format(i), v) for i, v in enumerate(value)] \
            if len(value) <= _ITEMS else []
    if isinstance(value, dict):
        return [('[{!r}]'.format(k), v) for k, v in value.items()] \
            if len(value) <= _ITEMS else []
    if isinstance(value, functools.partial):
        return [('.func', value.func), ('.args', value.args),
                ('.keywords', value.keywords)]
    if isinstance(value, types.MethodType):
        return [('.__self__', value.__self__), ('.__func__', value.__func__)]
    if isinstance(value, types.FunctionType):
        cells = value.__closure__ or ()
        return [('.<{}>'.format(name), cell.cell_contents)
                for name, cell in zip(value.__code__.co_freevars, cells)
                if _filled(cell)] + [
            ('.<default {}>'.format(i), v) for i, v in enumerate(value.__defaults__ or ())] + [
            ('.<default {}>'.format(k), v) for k, v in (value.__kwdefaults__ or {}).items()] + [
            (path, g) for path, g in _globals_of(value)]
    try:
        attributes = object.__getattribute__(value, '__dict__')
    except AttributeError:
        attributes = {}
    found = [('.' + str(k), v) for k, v in list(attributes.items())]
    for cls in type(value).__mro__:
        slots = cls.__dict__.get('__slots__', ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ('__dict__', '__weakref__'):
                try:
                    found.append(('.' + name, object.__getattribute__(value, name)))
                except AttributeError:
                    pass    # an empty slot
    return found + _class_generators(type(value))


def _class_generators(cls):
    """The generators ``cls`` and its bases hold as class attributes
    (``rng = numpy.random.RandomState(0)`` in the class body), and those of
    their modules' globals their methods name (``RNG.random()`` in
    ``get_example``; a decorated method, a property)."""
    memo = getattr(_walk, 'memo', None)
    memo = {} if memo is None else memo     # (asked outside find(): for this call only)
    found = memo.get(id(cls))
    if found is not None:
        return found
    # in progress: a class its methods reach again gets what is found so far
    # (the rest is found through this one); looked at anew by each find(), as
    # a module's global or an object's attribute may be rebound between them
    memo[id(cls)] = found = []
    depth = memo.get('depth', 0)
    if depth >= _CLASSES:
        return found
    memo['depth'] = depth + 1
    try:
        for c in cls.__mro__:
            for k, v in list(vars(c).items()):
                if _is(v, _OWN):
                    found.append(('.' + str(k), v))
                elif _is(v, (types.FunctionType, staticmethod, classmethod, property)):
                    v = v.fget if isinstance(v, property) else getattr(v, '__func__', v)
                    try:
                        found += [('.{}{}'.format(k, path), g)
                                  for path, g in _globals_of(v, closure=True)]
                    except Exception:
                        pass    # an object that cannot be asked (a proxy): the others stay
    finally:
        memo['depth'] = depth
    return found


def _globals_of(function, closure=False):
    """``[(path, generator)]``: the generators among the module globals
    ``function`` (and the functions and lambdas inside it) names, and those
    the functions, modules and classes it names reach the same way, up to
    :data:`_HOPS` calls deep (a transform calling ``augment.crop(img)``,
    whose module holds ``_rng``: ``.<global augment.crop>.<global _rng>``).
    A function reached is unwrapped (a decorator's or a factory's closure,
    ``__wrapped__``, a partial, a bound method); ``function``'s own closure
    only with ``closure`` (find() walks a transform's)."""
    found, seen = [], {id(function)}
    level = [('', function)]
    for _ in range(_HOPS + 1):
        below = []
        for path, f in level:
            code, space = getattr(f, '__code__', None), getattr(f, '__globals__', None)
            if not isinstance(code, types.CodeType) or not isinstance(space, dict):
                continue    # a builtin, a ufunc: no globals of its own
            names = _names(code)
            cells = [(name, c.cell_contents) for name, c in
                     zip(code.co_freevars, f.__closure__ or ()) if _filled(c)]
            reached = [('<global {}>'.format(label), value) for label, value in
                       _through_modules([(n, space[n]) for n in sorted(names) if n in space],
                                        names)]
            # the modules its closure holds (a transform defined in a function
            # that imported them); ``function``'s other cells are find()'s to walk
            reached += [('<{}>'.format(label), value) for label, value in _through_modules(
                [(n, v) for n, v in cells if _is(v, types.ModuleType)], names)]
            if f is not function or closure:
                reached += [('<{}>'.format(name), value) for name, value in cells
                            if not _is(value, types.ModuleType)]
            for label, value in _unwrapped(reached):
                where = '{}.{}'.format(path, label)
                if _is(value, _OWN):
                    found.append((where, value))
                elif _is(value, type) and not _library(value):
                    found += [(where + p, g) for p, g in _class_generators(value)]
                elif not _is(value, _LEAVES + (types.FunctionType,)) and \
                        not _library(type(value)):
                    # an object of a script's class (``AUGMENTER.flip(x)``): the
                    # generators it holds itself, and its class's
                    found += [(where + p, g) for p, g in _held(value)]
                elif _is(value, types.FunctionType) and id(value) not in seen \
                        and len(seen) < _FUNCTIONS:
                    seen.add(id(value))
                    below.append((where, value))
        level = below
    return found


def _held(value):
    try:
        attributes = list(object.__getattribute__(value, '__dict__').items())
    except Exception:
        attributes = []
    return [('.' + str(k), v) for k, v in attributes if _is(v, _OWN)] + \
        _class_generators(type(value))


def _library(cls):
    """Whether ``cls`` comes from Python's or an installed package's modules
    (a script's class is followed into, a library's are too many): a module
    of the interpreter's own, or a file under the standard library's or a
    site-packages/dist-packages folder. A script's ``__main__`` (a file, a
    notebook, ``python -c``), a module without a file that is not built in
    and one no longer in ``sys.modules`` (``runpy.run_path``) are scripts."""
    name = getattr(cls, '__module__', None)
    if not isinstance(name, str) or name in ('__main__', '__mp_main__'):
        return False
    known = _libraries.get(name)
    if known is None:
        module = sys.modules.get(name)
        if module is None:
            return False
        path = getattr(module, '__file__', None)
        known = name in sys.builtin_module_names if path is None else \
            os.path.normcase(os.path.realpath(path)).startswith(_installed())
        _libraries[name] = known
    return known


_libraries = {}


@functools.lru_cache(maxsize=None)
def _installed():
    import site
    paths = sysconfig.get_paths()
    folders = [paths[k] for k in ('stdlib', 'platstdlib', 'purelib', 'platlib') if k in paths]
    try:
        folders += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:
        pass        # (a virtualenv's old site.py)
    folders += [p for p in sys.path if os.path.basename(p.rstrip(os.sep)) in (
        'site-packages', 'dist-packages')]
    return tuple(sorted({os.path.normcase(os.path.realpath(f)) + os.sep for f in folders}))


def _unwrapped(reached):
    """``reached`` (label, value) with what a value wraps in its place: a
    partial's function and arguments, a bound method's function and object
    (``uniform = _rng.uniform``), ``__wrapped__`` (``functools.wraps``,
    ``lru_cache``)."""
    out, stack, expanded = [], [(label, value, 0) for label, value in reached][::-1], []
    while stack:
        label, value, depth = stack.pop()
        inner = []
        if depth >= _UNWRAP or any(value is e for e in expanded):
            continue    # a wrapper that leads back to itself, or on without end
        try:
            if isinstance(value, functools.partial):
                inner = [('.func', value.func)] + [('.args', a) for a in value.args] + [
                    ('.keywords', v) for v in (value.keywords or {}).values()]
            elif isinstance(value, (types.MethodType, types.BuiltinMethodType)):
                inner = [('.__self__', value.__self__)] + (
                    [('.__func__', value.__func__)] if isinstance(value, types.MethodType)
                    else [])
            elif not isinstance(value, types.FunctionType) and \
                    callable(getattr(value, '__wrapped__', None)):
                inner = [('.__wrapped__', value.__wrapped__)]
        except Exception:
            inner = []      # an object that cannot be asked (a proxy)
        if inner:
            expanded.append(value)      # (kept: an id is not reused while it lives)
            stack += [(label + part, v, depth + 1) for part, v in inner[::-1]
                      if not _is(v, types.ModuleType)]
        else:
            out.append((label, value))
    return out


def _names(code):
    """The global and attribute names ``code`` and the code inside it use."""
    names, codes = set(), [code]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


def _through_modules(reached, names):
    """``reached`` with, for each module among it, its attributes that
    ``names`` holds (``augment.crop``, ``pkg.augment.crop``: modules two
    deep)."""
    out, modules = [], []
    for name, value in reached:
        (modules if _is(value, types.ModuleType) else out).append((name, value))
    for _ in range(2):
        inner = []
        for name, module in modules:
            space = getattr(module, '__dict__', {})
            for attribute in sorted(names):
                value = space.get(attribute)
                if _is(value, types.ModuleType):
                    inner.append(('{}.{}'.format(name, attribute), value))
                elif value is not None:
                    out.append(('{}.{}'.format(name, attribute), value))
        modules = inner
    return out


def _filled(cell):
    try:
        cell.cell_contents
    except ValueError:      # an empty cell
        return False
    return True


def find(dataset, name='dataset'):
    """``[(path, generator)]``: the generators ``dataset`` holds (not the
    global ones), each once, in the order a breadth-first walk meets them."""
    outer = getattr(_walk, 'memo', None)
    _walk.memo = {} if outer is None else outer
    try:
        return _find(dataset, name)
    finally:
        _walk.memo = outer


def _find(dataset, name):
    found, seen = [], {id(dataset)}
    level, looked = [(name, dataset)], 0
    for _ in range(_DEPTH + 1):
        below = []
        for path, value in level:
            if _is(value, _OWN):
                if not _is_global(value):
                    found.append((path, value))
                continue
            for part, child in _children(value):
                looked += 1
                if looked > _NODES:
                    return found
                if id(child) not in seen and _is(child, object) and not _is(child, _LEAVES):
                    seen.add(id(child))
                    below.append((path + part, child))
        level = below
    return found


def _is(value, kinds):
    """``isinstance``, False where asking fails (a dead weakref proxy)."""
    try:
        return isinstance(value, kinds)
    except Exception:
        return False


def _state(generator):
    if isinstance(generator, numpy.random.RandomState):
        return generator.get_state(legacy=False)
    if isinstance(generator, numpy.random.Generator):
        return generator.bit_generator.state
    return generator.getstate()


def _set_state(generator, state):
    if isinstance(generator, numpy.random.RandomState):
        generator.set_state(state)
    elif isinstance(generator, numpy.random.Generator):
        generator.bit_generator.state = state
    else:
        generator.setstate(state)


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, numpy.ndarray):
        return numpy.array_equal(a, b)
    return a == b


def _reseed(generator, seed):
    if isinstance(generator, numpy.random.RandomState):
        bits = generator._bit_generator
        if type(bits) is numpy.random.MT19937:
            generator.seed(seed)        # as numpy.random.seed seeds
        else:   # RandomState(PCG64(...)): its seed() takes only MT19937
            state = type(bits)(seed).state      # (and no Gaussian kept from before)
            generator.set_state(dict(state, has_gauss=0, gauss=0.0))
    elif isinstance(generator, numpy.random.Generator):
        generator.bit_generator.state = type(generator.bit_generator)(seed).state
    else:
        generator.seed(seed)


def seed_example(seed, own=()):
    """Seed the generators an example's augmentation draws from: NumPy's
    global RNG, Python's ``random`` and ``own`` (:func:`find`'s), each
    generator of its own stream."""
    numpy.random.seed(seed)
    random.seed(seed)
    for k, (_, generator) in enumerate(own):
        _reseed(generator, (seed + 0x9E3779B1 * (k + 1)) % 2**32)
