"""A module of augmentations with generators of its own, as a script's
helper module has them (tests/data/test_generators.py)."""

import functools

import numpy

_rng = numpy.random.RandomState(3)


def shift(x):
    return x + numpy.float32(_rng.rand())


def _logged(f):
    @functools.wraps(f)
    def wrapper(x):
        return f(x)
    return wrapper


@_logged
def logged_shift(x):
    return shift(x)


def _make_shift(rng):
    def made(x):
        return x + numpy.float32(rng.random())
    return made


factory_shift = _make_shift(numpy.random.default_rng(4))


uniform = _rng.uniform          # a bound method
partial_shift = functools.partial(shift)


@functools.lru_cache(maxsize=None)
def cached_offset(n):
    return float(_rng.rand()) * 0 + n      # (draws once per n: enough to be found)


class RandomShift:
    def __call__(self, x):
        return x + numpy.float32(_rng.rand())


class _Augmenter:
    def __init__(self):
        self.rng = numpy.random.RandomState(5)

    def jitter(self, x):
        return x + numpy.float32(self.rng.rand())


AUGMENTER = _Augmenter()


class _Unaskable:
    """A lazy proxy (werkzeug's LocalProxy, Django's SimpleLazyObject) whose
    ``__class__`` raises outside its context."""

    @property
    def __class__(self):
        raise RuntimeError('working outside of context')


current = _Unaskable()


class _NoOpWriter:
    """A logger stub that answers every attribute with itself (a review:
    unwrapping ``__wrapped__`` on it never ended)."""

    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self


writer = _NoOpWriter()


class First:
    """Two classes whose methods reach each other (a review: the first one
    asked was cached with the second's list half made)."""

    def draw(self):
        return _rng.rand()

    def other(self):
        return Second()


class Second:
    def use(self):
        return First().draw()


keyword_shift = functools.partial(lambda x, rng: x + numpy.float32(rng.rand()),
                                  rng=numpy.random.RandomState(6))
