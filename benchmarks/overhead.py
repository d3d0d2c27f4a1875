"""Per-iteration time of ResNet-50 training with and without the static-graph
cache, and where the rest of the host time goes.

Two settings: overhead-bound (batch 2, 32x32 input: Chainer's per-function
Python work is a large part of a step) and compute-bound (batch 16, 96x96).
In each, identical models train side by side, windows alternating:

- ``dynamic``: ordinary define-by-run Chainer;
- ``static``: the static-graph cache alone
  (``enable(static_graph=True, fused_update=False)``);
- ``static_fused``: what ``enable(static_graph=True)`` gives, the cache plus
  the fused CPU update (on by default);
- ``fused`` (overhead-bound only): the fused update alone, so the two
  contributions can be told apart.

``static/dynamic@...`` is the cache's own effect. A cProfile of
``static_fused`` steps in the overhead-bound setting shows what is left.
"""

import cProfile
import io
import os
import pstats
import sys
import time
import warnings

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SETTINGS = {'overhead_bound': (2, 32), 'compute_bound': (16, 96)}
# variant: (static_graph, fused_update)
VARIANTS = {'dynamic': (False, False), 'static': (True, False),
            'static_fused': (True, True), 'fused': (False, True)}
VARIANTS_OF = {'overhead_bound': ('dynamic', 'static', 'static_fused', 'fused'),
               'compute_bound': ('dynamic', 'static', 'static_fused')}


def make(static, fused, batch, size):
    import chainer
    import chainer.links as L
    import fastchain
    from fastchain.models import ResNet
    numpy.random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        handle = fastchain.enable(static_graph=static, fused_update=fused,
                                  loader_workers=0)
    model = L.Classifier(ResNet(50, 10))
    optimizer = chainer.optimizers.MomentumSGD(0.01).setup(model)
    rng = numpy.random.RandomState(1)
    x = rng.randn(batch, 3, size, size).astype(numpy.float32)
    t = rng.randint(0, 10, batch).astype(numpy.int32)
    return (lambda: optimizer.update(model, x, t)), handle


def profile(step, n=5):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    pr.disable()
    out = io.StringIO()
    stats = pstats.Stats(pr, stream=out).sort_stats('tottime')
    total = sum(v[2] for v in stats.stats.values()) / n
    rows = []
    for (path, line, func), (cc, nc, tt, ct, callers) in sorted(
            stats.stats.items(), key=lambda kv: -kv[1][2])[:12]:
        rows.append({'function': '{}:{}({})'.format(os.path.basename(path), line, func),
                     'ms_per_step': round(tt / n * 1e3, 2),
                     'share': round(tt / n / total, 3) if total else None})
    return rows


def main(argv=None):
    p = _common.parser('overhead', __doc__)
    args = p.parse_args(argv)
    windows = args.windows or (5 if args.quick else 9)
    per_window = 3 if args.quick else 6
    rows = _common.Rows('iterations/s')
    config = {'model': 'ResNet-50 (v1.5, width 64)', 'windows': windows,
              'iterations_per_window': per_window,
              'settings': {k: {'batch': b, 'input': s} for k, (b, s) in SETTINGS.items()}}
    remaining = None
    for setting, (batch, size) in SETTINGS.items():
        steps = {}
        for name in VARIANTS_OF[setting]:
            step, handle = make(*VARIANTS[name], batch, size)
            for _ in range(3):      # warm-up: the cached model builds its schedule
                step()
            steps[name] = (step, handle)
        for w in range(windows):
            for name, (step, _) in steps.items():
                start = time.perf_counter()
                for _ in range(per_window):
                    step()
                rows.add('{}@{}'.format(name, setting),
                         per_window / (time.perf_counter() - start))
            print('{} window {}/{}: '.format(setting, w + 1, windows) + ', '.join(
                '{} {:.1f} ms'.format(n, 1e3 / v[-1]) for n, v in rows.windows.items()
                if n.endswith('@' + setting)), flush=True)
        if setting == 'overhead_bound':
            remaining = profile(steps['static_fused'][0])
        for _, handle in steps.values():
            handle.disable()
    ratios = {}
    for s in SETTINGS:
        for name in VARIANTS_OF[s][1:]:
            ratios['{}/dynamic@{}'.format(name, s)] = rows.ratio(
                '{}@{}'.format(name, s), 'dynamic@' + s)
    config['profile_of_a_cached_step_overhead_bound'] = remaining
    notes = ['Target on the overhead-bound setting: static/dynamic >= 1.3 on CPU; the '
             "talk's anchor is x1.31 on a V100. static/dynamic is the static-graph cache "
             'alone; static_fused/dynamic adds the fused CPU update that '
             'enable(static_graph=True) also turns on (fused_update, default on), and '
             'fused/dynamic is that update alone.',
             'Where a cached overhead-bound step (static_fused) still spends its host time (cProfile, '
             'top functions by own time): ' + '; '.join(
                 '{function} {ms_per_step} ms'.format(**r) for r in (remaining or [])[:6])]
    _common.write('overhead', args, config, rows, ratios, notes)


if __name__ == '__main__':
    main()
