"""The two dataset formats, decoding, and the transforms, on real JPEGs."""

import os

import numpy
import pytest

from fastchain import data


def test_list_and_folder_formats_agree(image_root):
    by_list = data.ImageListDataset(os.path.join(image_root, 'train.txt'))
    by_folder = data.ImageFolderDataset(image_root)
    assert len(by_list) == len(by_folder) == 18
    assert by_folder.classes == ['class0', 'class1', 'class2']
    for i in range(len(by_list)):
        (a, la), (b, lb) = by_list[i], by_folder[i]
        assert a.dtype == numpy.uint8 and a.ndim == 3 and a.shape[0] == 3
        assert la == lb and la.dtype == numpy.int32
        numpy.testing.assert_array_equal(a, b)
        assert by_list.path(i) == by_folder.path(i)


def test_list_format_with_explicit_root_and_a_bad_line(image_root, tmp_path):
    listing = tmp_path / 'list.txt'
    listing.write_text('class1/img000.jpg 1\n\nclass2/img001.jpg 2\n')
    d = data.ImageListDataset(str(listing), root=image_root)
    assert [int(d[i][1]) for i in range(len(d))] == [1, 2]
    listing.write_text('class1/img000.jpg one\n')
    with pytest.raises(ValueError, match=r'list.txt:1: expected "relative/path label"'):
        data.ImageListDataset(str(listing), root=image_root)
    # -1 trained as Chainer's ignore_label without a word, -3 failed deep in
    # softmax_cross_entropy
    listing.write_text('class1/img000.jpg 0\nclass2/img001.jpg -3\n')
    with pytest.raises(ValueError, match=r'list.txt:2: label -3 is negative'):
        data.ImageListDataset(str(listing), root=image_root)


def test_folder_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        data.ImageFolderDataset(str(tmp_path / 'nope'))
    with pytest.raises(ValueError, match='no class sub-directories'):
        data.ImageFolderDataset(str(tmp_path))


def _jpeg(path):
    from PIL import Image
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(numpy.zeros((8, 8, 3), numpy.uint8)).save(path)


def test_an_empty_class_folder_is_named_with_the_layout(tmp_path):
    root = str(tmp_path)
    _jpeg(os.path.join(root, 'cat', 'a.jpg'))
    os.makedirs(os.path.join(root, 'dog'))
    os.makedirs(os.path.join(root, 'eel'))
    (tmp_path / 'eel' / 'readme.txt').write_text('no pictures here')
    with pytest.raises(ValueError) as e:
        data.ImageFolderDataset(root)
    message = str(e.value)
    assert message.startswith(root)
    assert '2 of its 3 class folders hold no images' in message
    assert 'dog ({})'.format(os.path.join(root, 'dog')) in message
    assert 'eel ({}: other files only: .txt)'.format(os.path.join(root, 'eel')) in message
    assert 'cat (' not in message
    assert os.path.join(root, '<class name>', '<image>.jpg') in message
    _jpeg(os.path.join(root, 'dog', 'b.png'))
    _jpeg(os.path.join(root, 'eel', 'deeper', 'c.jpeg'))
    d = data.ImageFolderDataset(root)
    assert d.classes == ['cat', 'dog', 'eel'] and [int(d[i][1]) for i in range(3)] == [0, 1, 2]


def test_a_validation_folder_takes_the_training_sets_classes(tmp_path):
    """val/ lacking a class keeps every other label; a class train/ does not
    have is refused (labels would not agree)."""
    train, val = str(tmp_path / 'train'), str(tmp_path / 'val')
    for name in ('cat', 'dog', 'eel'):
        _jpeg(os.path.join(train, name, 'a.jpg'))
    for name in ('cat', 'eel'):
        _jpeg(os.path.join(val, name, 'a.jpg'))
    t = data.ImageFolderDataset(train)
    assert [int(data.ImageFolderDataset(val)[i][1]) for i in range(2)] == [0, 1]  # shifted
    v = data.ImageFolderDataset(val, classes=t.classes)
    assert v.classes == t.classes and v.missing == ['dog']
    assert [int(v[i][1]) for i in range(2)] == [0, 2]
    _jpeg(os.path.join(val, 'fox', 'a.jpg'))
    with pytest.raises(ValueError, match=r"val: class folder\(s\) fox are not among the 3 "
                       r"classes given \(those of the training set: cat, dog, eel\)"):
        data.ImageFolderDataset(val, classes=t.classes)


def test_a_folder_with_no_images_at_all_names_every_class_folder(tmp_path):
    root = str(tmp_path)
    for name in ('a', 'b'):
        os.makedirs(os.path.join(root, name))
    with pytest.raises(ValueError) as e:
        data.ImageFolderDataset(root, extensions='.png')
    message = str(e.value)
    assert '2 of its 2 class folders hold no images' in message
    for name in ('a', 'b'):
        assert os.path.join(root, name) in message
    assert '(files ending in .png)' in message     # a single extension, as given


def test_images_without_class_folders_say_where_to_put_them(tmp_path):
    root = str(tmp_path)
    for k in range(3):
        _jpeg(os.path.join(root, 'img{}.jpg'.format(k)))
    with pytest.raises(ValueError, match='no class sub-directories') as e:
        data.ImageFolderDataset(root)
    message = str(e.value)
    assert root in message and 'holds 3 image file(s) directly' in message
    assert os.path.join(root, '<class name>', '<image>.jpg') in message


def test_an_empty_list_names_the_list_file(tmp_path):
    listing = tmp_path / 'train.txt'
    listing.write_text('\n\n')
    with pytest.raises(ValueError) as e:
        data.ImageListDataset(str(listing))
    assert str(listing) in str(e.value)
    assert 'lists no images' in str(e.value) and '"relative/path label"' in str(e.value)


@pytest.mark.parametrize('name,reason', [
    ('corrupt.jpg', 'cannot decode|not an image'),
    ('truncated.jpg', 'cannot decode'),
    ('missing.jpg', 'FileNotFoundError'),
    ('notes.jpg', 'not an image'),
])
def test_each_bad_file_names_itself(bad_root, name, reason):
    d = data.ImageListDataset(os.path.join(bad_root, 'bad.txt'))
    i = [os.path.basename(d.path(k)) for k in range(len(d))].index(name)
    with pytest.raises(data.ImageDecodeError, match=reason) as e:
        d[i]
    assert e.value.index == i and e.value.path.endswith(name)
    assert 'example {}'.format(i) in str(e.value) and name in str(e.value)


def test_an_empty_file_is_named_empty_and_no_buffer_address_is_shown(tmp_path):
    (tmp_path / 'empty.jpg').write_bytes(b'')
    (tmp_path / 'notes.jpg').write_text('these are not pixels\n')
    (tmp_path / 'list.txt').write_text('empty.jpg 0\nnotes.jpg 1\n')
    d = data.ImageListDataset(str(tmp_path / 'list.txt'), root=str(tmp_path))
    with pytest.raises(data.ImageDecodeError, match=r'an empty file \(0 bytes\): rewrite'):
        d[0]
    with pytest.raises(data.ImageDecodeError, match='21 bytes that no image format') as e:
        d[1]
    assert 'BytesIO' not in str(e.value) and '0x' not in str(e.value)


def test_transforms_make_uint8_chw_of_the_requested_size(image_root):
    d = data.ImageListDataset(os.path.join(image_root, 'train.txt'))
    for transform, shape in [(data.RandomCrop(32), (3, 32, 32)),
                             (data.RandomCrop(120), (3, 120, 120)),   # upsized first
                             (data.RandomResizedCrop(48), (3, 48, 48)),
                             (data.CenterCrop(32), (3, 32, 32))]:
        d.transform = transform
        for i in range(0, len(d), 5):
            x, _ = d[i]
            assert x.shape == shape and x.dtype == numpy.uint8 and x.flags.c_contiguous


def test_random_crop_is_a_crop_and_flip_is_a_flip(image_root):
    d = data.ImageListDataset(os.path.join(image_root, 'train.txt'))
    full, _ = d[0]
    d.transform = data.RandomCrop(24, flip=False)
    numpy.random.seed(3)
    crop, _ = d[0]
    found = [(t, l) for t in range(full.shape[1] - 23) for l in range(full.shape[2] - 23)
             if (full[:, t:t + 24, l:l + 24] == crop).all()]
    assert found
    d.transform = data.RandomCrop(24, flip=True)
    seen = set()
    for seed in range(8):
        numpy.random.seed(seed)
        x, _ = d[0]
        t, l = None, None
        for (t, l) in [(a, b) for a in range(full.shape[1] - 23)
                       for b in range(full.shape[2] - 23)]:
            window = full[:, t:t + 24, l:l + 24]
            if (window == x).all():
                seen.add('plain')
                break
            if (window[:, :, ::-1] == x).all():
                seen.add('flipped')
                break
    assert seen == {'plain', 'flipped'}


def test_reduced_size_decoding_is_used_for_large_jpegs(tmp_path):
    from PIL import Image
    path = str(tmp_path / 'big.jpg')
    Image.fromarray(numpy.full((800, 1000, 3), 128, numpy.uint8)).save(path)
    image = Image.open(path)
    data.CenterCrop(64, resize=73)(image)
    assert image.size[0] < 1000      # decoded at a DCT scale, not full size


def test_normalize_on_the_device_side():
    x = numpy.full((2, 3, 4, 4), 255, numpy.uint8)
    out = data.Normalize(mean=(0, 0, 0), std=(255, 255, 255))(x, numpy.float16)
    assert out.dtype == numpy.float16 and numpy.allclose(out, 1.0)


@pytest.mark.parametrize('mode', ['RGB', 'L', 'CMYK'])
def test_fast_jpeg_decode_gives_pillows_pixels(tmp_path, mode):
    # simplejpeg decodes full-size JPEGs; CMYK (which it cannot) falls back
    # to Pillow. Either way the pixels are Pillow's.
    from PIL import Image
    from fastchain.data import _images
    rng = numpy.random.RandomState(0)
    pixels = rng.randint(0, 256, (37, 53, 3), dtype=numpy.uint8)
    path = str(tmp_path / 'x.jpg')
    Image.fromarray(pixels).convert(mode).save(path, quality=85)
    expected = numpy.asarray(Image.open(path).convert('RGB'))
    got = _images.to_hwc(_images.open_image(path))
    assert got.shape == (37, 53, 3) and got.dtype == numpy.uint8
    numpy.testing.assert_array_equal(got, expected)


def test_simplejpeg_is_the_full_size_decoder(tmp_path, monkeypatch):
    from PIL import Image
    from fastchain.data import _images
    if _images._simplejpeg is None:
        pytest.skip('simplejpeg is not installed')
    calls = []
    real = _images._simplejpeg.decode_jpeg
    monkeypatch.setattr(_images._simplejpeg, 'decode_jpeg',
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    path = str(tmp_path / 'x.jpg')
    Image.fromarray(numpy.zeros((64, 64, 3), numpy.uint8)).save(path)
    _images.to_hwc(_images.open_image(path))
    assert calls == [1]
    data.CenterCrop(16, resize=20)(_images.open_image(path))     # reduced size: Pillow
    assert calls == [1]


@pytest.mark.parametrize('mode,scale', [('RGB', 4), ('L', 1)])
def test_a_drafted_jpeg_decodes_as_drafted(tmp_path, mode, scale):
    # Image.draft, called by any transform: the decoder goes by the image's
    # own size and mode (no marker from fastchain's transforms), so the
    # result is Pillow's reduced-size or grey decode.
    from PIL import Image
    from fastchain.data import _images
    pixels = numpy.random.RandomState(0).randint(0, 256, (64, 80, 3), dtype=numpy.uint8)
    path = str(tmp_path / 'x.jpg')
    Image.fromarray(pixels).save(path, quality=90)
    reference = Image.open(path)
    reference.draft(mode, (80 // scale, 64 // scale))
    image = _images.open_image(path)
    image.draft(mode, (80 // scale, 64 // scale))
    got = _images.to_hwc(image)
    assert got.shape == (64 // scale, 80 // scale, 3)
    numpy.testing.assert_array_equal(got, numpy.asarray(reference.convert('RGB')))
