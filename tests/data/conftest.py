"""Real JPEG files for the input-pipeline tests, made with Pillow."""

import os

import numpy
import pytest


def make_images(root, n_per_class=6, classes=3, seed=0, min_side=40, max_side=96):
    """Folder-per-class JPEGs of varied sizes, plus an ImageNet-style list."""
    from PIL import Image
    rng = numpy.random.RandomState(seed)
    lines = []
    for c in range(classes):
        folder = os.path.join(root, 'class{}'.format(c))
        os.makedirs(folder, exist_ok=True)
        for k in range(n_per_class):
            w, h = rng.randint(min_side, max_side, 2)
            pixels = rng.randint(0, 256, (h, w, 3)).astype(numpy.uint8)
            pixels[..., c] = 255 - pixels[..., c] // 4     # a class colour
            name = 'img{:03d}.jpg'.format(k)
            Image.fromarray(pixels).save(os.path.join(folder, name), quality=90)
            lines.append('class{}/{} {}'.format(c, name, c))
    with open(os.path.join(root, 'train.txt'), 'w') as f:
        f.write('\n'.join(lines) + '\n')
    return os.path.join(root, 'train.txt')


@pytest.fixture(scope='session')
def image_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('images'))
    make_images(root)
    return root


@pytest.fixture
def bad_root(tmp_path):
    """A list whose entries 2..5 are corrupt, truncated, missing, not an image."""
    root = str(tmp_path)
    make_images(root, n_per_class=4, classes=2)
    entries = open(os.path.join(root, 'train.txt')).read().split('\n')
    good = os.path.join(root, entries[0].split()[0])
    data = open(good, 'rb').read()
    with open(os.path.join(root, 'corrupt.jpg'), 'wb') as f:
        f.write(b'\xff\xd8\xff' + bytes(numpy.random.RandomState(1).randint(0, 256, 500, dtype=numpy.uint8)))
    with open(os.path.join(root, 'truncated.jpg'), 'wb') as f:
        f.write(data[:len(data) // 3])
    with open(os.path.join(root, 'notes.jpg'), 'w') as f:
        f.write('this is text, not a picture\n')
    bad = ['corrupt.jpg 0', 'truncated.jpg 0', 'missing.jpg 1', 'notes.jpg 1']
    lines = entries[:2] + bad + [e for e in entries[2:] if e]
    with open(os.path.join(root, 'bad.txt'), 'w') as f:
        f.write('\n'.join(lines) + '\n')
    return root


@pytest.fixture
def first_bad_list(bad_root):
    """A list whose first entry is the corrupt JPEG, the others good."""
    entries = open(os.path.join(bad_root, 'train.txt')).read().split()
    good = [' '.join(entries[i:i + 2]) for i in range(0, len(entries), 2)]
    path = os.path.join(bad_root, 'first_bad.txt')
    with open(path, 'w') as f:
        f.write('\n'.join(['corrupt.jpg 0'] + good) + '\n')
    return path
