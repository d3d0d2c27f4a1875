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
  torch               PyTorch eager ResNet-50, DataLoader with PIL (when torch is installed);
                        on a GPU as its users train there: channels-last, AMP (fp16
                        autocast, GradScaler), cudnn.benchmark, pinned batches
  baseline_again      the baseline built again, an A/A control: baseline_again/baseline is
                        the run's noise floor (a ratio no accelerator can be told apart from)

Before the rungs, loading a batch the baseline's way (in the training
process) is timed apart (``time_loading``): the note gives it and its share
of the baseline's step, the part of that step no cuDNN rung can speed up.

A rung that cannot run here is listed with the reason. Rows are
iterations per second (the median of the turns or windows below);
``RUNG/baseline`` is a rung's speed over the baseline's,
``RUNG/baseline@paired`` the median of the per-round (per-window) ratios.

``--interleave turns`` (the default on a CPU): every rung is built once, in
a process of its own, warmed up (worker start, first calls, schedule
building), and the rungs take turns of one untimed and four timed steps, the
other rungs' processes stopped meanwhile, their loader workers included
(``_turns.py``), for ``--windows`` rounds (8 quick, 40 full), each round
in a new order (shuffled, seeded). A round takes seconds, so a round's ratios share the
machine's state; on this shared machine its speed shifts in regimes of tens
of seconds, which windows of rebuilt rungs could not cancel. The "all" rung
is built first and runs until autotune has decided every key; the other
tuned rungs start from its choices (a cache file) and decide what is left
before their turns, so no turn pays for measurements. A choice timed over
whole steps (the loader's workers and depth, the static cache) takes turns
longer than the ladder's turns and windows: one the tuning leaves (its step
limit, ``STEP_KIND_STEPS``, or its share of ``--time-limit``) is decided
from the trials it had, and the notes name it.

``--interleave windows`` (the default on a GPU, where a dozen processes would
not fit in its memory at the largest batch): the rungs are rebuilt in this
process, window by window, each window starting one rung later; first the
"all" rung runs until autotune has decided every key (the choices are shared
by the rungs in the process).

Writes JSON (with every turn's or window's value, in order, under
``config['samples']``), a Markdown table and a PNG bar chart.
"""

import argparse
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
import _turns  # noqa: E402
from _images import list_pairs, torch_dataset  # noqa: E402
from ladder_scripts import plain, with_fastchain  # noqa: E402

# fastchain's CPU kernels: on a GPU they leave the step as the rung below
CPU_ONLY = ('fused_update', 'cpu_conv', 'onednn', 'all_onednn')
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


LOAD_BATCHES = 8       # batches timed by time_loading (after one untimed)


def time_loading(paths, batch, crop, batches=LOAD_BATCHES):
    """What loading one batch costs in the training process, as the baseline,
    cudnn and autotune rungs load (plain.py's dataset: JPEG decode, fp32
    crop, flip and normalisation; a SerialIterator; the batch concatenated
    on the host, as the converter does before its copy to the device):
    {'ms': the median of ``batches`` batches after one untimed, 'batches'}.
    On a GPU, where such a step is the host's, this is the loading's share
    of the baseline's step, measured apart."""
    import chainer
    dataset = plain.Preprocessed(list_pairs(paths), paths['root'], crop, numpy.float32)
    iterator = chainer.iterators.SerialIterator(dataset, batch, shuffle=True)
    times = []
    for _ in range(batches + 1):
        start = time.perf_counter()
        chainer.dataset.concat_examples(iterator.next())
        times.append(time.perf_counter() - start)
    return {'ms': round(statistics.median(times[1:]) * 1e3, 2), 'batches': batches}


def loading_note(loading, baseline):
    """The note on ``time_loading``'s figure beside the baseline's speed."""
    text = ('Loading a batch in the training process (the baseline, cudnn and autotune rungs\' '
            'way: JPEG decode, crop, flip and normalisation, a SerialIterator, the batch '
            'concatenated on the host), timed apart before the rungs: median {} ms over {} '
            'batches'.format(loading['ms'], loading['batches']))
    if baseline:
        text += ', {:.0%} of the baseline\'s step ({:.1f} ms)'.format(
            loading['ms'] / (1e3 / baseline), 1e3 / baseline)
    return text + '.'


def torch_rung(paths, args, workers, gpu=None):
    """PyTorch eager ResNet-50 with its DataLoader (PIL decode). On a GPU
    (``gpu``: its index) as PyTorch users train there: the model in
    channels-last, AMP (fp16 autocast with its GradScaler), cuDNN's
    autotuner (``cudnn.benchmark``), pinned batches copied without
    blocking; on a CPU in fp32. Returns (step, close)."""
    import torch
    import torch_resnet

    on_gpu = gpu is not None
    device = torch.device('cuda', gpu) if on_gpu else torch.device('cpu')
    loader = torch.utils.data.DataLoader(
        torch_dataset(paths, args.crop, plain.MEAN, 1 / 255), batch_size=args.batch,
        shuffle=True, num_workers=workers, drop_last=True, persistent_workers=workers > 0,
        pin_memory=on_gpu)
    train = torch_resnet.trainer(len(paths['classes']), device)
    state = {'it': iter(loader)}

    def step():
        try:
            x, t = next(state['it'])
        except StopIteration:
            state['it'] = iter(loader)
            x, t = next(state['it'])
        train(x, t)

    def close():
        # the loader's persistent workers end now, not when collected (windows
        # rebuild this rung: each window would leave its workers behind)
        it = getattr(loader, '_iterator', None) or state.get('it')
        shutdown = getattr(it, '_shutdown_workers', None)
        if shutdown is not None:
            shutdown()
        state.clear()
    return step, close


WARMUP_ITERATIONS = 5  # workers start; first calls, a schedule's build, 2 checks
TURN_SETTLE = 1        # untimed steps at the start of a turn (caches the others evicted)
TURN_STEPS = 4         # timed steps of a turn
BUILD_TIMEOUT = 1200   # seconds for a rung's process to build, warm up and tune
TUNING_STEPS = 240     # at most, while only keys timed per call are left
STEP_KIND_STEPS = 1200 # at most, while a choice timed over whole steps is left: the loader
                       # of a 16-core node takes 680 steps (worker counts) + up to 408 (depth)
STALLED = 64           # steps without a new decision that end the tuning early when
                       # only per-call keys are left (one met rarely, in define-by-run)
STEP_KINDS = ('loader_workers', 'loader_prefetch', 'static_graph', 'per_call_picks')
                       # timed over whole steps, in turns longer than the ladder's turns
                       # and windows: what the tuning leaves of them is decided early


def tune_first(build, limit, seconds=None):
    """Runs the "all" rung until autotune has decided every key it met (or
    ``limit`` steps, or ``seconds``); returns the steps and seconds it took,
    for the record."""
    if build is None:
        return None
    step, close = build()
    try:
        return settle_tuning(step, limit, seconds)
    finally:
        close()


def tuning_seconds(args):
    """The tuning pass's share of ``--time-limit``: half of what is left."""
    left = time_left(args)
    return None if left is None else max(left / 2, 0.0)


def settle_tuning(step, limit, seconds=None, step_limit=None):
    """Steps until autotune has decided every key met so far: at least 8
    steps; at most ``limit`` while only keys timed per call are left and
    ``step_limit`` (``STEP_KIND_STEPS``) while a choice timed over whole
    steps is; no longer than ``seconds`` once 8 steps ran; ``STALLED`` steps
    without a new decision end it where only per-call keys are left.

    A choice timed over whole steps still undecided then is decided from
    the trials it has (``decide_now``): one of its turns (the loader's:
    its slots plus two steps) is longer than a turn or a window of the
    ladder, so it would never finish there and the rung would run under
    whichever alternative a turn had begun. Returns the steps and seconds
    it took, what was decided early, and what stayed undecided."""
    from fastchain import tune
    from fastchain.tune import _steps, _tuner
    step_limit = STEP_KIND_STEPS if step_limit is None else step_limit
    start, steps, last_progress, decided, left = time.perf_counter(), 0, 0, -1, []
    while steps < (step_limit if set(left) & set(STEP_KINDS) else limit):
        if seconds is not None and steps >= 8 and time.perf_counter() - start > seconds:
            break       # the time limit's share
        step()
        steps += 1
        summary = tune.summary()
        now = sum(s['decided'] for s in summary.values())
        if now != decided:
            decided, last_progress = now, steps
        left = [k for k, s in summary.items() if s['decided'] < s['keys']]
        if _steps.pending() and 'per_call_picks' not in left:
            left.append('per_call_picks')       # due: it opens at the next quiet step
        if steps >= 8 and summary and not left:
            break
        if steps - last_progress >= STALLED and not set(left) & set(STEP_KINDS):
            break       # what is left is met rarely in this rung (a key of define-by-run)
    early = []
    for _ in range(len(STEP_KINDS) + 1):
        now_decided = _tuner.decide_now(STEP_KINDS)
        if not now_decided and not _steps.pending():
            break
        early += now_decided
        step()          # a decision can open the next choice (the loader's depth)
        steps += 1
    summary = tune.summary()
    return {'steps': steps, 'seconds': round(time.perf_counter() - start, 1),
            'decided_early': early,
            'undecided': {k: s['keys'] - s['decided'] for k, s in summary.items()
                          if s['decided'] < s['keys']}}


def undecided_step_kinds(tuning):
    """{rung: [kind]} of choices timed over whole steps that the tuning left
    undecided (met first after it: measured in the timed turns or windows)."""
    return {rung: sorted(set(t['undecided']) & set(STEP_KINDS))
            for rung, t in (tuning or {}).items()
            if t and set(t['undecided']) & set(STEP_KINDS)}


def decided_early(tuning):
    """{rung: ['kind key: picked (trials)']} of the choices the tuning pass
    decided before their measurements were done."""
    return {rung: ['{} {}: {} (trials {})'.format(d['kind'], d['key'], d['picked'], d['trials'])
                   for d in t['decided_early']]
            for rung, t in (tuning or {}).items() if t and t.get('decided_early')}


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


SKIP_FP16 = ('fp16 is a GPU rung: NumPy runs float16 matrix products without BLAS (measured '
             'here: 31 s per iteration against 0.4 s in fp32 for this model and batch); the '
             'later rungs stay in fp32. --cpu-fp16 runs it anyway')


def parse(argv):
    p = _common.parser('ladder', __doc__)
    p.add_argument('--batch', type=batch_arg, default=None,
                   help="images per step (default 32 on a GPU, 16 on a CPU); 'max' on a GPU: "
                        "the largest power of two from 64 at which the baseline's fp32 "
                        "step fits in its memory (probed first)")
    p.add_argument('--crop', type=int, default=None, help='training crop in pixels')
    p.add_argument('--images', type=int, default=None)
    p.add_argument('--device', default=None)
    p.add_argument('--cpu-fp16', action='store_true',
                   help='run the fp16 rungs on a CPU too (measured: ~80x slower than fp32)')
    p.add_argument('--interleave', choices=('turns', 'windows'), default=None,
                   help='turns: every rung built once in a process of its own, rungs taking '
                        'turns of a few steps, the others stopped meanwhile (default on a '
                        'CPU); windows: rungs rebuilt in this process window by window '
                        '(default on a GPU, where a dozen processes would not fit its '
                        'memory at the largest batch). With turns, --windows is the '
                        'number of rounds (8 quick, 40 full)')
    p.add_argument('--time-limit', type=float, default=None, metavar='SECONDS',
                   help='end the tuning pass by half of this many seconds from the start and '
                        'start no window (round) that would end after it; the report names '
                        'what was cut (the one command of a GPU node passes what its '
                        'deadline leaves)')
    p.add_argument('--rungs', type=rung_list, default=None, metavar='LIST',
                   help='comma-separated rungs to time, baseline among them (default: every '
                        'rung that can run here; from: {}); the others are listed as left '
                        'out. The "all" rung still runs the tuning pass when a tuned rung is '
                        'timed'.format(', '.join(ALL_ROWS)))
    p.add_argument('--serve', metavar='RUNG', help=argparse.SUPPRESS)
    p.add_argument('--tune-cache', metavar='PATH',
                   help="autotune's choices read from this file (enable()'s tune_cache) "
                        'before the tuning pass and written back after it: a later run on '
                        'the same machine and versions skips the measurements it holds '
                        '(the report counts the choices read from it); the rungs\' '
                        'processes share it on a CPU (turns)')
    p.add_argument('--tune-seconds', type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.started = time.monotonic()
    return args


ALL_ROWS = RUNGS + ('torch', 'baseline_again')


def rung_list(text):
    names = [n.strip() for n in text.split(',') if n.strip()]
    unknown = [n for n in names if n not in ALL_ROWS]
    if unknown:
        raise argparse.ArgumentTypeError('unknown rung(s) {}; choose from {}'.format(
            ', '.join(unknown), ', '.join(ALL_ROWS)))
    if 'baseline' not in names:
        raise argparse.ArgumentTypeError('baseline must be among them: every ratio is to it '
                                         '(e.g. baseline,{})'.format(','.join(names)))
    return names


def timed_rungs(args, builders, rows):
    """The rungs of ``builders`` to time (``--rungs``, or all of them);
    those left out are listed in ``rows`` with the reason."""
    chosen = getattr(args, 'rungs', None)
    if chosen is None:
        return list(builders)
    for name in builders:
        if name not in chosen:
            rows.skip(name, 'left out of this run (--rungs)')
    return [n for n in builders if n in chosen]


def batch_arg(text):
    if text == 'max':
        return text
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError('a batch of at least 1 image, or max')
    return value


PROBE_BATCHES = (64, 128, 256, 512, 1024)


def out_of_memory(error):
    """Whether ``error`` is a GPU's out-of-memory (CuPy's or PyTorch's)."""
    names = {type(error).__name__} | {c.__name__ for c in type(error).__mro__}
    return 'OutOfMemoryError' in names or 'out of memory' in str(error).lower()


def largest_batch(device, crop, n_classes, sync, release, candidates=PROBE_BATCHES):
    """The largest of ``candidates`` at which two steps of the baseline's
    model (ResNet-50, fp32, Chainer's own kernels, MomentumSGD) fit on
    ``device``, on random input of the ladder's crop; {batch: 'fits' or the
    error} for the record. The baseline's fp32 im2col step needs the most
    memory of the rungs; the others are built one at a time."""
    import chainer
    import chainer.links as L
    from fastchain.models import ResNet
    xp = device.xp
    best, tried = None, {}
    model = optimizer = x = t = None
    for batch in candidates:
        try:
            model = L.Classifier(ResNet(50, n_classes))
            model.to_device(device)
            optimizer = chainer.optimizers.MomentumSGD(lr=0.01).setup(model)
            x = xp.asarray(numpy.random.RandomState(0).standard_normal(
                (batch, 3, crop, crop)).astype(numpy.float32))
            t = xp.asarray(numpy.random.RandomState(1).randint(0, n_classes, batch)
                           .astype(numpy.int32))
            for _ in range(2):
                optimizer.update(model, x, t)
            sync()
            tried[batch], best = 'fits', batch
        except Exception as e:
            if not out_of_memory(e):
                raise
            tried[batch] = 'out of memory'
            break
        finally:
            model = optimizer = x = t = None
            release()
    return best, tried


def time_left(args):
    """Seconds left of ``--time-limit`` (None without one)."""
    if args.time_limit is None:
        return None
    return args.time_limit - (time.monotonic() - args.started)


def next_fits(args, last_seconds):
    """Whether one more window (round) as long as the last fits the limit."""
    left = time_left(args)
    return left is None or left >= last_seconds


class Setup:
    """What the coordinator and every rung process agree on."""

    def __init__(self, args):
        from fastchain.backends import cuda
        from fastchain.data import available_cores, make_demo_dataset
        self.args = args
        try:
            self.device = cuda.get_device(args.device)      # default: GPU 0 if usable
        except RuntimeError as e:
            sys.exit(str(e))
        self.gpu = self.device.xp is not numpy
        self.default_batch = 32 if self.gpu else 16
        args.crop = args.crop or (224 if self.gpu else 32)
        args.interleave = args.interleave or ('windows' if self.gpu else 'turns')
        self.device.use()
        self.probed = None
        if args.batch == 'max':
            if not self.gpu:
                sys.exit("--batch max: the largest batch that fits is a GPU's; this run is "
                         'on {} (give a number)'.format(self.device))
            from fastchain.data._demo import CLASSES
            args.batch, self.probed = largest_batch(self.device, args.crop, len(CLASSES),
                                                    self.sync, self.release)
            if args.batch is None:
                sys.exit('--batch max: not even {} images fit: {}'.format(
                    PROBE_BATCHES[0], self.probed))
            print('largest batch that fits: {} ({})'.format(args.batch, self.probed),
                  flush=True)
        args.batch = args.batch or self.default_batch
        # at least two batches of distinct images per epoch
        self.n_images = args.images or max(320 if args.quick else 640,
                                           -(-2 * args.batch // 10) * 10)
        self.workers = available_cores()
        try:
            import torch
            # PyTorch's threads (its rung and the onednn kernels) on the cores
            # the rungs use, set before any of them runs
            torch.set_num_threads(self.workers)
            self.has_torch = True
        except ImportError:
            self.has_torch = False
        cudnn = cuda.cudnn_status()
        if not cudnn.available and self.gpu:
            # CuPy 14: cuDNN 9 through fastchain's graphs, or why not.
            from fastchain.cudnn._group import graph_status
            cudnn = graph_status()
        self.cudnn = cudnn
        self.fp16_ok = self.gpu or args.cpu_fp16
        self.paths = make_demo_dataset(
            os.path.join(HERE, '.cache', 'ladder-jpegs-{}'.format(self.n_images)),
            n_train=self.n_images // 10, n_val=0, size=(300, 640), seed=2018)

    def rungs(self, rows):
        """{name: build} of the rungs that can run here (the others are
        listed in ``rows`` with the reason)."""
        from fastchain.kernels import _onednn
        onednn_ok = _onednn.status(load=True)
        builders = {}
        for rung in RUNGS:
            if rung in CPU_ONLY and self.gpu:
                rows.skip(rung, 'a CPU rung: on a GPU it changes nothing (the same steps as the '
                          'rung below it)')
                continue
            if rung in ('cudnn', 'autotune') and not self.cudnn.available:
                rows.skip(rung, 'cuDNN is not available here: {} (fix: {})'.format(
                    self.cudnn.why, self.cudnn.fix))
                continue
            if rung in ('fp16', 'fp32_preprocessing') and not self.fp16_ok:
                rows.skip(rung, SKIP_FP16)
                continue
            if rung in ('onednn', 'all_onednn') and not onednn_ok[0]:
                rows.skip(rung, 'onednn is not available here: {} (fix: {})'.format(
                    onednn_ok[2], onednn_ok[3]))
                continue
            builders[rung] = (lambda rung=rung: build_rung(
                rung, self.paths, self.args, self.device, self.cudnn.available,
                self.fp16_ok))
        if self.has_torch:
            builders['torch'] = self.torch_rung
        else:
            rows.skip('torch', 'PyTorch is not installed (pip install torch)')
        builders['baseline_again'] = builders['baseline']
        return builders

    def torch_rung(self):
        return torch_rung(self.paths, self.args, self.workers,
                          self.device.device.id if self.gpu else None)

    def sync(self):
        """Waits for the GPU's work (every stream: PyTorch's too)."""
        if self.gpu:
            self.device.device.synchronize()

    def release(self):
        """Gives back the memory a closed rung's pools keep (windows rebuild
        rungs in one process: at the largest batch, what CuPy's and
        PyTorch's pools hold from the last rung would not leave room)."""
        if self.gpu:
            import cupy
            self.sync()
            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()
            torch = sys.modules.get('torch')
            if torch is not None and torch.cuda.is_initialized():
                torch.cuda.empty_cache()


def tuned(rung):
    """Whether autotune is on in ``rung`` (it chooses, so it is decided first)."""
    if rung in ('all', 'all_onednn'):
        return True
    if rung in ('torch', 'baseline_again'):
        return False
    return rung_options(rung, True)[0]['autotune']


def serve(argv):
    """A rung's process (``--interleave turns``): build the rung, warm it up,
    let autotune decide its keys (starting from what the tuning rung kept in
    the cache file), then run turns when told (:mod:`_turns`)."""
    fd, argv = _turns.reply_fd(argv)
    args = parse(argv)
    setup = Setup(args)
    rung = args.serve
    state = {}

    from fastchain import tune

    def build():
        from fastchain.tune import _cache
        builders = setup.rungs(_common.Rows('iterations/s'))
        if tuned(rung) and args.tune_cache:
            _cache.load(args.tune_cache)
        t0 = time.perf_counter()
        step, close = builders[rung]()
        state['close'] = close
        for _ in range(WARMUP_ITERATIONS):
            step()
        info = {'warmup_seconds': round(time.perf_counter() - t0, 2)}
        if tuned(rung):
            info['tuning'] = settle_tuning(step, TUNING_STEPS, args.tune_seconds)
            if args.tune_cache:
                _cache.save(args.tune_cache)
        return step, finish, info

    def finish():
        # what autotune decided, as it stands at the end (turns may have
        # decided what the tuning left)
        summary = tune.summary() if tuned(rung) else None
        state['close']()
        return summary

    _turns.serve(fd, build, setup.sync)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if _turns.REPLY_FD_FLAG in argv:
        return serve(argv)
    args = parse(argv)
    setup = Setup(args)
    rows = _common.Rows('iterations/s')
    builders = setup.rungs(rows)
    timed = timed_rungs(args, builders, rows)
    setup.loading = time_loading(setup.paths, args.batch, args.crop)
    if args.interleave == 'turns':
        measured = run_turns(args, setup, timed, rows, argv, builders)
    else:
        measured = run_windows(args, builders, rows, setup, on_window=lambda m: report(
            args, setup, rows, m, final=False), timed=timed)    # what a run cut off keeps
    report(args, setup, rows, measured)


def run_turns(args, setup, names, rows, argv, builders=()):
    """Every rung in a process of its own, taking turns (:mod:`_turns`); the
    tuning rung ("all") is built first and its choices are what the other
    tuned rungs start from (a cache file)."""
    import tempfile
    n_rounds = args.windows or (8 if args.quick else 40)
    order = sorted(names, key=lambda n: n != 'all')      # the tuning rung first
    if 'all' not in names and any(tuned(n) for n in names) and 'all' in builders:
        order.insert(0, 'all')      # built for its choices only, not timed
    ready, byes = {}, {}
    with tempfile.TemporaryDirectory(prefix='ladder-') as tmp, \
            _turns.Coordinator() as coordinator:
        cache = args.tune_cache or os.path.join(tmp, 'tune.json')
        base = [sys.executable, os.path.abspath(__file__)] + argv + ['--tune-cache', cache]
        share, began = tuning_seconds(args), time.monotonic()     # for all rungs together
        for name in order:
            seconds = None if share is None else max(0.0, share - (time.monotonic() - began))
            rung = coordinator.start(name, base + ['--serve', name] + (
                [] if seconds is None else ['--tune-seconds', str(seconds)]))
            ready[name] = rung.reply(BUILD_TIMEOUT)['ready']
            rung.stop()
            print('built {}: {}'.format(name, ready[name]), flush=True)
            if name not in names:
                byes[name] = rung.close()       # its choices are in the cache file
        rungs = {n: coordinator.rungs[n] for n in names}        # the rungs' own order

        def record(name, seconds):
            rows.add(name, TURN_STEPS / seconds)

        done = {'rounds': 0, 'at': time.monotonic()}

        def progress(r):
            print('round {}/{}: '.format(r + 1, n_rounds) + ', '.join(
                '{} {:.2f}'.format(n, v[-1]) for n, v in rows.windows.items()), flush=True)
            now = time.monotonic()
            last, done['at'], done['rounds'] = now - done['at'], now, r + 1
            return not next_fits(args, last)         # True ends the rounds

        _turns.rounds(rungs, n_rounds, TURN_SETTLE, TURN_STEPS, record, on_round=progress)
        byes.update({name: rung.close() for name, rung in rungs.items()})
    summary = (byes.get('all') or {}).get('bye')
    return {'interleave': 'turns', 'rounds': done['rounds'], 'rounds_planned': n_rounds,
            'turn': {'settle_steps': TURN_SETTLE, 'timed_steps': TURN_STEPS},
            'warmup': {n: r.get('warmup_seconds') for n, r in ready.items()},
            'tuning': {n: r['tuning'] for n, r in ready.items() if 'tuning' in r},
            'autotune_choices': summary}


def run_windows(args, builders, rows, setup=None, on_window=None, timed=None):
    """Rungs rebuilt in this process, one window each, window by window;
    the clock is read with the device synchronised (``setup.sync``), and a
    closed rung's memory is given back before the next is built. On a GPU a
    rung with loader workers warms up past what they load ahead
    (``warmup_steps``) and windows time more steps. ``on_window(measured)``
    after each rung (the partial report: a run cut off keeps it). ``timed``:
    the rungs of ``builders`` to time (default: all); "all" runs the tuning
    pass even when left out of them, if a tuned rung is among them."""
    import gc
    from fastchain import tune
    sync = setup.sync if setup is not None else (lambda: None)
    release = setup.release if setup is not None else (lambda: None)
    gpu = setup is not None and setup.gpu
    windows = args.windows or (3 if args.quick else 5)
    per_window = (16 if args.quick else 32) if gpu else (4 if args.quick else 8)
    if setup is not None and args.batch > setup.default_batch:
        # a larger batch (the largest that fits): fewer steps, about as many images
        per_window = max(4, per_window * setup.default_batch // args.batch)
    # autotune's choices are kept across rungs and windows (keyed by shapes and
    # structure): make them before any window is timed, so no rung's windows
    # pay for the measurements: on the "all" rung, and on a GPU also on the
    # autotune rung, whose fp32 keys the fp16 "all" rung never meets.
    names = list(builders) if timed is None else list(timed)
    tuning = {}
    cache = {'path': getattr(args, 'tune_cache', None)}
    if cache['path']:
        from fastchain.tune import _cache
        cache['read'] = _cache.load(cache['path'])

    def keep_choices():
        if cache['path']:
            cache['holds'] = _cache.save(cache['path'])
    for name in ('all', 'autotune') if gpu else ('all',):
        if name not in builders or not any(tuned(n) for n in names) or (
                name == 'autotune' and name not in names):
            continue
        try:
            tuning[name] = tune_first(builders[name], TUNING_STEPS, tuning_seconds(args))
        except Exception as e:
            if not out_of_memory(e):
                raise
            tuning[name] = {'steps': 0, 'seconds': 0.0, 'decided_early': [], 'undecided': {},
                            'error': 'out of memory at batch {}: {}'.format(args.batch, e)}
        if gpu:
            gc.collect()
        release()
    keep_choices()
    warmup = {}
    ran, last, out_of_room, cut = 0, 0.0, {}, False

    def measured():
        return {'interleave': 'windows', 'windows': ran, 'windows_planned': windows,
                'iterations_per_window': per_window,
                'warmup_steps': {n: warmup_steps(n, setup) for n in names},
                'warmup': warmup, 'cut_mid_window': cut, 'out_of_memory': out_of_room,
                'tuning': tuning, 'autotune_choices': tune.summary(),
                **({'tune_cache': dict(cache)} if cache['path'] else {})}

    for w in range(windows):
        if w and not next_fits(args, last):
            break           # --time-limit: the report says how many windows ran
        began = time.monotonic()
        # Each window starts one rung later, so no rung always runs first or
        # right after another (a slow rung's leftovers, the order's drift).
        shift = w % len(names)
        for name in names[shift:] + names[:shift]:
            if name in out_of_room:
                continue
            left = time_left(args)
            if left is not None and left < 0:
                cut = True  # past the limit inside a window: its other rungs are left out
                break
            t0, step, close = time.perf_counter(), None, None
            try:
                step, close = builders[name]()
                for _ in range(warmup_steps(name, setup)):
                    step()
                sync()
                warmup.setdefault(name, round(time.perf_counter() - t0, 2))
                start = time.perf_counter()
                for _ in range(per_window):
                    step()
                sync()
                rows.add(name, per_window / (time.perf_counter() - start))
            except Exception as e:
                if not out_of_memory(e):
                    raise
                # named, not fatal: the other rungs go on at this batch (a rung
                # with windows already measured keeps them, the note says why
                # it has fewer)
                out_of_room[name] = 'window {}: {}'.format(w + 1, e)
                if name not in rows.windows:
                    rows.skip(name, 'out of memory at batch {}: {}'.format(args.batch, e))
            finally:
                if close is not None:
                    close()
                step = close = None         # the rung's arrays unreferenced, then freed
                if gpu:
                    gc.collect()
                release()
            if on_window is not None:
                on_window(measured())
        keep_choices()      # what this window decided: kept if the run is stopped later
        print('window {}/{}: '.format(w + 1, windows) + ', '.join(
            '{} {:.2f}'.format(n, v[-1]) for n, v in rows.windows.items()), flush=True)
        last, ran = time.monotonic() - began, w + 1
        if on_window is not None:
            on_window(measured())
        if cut:
            break
    keep_choices()          # and what the windows decided
    return measured()


LOADER_WARMUP_PER_WORKER = 4    # a worker keeps 2 batches ahead (fastchain's slots,
                                # PyTorch's prefetch_factor): twice that to drain them


def warmup_steps(name, setup):
    """Untimed steps before a window: ``WARMUP_ITERATIONS``, and on a GPU,
    for a rung with loader workers, ``LOADER_WARMUP_PER_WORKER`` per worker,
    so the batches they loaded ahead are used up before the clock starts (a
    window of a few steps would otherwise time the buffer, not the loader)."""
    if setup is None or not setup.gpu or not has_loader(name):
        return WARMUP_ITERATIONS
    return WARMUP_ITERATIONS + LOADER_WARMUP_PER_WORKER * setup.workers


def has_loader(name):
    """Whether the rung loads with worker processes."""
    if name in ('all', 'all_onednn', 'torch'):
        return True
    return name in RUNGS and rung_options(name, True)[0]['loader_workers'] != 0


def report(args, setup, rows, measured, final=True):
    """The results; ``final=False``: a partial report written during the
    run (no chart, nothing printed, a note saying so)."""
    from fastchain import tune
    ratios = {'{}/baseline'.format(r): rows.ratio(r, 'baseline')
              for r in RUNGS[1:] + ('torch', 'baseline_again')}
    ratios['all/torch'] = rows.ratio('all', 'torch')
    ratios['all_onednn/torch'] = rows.ratio('all_onednn', 'torch')
    # Paired: the median over windows (rounds) of one window's ratio, which
    # cancels what drifts from window to window (the machine's load).
    for r in RUNGS[1:] + ('torch', 'baseline_again'):
        ratios['{}/baseline@paired'.format(r)] = paired_ratio(rows, r, 'baseline')
    ratios['all/cpu_conv@paired'] = paired_ratio(rows, 'all', 'cpu_conv')
    diff = changed_lines()
    config = {'model': 'ResNet-50 v1.5', 'batch': args.batch, 'crop': args.crop,
              'largest_batch_probe': setup.probed,
              'images': setup.n_images, 'image_sides_px': [300, 640],
              'device': str(setup.device), 'loader_workers': setup.workers,
              'warmup_iterations': WARMUP_ITERATIONS,
              'changed_lines_plain_to_all': len(diff), 'changed_lines': diff,
              'talk_changed_lines': 8}
    config.update(measured)
    loading = getattr(setup, 'loading', None)
    if loading is not None:
        config['loading_in_process'] = loading
    config['samples'] = {n: [round(v, 4) for v in vs] for n, vs in rows.windows.items()}
    choices = measured['autotune_choices'] or {}
    if measured['interleave'] == 'turns':
        how = ('Each rung was built once in a process of its own and warmed up; the rungs '
               'then took turns of {} untimed and {} timed steps, the others\' processes '
               '(their loader workers included) stopped meanwhile, for {} rounds, each round '
               'in a new order (shuffled, seeded); rows are medians of the turns, "@paired" ratios '
               'medians of per-round ratios. The "all" rung was built first and ran until '
               'autotune had decided every key; the other tuned rungs started from its choices '
               '(a cache file) and decided what was left before their turns: {}.').format(
                   TURN_SETTLE, TURN_STEPS, measured['rounds'], measured['tuning'])
    else:
        how = ('Before the windows, the "all" rung (and on a GPU the autotune rung, for its '
               'fp32 keys) ran until autotune had decided every key (choices are shared by '
               'the rungs): {}. Rungs take turns, each window starting one rung later; '
               '"@paired" ratios are medians of per-window ratios.').format(measured['tuning'])
        kept = measured.get('tune_cache')
        if kept:
            how += (" Autotune's cache file {}: {} choices of this machine and versions "
                    'read from it before the tuning pass (decided by an earlier run; a key '
                    'met again with the same alternatives was not measured again), {} held '
                    'after this run.').format(kept['path'], kept.get('read', 0),
                                              kept.get('holds', 'none'))
    notes = ['Changed lines from the plain script to the "all" row: {} ({}); the talk '
             'needed 8.'.format(len(diff), '; '.join(diff)),
             'autotune (on from the autotune rung up, and in "all"; keyed by shapes and '
             'structure; the "all" rung\'s choices): ' +
             ('; '.join(tune.describe(choices)) or 'nothing to choose'),
             'onednn and all_onednn: enable(onednn=True), oneDNN/PyTorch kernels that are '
             "NOT bitwise equal to Chainer's (README, 'The same training'); "
             'NumPy\'s BLAS on one thread while they run.',
             how,
             'baseline_again is the baseline built again (an A/A control): '
             'baseline_again/baseline is this run\'s noise floor.',
             ('PyTorch (torch row): channels-last, AMP (fp16 autocast with its '
              'GradScaler), cudnn.benchmark, pinned batches copied without blocking; the clock '
              'is read with the device synchronised.' if setup.gpu else
              'PyTorch (torch row): fp32 on the CPU, its own threads on the same cores.'),
             ('Targets on a GPU (issue #19): autotune/baseline >= 2.1 (the talk\'s cuDNN and '
              'autotune rungs), all/torch >= 0.8.' if setup.gpu else
              'Target on CPU: all/baseline >= 1.5.')]
    if loading is not None:
        notes.append(loading_note(loading, rows.median('baseline')
                                  if 'baseline' in rows.windows else None))
    unit = 'rounds' if measured['interleave'] == 'turns' else 'windows'
    if measured.get('out_of_memory'):
        notes.insert(0, 'WARNING: rungs out of GPU memory at batch {} (left out from then '
                     'on): {}.'.format(args.batch, measured['out_of_memory']))
    if not final:
        notes.insert(0, 'PARTIAL: written during the run after {} complete {} of {} (the run '
                     'was cut off if no later report replaced this one).'.format(
                         measured[unit], unit, measured[unit + '_planned']))
    elif measured.get('cut_mid_window'):
        notes.insert(0, 'WARNING: --time-limit {} s was reached inside window {}: the rungs '
                     'after that point have one window fewer.'.format(args.time_limit,
                                                                      measured[unit]))
    if final and measured[unit] < measured[unit + '_planned']:
        notes.insert(0, 'WARNING: --time-limit {} s: {} of the {} {} ran (the figures rest '
                     'on fewer samples than planned).'.format(
                         args.time_limit, measured[unit], measured[unit + '_planned'], unit))
    early = decided_early(measured['tuning'])
    if early:
        notes.insert(0, 'WARNING: choices timed over whole steps were decided before their '
                     'measurements were done (the tuning pass reached its step or time limit), '
                     'from the trials they had; those rungs ran with these choices: '
                     '{}.'.format(early))
    late = undecided_step_kinds(measured['tuning'])
    if late:
        notes.insert(0, 'WARNING: choices timed over whole steps were still undecided when the '
                     'timing began, so they were measured during it (in turns, across the '
                     'stops) and those rungs ran with changing choices: {}.'.format(late))
    # another batch than the device's default (the largest that fits, on a
    # GPU) is written beside the default's results, not over them
    name = 'ladder' + ('' if args.batch == setup.default_batch else '-b{}'.format(args.batch))
    result = _common.write(name, args, config, rows, ratios, notes, quiet=not final)
    if final:
        chart(result, os.path.join(args.results, name + ('-quick' if args.quick else '')
                                   + '.png'))


if __name__ == '__main__':
    main()
