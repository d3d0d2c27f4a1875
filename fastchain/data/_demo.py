"""A learnable image dataset made on the spot: real JPEG files, nothing to
download.

Each image shows one coloured shape on a varied, muted background
(gradients, stripes, smooth noise). The class is the shape and its colour family, so a model has
to look at form and colour; position, size, rotation, background and JPEG
quality vary. Files go in Chainer's ImageNet layout: ``train/`` and ``val/``
with one folder per class, plus ``train.txt`` and ``val.txt`` lists. The same
seed always makes the same files.
"""

import json
import math
import os

import numpy

SHAPES = ('circle', 'square', 'triangle', 'cross', 'ring')
COLOURS = {'warm': [(230, 60, 40), (240, 160, 30), (220, 40, 140)],
           'cool': [(40, 90, 230), (30, 180, 120), (120, 60, 220)]}
CLASSES = tuple('{}_{}'.format(s, c) for s in SHAPES for c in COLOURS)
_VERSION = 2    # bump when the pictures change, so old caches are remade


def _background(rng, w, h):
    kind = rng.randint(3)
    base = rng.randint(0, 256, 3).astype(numpy.float32)
    other = rng.randint(0, 256, 3).astype(numpy.float32)
    if kind == 0:       # linear gradient
        t = numpy.linspace(0, 1, w if rng.randint(2) else h, dtype=numpy.float32)
        t = t[None, :, None] if t.size == w else t[:, None, None]
        img = base * (1 - t) + other * t
        img = numpy.broadcast_to(img, (h, w, 3))
    elif kind == 1:     # stripes
        period = rng.randint(6, 30)
        yy, xx = numpy.mgrid[0:h, 0:w]
        angle = rng.uniform(0, math.pi)
        phase = ((xx * math.cos(angle) + yy * math.sin(angle)) // period) % 2
        img = numpy.where(phase[..., None] > 0, base, other)
    else:               # smooth noise
        small = rng.randint(0, 256, (max(2, h // 16), max(2, w // 16), 3)).astype(numpy.uint8)
        from PIL import Image
        img = numpy.asarray(Image.fromarray(small).resize((w, h), Image.BILINEAR),
                            numpy.float32)
    # Muted: mostly grey, so the shape's colour family stands out.
    grey = img.mean(axis=-1, keepdims=True)
    img = 0.3 * img + 0.7 * grey
    noise = rng.normal(0, rng.uniform(2, 12), (h, w, 3))
    return numpy.clip(img + noise, 0, 255).astype(numpy.uint8)


def _draw(image, rng, shape, colour):
    from PIL import ImageDraw
    w, h = image.size
    r = rng.uniform(0.18, 0.32) * min(w, h)
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    draw = ImageDraw.Draw(image)
    fill = tuple(int(numpy.clip(c + rng.randint(-25, 26), 0, 255)) for c in colour)
    turn = rng.uniform(0, 2 * math.pi)

    def polygon(points):
        return [(cx + r * math.cos(turn + a) * s, cy + r * math.sin(turn + a) * s)
                for a, s in points]
    if shape == 'circle':
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == 'ring':
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fill, width=max(2, int(r / 3)))
    elif shape == 'square':
        draw.polygon(polygon([(a * math.pi / 2 + math.pi / 4, 1.0) for a in range(4)]), fill=fill)
    elif shape == 'triangle':
        draw.polygon(polygon([(a * 2 * math.pi / 3, 1.0) for a in range(3)]), fill=fill)
    elif shape == 'cross':
        arm = 0.35
        pts = []
        for k in range(4):
            base = k * math.pi / 2
            pts += [(base - math.atan(arm), math.hypot(1, arm)),
                    (base + math.atan(arm), math.hypot(1, arm)),
                    (base + math.pi / 4, arm * math.sqrt(2))]
        draw.polygon(polygon(pts), fill=fill)


def make_image(rng, label, size):
    """One RGB Pillow image of class ``label``, ``size`` = (width, height)."""
    from PIL import Image
    shape, family = CLASSES[label].split('_')
    colours = COLOURS[family]
    image = Image.fromarray(_background(rng, *size))
    _draw(image, rng, shape, colours[rng.randint(len(colours))])
    return image


def make_demo_dataset(root, n_train=100, n_val=20, size=(96, 160), seed=0,
                      classes=len(CLASSES)):
    """Write the dataset under ``root`` (skipped if already there, same args).

    Args:
        n_train, n_val (int): images per class in each split.
        size (tuple): (min, max) of each side in pixels; each image draws
            its width and height from this range.
        classes (int): how many of :data:`CLASSES` to use.

    Returns:
        dict: paths of ``train.txt``, ``val.txt`` and the class names.
    """
    spec = {'version': _VERSION, 'n_train': n_train, 'n_val': n_val,
            'size': list(size), 'seed': seed, 'classes': classes}
    stamp = os.path.join(root, 'dataset.json')
    out = {'root': root, 'train': os.path.join(root, 'train.txt'),
           'val': os.path.join(root, 'val.txt'), 'classes': list(CLASSES[:classes])}
    try:
        with open(stamp) as f:
            if json.load(f) == spec:
                return out
    except (OSError, ValueError):
        pass                # none yet, or one cut off: made again
    # The stamp goes first and comes back last, and each file is written under
    # a temporary name and renamed: a run stopped part way leaves no stamp (the
    # next run makes the set again, not a mix of two), and a run reading the
    # set while another makes it never meets a half-written file.
    if os.path.exists(stamp):
        os.remove(stamp)
    for split, per_class, offset in (('train', n_train, 0), ('val', n_val, 1)):
        lines = []
        for label in range(classes):
            folder = os.path.join(root, split, CLASSES[label])
            os.makedirs(folder, exist_ok=True)
            rng = numpy.random.RandomState([seed, offset, label])
            for k in range(per_class):
                w, h = rng.randint(size[0], size[1] + 1, 2)
                image = make_image(rng, label, (int(w), int(h)))
                name = '{:05d}.jpg'.format(k)
                path = os.path.join(folder, name)
                part = '{}.{}.part'.format(path, os.getpid())  # two jobs: a name each
                image.save(part, format='JPEG', quality=int(rng.randint(75, 96)))
                os.replace(part, path)
                lines.append('{}/{}/{} {}'.format(split, CLASSES[label], name, label))
        _write(out[split], '\n'.join(lines) + '\n')
    _write(stamp, json.dumps(spec))
    return out


def _write(path, text):
    part = '{}.{}.part'.format(path, os.getpid())
    with open(part, 'w') as f:
        f.write(text)
    os.replace(part, path)
