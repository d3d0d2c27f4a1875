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
