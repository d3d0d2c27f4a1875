"""The GTC Japan 2018 speed ladder, reproduced on the device present.

ResNet-50 (the recipe's model), the same batch and the same real JPEG files
(ImageNet-like sizes, so decoding and preprocessing are part of every step),
one rung after another, each adding one change to the one before, as in the
talk:

  baseline            SerialIterator, fp32, no cuDNN   (benchmarks/ladder_scripts/plain.py)
  cudnn               + cuDNN (CuPy 13's, or on CuPy 14 cuDNN 9 through fastchain's graphs)
  autotune            + autotuning: cuDNN's algorithm search (the graphs' plans timed),
                        and from here on fastchain's measure-and-choose between its bitwise-equal
                        alternatives (a rung of its own only where cuDNN works)
  fp16                + fp16 compute, preprocessing in NumPy fp16 (the talk's slow rung)
  fp32_preprocessing  + preprocessing back in fp32, cast on the device
  multiprocess        + worker processes (enable()'s default count; autotune keeps
                        the fastest number of them loading) and device prefetch
  static_graph        + static-subgraph caching
  fused_update        + the fused CPU optimizer update (fastchain's, not in the talk; it
                        leaves Chainer's GPU update kernel as it is: not run on a GPU)
  cpu_conv            + fastchain's CPU convolution kernels, also bound into the cached
                        schedule (fastchain's, not in the talk; CPU only)
  onednn              + oneDNN's convolutions and PyTorch's BatchNormalization from
                        PyTorch's CPU build (enable(onednn=True): NOT bitwise equal to
                        Chainer, within a stated tolerance; when torch is installed)
  all                 plain.py + one fastchain.enable() call (ladder_scripts/with_fastchain.py)
  all_onednn          the same with onednn=True added to that call
  torch               PyTorch eager ResNet-50, DataLoader with PIL (when torch is installed)
  baseline_again      the baseline built again, an A/A control: baseline_again/baseline is
                        the run's noise floor (a ratio no accelerator can be told apart from)

A rung that cannot run here is listed with the reason. First the "all" rung
runs until autotune has decided every key (its choices are shared by every
rung, keyed by shapes and structure), so no window pays for measurements;
steps and seconds are recorded. Then each rung is built fresh, warmed up
(worker start, first calls, schedule building) and timed for one window;
rungs take turns, each window starting one rung later. Rows are iterations
per second (median of windows); ``RUNG/baseline`` is a rung's speed over the
baseline's, ``RUNG/baseline@paired`` the median of the per-window ratios.
Writes JSON, a Markdown table and a PNG bar chart.
"""

import difflib
import os
import statistics
import sys
import time
import warnings

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402
from _images import list_pairs, torch_dataset  # noqa: E402
from ladder_scripts import plain, with_fastchain  # noqa: E402

RUNGS = ('baseline', 'cudnn', 'autotune', 'fp16', 'fp32_preprocessing', 'multiprocess',
         'static_graph', 'fused_update', 'cpu_conv', 'onednn', 'all', 'all_onednn')


def changed_lines():
    """Lines that differ between the plain script and the accelerated one."""
    a = open(plain.__file__).read().splitlines()
    b = open(with_fastchain.__file__).read().splitlines()
    return [l[1:].strip() for l in difflib.unified_diff(a, b, lineterm='')
            if l[:1] in '+-' and l[:3] not in ('+++', '---')]


def rung_options(rung, cudnn_ok, fp16_ok=True):
    """The enable() options of a rung (each adds to the one before)."""
    upto = RUNGS.index(rung)
    options = dict(cudnn='never', autotune=False, loader_workers=0,
                   prefetch_to_device=False, static_graph=False, fp16=False,
                   fused_update=False, cpu_conv=False)
    if upto >= 1 and cudnn_ok:
        options['cudnn'] = 'auto'
    if upto >= 2:
        options['autotune'] = True
    if upto >= 3 and fp16_ok:
        options['fp16'] = True
    if upto >= 5:
        # enable()'s default count (this process's share of the cores), of
        # which autotune keeps the fastest number loading.
        options['loader_workers'] = None
        options['prefetch_to_device'] = True
    if upto >= 6:
        options['static_graph'] = True
    if upto >= 7:
        options['fused_update'] = True
    if upto >= 8:
        options['cpu_conv'] = True
    options['onednn'] = upto >= 9
    dtype = numpy.float16 if rung == 'fp16' else numpy.float32
    return options, dtype


def build_rung(rung, paths, args, device, cudnn_ok, fp16_ok):
    import fastchain
    pairs = list_pairs(paths)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')     # "fp16 is slower on a CPU", etc.
        if rung in ('all', 'all_onednn'):
            if rung == 'all_onednn':
                fastchain.enable(onednn=True)   # the one line, with onednn=True added
            updater = with_fastchain.build(pairs, paths['root'], args.batch, args.crop,
                                           len(paths['classes']), device)
        else:
            options, dtype = rung_options(rung, cudnn_ok, fp16_ok)
            fastchain.enable(**options)
            updater = plain.build(pairs, paths['root'], args.batch, args.crop,
                                  len(paths['classes']), device, dtype=dtype)

    def close():
        updater.finalize()
        for handle in reversed(fastchain.active_handles()):
            handle.disable()
    return updater.update, close


def torch_rung(paths, args, workers):
    import torch
    import torch_resnet

    loader = torch.utils.data.DataLoader(torch_dataset(paths, args.crop, plain.MEAN, 1 / 255), batch_size=args.batch, shuffle=True,
                                         num_workers=workers, drop_last=True,
                                         persistent_workers=workers > 0)
    model = torch_resnet.resnet50(len(paths['classes']))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = {'it': iter(loader)}

    def step():
        try:
            x, t = next(state['it'])
        except StopIteration:
            state['it'] = iter(loader)
            x, t = next(state['it'])
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), t)
        loss.backward()
        optimizer.step()
    return step, lambda: None


TUNING_STEPS = 240     # at most; the loader's count and depth take 96 with 2 workers
STALLED = 64           # steps without a new decision that end the tuning early (a
                       # loader turn series is 48 steps with 2 workers)


def tune_first(build, limit):
    """Runs the "all" rung until autotune has decided every key it met (or
    ``limit`` steps); returns the steps and seconds it took, for the record."""
    from fastchain import tune
    if build is None:
        return None
    step, close = build()
    start, steps, last_progress, decided = time.perf_counter(), 0, 0, -1
    try:
        while steps < limit:
            step()
            steps += 1
            summary = tune.summary()
            now = sum(s['decided'] for s in summary.values())
            if now != decided:
                decided, last_progress = now, steps
            if steps >= 8 and summary and all(s['decided'] == s['keys']
                                              for s in summary.values()):
                break
            if steps - last_progress >= STALLED:
                break       # what is left is met rarely in this rung (a key of define-by-run)
    finally:
        close()
    summary = tune.summary()
    return {'steps': steps, 'seconds': round(time.perf_counter() - start, 1),
            'undecided': {k: s['keys'] - s['decided'] for k, s in summary.items()
                          if s['decided'] < s['keys']}}


def paired_ratio(rows, a, b):
    """Median over windows of a's speed over b's in the same window."""
    if a not in rows.windows or b not in rows.windows:
        return None
    pairs = [x / y for x, y in zip(rows.windows[a], rows.windows[b])]
    return round(statistics.median(pairs), 3)


def chart(result, path):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = {r['name']: r for r in result['rows']}
    names = [n for n in RUNGS + ('torch', 'baseline_again') if n in rows or
             any(u['name'] == n for u in result['unavailable'])]
    values = [rows[n]['value'] if n in rows else 0 for n in names]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bars = ax.bar(names, values, color=['#1f77b4' if n in rows else '#dddddd' for n in names])
    for bar, n in zip(bars, names):
        label = '{:.2f}'.format(rows[n]['value']) if n in rows else 'n/a'
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), label,
                ha='center', va='bottom', fontsize=8)
    ax.set_ylabel('iterations/s')
    m = result['machine']
    ax.set_title('ResNet-50, batch {}, {}px crops - {} ({} cores), {}'.format(
        result['config']['batch'], result['config']['crop'], m['cpu'], m['cores'],
        'GPU: ' + m['gpus'][0]['name'] if m['gpus'] else 'no GPU'), fontsize=9)
    plt.xticks(rotation=25, ha='right', fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = _common.parser('ladder', __doc__)
    p.add_argument('--batch', type=int, default=None)
    p.add_argument('--crop', type=int, default=None, help='training crop in pixels')
    p.add_argument('--images', type=int, default=None)
    p.add_argument('--device', default=None)
    p.add_argument('--cpu-fp16', action='store_true',
                   help='run the fp16 rungs on a CPU too (measured: ~80x slower than fp32)')
    args = p.parse_args(argv)
    import chainer
    from fastchain.backends import cuda
    from fastchain.data import available_cores, make_demo_dataset
    gpu = cuda.available()
    args.batch = args.batch or (32 if gpu else 16)
    args.crop = args.crop or (224 if gpu else 32)
    n_images = args.images or (320 if args.quick else 640)
    windows = args.windows or (3 if args.quick else 5)
    per_window = 4 if args.quick else 8
    # Warm-up: workers start, first calls, and for the cached rungs the
    # schedule build plus its two verified replays.
    warmup_iterations = 4
    device = chainer.get_device(args.device or ('@cupy:0' if gpu else '@numpy'))
    device.use()
    workers = available_cores()
    cudnn = cuda.cudnn_status()
    if not cudnn.available and cuda.available():
        # CuPy 14: cuDNN 9 through fastchain's graphs, or why not.
        from fastchain.cudnn._group import graph_status
        cudnn = graph_status()
    paths = make_demo_dataset(os.path.join(HERE, '.cache', 'ladder-jpegs-{}'.format(n_images)),
                              n_train=n_images // 10, n_val=0, size=(300, 640), seed=2018)

    rows = _common.Rows('iterations/s')
    builders = {}
    fp16_ok = gpu or args.cpu_fp16
    from fastchain.kernels import _onednn
    onednn_ok = _onednn.status(load=True)
    for rung in RUNGS:
        if rung in ('cudnn', 'autotune') and not cudnn.available:
            rows.skip(rung, 'cuDNN is not available here: {} (fix: {})'.format(
                cudnn.why, cudnn.fix))
            continue
        if rung in ('fp16', 'fp32_preprocessing') and not fp16_ok:
            rows.skip(rung, 'fp16 is a GPU rung: NumPy runs float16 matrix products '
                      'without BLAS (measured here: 31 s per iteration against 0.4 s in '
                      'fp32 for this model and batch); the later rungs stay in fp32. '
                      '--cpu-fp16 runs it anyway')
            continue
        if rung in ('onednn', 'all_onednn') and not onednn_ok[0]:
            rows.skip(rung, 'onednn is not available here: {} (fix: {})'.format(
                onednn_ok[2], onednn_ok[3]))
            continue
        builders[rung] = (lambda rung=rung: build_rung(rung, paths, args, device,
                                                       cudnn.available, fp16_ok))
    try:
        import torch    # noqa: F401
        torch.set_num_threads(workers)
        builders['torch'] = lambda: torch_rung(paths, args, workers)
    except ImportError:
        rows.skip('torch', 'PyTorch is not installed (pip install torch)')
    builders['baseline_again'] = builders['baseline']
    # autotune's choices are kept across rungs and windows (keyed by shapes and
    # structure): make them all before any window is timed, on the rung that
    # meets every key, so no rung's windows pay for the measurements.
    tuning = tune_first(builders.get('all'), TUNING_STEPS)
    warmup = {}
    names = list(builders)
    for w in range(windows):
        # Each window starts one rung later, so no rung always runs first or
        # right after another (a slow rung's leftovers, the order's drift).
        shift = w % len(names)
        for name in names[shift:] + names[:shift]:
            build = builders[name]
            t0 = time.perf_counter()
            step, close = build()
            try:
                for _ in range(warmup_iterations):
                    step()
                warmup.setdefault(name, round(time.perf_counter() - t0, 2))
                start = time.perf_counter()
                for _ in range(per_window):
                    step()
                rows.add(name, per_window / (time.perf_counter() - start))
            finally:
                close()
        print('window {}/{}: '.format(w + 1, windows) + ', '.join(
            '{} {:.2f}'.format(n, v[-1]) for n, v in rows.windows.items()), flush=True)

    ratios = {'{}/baseline'.format(r): rows.ratio(r, 'baseline')
              for r in RUNGS[1:] + ('torch', 'baseline_again')}
    ratios['all/torch'] = rows.ratio('all', 'torch')
    ratios['all_onednn/torch'] = rows.ratio('all_onednn', 'torch')
    # Paired: the median over windows of one window's ratio, which cancels
    # what drifts from window to window (the machine's load).
    for r in RUNGS[1:] + ('torch', 'baseline_again'):
        ratios['{}/baseline@paired'.format(r)] = paired_ratio(rows, r, 'baseline')
    ratios['all/cpu_conv@paired'] = paired_ratio(rows, 'all', 'cpu_conv')
    diff = changed_lines()
    config = {'model': 'ResNet-50 v1.5', 'batch': args.batch, 'crop': args.crop,
              'images': n_images, 'image_sides_px': [300, 640], 'device': str(device),
              'loader_workers': workers, 'windows': windows,
              'iterations_per_window': per_window,
              'tuning_before_the_windows': tuning,
              'warmup_seconds_first_window': warmup,
              'changed_lines_plain_to_all': len(diff), 'changed_lines': diff,
              'talk_changed_lines': 8}
    from fastchain import tune
    config['autotune_choices'] = tune.summary()
    notes = ['Changed lines from the plain script to the "all" row: {} ({}); the talk '
             'needed 8.'.format(len(diff), '; '.join(diff)),
             'autotune (on from the autotune rung up, and in "all"; choices are kept '
             'across rungs and windows, keyed by shapes and structure): ' +
             ('; '.join(tune.describe(config['autotune_choices'])) or 'nothing to choose'),
             'onednn and all_onednn: enable(onednn=True), oneDNN/PyTorch kernels that are '
             "NOT bitwise equal to Chainer's (README, 'What is the same training'); "
             'NumPy\'s BLAS on one thread while they run.',
             'Before the windows, the "all" rung ran until autotune had decided every key '
             '(choices are shared by the rungs): {}.'.format(tuning),
             'baseline_again is the baseline built again (an A/A control): '
             'baseline_again/baseline is this run\'s noise floor. Rungs take turns, each '
             'window starting one rung later; "@paired" ratios are medians of per-window '
             'ratios.',
             'Target on CPU: all/baseline >= 1.5.']
    result = _common.write('ladder', args, config, rows, ratios, notes)
    chart(result, os.path.join(args.results, 'ladder' + ('-quick' if args.quick else '')
                               + '.png'))


if __name__ == '__main__':
    main()
