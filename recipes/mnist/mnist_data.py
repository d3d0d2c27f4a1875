#!/usr/bin/env python
"""The MNIST recipes' data. Nothing is ever downloaded.

``--data digits`` (the default): scikit-learn's handwritten digits, which ship
inside the scikit-learn package (the ``recipes`` extra): 1,797 real 8x8
images of the digits 0-9 (64 values in [0, 1]), 1,497 for training and 300
for validation (a fixed split).

``--data FOLDER``: MNIST's four files (``train-images-idx3-ubyte``,
``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``, each optionally ``.gz``), read as Chainer's
``get_mnist()`` gives them (784 values in [0, 1], int32 labels).

``--data FILE.npz``: arrays ``x_train``, ``t_train``, ``x_test``, ``t_test``.
Convert MNIST's four files into one once (one file to copy to every node)::

    python recipes/mnist/mnist_data.py FOLDER mnist.npz
"""

import gzip
import os
import sys

import numpy

import chainer

FILES = {'x_train': 'train-images-idx3-ubyte', 't_train': 'train-labels-idx1-ubyte',
         'x_test': 't10k-images-idx3-ubyte', 't_test': 't10k-labels-idx1-ubyte'}
HOW_TO_GET_MNIST = (
    'MNIST does not ship with fastchain and the recipe never downloads it: put its four '
    'files ({}, each may end in .gz) in one folder, then pass --data FOLDER, or convert '
    'them once with `python recipes/mnist/mnist_data.py FOLDER mnist.npz` and pass '
    '--data mnist.npz. Without them, --data digits trains on the handwritten digits that '
    'ship with scikit-learn.'.format(', '.join(FILES.values())))


class DataError(Exception):
    """The data named cannot be read; the message says why and the fix."""


def positive(text):
    """An argparse type: a whole number of at least 1 (``--epoch 0`` failed
    with a ZeroDivisionError inside Chainer's trigger, ``--batchsize 0``
    with 'batch is empty')."""
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError('expected a whole number, got {!r}'.format(text))
    if value < 1:
        raise argparse.ArgumentTypeError('expected at least 1, got {}'.format(value))
    return value


def load(spec='digits'):
    """``(train, test)`` TupleDatasets for ``--data spec``; a spec that
    cannot be read ends the script with the reason and the fix."""
    try:
        return read(spec)
    except DataError as e:
        sys.exit('error: {}'.format(e))


def read(spec='digits'):
    """As :func:`load`, raising :class:`DataError`."""
    if spec in ('digits', None):
        x, t = _digits()
        order = numpy.random.RandomState(0).permutation(len(t))
        x, t = x[order], t[order]
        return (chainer.datasets.TupleDataset(x[:-300], t[:-300]),
                chainer.datasets.TupleDataset(x[-300:], t[-300:]))
    if spec == 'mnist' and not os.path.exists(spec):
        raise DataError(HOW_TO_GET_MNIST)
    if os.path.isdir(spec):
        arrays = read_idx_folder(spec)
    elif os.path.isfile(spec):
        arrays = _read_npz(spec)
    else:
        raise DataError("--data {}: no such file or folder; expected 'digits', a folder "
                        'with MNIST\'s four files, or an .npz. {}'.format(spec,
                                                                        HOW_TO_GET_MNIST))
    return (chainer.datasets.TupleDataset(arrays['x_train'], arrays['t_train']),
            chainer.datasets.TupleDataset(arrays['x_test'], arrays['t_test']))


def _read_npz(path):
    import zipfile
    if os.path.isfile(path):
        with open(path, 'rb') as f:
            head = f.read(6)
        if not head.startswith((b'PK', b'\x93NUMPY')):     # neither an .npz nor an .npy
            raise DataError('{}: not an .npz file (an .npz is a zip archive of arrays). {}'
                            .format(path, HOW_TO_GET_MNIST))
    try:
        f = numpy.load(path)
        if not isinstance(f, numpy.lib.npyio.NpzFile):
            raise ValueError('one array, not an archive of four')
        with f:
            return {k: f[k] for k in FILES}
    except KeyError as e:
        raise DataError('{}: no array {} (an .npz needs x_train, t_train, x_test, '
                        't_test)'.format(path, e)) from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, AttributeError) as e:
        raise DataError('{}: not a readable .npz file ({}). {}'.format(
            path, e, HOW_TO_GET_MNIST)) from None


def _digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("--data digits needs scikit-learn (pip install -e '.[recipes]'). "
                        + HOW_TO_GET_MNIST) from None
    d = load_digits()
    return (d.data / 16).astype(numpy.float32), d.target.astype(numpy.int32)


def read_idx_folder(folder):
    """MNIST's four IDX files in ``folder``, as float32 images in [0, 1]
    (flattened) and int32 labels."""
    arrays = {}
    for key, name in FILES.items():
        path = next((os.path.join(folder, name + ext) for ext in ('', '.gz')
                     if os.path.isfile(os.path.join(folder, name + ext))), None)
        if path is None:
            raise DataError('{}: no {} (or {}.gz). {}'.format(folder, name, name,
                                                             HOW_TO_GET_MNIST))
        arrays[key] = _read_idx(path, images=key.startswith('x'))
    return arrays


def _read_idx(path, images):
    opener = gzip.open if path.endswith('.gz') else open
    try:
        with opener(path, 'rb') as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise DataError('{}: cannot read it ({})'.format(path, e)) from None
    want = (0x0803, 3) if images else (0x0801, 1)
    if len(raw) < 4 or int.from_bytes(raw[:4], 'big') != want[0]:
        raise DataError('{}: not an IDX {} file (its first bytes are not the IDX magic '
                        'number {:#06x}). Fix: copy the file again from MNIST, or train '
                        'on --data digits'.format(path, 'image' if images else 'label',
                                                  want[0]))
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], 'big') for i in range(want[1])]
    body = numpy.frombuffer(raw, numpy.uint8, offset=4 + 4 * want[1])
    if body.size != int(numpy.prod(dims)):
        raise DataError('{}: {} values for a {} array: the file is truncated or '
                        'corrupt. Fix: copy it again from MNIST, or train on --data '
                        'digits'.format(path, body.size, 'x'.join(map(str, dims))))
    if images:
        return (body.reshape(dims[0], -1) / numpy.float32(255)).astype(numpy.float32)
    return body.astype(numpy.int32)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] in ('-h', '--help'):
        print('usage: python recipes/mnist/mnist_data.py FOLDER OUT.npz\n\n'
              "Converts MNIST's four IDX files in FOLDER into one .npz for --data.")
        return 0 if argv[:1] in (['-h'], ['--help']) else 2
    folder, out = argv
    try:
        arrays = read_idx_folder(folder)
    except DataError as e:
        print('error: {}'.format(e), file=sys.stderr)
        return 2
    numpy.savez_compressed(out, **arrays)
    print('{}: {} training and {} test images'.format(out, len(arrays['t_train']),
                                                     len(arrays['t_test'])))
    return 0


if __name__ == '__main__':
    sys.exit(main())
