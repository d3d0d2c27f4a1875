"""What fastchain's NVTX annotations cost with no profiler attached.

The ResNet-50 recipe's training step (model, optimizer, StandardUpdater,
converter) on in-memory data, built three times in one process: plain, under
``enable(nvtx=True)``, then plain again (the A/A control: how far two identical
updaters in one process run apart). The updaters take turns window by window
(in reverse order every other window); each row is
iterations per second; ``annotated/plain`` is the speed with annotations over
the speed without (1.0 = free). Because that difference is far below this
machine's noise, the cost is also counted: the annotator calls of one step
(also with ``nvtx='links'``: a range per link and per function's backward)
times the measured cost of one call.
"""

import os
import sys
import time
import warnings

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def make_updater(size, batch, depth, width, device):
    import chainer
    import chainer.links as L
    from chainer import training
    from fastchain.models import ResNet
    rng = numpy.random.RandomState(0)
    x = rng.randn(batch * 4, 3, size, size).astype(numpy.float32)
    t = rng.randint(0, 10, batch * 4).astype(numpy.int32)
    model = L.Classifier(ResNet(depth, 10, width=width))
    model.to_device(device)
    optimizer = chainer.optimizers.MomentumSGD(0.01).setup(model)
    it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), batch)
    return training.StandardUpdater(it, optimizer, device=device)


class _Counter:
    """Stands in for the timeline to count the annotator's calls in a step."""

    def __init__(self):
        self.calls = 0

    def push(self, name, category):
        self.calls += 1

    def pop(self):
        self.calls += 1

    def mark(self, name, category):
        self.calls += 1


def call_cost(n=200000):
    """Seconds per push+pop pair into the fastchain domain, no tool attached."""
    from fastchain.nvtx import annotator
    ann = annotator()
    ann.push('forward', 'forward')      # make the attributes once
    ann.pop()
    start = time.perf_counter()
    for _ in range(n):
        ann.push('forward', 'forward')
        ann.pop()
    return (time.perf_counter() - start) / n


def main(argv=None):
    p = _common.parser('nvtx_cost', __doc__)
    p.add_argument('--size', type=int, default=None, help='input side in pixels')
    p.add_argument('--batch', type=int, default=None, help='default: 8 on a CPU, 32 on a GPU')
    p.add_argument('--device', default=None, help="default: GPU 0 if usable, else '@numpy'")
    args = p.parse_args(argv)
    import fastchain
    from fastchain.backends import nvtx as nvtx_backend
    device = _common.device(args.device)
    gpu = device.xp is not numpy

    def sync():             # on a GPU the clock is read after its work is done
        if gpu:
            device.device.synchronize()
    if nvtx_backend.profiler_attached():
        raise SystemExit('a profiler is attached (NVTX_INJECTION64_PATH is set): this '
                         'benchmark measures the cost without one')
    size = args.size or (224 if gpu else 32 if args.quick else 64)
    args.batch = args.batch or (32 if gpu else 8)
    windows = args.windows or (9 if args.quick else 15)
    per_window = 4 if args.quick else 8
    depth, width = 50, 64

    with warnings.catch_warnings():
        warnings.simplefilter('ignore')     # "no NVTX tool attached"
        # Both built under the same options but nvtx: the plain updater was
        # built without enable(), so only the annotated one had the fused
        # update (it acts at optimizer setup), and "annotated" ran faster
        # (a review). Kept enabled while measuring: the ranges live on the
        # annotated updater and optimizer; the plain one gets only the
        # shared converter's 'convert' range (one push/pop per step).
        base = fastchain.enable(nvtx=False, loader_workers=0, autotune=False)
        updaters = {'plain': make_updater(size, args.batch, depth, width, device)}
        handle = fastchain.enable(nvtx=True)
        updaters['annotated'] = make_updater(size, args.batch, depth, width, device)
        # A/A control: the plain one built again, after the annotated one
        # (nvtx=False stacked over it: the annotated updater keeps its ranges).
        # Two identical updaters in one process ran up to 11% apart here
        # (where each one's arrays lie), more than annotations cost.
        off = fastchain.enable(nvtx=False)
        updaters['plain_again'] = make_updater(size, args.batch, depth, width, device)
        off.disable()
    from fastchain.kernels._update import is_fused
    fused = {n: sorted({is_fused(p.update_rule) for p in u.get_optimizer('main').target.params()})
             for n, u in updaters.items()}
    assert fused['plain'] == fused['annotated'] == fused['plain_again'], fused
    for updater in updaters.values():       # warm-up: first calls, allocations
        for _ in range(2):
            updater.update()

    rows = _common.Rows('iterations/s')
    for w in range(windows):
        # the order reversed every window: the second of a pair ran faster
        # beyond the spread with a fixed order (a review)
        for name, updater in list(updaters.items())[::1 if w % 2 == 0 else -1]:
            sync()
            start = time.perf_counter()
            for _ in range(per_window):
                updater.update()
            sync()
            rows.add(name, per_window / (time.perf_counter() - start))
        print('window {}/{}: '.format(w + 1, windows) + ', '.join(
            '{} {:.3f}'.format(n, v[-1]) for n, v in rows.windows.items()), flush=True)
    # The A/B above is as noisy as the machine; the cost is also
    # counted: calls per step times the cost of one call.
    from fastchain.nvtx import annotator
    ann = annotator()
    handle.disable()
    base.disable()
    per_step = {}
    for name, mode in (('annotated', True), ('annotated_links', 'links')):
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            with fastchain.enable(nvtx=mode, loader_workers=0, autotune=False):
                updater = make_updater(size, args.batch, depth, width, device)
                updater.update()
                counter = _Counter()
                ann.timeline = counter
                updater.update()
                ann.timeline = None
        per_step[name] = counter.calls
    pair = call_cost()
    step_s = 1.0 / rows.median('plain')
    counted = {n: c / 2 * pair / step_s for n, c in per_step.items()}
    ratios = {'annotated/plain': rows.ratio('annotated', 'plain'),
              'plain_again/plain (A/A control)': rows.ratio('plain_again', 'plain'),
              'annotated/plain (counted)': round(1 / (1 + counted['annotated']), 5),
              'annotated_links/plain (counted)': round(1 / (1 + counted['annotated_links']), 5)}
    config = {'model': 'ResNet-{} (width {})'.format(depth, width), 'input': size,
              'device': str(device),
              'batch': args.batch, 'windows': windows, 'iterations_per_window': per_window,
              'profiler_attached': False, 'annotator_calls_per_step': per_step,
              'seconds_per_push_pop_pair': pair,
              'counted_cost_share_of_a_step': {n: round(v, 6) for n, v in counted.items()}}
    notes = ['Target: annotated/plain >= 0.99 (annotations cost at most 1% of a step).',
             'Counted: {} annotator calls per step ({} with per-link ranges) at {:.2f} us per '
             'push+pop pair = {:.4f}% ({:.3f}%) of a {:.0f} ms step. The timed A/B ratios '
             'carry the machine\'s noise (see the spread and the A/A control: the plain '
             'updater built again).'.format(
                 per_step['annotated'], per_step['annotated_links'], pair * 1e6,
                 100 * counted['annotated'], 100 * counted['annotated_links'], step_s * 1e3)]
    _common.write('nvtx_cost', args, config, rows, ratios, notes)


if __name__ == '__main__':
    main()
