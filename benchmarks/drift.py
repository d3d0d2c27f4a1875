"""How this machine's speed drifts while nothing changes: why the ladder
times its rungs in short turns (``ladder.py --interleave turns``).

The ladder's baseline rung (plain Chainer, ResNet-50 on the ladder's JPEG
files, batch 16, 32 px on a CPU) is built once and stepped ``--steps``
times in a row, alone. Each block of 8 consecutive steps is a row's window
(iterations/s); ``fastest_block/slowest_block`` is how far the same work's
speed moved within the run; the notes give the correlation of a step's time
with the next one's and with the one 8 steps later (near 0: independent
noise, which longer windows average out; near 1: drift, which only
alternating the variants closely cancels), and the process's CPU time over
wall time (how many of the cores a step keeps busy).
"""

import os
import statistics
import sys
import time

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402
from _images import list_pairs  # noqa: E402
from ladder_scripts import plain  # noqa: E402

BLOCK = 8


def correlation(times, lag):
    d = numpy.asarray(times) - numpy.mean(times)
    return float((d[lag:] * d[:-lag]).mean() / d.var())


def main(argv=None):
    p = _common.parser('drift', __doc__)
    p.add_argument('--steps', type=int, default=None,
                   help='consecutive steps (default 96 quick, 240 full)')
    args = p.parse_args(argv)
    import chainer
    from fastchain.data import make_demo_dataset
    steps = args.steps or (96 if args.quick else 240)
    n_images = 640
    paths = make_demo_dataset(os.path.join(HERE, '.cache', 'ladder-jpegs-{}'.format(n_images)),
                              n_train=n_images // 10, n_val=0, size=(300, 640), seed=2018)
    device = chainer.get_device('@numpy')
    updater = plain.build(list_pairs(paths), paths['root'], 16, 32, len(paths['classes']),
                          device)
    for _ in range(4):
        updater.update()        # warm-up
    times = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        updater.update()
        times.append(time.perf_counter() - t0)
    cores_busy = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    updater.finalize()
    rows = _common.Rows('iterations/s')
    for b in range(0, steps - BLOCK + 1, BLOCK):
        rows.add('baseline_block', BLOCK / sum(times[b:b + BLOCK]))
    blocks = rows.windows['baseline_block']
    ratios = {'fastest_block/slowest_block': round(max(blocks) / min(blocks), 3)}
    config = {'model': 'ResNet-50 v1.5', 'batch': 16, 'crop': 32, 'images': n_images,
              'steps': steps, 'block_steps': BLOCK,
              'step_ms': {'median': round(statistics.median(times) * 1e3, 1),
                          'p10': round(float(numpy.percentile(times, 10)) * 1e3, 1),
                          'p90': round(float(numpy.percentile(times, 90)) * 1e3, 1)},
              'correlation_lag_1': round(correlation(times, 1), 3),
              'correlation_lag_8': round(correlation(times, BLOCK), 3),
              'cpu_time_over_wall': round(cores_busy, 3),
              'blocks_in_order': [round(v, 3) for v in blocks]}
    notes = ['Blocks of {} steps in order (iterations/s): {}.'.format(
                 BLOCK, ', '.join('{:.2f}'.format(v) for v in blocks)),
             'Correlation of step times: next step {:.2f}, {} steps later {:.2f}; process CPU '
             'time / wall time {:.2f}.'.format(config['correlation_lag_1'], BLOCK,
                                               config['correlation_lag_8'], cores_busy)]
    _common.write('drift', args, config, rows, ratios, notes)


if __name__ == '__main__':
    main()
