"""The autotuner's key of a CPU convolution call, and how it reads in a report."""

import numpy


_PARAMETERS = ('sy', 'sx', 'ph', 'pw', 'dy', 'dx', 'kh', 'kw', 'outh', 'outw')


def call_key(node, inputs):
    """What a convolution call's speed depends on: the function, each array's
    shape and dtype, and the node's geometry."""
    return ((type(node).__name__,)
            + tuple((a.shape, a.dtype.str) for a in inputs)
            + tuple(getattr(node, p, None) for p in _PARAMETERS))


def describe(key):
    """A call key as one line of a report."""
    name, rest = key[0], key[1:]
    arrays = [r for r in rest if isinstance(r, tuple)]
    geometry = dict(zip(_PARAMETERS, rest[len(arrays):]))
    shapes = ' '.join('x'.join(map(str, shape)) for shape, _ in arrays)
    return '{} {} {} stride {},{} pad {},{}{}'.format(
        {'Convolution2DFunction': 'forward', 'Convolution2DGradW': 'weight-grad',
         'Deconvolution2DFunction': 'input-grad/deconv'}.get(name, name), shapes,
        numpy.dtype(arrays[0][1]).name if arrays else '', geometry['sy'], geometry['sx'],
        geometry['ph'], geometry['pw'], '' if (geometry['dy'], geometry['dx']) == (1, 1) else
        ' dilation {},{}'.format(geometry['dy'], geometry['dx']))
