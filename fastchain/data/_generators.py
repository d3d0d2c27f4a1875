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
import random
import types
import weakref

import numpy

_OWN = (numpy.random.RandomState, numpy.random.Generator, random.Random)
_DEPTH = 10         # attribute hops from the dataset
_NODES = 4000       # objects looked at, at most
_ITEMS = 64         # a longer list, tuple or dict (file names, labels) is not entered
_HOPS = 4           # functions followed from a function through the globals it calls
_FUNCTIONS = 256    # functions looked into that way, at most, from one function
_by_class = weakref.WeakKeyDictionary()     # class -> its class-attribute generators
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
    ``get_example``)."""
    found = _by_class.get(cls)
    if found is None:
        found = []
        for c in cls.__mro__:
            for k, v in list(vars(c).items()):
                if isinstance(v, _OWN):
                    found.append(('.' + str(k), v))
                elif isinstance(v, (types.FunctionType, staticmethod, classmethod)):
                    found += [('.{}{}'.format(k, path), g)
                              for path, g in _globals_of(getattr(v, '__func__', v))]
        _by_class[cls] = found
    return found


def _globals_of(function):
    """``[(path, generator)]``: the generators among the module globals
    ``function`` (and the functions and lambdas inside it) names, and those
    the functions and modules it names reach the same way, up to
    :data:`_HOPS` calls deep (a transform calling ``augment.crop(img)``,
    whose module holds ``_rng``: ``.<global augment.crop>.<global _rng>``)."""
    found, seen = [], {id(function)}
    level = [('', function)]
    for _ in range(_HOPS + 1):
        below = []
        for path, f in level:
            code, space = getattr(f, '__code__', None), getattr(f, '__globals__', None)
            if not isinstance(code, types.CodeType) or not isinstance(space, dict):
                continue    # a builtin, a ufunc, a partial: no globals of its own
            names = _names(code)
            cells = [(name, c.cell_contents) for name, c in
                     zip(code.co_freevars, f.__closure__ or ()) if _filled(c)]
            reached = [('<global {}>'.format(label), value) for label, value in
                       _through_modules([(n, space[n]) for n in sorted(names) if n in space],
                                        names)]
            # the modules its closure holds (a transform defined in a function
            # that imported them); ``function``'s other cells are find()'s to walk
            reached += [('<{}>'.format(label), value) for label, value in _through_modules(
                [(n, v) for n, v in cells if isinstance(v, types.ModuleType)], names)]
            if f is not function:
                # a function it calls that was made by another (a decorator's, a factory's)
                reached += [('<{}>'.format(name), value) for name, value in cells
                            if isinstance(value, (types.FunctionType,) + _OWN)]
            for label, value in reached:
                if isinstance(value, _OWN):
                    found.append(('{}.{}'.format(path, label), value))
                elif isinstance(value, types.FunctionType) and id(value) not in seen \
                        and len(seen) < _FUNCTIONS:
                    seen.add(id(value))
                    below.append(('{}.{}'.format(path, label), value))
        level = below
    return found


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
        (modules if isinstance(value, types.ModuleType) else out).append((name, value))
    for _ in range(2):
        inner = []
        for name, module in modules:
            space = getattr(module, '__dict__', {})
            for attribute in sorted(names):
                value = space.get(attribute)
                if isinstance(value, types.ModuleType):
                    inner.append(('{}.{}'.format(name, attribute), value))
                elif isinstance(value, (types.FunctionType,) + _OWN):
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
            bits.state = type(bits)(seed).state
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
