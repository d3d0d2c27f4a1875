"""How fast each input pipeline feeds training, against the decode limit.

One generated set of real JPEG files at ImageNet-like sizes; every variant
produces the same thing, a training batch of 224x224 random crops with random
flips, normalised, as float32 arrays ready for the model:

  chainer_serial        LabeledImageDataset + PIL + SerialIterator, fp32
                        preprocessing (the GTC talk's starting point)
  chainer_multiprocess  the same dataset through Chainer's MultiprocessIterator
                        with one process per core (the talk's rung 5)
  fastchain             ImageListDataset + uint8 RandomCrop + fastchain's
                        MultiprocessIterator + normalisation after the copy
                        (here the "device" is this CPU, so it costs host time)
  fastchain_uint8       the same, stopping at the uint8 batch that crosses to
                        the device (what the host pays when a GPU normalises)
  torch                 PyTorch DataLoader with PIL, one worker per core (when
                        torch is installed)
  limit                 decode only (full size, with the decoder fastchain uses:
                        simplejpeg, measured faster than Pillow below) of the
                        same files by one process per core: what the cores can
                        do at best

Each variant is built, warmed up (workers started, first batches), then
timed for one window; variants take turns window by window, in the reverse
order every other window.
"""

import multiprocessing
import os
import statistics
import sys
import time

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from _images import list_pairs, random_crop_flip, torch_dataset  # noqa: E402

MEAN = numpy.array([123.675, 116.28, 103.53], numpy.float32)[:, None, None]
STD = numpy.array([58.395, 57.12, 57.375], numpy.float32)[:, None, None]
CROP = 224


def dataset_dir(n_images):
    from fastchain.data import make_demo_dataset
    root = os.path.join(_common.HERE, '.cache', 'loader-jpegs-{}'.format(n_images))
    # ImageNet-like sizes: sides from 300 to 640 pixels (ImageNet's median
    # image is about 500x375).
    classes = 10
    return make_demo_dataset(root, n_train=n_images // classes, n_val=0,
                             size=(300, 640), seed=2018, classes=classes)


# --- (a)/(b): Chainer's ImageNet example style ------------------------------

class _ChainerPreprocessed:
    """The talk's preprocessing on Chainer's LabeledImageDataset, in fp32."""

    def __init__(self, pairs, root):
        import chainer
        self.base = chainer.datasets.LabeledImageDataset(pairs, root)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        image, label = self.base[i]       # float32 CHW, via PIL
        return (random_crop_flip(image, CROP) - MEAN) / STD, label


def chainer_variant(kind, paths, batch, workers):
    import chainer
    from chainer.dataset import concat_examples
    ds = _ChainerPreprocessed(list_pairs(paths), paths['root'])
    if kind == 'serial':
        it = chainer.iterators.SerialIterator(ds, batch)
    else:
        it = chainer.iterators.MultiprocessIterator(ds, batch, n_processes=workers)
    return (lambda: concat_examples(it.next())), it.finalize


# --- (c): fastchain ------------------------------------------------------------

def fastchain_variant(paths, batch, workers, normalize=True):
    """normalize=False: stop at the uint8 batch handed to the device (on a
    GPU the normalisation then runs there, costing the host nothing)."""
    from fastchain import data
    ds = data.ImageListDataset(paths['train'], paths['root'],
                               transform=data.RandomCrop(CROP))
    it = data.MultiprocessIterator(ds, batch, n_workers=workers)
    norm = data.Normalize(MEAN.ravel(), STD.ravel()) if normalize else (lambda x: x)
    convert = data.ImageConverter(norm)
    return (lambda: convert(it.next())), it.finalize


# --- (d): PyTorch ---------------------------------------------------------------

def torch_variant(paths, batch, workers):
    import torch
    loader = torch.utils.data.DataLoader(torch_dataset(paths, CROP, MEAN, 1.0 / STD), batch_size=batch, shuffle=True,
                                         num_workers=workers, persistent_workers=True,
                                         drop_last=True)
    state = {'it': iter(loader)}

    def step():
        try:
            return next(state['it'])
        except StopIteration:
            state['it'] = iter(loader)
            return next(state['it'])
    return step, lambda: None


# --- (e): the decode limit ----------------------------------------------------

def _decode(path):
    # fastchain's decoder: simplejpeg for full-size JPEGs (see decoder_rates).
    from fastchain.data._images import open_image, to_hwc
    return to_hwc(open_image(path)).shape


def _decode_for(task):
    """One worker decoding ``files`` in turn, from ``offset``, between the
    wall-clock times ``start`` and ``end``: (images, seconds)."""
    files, offset, start, end = task
    while time.time() < start:
        time.sleep(0.001)
    done, i = 0, offset
    while time.time() < end:
        _decode(files[i % len(files)])
        done, i = done + 1, i + 1
    return done, time.time() - start


def limit_rate(files, workers, seconds):
    """Images/s of full-size decodes with the decoder fastchain uses, one
    process per core, each decoding without a pause for ``seconds`` (it was
    whole ``pool.map`` passes over the files, each ending in a wait for the
    slowest worker: on 16 cores the loader beat that "limit", 1.09x)."""
    ctx = multiprocessing.get_context('fork')
    with ctx.Pool(workers) as pool:
        pool.map(_decode, files[:workers * 4])      # warm up
        start = time.time() + 0.2                   # every worker started by then
        tasks = [(files, k * len(files) // workers, start, start + seconds)
                 for k in range(workers)]
        return sum(n / s for n, s in pool.map(_decode_for, tasks, chunksize=1))


def decoder_rates(files, n=60, passes=5):
    """Single-process decoders on the same files, images/s: the median of
    ``passes`` alternated passes (after one untimed) and the spread (why
    simplejpeg decodes full-size JPEGs and Pillow's draft the resized ones)."""
    from PIL import Image
    rates = {}

    def pil_full(p):
        return numpy.asarray(Image.open(p).convert('RGB'))

    def pil_draft_half(p):
        im = Image.open(p)
        im.draft('RGB', (im.size[0] // 2, im.size[1] // 2))
        return numpy.asarray(im.convert('RGB'))
    decoders = {'pillow': pil_full, 'pillow_draft_1/2': pil_draft_half}
    try:
        import simplejpeg

        def sj(p):
            with open(p, 'rb') as f:
                return simplejpeg.decode_jpeg(f.read(), colorspace='RGB')
        decoders['simplejpeg'] = sj
    except ImportError:
        pass
    sample = files[:n]
    for i in range(passes + 1):     # alternated, the first pass untimed (warm-up)
        for name, fn in decoders.items():
            start = time.perf_counter()
            for p in sample:
                fn(p)
            if i:
                rates.setdefault(name, []).append(len(sample) / (time.perf_counter() - start))
    return {name: {'median': round(statistics.median(r), 1),
                   'spread': [round(min(r), 1), round(max(r), 1)], 'passes': passes}
            for name, r in rates.items()}


def main(argv=None):
    p = _common.parser('loader', __doc__)
    p.add_argument('--images', type=int, default=None, help='JPEG files in the set')
    p.add_argument('--batch', type=int, default=32)
    p.add_argument('--workers', type=int, default=None,
                   help='processes for every parallel variant (default: the cores)')
    args = p.parse_args(argv)
    from fastchain.data import available_cores
    workers = args.workers or available_cores()
    n_images = args.images or (250 if args.quick else 1000)
    windows = args.windows or (4 if args.quick else 7)
    # A window is timed for at least this long (whole batches): at ~2,000
    # images/s, the 8 batches a quick window used to be took 0.13 s, and the
    # float path's median over such windows swung from 0.29 to 0.39 of the
    # limit while a longer, isolated run gave 0.9 (DEVELOPERS.md).
    window_seconds = 1.5 if args.quick else 3.0
    warmup_batches = 3 if args.quick else 6
    paths = dataset_dir(n_images)
    files = [os.path.join(paths['root'], l.split()[0])
             for l in open(paths['train']).read().split('\n') if l]

    builders = {
        'chainer_serial': lambda: chainer_variant('serial', paths, args.batch, workers),
        'chainer_multiprocess': lambda: chainer_variant('multiprocess', paths,
                                                        args.batch, workers),
        'fastchain': lambda: fastchain_variant(paths, args.batch, workers),
        'fastchain_uint8': lambda: fastchain_variant(paths, args.batch, workers,
                                                     normalize=False),
    }
    rows = _common.Rows('images/s')
    try:
        import torch    # noqa: F401
        builders['torch'] = lambda: torch_variant(paths, args.batch, workers)
        torch.set_num_threads(1)
    except ImportError:
        rows.skip('torch', 'PyTorch is not installed (pip install torch)')

    startup = {}
    for w in range(windows):
        # the order reversed every other window, as the other benchmarks do
        for name in (list(builders) + ['limit'])[::1 if w % 2 == 0 else -1]:
            if name == 'limit':
                rows.add('limit', limit_rate(files, workers, window_seconds))
                continue
            build = builders[name]
            t0 = time.perf_counter()
            step, close = build()
            try:
                for _ in range(warmup_batches):
                    step()
                startup.setdefault(name, round(time.perf_counter() - t0, 3))
                batches, start = 0, time.perf_counter()
                while time.perf_counter() - start < window_seconds:
                    step()
                    batches += 1
                seconds = time.perf_counter() - start
            finally:
                close()
            rows.add(name, batches * args.batch / seconds)
        print('window {}/{}: '.format(w + 1, windows) + ', '.join(
            '{} {:.0f}'.format(n, v[-1]) for n, v in rows.windows.items()), flush=True)

    ratios = {'fastchain/limit': rows.ratio('fastchain', 'limit')}
    for other in ('chainer_serial', 'chainer_multiprocess', 'torch'):
        ratios['fastchain/' + other] = rows.ratio('fastchain', other)
    for name in builders:
        ratios[name + '/limit'] = rows.ratio(name, 'limit')
    config = {'images': n_images, 'image_sides_px': [300, 640], 'batch': args.batch,
              'crop': CROP, 'workers': workers, 'windows': windows,
              'window_seconds': window_seconds, 'warmup_batches': warmup_batches,
              'startup_seconds_first_window': startup,
              'decoders_single_process_images_per_s': decoder_rates(files)}
    notes = ['Every variant but fastchain_uint8 outputs normalised float32 224x224 '
             'crops with flips; fastchain_uint8 stops at the uint8 batch a GPU would '
             'normalise. The limit decodes each file at full size and '
             'nothing else, in one process per core, each decoding without a pause for the '
             'window, with the fastest decoder measured '
             '(decoders_single_process_images_per_s in the config).']
    _common.write('loader', args, config, rows, ratios, notes)


if __name__ == '__main__':
    main()
