"""Image datasets on real files: the ImageNet list format and folder-per-class.

Images are opened lazily with Pillow, so a transform can ask for reduced-size
JPEG decoding (``Image.draft``) before any pixel is decoded, and come out as
uint8 CHW arrays. A JPEG decoded at full size goes through simplejpeg
(libjpeg-turbo straight into a NumPy array): measured by
benchmarks/loader.py at 1.5x Pillow's full decode on ImageNet-sized files,
with identical pixels (checked on 60 files, colour and grey); anything it
cannot decode falls back to Pillow, which names the problem. Normalisation
to float belongs on the device, after the copy (``fastchain.data.Normalize``).
"""

import io
import os
import re

import numpy

try:
    import simplejpeg as _simplejpeg
except ImportError:         # optional: Pillow decodes everything on its own
    _simplejpeg = None

import chainer

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.ppm', '.bmp', '.webp')


class ImageDecodeError(Exception):
    """A file could not be read or decoded as an image.

    Attributes:
        path (str): the file.
        index (int): the example's index in its dataset.
    """

    def __init__(self, path, index, reason):
        self.path = path
        self.index = index
        self.reason = reason
        super().__init__('example {} ({}): {}'.format(index, path, reason))

    def __reduce__(self):       # crosses process boundaries intact
        return (ImageDecodeError, (self.path, self.index, self.reason))


def open_image(path, index=None):
    """Open ``path`` as a not-yet-decoded Pillow image (the header is read).

    The file's bytes ride along on the image (set here, read by
    :func:`to_hwc` only), for the fast full-size JPEG decode.

    Raises:
        ImageDecodeError: missing, unreadable or not an image.
    """
    from PIL import Image
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except OSError as e:
        raise ImageDecodeError(path, index, '{}: {}'.format(
            type(e).__name__, e.strerror or e)) from None
    if not data:
        raise ImageDecodeError(path, index, 'an empty file (0 bytes): rewrite or remove '
                               'it, or leave such files out (the iterator\'s on_error=\'skip\', the '
                               'recipe\'s --skip-bad-images)')
    try:
        image = Image.open(io.BytesIO(data))
    except Exception as e:
        # Pillow names the buffer it read ("<_io.BytesIO object at 0x...>"): the
        # path is named already
        text = re.sub(r'\s*<_io\.BytesIO object at 0x[0-9a-f]+>', '', str(e))
        raise ImageDecodeError(path, index, 'not an image ({}: {}): {} bytes that no image '
                               'format Pillow reads begins with'.format(
                                   type(e).__name__, text, len(data))) from None
    image.fastchain_data = data
    return image


# The Pillow mode a JPEG decodes to, by the colour space in its header: the
# ones simplejpeg gives Pillow's pixels for (Pillow's CMYK conversion differs
# by a level or so).
_FAST_MODES = {'YCbCr': 'RGB', 'RGB': 'RGB', 'Gray': 'L'}


def _fast_decode(image):
    """simplejpeg's full-size RGB decode of ``image``, or ``None`` where Pillow
    must decode: not an opened JPEG, or one that will not decode as its file
    says (``Image.draft`` has reduced its size or changed its mode), or one
    that simplejpeg cannot read (Pillow then names the problem)."""
    data = getattr(image, 'fastchain_data', None)
    if _simplejpeg is None or data is None or image.format != 'JPEG':
        return None
    try:
        height, width, colourspace, _ = _simplejpeg.decode_jpeg_header(data)
        if image.size != (width, height) or image.mode != _FAST_MODES.get(colourspace):
            return None
        return _simplejpeg.decode_jpeg(data, colorspace='RGB')
    except Exception:
        return None         # truncated, corrupt, ...


def to_hwc(image, path=None, index=None):
    """Decode a Pillow image to a uint8 HWC RGB array."""
    array = _fast_decode(image)
    if array is not None:
        return array
    try:
        if image.mode != 'RGB':
            image = image.convert('RGB')
        return numpy.asarray(image)
    except Exception as e:      # truncated or corrupt data shows up here
        raise ImageDecodeError(path, index, 'cannot decode ({}: {})'.format(
            type(e).__name__, e)) from None


def to_chw(image, path=None, index=None):
    """Decode a Pillow image to a contiguous uint8 CHW RGB array."""
    return numpy.ascontiguousarray(to_hwc(image, path, index).transpose(2, 0, 1))


class _ImageDataset(chainer.dataset.DatasetMixin):
    """(uint8 CHW image, int32 label) pairs from ``(path, label)`` entries."""

    def __init__(self, entries, transform=None):
        self._entries = entries
        self.transform = transform

    def __len__(self):
        return len(self._entries)

    def path(self, i):
        return self._entries[i][0]

    def label(self, i):
        return self._entries[i][1]

    def get_example(self, i):
        path, label = self._entries[i]
        image = open_image(path, i)
        try:
            if self.transform is None:
                array = to_chw(image, path, i)
            else:
                array = self.transform(image)
        except ImageDecodeError as e:
            raise ImageDecodeError(path, i, e.reason) from None
        except Exception as e:
            raise ImageDecodeError(path, i, 'cannot decode ({}: {})'.format(
                type(e).__name__, e)) from None
        return array, numpy.int32(label)


class ImageListDataset(_ImageDataset):
    """The list format of Chainer's ImageNet example.

    Args:
        list_path (str): a text file of ``relative/path label`` lines.
        root (str): the directory the paths are relative to (default: the
            list file's directory).
        transform (callable): ``PIL.Image (not yet decoded) -> uint8 CHW``;
            default: decode the whole image.
    """

    def __init__(self, list_path, root=None, transform=None):
        root = os.path.dirname(os.path.abspath(list_path)) if root is None else root
        entries = []
        with open(list_path) as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                parts = line.rsplit(None, 1)
                if len(parts) != 2 or not parts[1].lstrip('-').isdigit():
                    raise ValueError('{}:{}: expected "relative/path label", got {!r}'
                                     .format(list_path, lineno, line))
                if parts[1].startswith('-'):
                    raise ValueError('{}:{}: label {} is negative: labels are class indices '
                                     '0, 1, 2, ... (got {!r})'.format(list_path, lineno,
                                                                      parts[1], line))
                entries.append((os.path.join(root, parts[0]), int(parts[1])))
        if not entries:
            raise ValueError('{} lists no images: expected one "relative/path label" line '
                             'per image (paths relative to {})'.format(list_path, root))
        super().__init__(entries, transform)


class ImageFolderDataset(_ImageDataset):
    """One sub-directory per class; labels follow the sorted directory names.

    ``classes``: the class names of another split (``train.classes`` for the
    validation folder), so that labels agree: each sub-directory must be one
    of them, and a class may have no folder here. Without it, a validation
    folder lacking one class would shift every label after it.

    Attributes:
        classes (list of str): the class names, index = label.
    """

    def __init__(self, root, transform=None, extensions=IMAGE_EXTENSIONS, classes=None):
        extensions = (extensions,) if isinstance(extensions, str) else tuple(extensions)
        if not os.path.isdir(root):
            raise FileNotFoundError('no such dataset directory: {}'.format(root))
        folders = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        if classes is not None:
            classes = list(classes)
            unknown = sorted(set(folders) - set(classes))
            if unknown:
                raise ValueError('{}: class folder(s) {} are not among the {} classes given '
                                 '(those of the training set: {}{}); labels would not agree. '
                                 'Rename or remove them, or add them to the training set'
                                 .format(root, ', '.join(unknown), len(classes),
                                         ', '.join(classes[:5]),
                                         ', ...' if len(classes) > 5 else ''))
        self.classes = folders if classes is None else classes
        self.missing = sorted(set(self.classes) - set(folders))    # classes with no folder
        if not folders:
            loose = sum(1 for f in os.listdir(root) if f.lower().endswith(extensions))
            raise ValueError('{} has no class sub-directories{}. {}'.format(
                root, ' (it holds {} image file(s) directly: move them into one '
                'sub-directory per class)'.format(loose) if loose else '',
                _folder_layout(root, extensions)))
        entries, empty = [], []
        for label, name in enumerate(self.classes):
            if name in self.missing:
                continue
            folder = os.path.join(root, name)
            others = set()
            for dirpath, _, files in sorted(os.walk(folder)):
                for f in sorted(files):
                    if f.lower().endswith(extensions):
                        entries.append((os.path.join(dirpath, f), label))
                    else:
                        others.add(os.path.splitext(f)[1] or f)
            if not entries or entries[-1][1] != label:
                empty.append('{} ({}{})'.format(name, folder, ': other files only: '
                                                + ', '.join(sorted(others)) if others else ''))
        if empty:
            # Labels follow the sorted folder names: a class with no examples
            # (a stray folder, a failed copy) would shift or lose labels silently.
            raise ValueError(
                '{}: {} of its {} class folders hold no images: {}. {}. Add images to '
                'the empty class folder(s) or remove them: every sub-directory of {} '
                'is a class.'.format(root, len(empty), len(folders),
                                     ', '.join(empty), _folder_layout(root, extensions),
                                     root))
        super().__init__(entries, transform)


def _folder_layout(root, extensions):
    return ("Expected one sub-directory per class, each holding that class's images "
            '(files ending in {}): {}'.format(
                ', '.join(extensions),
                os.path.join(root, '<class name>', '<image>' + extensions[0])))
