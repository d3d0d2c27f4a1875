"""Per-iteration time of ResNet-50 training with and without the static-graph
cache, and where the rest of the host time goes.

Two settings, as the issue asks: overhead-bound (batch 2, 32x32 input: the
smallest batch and input of a full ResNet-50 step) and compute-bound (batch
16, 96x96). On a CPU the overhead-bound step is not only Python: every step
streams the 25.5 M weights through memory several times (forward and input
gradient read them, the weight gradients write as many, the update reads and
writes three arrays of that size), which takes most of a cached step there.
A third setting, python-bound, shows the cache where the step is Chainer's
Python: the same ResNet-50 graph (50 layers, 161 parameters, ~400 functions
per step) at 1/16 width (0.1 M weights), batch 2, 32x32.
In each, identical models (same weights, same batch) train in one process,
one step each in turn, the order of the turn alternating, so drift and the
machine's neighbours hit every variant alike:

- ``dynamic``: define-by-run with fastchain's defaults (``enable()``: its
  CPU convolution kernels and fused update, both bitwise equal to Chainer's);
- ``static``: the same plus the static-graph cache (``enable(static_graph=
  True)``): Chainer's schedule replay with fastchain's fixes and the kernels
  bound into the schedule;
- ``chainer_dynamic``: plain Chainer;
- ``chainer_static``: the cache with Chainer's kernels and update
  (``enable(static_graph=True, cpu_conv=False, fused_update=False)``).

With ``--untuned``, ``dynamic_untuned`` and ``static_untuned`` repeat the
two with autotune off (fastchain's kernels for every key, the cache always
replaying): ``static/static_untuned`` and ``dynamic/dynamic_untuned`` show
what autotune's machinery costs a step (the results are the same bits).

``static/dynamic`` is the cache's effect with everything else equal, as the
talk's static-graph rung sat on the rungs below it; ``chainer_static/
chainer_dynamic`` is the same comparison on Chainer's own kernels. The cache
and the fused update are applied per model with the functions ``enable()``
applies at optimizer set-up (``cache_static_graph``, ``fuse``); the
convolution kernels (process-wide) are switched around each step. A cProfile
of cached steps in the overhead-bound setting shows what is left. Each
variant warms up until autotune has decided what it meets, so no timed round
measures alternatives. On a GPU (the default where one works; ``--device``)
the clock is read after the device synchronises, Chainer's variants run
Chainer's own kernels (``cudnn='never'``: im2col on CuPy 14) and fastchain's
the cuDNN graphs; the CPU kernels act on NumPy arrays only (the GPU path is
not run on a GPU yet).
"""

import collections
import contextlib
import cProfile
import io
import os
import pstats
import sys
import warnings

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

# setting: (batch, input size, width of the first stage: 64 is ResNet-50)
SETTINGS = {'overhead_bound': (2, 32, 64), 'compute_bound': (16, 96, 64),
            'python_bound': (2, 32, 4)}
# variant: (static_graph, cpu_conv, fused_update)
VARIANTS = {'chainer_dynamic': (False, False, False), 'chainer_static': (True, False, False),
            'dynamic': (False, True, True), 'static': (True, True, True)}
# --untuned adds these (autotune off: fastchain's kernels everywhere, the cache
# always replays): what autotune's machinery costs a step, everything else equal
UNTUNED = {'dynamic_untuned': (False, True, True), 'static_untuned': (True, True, True)}
WARM_UP = 4     # steps: the cached models build and verify (3), and one more
MAX_TUNING_STEPS = 90   # then until autotune decided (the static cache: ~10 more steps,
                        # the per-call picks' check over whole steps ~34)


def make(static, cpu_conv, fused, batch, size, width, device, autotune=True):
    """One variant: a ResNet-50 classifier and its training step (on ``device``)."""
    import chainer
    import chainer.links as L
    import fastchain
    from fastchain.models import ResNet
    from fastchain.static import cache_static_graph
    from fastchain.kernels._update import fuse
    numpy.random.seed(0)                # the same weights in every variant
    model = L.Classifier(ResNet(50, 10, width=width))
    model.to_device(device)
    if static:
        cache_static_graph(model.predictor)
    optimizer = chainer.optimizers.MomentumSGD(0.01).setup(model)
    if fused:
        fuse(optimizer)
    rng = numpy.random.RandomState(1)
    x = device.send(rng.randn(batch, 3, size, size).astype(numpy.float32))
    t = device.send(rng.randint(0, 10, batch).astype(numpy.int32))

    def step():
        optimizer.update(model, x, t)
        if device.xp is not numpy:
            device.device.synchronize()     # read the clock after the GPU is done
    step.model, step.optimizer = model, optimizer

    # Chainer's variants are plain Chainer on a GPU too: Chainer's own
    # kernels there (im2col on CuPy 14), not fastchain's cuDNN graphs.
    plain = {} if cpu_conv else {'cudnn': 'never'}

    @contextlib.contextmanager
    def kernels():
        """This variant's convolution kernels (process-wide) while inside."""
        with fastchain.enable(cpu_conv=cpu_conv, fused_update=False, loader_workers=0,
                              autotune=autotune, **plain):
            yield
    with kernels(), warnings.catch_warnings():
        warnings.simplefilter('error')      # a fallback would void the comparison
        for _ in range(WARM_UP):
            step()
        # then until autotune has decided what this variant meets (the
        # cache's schedule against define-by-run, kernels per key): a step
        # that calls no undecided choice, so no timed round measures
        # alternatives (a key met only while the schedule was built stays
        # undecided and is not met again)
        for _ in range(MAX_TUNING_STEPS):
            before = _measuring()
            step()
            if _measuring() == before and not _picks_pending():
                break
    return step, kernels


def _picks_pending():
    """Whether autotune's check of the per-call picks over whole steps is
    open or due (it runs once the per-call keys are decided)."""
    from fastchain.tune import _steps
    return _steps.pending()


def _measuring():
    """The calls so far of autotune's undecided choices, per choice."""
    from fastchain.tune import _tuner
    return {k: c.calls for k, c in list(_tuner._choices.items()) if c.picked is None}


def profile(step, n=5):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    pr.disable()
    out = io.StringIO()
    stats = pstats.Stats(pr, stream=out).sort_stats('tottime')
    total = sum(v[2] for v in stats.stats.values()) / n
    import fastchain
    mine = os.path.dirname(os.path.abspath(fastchain.__file__))
    rows, packages = [], collections.Counter()
    for (path, line, func), (cc, nc, tt, ct, callers) in sorted(
            stats.stats.items(), key=lambda kv: -kv[1][2]):
        packages[package_of(path, mine)] += tt / n * 1e3
        if len(rows) < 12:
            rows.append({'function': '{}:{}({})'.format(os.path.basename(path), line, func),
                         'ms_per_step': round(tt / n * 1e3, 2),
                         'share': round(tt / n / total, 3) if total else None})
    return {'ms_per_step': round(total * 1e3, 1), 'top': rows,
            'by_package_ms': {k: round(v, 2) for k, v in packages.most_common()}}


PACKAGES = {'cudnn': 'cuDNN frontend', 'fastchain': 'fastchain', 'chainer': 'chainer',
            'cupy': 'cupy', 'cupy_backends': 'cupy', 'cupyx': 'cupy', 'numpy': 'numpy'}


def package_of(path, fastchain_dir=None):
    """Where a profiled function lives, for the own time by package: the
    folder under site-packages, or fastchain's own package folder (an
    editable install; a checkout named fastchain holding the venv does not
    count its installed packages as fastchain's). Calls into compiled code
    (the frontend's pybind functions, CuPy's kernels' launches) count as
    'C functions and methods'."""
    if path == '~':
        return 'C functions and methods'
    if fastchain_dir is None:
        import fastchain
        fastchain_dir = os.path.dirname(os.path.abspath(fastchain.__file__))
    parts = os.path.normpath(path).split(os.sep)
    if 'site-packages' in parts[:-1]:
        return PACKAGES.get(parts[parts.index('site-packages') + 1], 'other')
    if os.path.normpath(path).startswith(fastchain_dir + os.sep):
        return 'fastchain'
    return 'other'


def main(argv=None):
    p = _common.parser('overhead', __doc__)
    p.add_argument('--device', default=None,
                   help="Chainer device (default: '@cupy:0' where a GPU works, else '@numpy'); "
                        'the CPU kernels (cpu_conv, fused_update) act on NumPy arrays only')
    p.add_argument('--untuned', action='store_true',
                   help='also run dynamic and static with autotune off (fastchain\'s kernels '
                        'everywhere, the cache always replays): what autotune\'s machinery '
                        'costs a step')
    args = p.parse_args(argv)
    device = _common.device(args.device)       # default: GPU 0 if usable
    gpu = device.xp is not numpy
    # Rounds (one step per variant each); --windows sets the overhead- and
    # python-bound counts. A compute-bound step takes ~2 s here.
    short = args.windows or (30 if args.quick else 80)
    rounds = {'overhead_bound': short, 'compute_bound': 4 if args.quick else 9,
              'python_bound': short}
    rows = _common.Rows('iterations/s')
    config = {'model': 'ResNet-50 (v1.5); width 64, python_bound at width 4',
              'device': str(device), 'windows': rounds,
              'warm_up_steps': WARM_UP,
              'method': 'one process; every variant runs one step in turn, the order '
                        'alternating between rounds; a window is one step',
              'settings': {k: {'batch': b, 'input': s, 'width': w}
                           for k, (b, s, w) in SETTINGS.items()}}
    config['untuned_variants'] = sorted(UNTUNED) if args.untuned else []
    specs = dict(VARIANTS, **(UNTUNED if args.untuned else {}))
    profiles = {}
    for setting, (batch, size, width) in SETTINGS.items():
        variants = {name: make(*specs[name], batch, size, width, device,
                               autotune=name not in UNTUNED)
                    for name in specs}
        names = list(variants)
        # what autotune decided while the variants warmed up (cumulative over
        # the settings so far): picks per kind, and the checks of the per-call
        # picks over whole steps with their step times
        from fastchain.tune import _steps, _tuner
        config.setdefault('autotune', {})[setting] = {
            'summary': _tuner.summary(), 'check_pending': _steps.pending(),
            'per_call_picks': [{k: c[k] for k in ('key', 'picked', 'median_ms', 'trials')}
                               for c in _tuner.choices('per_call_picks')]}

        def timed_step(name):
            step, kernels = variants[name]
            with kernels():
                return _common.timed(step)[0]     # step() synchronises a GPU itself
        moved = _tuner.generation, _tuner.measuring
        for r in range(rounds[setting]):
            for name in (names if r % 2 == 0 else names[::-1]):
                rows.add('{}@{}'.format(name, setting), 1.0 / timed_step(name))
            if (r + 1) % max(1, rounds[setting] // 5) == 0:
                print('{} round {}/{}: '.format(setting, r + 1, rounds[setting]) + ', '.join(
                    '{} {:.1f} ms'.format(n.split('@')[0], 1e3 / numpy.median(v))
                    for n, v in rows.windows.items() if n.endswith('@' + setting)),
                    flush=True)
        # autotune at rest while timed: no pick changed (generation), nothing measured
        config['autotune'][setting]['during_rounds'] = {
            'generation_bumps': _tuner.generation - moved[0],
            'measuring_calls': _tuner.measuring - moved[1]}
        if setting == 'overhead_bound':
            # Both cached variants: what is left, and the two update kernels'
            # own times from the same run.
            for name in ('static', 'chainer_static'):
                step, kernels = variants[name]
                with kernels():
                    profiles[name] = profile(step, 5)
        del variants
    ratios, paired = {}, {}
    for s in SETTINGS:
        pairs = [('static', 'dynamic'), ('chainer_static', 'chainer_dynamic'),
                 ('dynamic', 'chainer_dynamic'), ('static', 'chainer_dynamic')]
        if args.untuned:
            pairs += [('static_untuned', 'dynamic_untuned'), ('static', 'static_untuned'),
                      ('dynamic', 'dynamic_untuned')]
        for a, b in pairs:
            key = '{}/{}@{}'.format(a, b, s)
            ratios[key] = rows.ratio('{}@{}'.format(a, s), '{}@{}'.format(b, s))
            # The same ratio taken within each round, then the median: steps of
            # one round ran back to back, so slow drift cancels.
            paired[key] = round(float(numpy.median(
                numpy.array(rows.windows['{}@{}'.format(a, s)])
                / numpy.array(rows.windows['{}@{}'.format(b, s)]))), 3)
    config['paired_ratios'] = paired
    config['profiles_of_cached_steps_overhead_bound'] = profiles
    remaining = profiles['static']['top'] if 'static' in profiles else []

    def own_ms(variant, function):
        return next((r['ms_per_step'] for r in profiles.get(variant, {}).get('top', [])
                     if function in r['function']), None)
    # The kernels that stream the weights: the update and the three
    # convolution products (forward, weight gradient, input gradient).
    streaming = sum(r['ms_per_step'] for r in remaining
                    if '_momentum_blocks' in r['function'] or '_bind.py' in r['function'])
    notes = ['Target on the overhead-bound setting: static/dynamic >= 1.3 on CPU; the '
             "talk's anchor is x1.31 on a V100, measured on top of the rungs below it. "
             'static/dynamic: the cache, everything else at fastchain\'s defaults on both '
             'sides; chainer_static/chainer_dynamic: the cache on Chainer\'s kernels and '
             "update; dynamic/chainer_dynamic: fastchain's CPU kernels (cpu_conv, "
             'fused_update) without the cache; static/chainer_dynamic: all of it.',
             'python_bound: the same graph at 1/16 width, where a step is Chainer\'s '
             'Python; it shows what the cache removes when weights do not dominate, not '
             'the target setting.',
             'Median of the per-round ratios (steps of a round run back to back): ' + ', '.join(
                 '{} {}'.format(k, v) for k, v in paired.items()
                 if 'compute' not in k) + '.',
             'Where a cached overhead-bound step (static) still spends its host time '
             '(cProfile, top functions by own time): ' + '; '.join(
                 '{function} {ms_per_step} ms'.format(**r) for r in remaining[:6]),
             'Under cProfile a cached overhead-bound step (static) took {} ms; its own time '
             'by package: {}.'.format(
                 profiles.get('static', {}).get('ms_per_step'), ', '.join(
                     '{} {} ms'.format(k, v) for k, v in
                     profiles.get('static', {}).get('by_package_ms', {}).items()))]
    if not gpu:
        notes += ['{:.1f} ms of that step in the update and the three convolution kernels, '
                  'which stream the weights.'.format(streaming),
                  "The optimizer update's own time per step, same run: Chainer's "
                  'MomentumSGD update_core_cpu {} ms (chainer_static), the fused '
                  '_momentum_blocks {} ms (static).'.format(
                      own_ms('chainer_static', 'update_core_cpu'),
                      own_ms('static', '_momentum_blocks'))]
    _common.write('overhead', args, config, rows, ratios, notes)


if __name__ == '__main__':
    main()
