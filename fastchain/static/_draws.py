"""Random generators outside a cached chain's links that its forward draws
from, which a replay never draws from again.

A stochastic-depth ``if random.random() < p`` or noise from a module-level
``default_rng`` trained differently from plain Chainer without a word (a
new-user trial: 4 of 6 seeds cached; and where the model fell back, the
recording's and the reference run's draws had left the script's own later
draws off plain Chainer's). Two ways of seeing them, both compared and put
back around a verified call by :class:`fastchain.static._state.PythonState`:

- Python's ``random.Random`` objects (the ``random`` module's hidden one, a
  module's, a class attribute, a closure's): a profile function on the
  calling thread while the recording and the reference run execute
  (:meth:`Draws.watching`) takes each one's state before its first draw
  there. Thread by thread: a data-loading thread drawing from ``random``
  meanwhile is not taken for the forward (a review measured that false
  alarm, and the put-back then rewound that thread's draws). Left alone
  where a profiler is already set (``cProfile``): then not seen.
- NumPy's ``RandomState`` and ``Generator`` objects, whose draws run no
  Python frame a profile function sees: those the model's classes reach
  (their modules' globals, class attributes, their functions' closure cells
  and default arguments), by their state (:func:`global_generators`; a
  thread drawing from the same one meanwhile counts as the forward).

NumPy's global state is the verification's own (:mod:`_verify`): compared
and put back around a verified call. While one runs (:func:`holding_numpy`),
another thread's draw from it through ``numpy.random``'s functions waits
until the call is done, so that a data thread's augmentation is neither
taken for the forward's draw nor rewound by the put-back (a false fallback
in 3 of 3 runs, and 20% of that thread's draws repeated, before). A review
found arrays drawn meanwhile still taken (19 of 20 runs): a draw that had
begun, or had looked the function up, just before the check fills its array
without the GIL. The check now waits for draws running through the
wrappers, gives a thread holding the unwrapped function two GIL switch
intervals to call it, and waits on the generator's lock for its fill (0 of
40 runs). A thread waits at most :data:`HOLD` once a check (a forward that
waits on a thread of its own which draws would otherwise hang); the
wrappers answer for the functions (``__self__``, name, pickling). Chainer's
``ShuffleOrderSampler`` draws from the RandomState object itself: a layer on
its ``__call__`` holds it the same way (a SerialIterator's next order, drawn
by a prefetch thread at an epoch's end).
"""

import contextlib
import os
import random
import sys
import threading
import time
import weakref

import numpy

DRAWN = 'a random generator outside the links the forward draws from'
_NUMPY = (numpy.random.RandomState, numpy.random.Generator)
# packages whose objects and classes are not the user's (_state looks into the user's)
LIBRARIES = ('chainer', 'fastchain', 'numpy', 'cupy', 'builtins', 'cupyx', 'collections',
              'itertools', 'functools', 'random', 'threading', 'weakref')


def global_generators(chain):
    """(label, generator) of the NumPy generators the model's classes reach
    outside its links' objects: globals of the modules of ``chain``'s link
    classes, the classes' attributes, and the closure cells and default
    arguments of their functions (NumPy's global state left out: it is the
    verification's own). Stochastic depth drawn from a class attribute's or a
    closure's ``RandomState`` trained differently from plain Chainer without a
    word in 2 of 6 seeds before these were looked at."""
    reached, namespaces = [], {}
    for cls in _classes(chain):
        for attr, value in sorted(vars(cls).items()):
            where = '{}.{}'.format(cls.__qualname__, attr)
            reached.append((where + ' (a class attribute)', value))
            if type(value) in weakref.ProxyTypes:
                continue                    # (a dead one raises on every attribute)
            # the module's globals: a script loaded from a file need not be in sys.modules
            namespace = getattr(value, '__globals__', None)
            if isinstance(namespace, dict):
                namespaces.setdefault(id(namespace), (
                    namespace.get('__name__', cls.__module__), namespace))
            function = getattr(value, '__func__', value)    # staticmethod, classmethod
            for cell in getattr(function, '__closure__', None) or ():
                try:
                    reached.append(('a closure of ' + where, cell.cell_contents))
                except ValueError:          # an empty cell
                    pass
            defaults = tuple(getattr(function, '__defaults__', None) or ()) + tuple(
                (getattr(function, '__kwdefaults__', None) or {}).values())
            reached += [('a default argument of ' + where, value) for value in defaults]
    globals_ = [('{}.{}'.format(name, attr), value)
                for name, namespace in sorted(namespaces.values(), key=lambda item: item[0])
                for attr, value in sorted(namespace.items())]
    found, seen = [], {id(numpy.random.mtrand._rand)}
    for label, value in globals_ + reached:     # (a module global keeps that label)
        # (by type: isinstance asks a dead weakref proxy, which raises)
        if issubclass(type(value), _NUMPY) and id(value) not in seen:
            seen.add(id(value))
            found.append((label, value))
    return found


def _classes(chain):
    """The classes of ``chain``'s links and their bases that are not a
    library's, each once."""
    found = {}
    for link in chain.links():
        for cls in type(link).__mro__:
            if (cls.__module__ or '').split('.')[0] not in LIBRARIES:
                found.setdefault(cls, None)
    return list(found)


class Draws:
    """The ``random.Random`` objects this thread draws from inside
    :meth:`watching`, each one's state (``take(generator)``) from before its
    first draw."""

    def __init__(self, take):
        self.take = take
        self.found = {}         # id -> (label, taken)

    def taken(self):
        return list(self.found.values())

    @contextlib.contextmanager
    def watching(self):
        if sys.getprofile() is not None:    # a profiler of the user's: left alone
            yield
            return
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            sys.setprofile(None)

    def _profile(self, frame, event, arg):
        if event != 'c_call':
            return
        owner = getattr(arg, '__self__', None)
        if isinstance(owner, random.Random) and id(owner) not in self.found:
            while frame.f_back is not None and frame.f_code.co_filename == random.__file__:
                frame = frame.f_back        # (random.uniform and the like draw in random.py)
            label = "Python's random module" if owner is getattr(random, '_inst', None) else \
                'a random.Random (drawn from at {}:{})'.format(
                    os.path.basename(frame.f_code.co_filename), frame.f_lineno)
            self.found[id(owner)] = (label, self.take(owner))


# NumPy's global state held while a verified call runs ------------------------

HOLD = 30.0     # seconds another thread waits at most, once a hold (then it draws)
_gate = threading.Condition()
_owners = {}    # thread id -> depth: the threads inside holding_numpy
_inflight = {}  # thread id -> its numpy.random calls running through a wrapper
_released = set()   # threads that waited HOLD: not held again until the hold ends
_windows = []   # each open hold's list of the functions that waited HOLD
_saved = []     # (namespace, name, original) while the wrappers are in place


class _Held:
    """``numpy.random``'s function while a call is verified: another thread's
    call waits for the check to end; everything else about it is the
    function's (``__self__``, which Chainer's ``ShuffleOrderSampler`` reads,
    its name and documentation, pickling as the original)."""

    __slots__ = ('fastchain_holds', 'name')

    def __init__(self, name, function):
        self.fastchain_holds, self.name = function, name

    def __call__(self, *args, **kwargs):
        with _turn('numpy.random.' + self.name):
            return self.fastchain_holds(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self.fastchain_holds, attr)

    @property
    def __doc__(self):
        return self.fastchain_holds.__doc__

    def __reduce_ex__(self, protocol):
        return self.fastchain_holds.__reduce_ex__(protocol)

    def __repr__(self):
        return repr(self.fastchain_holds)


@contextlib.contextmanager
def _turn(name):
    """Inside: a draw of this thread's (``name``, for the fallback's message),
    after waiting for another thread's check to end."""
    me = threading.get_ident()
    with _gate:
        if _owners and me not in _owners and me not in _released:
            deadline = time.monotonic() + HOLD
            while _owners and me not in _owners:
                left = deadline - time.monotonic()
                if left <= 0:
                    # (a forward waiting on this thread: go on rather than hang,
                    # and without waiting again until this hold ends)
                    _released.add(me)
                    for window in _windows:
                        window.append(name)
                    break
                _gate.wait(left)
        _inflight[me] = _inflight.get(me, 0) + 1
    try:
        yield
    finally:
        with _gate:
            left = _inflight.pop(me, 1) - 1
            if left:
                _inflight[me] = left
            else:
                _gate.notify_all()


def _sampler_layer(next_, sampler, *args, **kwargs):
    """Chainer's ``ShuffleOrderSampler``, which draws from the global
    RandomState object itself (a SerialIterator's next epoch's order, drawn
    by a prefetch thread): held as ``numpy.random``'s functions are."""
    if getattr(sampler, '_random', None) is not numpy.random.mtrand._rand:
        return next_(sampler, *args, **kwargs)
    with _turn("Chainer's ShuffleOrderSampler"):
        return next_(sampler, *args, **kwargs)


def _sampler():
    from chainer.iterators.order_samplers import ShuffleOrderSampler
    return ShuffleOrderSampler


def _global_functions():
    """(name, function) of ``numpy.random``'s functions that use its global
    ``RandomState``: its bound methods, and those that reach it in C."""
    state = numpy.random.mtrand._rand
    found = {name: value for name, value in vars(numpy.random).items()
             if getattr(value, '__self__', None) is state}
    for name in ('seed', 'ranf', 'sample', 'set_bit_generator'):
        value = getattr(numpy.random, name, None)
        if callable(value):
            found[name] = value
    return sorted(found.items())


def _after_fork_in_child():
    """A process forked while a call was verified (a pool's worker started
    from another thread) has no verified call: NumPy's functions as they
    were, nothing held (its draws would each have waited HOLD seconds)."""
    global _gate
    _gate = threading.Condition()       # (another thread may have held the old one)
    _restore(layers=False)      # (the sampler's layer passes through with no hold)
    _owners.clear()
    _inflight.clear()
    _released.clear()
    del _windows[:]


if hasattr(os, 'register_at_fork'):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _restore(layers=True):
    for namespace, name, function in _saved:
        if getattr(getattr(namespace, name, None), 'fastchain_holds', None) is function:
            setattr(namespace, name, function)      # (not if someone replaced it since)
    if _saved and layers:
        from fastchain.config import _patches
        _patches.unwrap(_sampler(), '__call__', 'static_graph')
    del _saved[:]


@contextlib.contextmanager
def holding_numpy():
    """NumPy's global random state to this thread while inside: the
    ``numpy.random`` functions another thread calls wait until it is out
    (each thread at most :data:`HOLD` seconds a hold; this thread's own
    draws go on). Draws already running when it starts are waited for. The
    list yielded gets the functions of threads that waited HOLD and drew."""
    me = threading.get_ident()
    window = []
    with _gate:
        installing = not _owners
        if installing:
            functions = _global_functions()
            for namespace in (numpy.random, numpy.random.mtrand):
                for name, function in functions:
                    if getattr(namespace, name, None) is function:
                        _saved.append((namespace, name, function))
                        setattr(namespace, name, _Held(name, function))
            from fastchain.config import _patches
            _patches.wrap(_sampler(), '__call__', 'static_graph', _sampler_layer)
        _owners[me] = _owners.get(me, 0) + 1
        _windows.append(window)
        # another thread's call that passed its wrapper before this hold began
        deadline = time.monotonic() + HOLD
        while any(t not in _owners for t in _inflight) and time.monotonic() < deadline:
            _gate.wait(max(0.0, deadline - time.monotonic()))
    if installing and threading.active_count() > 1:
        # a thread that had looked the function up just before it was replaced
        # calls it now: let it (two switch intervals of the GIL), then wait for
        # its fill, which runs without the GIL holding the generator's lock
        time.sleep(2 * sys.getswitchinterval())
    lock = getattr(getattr(numpy.random.mtrand._rand, '_bit_generator', None), 'lock', None)
    if lock is not None:
        with lock:
            pass
    try:
        yield window
    finally:
        with _gate:
            if window in _windows:          # (not after a fork inside: reset there)
                _windows.remove(window)
            depth = _owners.pop(me, 1) - 1
            if depth:
                _owners[me] = depth
            if not _owners:
                _restore()
                _released.clear()
                _gate.notify_all()
