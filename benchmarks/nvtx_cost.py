"""What fastchain's NVTX annotations cost with no profiler attached.

The ResNet-50 recipe's training step (model, optimizer, StandardUpdater,
converter) on in-memory data, built three ways in one process: plain,
under ``enable(nvtx=True)`` and under ``enable(nvtx='links')`` (a range per
link and per function's backward as well). The updaters take turns window by
window; each row is iterations per second. The ratio ``annotated/plain`` is
the speed with annotations over the speed without (1.0 = free).
"""

import os
import sys
import time
import warnings

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def make_updater(size, batch, depth, width):
    import chainer
    import chainer.links as L
    from chainer import training
    from fastchain.models import ResNet
    rng = numpy.random.RandomState(0)
    x = rng.randn(batch * 4, 3, size, size).astype(numpy.float32)
    t = rng.randint(0, 10, batch * 4).astype(numpy.int32)
    model = L.Classifier(ResNet(depth, 10, width=width))
    optimizer = chainer.optimizers.MomentumSGD(0.01).setup(model)
    it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), batch)
    return training.StandardUpdater(it, optimizer)


def main(argv=None):
    p = _common.parser('nvtx_cost', __doc__)
    p.add_argument('--size', type=int, default=None, help='input side in pixels')
    p.add_argument('--batch', type=int, default=8)
    args = p.parse_args(argv)
    import fastchain
    from fastchain.backends import nvtx as nvtx_backend
    if nvtx_backend.profiler_attached():
        raise SystemExit('a profiler is attached (NVTX_INJECTION64_PATH is set): this '
                         'benchmark measures the cost without one')
    size = args.size or (32 if args.quick else 64)
    windows = args.windows or (5 if args.quick else 9)
    per_window = 4 if args.quick else 8
    depth, width = 50, 64

    updaters = {'plain': make_updater(size, args.batch, depth, width)}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')     # "no NVTX tool attached"
        for name, mode in (('annotated', True), ('annotated_links', 'links')):
            with fastchain.enable(nvtx=mode, loader_workers=0, autotune=False):
                updaters[name] = make_updater(size, args.batch, depth, width)
    for updater in updaters.values():       # warm-up: first calls, allocations
        for _ in range(2):
            updater.update()

    rows = _common.Rows('iterations/s')
    for w in range(windows):
        for name, updater in updaters.items():
            start = time.perf_counter()
            for _ in range(per_window):
                updater.update()
            rows.add(name, per_window / (time.perf_counter() - start))
        print('window {}/{}: '.format(w + 1, windows) + ', '.join(
            '{} {:.3f}'.format(n, v[-1]) for n, v in rows.windows.items()), flush=True)
    ratios = {'annotated/plain': rows.ratio('annotated', 'plain'),
              'annotated_links/plain': rows.ratio('annotated_links', 'plain')}
    config = {'model': 'ResNet-{} (width {})'.format(depth, width), 'input': size,
              'batch': args.batch, 'windows': windows, 'iterations_per_window': per_window,
              'profiler_attached': False}
    notes = ['Target: annotated/plain >= 0.99 (annotations cost at most 1% of a step).']
    _common.write('nvtx_cost', args, config, rows, ratios, notes)


if __name__ == '__main__':
    main()
