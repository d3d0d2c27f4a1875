"""The iterator a script holds, after the loader took its place.

``enable()``'s loader puts its own iterator (``MultiprocessIterator``, and
``DevicePrefetcher`` around it) where the updater had the script's
``SerialIterator``, from where that one stood. In plain Chainer the two are
one object: ``while train_iter.epoch < 2: updater.update()``, a snapshot of
``train_iter``, or its ``epoch_detail`` read for a schedule all follow the
training. Left as it was, the script's object never moved again (a
new-user trial's loop ran for ever). So it follows the loader's: its class
becomes a subclass of its own whose attribute reads, writes and ``next()``
go to the iterator the updater uses (an attribute only the old one has is
still read from it).

A ``SerialIterator`` outlives a run in plain Chainer (its ``finalize`` does
nothing): a second trainer, or a loop of the script's, goes on with it. The
loader's ``finalize`` (at the end of ``trainer.run()``) stops its workers;
from then on the script's object is its own class again, at the position
the training left it (:func:`live_target`), and an updater built on it gets
a new loader from there. A copy or pickle of the script's object is a
plain object of its class at the training's position.
"""

import copyreg

import weakref

import numpy

_classes = {}
_followers = weakref.WeakKeyDictionary()    # loader -> the script's objects following it
TARGET = '_fastchain_follows'


def follow(original, replacement):
    """Make ``original`` (the script's iterator) act as ``replacement``."""
    cls = type(original)
    sub = _classes.get(cls)
    if sub is None:
        sub = _classes[cls] = type(cls.__name__, (cls,), {
            '__getattribute__': _get, '__setattr__': _set,
            '__next__': _next,
            '__reduce_ex__': _reduce_ex,
            '__iter__': lambda self: self,
            # Chainer's Iterator.__del__ finalizes: the script dropping its
            # object must not stop the updater's iterator (finalize() called
            # by the script still does, as it would in plain Chainer)
            '__del__': lambda self: None,
            '__module__': cls.__module__,
            '__doc__': '{} following the iterator fastchain\'s loader put in the '
                       'updater\'s place ({}).'.format(cls.__name__, __name__)})
    object.__setattr__(original, TARGET, replacement)
    original.__class__ = sub
    _followers.setdefault(replacement, weakref.WeakSet()).add(original)


def release(target):
    """``target`` is finalized: the objects following it become their own."""
    try:
        following = list(_followers.pop(target, ()))
    except Exception:       # at the interpreter's exit (from a __del__)
        return
    for iterator in following:
        live_target(iterator)


def target_of(iterator):
    """The iterator ``iterator`` follows, or None."""
    try:
        return object.__getattribute__(iterator, '__dict__').get(TARGET)
    except AttributeError:
        return None


def live_target(iterator):
    """The iterator ``iterator`` follows, or None: none once that one is
    finalized, when ``iterator`` becomes its own again, where it left off."""
    target = target_of(iterator)
    if target is None or not _finalized(target):
        return target
    _followers.pop(target, None)
    own = object.__getattribute__(iterator, '__dict__')
    cls = type(iterator).__mro__[1]
    del own[TARGET]
    _take_position(own, target, cls)
    object.__setattr__(iterator, '__class__', cls)
    return None


def _finalized(iterator):
    if getattr(iterator, '_finalized', False):              # DevicePrefetcher
        return True
    pool = getattr(iterator, '_pool', None)                 # MultiprocessIterator
    return pool is not None and pool.closed


def _take_position(own, target, cls):
    """Load into ``own`` (the ``__dict__`` of the script's object, of class
    ``cls``, without ``TARGET``) the position of ``target``, through their
    ``serialize`` (the loader writes SerialIterator's keys)."""
    from chainer.serializers import DictionarySerializer, NpzDeserializer
    saved = DictionarySerializer()
    target.serialize(saved)
    plain = object.__new__(cls)
    plain.__dict__.update(own)
    state = own.get('_state')       # SerialIterator's; its order is loaded in place
    if isinstance(getattr(state, 'order', None), numpy.ndarray):
        plain._state = state._replace(order=state.order.copy())
    plain.serialize(NpzDeserializer(saved.target))
    own.update(vars(plain))


def _next(self):
    target = live_target(self)
    return next(self) if target is None else next(target)


def _reduce_ex(self, protocol):
    target = live_target(self)
    if target is None:
        return self.__reduce_ex__(protocol)
    cls = type(self).__mro__[1]
    own = dict(object.__getattribute__(self, '__dict__'))
    del own[TARGET]
    _take_position(own, target, cls)
    # (not __newobj__, which pickle allows for the object's own class only)
    return copyreg._reconstructor, (cls, object, None), own


def _get(self, name):
    if name.startswith('__') and name.endswith('__'):     # __class__, __dict__, ...: its own
        return object.__getattribute__(self, name)
    target = live_target(self)
    if target is None:
        return getattr(self, name)
    try:
        return getattr(target, name)
    except AttributeError:
        return object.__getattribute__(self, name)


def _set(self, name, value):
    target = live_target(self)
    if target is not None and hasattr(target, name):
        setattr(target, name, value)
    else:
        object.__setattr__(self, name, value)
