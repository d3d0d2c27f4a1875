"""Per-iteration time of ResNet-50 training with and without the static-graph
cache, and where the rest of the host time goes.

Two settings: overhead-bound (batch 2, 32x32 input: Chainer's per-function
Python work is a large part of a step) and compute-bound (batch 16, 96x96).
In each, identical models train side by side, each in its own process,
windows alternating:

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
SETTLE = 0.3        # seconds between two variants' windows
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


class _Variant:
    """One variant in its own process: its own model, heap and BLAS threads,
    as in a real run (four ResNet-50s in one process share a heap and the
    allocator's state). The processes take turns window by window, so the
    alternation stays."""

    TIMEOUT = 600

    def __init__(self, name, batch, size):
        import multiprocessing
        self.name = name
        ctx = multiprocessing.get_context('spawn')
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, name, batch, size),
                                   name='overhead-' + name, daemon=True)
        self.process.start()
        child.close()

    def ask(self, *request):
        self.conn.send(request)
        if not self.conn.poll(self.TIMEOUT):
            raise RuntimeError('variant {} did not answer within {} s'.format(
                self.name, self.TIMEOUT))
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError('variant {} died (exit code {})'.format(
                self.name, self.process.exitcode)) from None
        if kind == 'error':
            raise RuntimeError('variant {} failed: {}'.format(self.name, value))
        return value

    def close(self):
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def _serve(conn, name, batch, size):
    try:
        step, handle = make(*VARIANTS[name], batch, size)
        for _ in range(3):      # warm-up: the cached model builds its schedule
            step()
    except Exception as e:      # reported by the parent, naming the variant
        conn.recv()
        conn.send(('error', '{}: {}'.format(type(e).__name__, e)))
        return
    while True:
        request = conn.recv()
        if request is None:
            break
        kind, n = request
        if kind == 'run':
            start = time.perf_counter()
            for _ in range(n):
                step()
            conn.send(('ok', time.perf_counter() - start))
        elif kind == 'profile':
            conn.send(('ok', profile(step, n)))
    handle.disable()


def main(argv=None):
    p = _common.parser('overhead', __doc__)
    args = p.parse_args(argv)
    windows = args.windows or (5 if args.quick else 9)
    # iterations per window: a compute-bound step takes ~2 s here.
    per_window = {'overhead_bound': 8 if args.quick else 16,
                  'compute_bound': 2 if args.quick else 4}
    rows = _common.Rows('iterations/s')
    config = {'model': 'ResNet-50 (v1.5, width 64)', 'windows': windows,
              'iterations_per_window': per_window,
              'method': 'each variant in its own process; windows alternate',
              'settings': {k: {'batch': b, 'input': s} for k, (b, s) in SETTINGS.items()}}
    profiles = {}
    for setting, (batch, size) in SETTINGS.items():
        variants = [_Variant(name, batch, size) for name in VARIANTS_OF[setting]]
        try:
            for v in variants:      # every process has warmed up before any window
                v.ask('run', 0)
            for w in range(windows):
                for v in variants:
                    # Let the last process's OpenBLAS threads stop spinning
                    # (they busy-wait ~0.1 s after a call) before timing the next.
                    time.sleep(SETTLE)
                    elapsed = v.ask('run', per_window[setting])
                    rows.add('{}@{}'.format(v.name, setting), per_window[setting] / elapsed)
                print('{} window {}/{}: '.format(setting, w + 1, windows) + ', '.join(
                    '{} {:.1f} ms'.format(n, 1e3 / v[-1]) for n, v in rows.windows.items()
                    if n.endswith('@' + setting)), flush=True)
            if setting == 'overhead_bound':
                # Both cached variants, so the two update kernels' own times
                # come from the same run.
                profiles = {v.name: v.ask('profile', 5) for v in variants
                            if v.name in ('static', 'static_fused')}
        finally:
            for v in variants:
                v.close()
    ratios = {}
    for s in SETTINGS:
        for name in VARIANTS_OF[s][1:]:
            ratios['{}/dynamic@{}'.format(name, s)] = rows.ratio(
                '{}@{}'.format(name, s), 'dynamic@' + s)
    config['profiles_of_cached_steps_overhead_bound'] = profiles
    remaining = profiles.get('static_fused', [])

    def own_ms(variant, function):
        return next((r['ms_per_step'] for r in profiles.get(variant, [])
                     if function in r['function']), None)
    notes = ['Target on the overhead-bound setting: static/dynamic >= 1.3 on CPU; the '
             "talk's anchor is x1.31 on a V100. static/dynamic is the static-graph cache "
             'alone; static_fused/dynamic adds the fused CPU update that '
             'enable(static_graph=True) also turns on (fused_update, default on), and '
             'fused/dynamic is that update alone.',
             'Where a cached overhead-bound step (static_fused) still spends its host time (cProfile, '
             'top functions by own time): ' + '; '.join(
                 '{function} {ms_per_step} ms'.format(**r) for r in remaining[:6]),
             "The optimizer update's own time per step, same run: Chainer's "
             'MomentumSGD update_core_cpu {} ms (static), the fused _momentum_blocks {} ms '
             '(static_fused).'.format(own_ms('static', 'update_core_cpu'),
                                      own_ms('static_fused', '_momentum_blocks'))]
    _common.write('overhead', args, config, rows, ratios, notes)


if __name__ == '__main__':
    main()
