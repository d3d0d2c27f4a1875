"""Augmentation on the host, in uint8: crops, flips, resizes.

Each transform takes a Pillow image that has been opened but not decoded and
returns a uint8 CHW array. Randomness comes from ``numpy.random`` (the
iterator seeds it per example in each worker, so results do not depend on
which worker ran them). No floating-point arithmetic happens here: the mean
and standard deviation are applied on the device (:class:`Normalize`).
"""

import math

import numpy

from fastchain.data._images import to_chw, to_hwc


def _draft(image, width, height):
    """Let libjpeg decode at 1/2, 1/4 or 1/8 scale while the result stays at
    least ``width`` x ``height``. Returns the (x, y) scale factors applied."""
    if image.format != 'JPEG':
        return 1.0, 1.0
    full = image.size
    image.draft('RGB', (max(1, int(width)), max(1, int(height))))
    return image.size[0] / full[0], image.size[1] / full[1]


class RandomCrop:
    """The GTC talk's training preprocessing: a random ``size`` crop of the
    decoded image (resized up first if it is smaller), then a random
    horizontal flip."""

    def __init__(self, size, flip=True):
        self.size = size
        self.flip = flip

    def __call__(self, image):
        s = self.size
        w, h = image.size
        if w < s or h < s:
            f = s / min(w, h)
            image = image.convert('RGB').resize(   # (a new image: decoded by Pillow)
                (max(s, math.ceil(w * f)), max(s, math.ceil(h * f))))
        array = to_hwc(image)
        h, w, _ = array.shape
        top = numpy.random.randint(0, h - s + 1)
        left = numpy.random.randint(0, w - s + 1)
        out = array[top:top + s, left:left + s]
        if self.flip and numpy.random.randint(2):
            out = out[:, ::-1]
        # Crop first, then one copy into CHW order.
        return numpy.ascontiguousarray(out.transpose(2, 0, 1))


class RandomResizedCrop:
    """Inception-style crop: a random box of ``scale`` of the area and
    ``ratio`` aspect, resized to ``size`` x ``size``, plus a random flip.

    The box is chosen from the JPEG header alone, so libjpeg can decode at
    the smallest DCT scale that still covers the box at ``size`` pixels.
    """

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip=True):
        self.size = size
        self.scale = scale
        self.ratio = ratio
        self.flip = flip

    def _box(self, w, h):
        area = w * h
        for _ in range(10):
            target = area * numpy.random.uniform(*self.scale)
            aspect = math.exp(numpy.random.uniform(*map(math.log, self.ratio)))
            bw = int(round(math.sqrt(target * aspect)))
            bh = int(round(math.sqrt(target / aspect)))
            if 0 < bw <= w and 0 < bh <= h:
                return (numpy.random.randint(0, w - bw + 1),
                        numpy.random.randint(0, h - bh + 1), bw, bh)
        side = min(w, h)        # fall back to the central square
        return (w - side) // 2, (h - side) // 2, side, side

    def __call__(self, image):
        from PIL import Image
        w, h = image.size
        x, y, bw, bh = self._box(w, h)
        # Decode just large enough for the box to keep `size` pixels.
        fx, fy = _draft(image, w * self.size / bw, h * self.size / bh)
        dw, dh = image.size     # the decoded size (rounded up by libjpeg)
        box = (x * fx, y * fy, min(dw, (x + bw) * fx), min(dh, (y + bh) * fy))
        image = image.convert('RGB').resize((self.size, self.size),
                                            Image.BILINEAR, box=box)
        array = to_chw(image)
        if self.flip and numpy.random.randint(2):
            array = array[:, :, ::-1]
        return numpy.ascontiguousarray(array)


class CenterCrop:
    """Evaluation: resize the shorter side to ``resize``, crop the centre."""

    def __init__(self, size, resize=None):
        self.size = size
        self.resize = resize if resize is not None else int(round(size / 0.875))

    def __call__(self, image):
        from PIL import Image
        w, h = image.size
        f = self.resize / min(w, h)
        _draft(image, w * f, h * f)
        dw, dh = image.size          # after draft
        f = self.resize / min(dw, dh)
        image = image.convert('RGB').resize(
            (max(self.size, round(dw * f)), max(self.size, round(dh * f))),
            Image.BILINEAR)
        array = to_chw(image)
        _, h, w = array.shape
        top, left = (h - self.size) // 2, (w - self.size) // 2
        return numpy.ascontiguousarray(
            array[:, top:top + self.size, left:left + self.size])


class Normalize:
    """uint8 CHW batch -> ``(x - mean) / std`` in ``dtype``, on its device.

    Run after the host-to-device copy, so a uint8 batch crosses the bus
    (4x fewer bytes than fp32) and the arithmetic runs where it is cheap.
    ``mean`` and ``std`` are per channel, in 0-255 units.
    """

    def __init__(self, mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375)):
        self.mean = numpy.asarray(mean, numpy.float32).reshape(1, -1, 1, 1)
        self.scale = (1.0 / numpy.asarray(std, numpy.float32)).reshape(1, -1, 1, 1)
        self._on_device = {}

    def __call__(self, x, dtype=None):
        import chainer
        from chainer import backend
        dtype = chainer.get_dtype() if dtype is None else dtype
        xp = backend.get_array_module(x)
        key = (id(xp), getattr(getattr(x, 'device', None), 'id', None))
        if key not in self._on_device:
            self._on_device[key] = (xp.asarray(self.mean), xp.asarray(self.scale))
        mean, scale = self._on_device[key]
        # In place, in fp32: one pass to subtract-and-convert, one to scale
        # (4x faster than the expression form on the CPU, measured).
        out = xp.empty(x.shape, numpy.float32)
        xp.subtract(x, mean, out=out, dtype=numpy.float32)
        out *= scale
        return out.astype(dtype, copy=False)
