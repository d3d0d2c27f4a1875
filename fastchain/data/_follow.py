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
"""

_classes = {}
TARGET = '_fastchain_follows'


def follow(original, replacement):
    """Make ``original`` (the script's iterator) act as ``replacement``."""
    cls = type(original)
    sub = _classes.get(cls)
    if sub is None:
        sub = _classes[cls] = type(cls.__name__, (cls,), {
            '__getattribute__': _get, '__setattr__': _set,
            '__next__': lambda self: next(target_of(self)),
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


def target_of(iterator):
    """The iterator ``iterator`` follows, or None."""
    try:
        return object.__getattribute__(iterator, '__dict__').get(TARGET)
    except AttributeError:
        return None


def _get(self, name):
    if name.startswith('__') and name.endswith('__'):     # __class__, __dict__, ...: its own
        return object.__getattribute__(self, name)
    target = target_of(self)
    try:
        return getattr(target, name)
    except AttributeError:
        return object.__getattribute__(self, name)


def _set(self, name, value):
    target = target_of(self)
    if hasattr(target, name):
        setattr(target, name, value)
    else:
        object.__setattr__(self, name, value)
