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

A ``SerialIterator`` outlives its ``finalize`` in plain Chainer (it does
nothing): a second trainer, the same updater again, or a loop of the
script's goes on with it. The loader's ``finalize`` (at the end of
``trainer.run()``, or the script's) stops its workers, and hands back
(:func:`release`): the script's object is its own class again, at the
position the training left it, and every updater the loader served has it
back (and its own converter), so it goes on serially; an updater built on
it later gets a new loader from there. A copy or pickle of the script's
object is a plain object of its class at the training's position, read
without moving the loader (a copy may be made from another thread).
"""

import copyreg
import weakref

import numpy
from chainer.serializers import DictionarySerializer, NpzDeserializer

_classes = {}
_followers = weakref.WeakKeyDictionary()    # loader -> the script's object following it
_served = weakref.WeakKeyDictionary()       # loader -> [(updater, its converter replaced)]
TARGET = '_fastchain_follows'


def follow(original, replacement, updater, converted):
    """Make ``original`` (the script's iterator) act as ``replacement``, the
    loader ``updater`` now uses (:func:`serve`)."""
    cls = type(original)
    sub = _classes.get(cls)
    if sub is None:
        sub = _classes[cls] = type(cls.__name__, (cls,), {
            '__getattribute__': _get, '__setattr__': _set,
            '__next__': lambda self: next(target_of(self)),
            '__reduce_ex__': _reduce_ex,
            '__iter__': lambda self: self,
            # Chainer's Iterator.__del__ finalizes: the script dropping its
            # object must not stop the updater's iterator
            '__del__': lambda self: None,
            '__module__': cls.__module__,
            '__doc__': '{} following the iterator fastchain\'s loader put in the '
                       'updater\'s place ({}).'.format(cls.__name__, __name__)})
    object.__setattr__(original, TARGET, replacement)
    original.__class__ = sub
    # (what it holds besides, for a script that kept no reference to it:
    # StandardUpdater(SerialIterator(...), optimizer))
    _followers[replacement] = (weakref.ref(original), cls, {
        k: v for k, v in vars(original).items() if k != TARGET})
    serve(replacement, updater, converted)


def serve(loader, updater, converted):
    """``updater`` uses ``loader`` in the script's iterator's place (and
    ``converted``: its converter is the loader's, a DevicePrefetcher's, in
    place of its own, which the prefetcher keeps)."""
    _served.setdefault(loader, []).append((weakref.ref(updater), converted))


def release(target):
    """``target`` (a loader) is finalized: the script's object following it
    is its own again, and the updaters it served have it back."""
    try:
        followed = _followers.pop(target, None)
        served = _served.pop(target, ())
    except Exception:       # at the interpreter's exit (from a __del__)
        return
    if followed is None:
        return
    ref, cls, held = followed
    original = ref()
    if original is None:    # the script kept none: the updaters get one like it
        original = object.__new__(cls)
        original.__dict__.update(held)
        original.__dict__[TARGET] = target
    if target_of(original) is target:
        own = object.__getattribute__(original, '__dict__')
        del own[TARGET]
        _load(own, cls, _serialized(target))    # (finalized: nothing moves meanwhile)
        object.__setattr__(original, '__class__', cls)
    for updater_ref, converted in served:
        updater = updater_ref()
        if updater is not None and updater._iterators.get('main') is target:
            updater._iterators['main'] = original
            if converted and updater.converter is target.converter:
                updater.converter = target._convert


def followed(loader):
    """A script's iterator follows ``loader``."""
    return loader in _followers


def target_of(iterator):
    """The iterator ``iterator`` follows, or None."""
    try:
        return object.__getattribute__(iterator, '__dict__').get(TARGET)
    except AttributeError:
        return None


def _position(target):
    """SerialIterator's keys for where ``target`` stands, read without moving
    it (its ``serialize`` gives back the batches fetched ahead, stopping the
    prefetch thread); None where the order of its epoch is no longer kept."""
    before = target.previous_epoch_detail
    saved = {'current_position': target.current_position, 'epoch': target.epoch,
             'is_new_epoch': target.is_new_epoch,
             'previous_epoch_detail': -1.0 if before is None else before}
    schedule = getattr(target, 'iterator', target)._schedule
    if schedule.shuffle:
        saved['order'] = schedule.order(saved['epoch'])
        if saved['order'] is None:
            return None
    return {key: numpy.array(value) for key, value in saved.items()}


def _serialized(target):
    """What ``target.serialize`` saves (SerialIterator's keys)."""
    saved = DictionarySerializer()
    target.serialize(saved)
    return saved.target


def _load(own, cls, saved):
    """Load ``saved`` (SerialIterator's keys) into ``own``, the ``__dict__``
    of the script's object of class ``cls``, through its ``serialize``."""
    plain = object.__new__(cls)
    plain.__dict__.update(own)
    state = own.get('_state')       # SerialIterator's; its order is loaded in place
    if isinstance(getattr(state, 'order', None), numpy.ndarray):
        plain._state = state._replace(order=state.order.copy())
    plain.serialize(NpzDeserializer(saved))
    own.update(vars(plain))


def _reduce_ex(self, protocol):
    target = target_of(self)
    cls = type(self).__mro__[1]
    own = dict(object.__getattribute__(self, '__dict__'))
    del own[TARGET]
    saved = _position(target)
    _load(own, cls, _serialized(target) if saved is None else saved)
    # (not __newobj__, which pickle allows for the object's own class only)
    return copyreg._reconstructor, (cls, object, None), own


def _get(self, name):
    if name.startswith('__') and name.endswith('__'):     # __class__, __dict__, ...: its own
        return object.__getattribute__(self, name)
    target = target_of(self)
    try:
        return getattr(target, name)
    except AttributeError:
        return object.__getattribute__(self, name)


def _set(self, name, value):
    # (a review: written on the loader, these were accepted where Chainer
    # refuses them, and then broke its next batch or were overwritten by it;
    # a new dataset or order sampler was not seen by the workers)
    cls = type(self).__mro__[1]
    kind = getattr(cls, name, None)
    if isinstance(kind, property) and kind.fset is None:        # as the class refuses it
        raise AttributeError("property {!r} of {!r} object has no setter".format(
            name, cls.__name__))
    if name in ('dataset', 'order_sampler'):
        raise AttributeError(
            "fastchain: this {0}'s {1} cannot change while fastchain's loader serves it: the "
            'loader and its workers keep the one they started with. Keep Chainer\'s iterator '
            'for a script that changes it, fastchain.enable(loader_workers=0), or build a new '
            'iterator and updater'.format(cls.__name__, name))
    target = target_of(self)
    if hasattr(target, name):
        setattr(target, name, value)
    else:
        object.__setattr__(self, name, value)
