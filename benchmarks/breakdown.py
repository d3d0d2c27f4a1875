"""Where a ResNet-50 training step's time goes, on the device present: the
host's phases and, on a GPU, the device's kernels, for plain Chainer, the
ladder's GPU rungs and PyTorch, one after another in one process.

    python benchmarks/breakdown.py                  # on GPU 0 where one works
    python benchmarks/breakdown.py --quick          # fewer steps
    python benchmarks/breakdown.py --device @numpy --batch 2 --crop 32 --width 4
                                                    # the host side, on a CPU

The data are a fixed set of synthetic images in host memory (two batches,
no JPEG decode, no loader workers): what is measured is the step's model
part, its conversion and copy to the device included. The ladder times
loading apart (its ``time_loading``).

Variants (the options of the ladder's rungs named, autotune off in all of
them: cuDNN's heuristic plan for each key; autotune added 1% in the ladder's
first GPU run, and tuning every key takes minutes of a GPU's time):

  baseline       plain Chainer (use_cudnn 'never': convolutions as im2col + GEMM), fp32
  static_graph   fastchain's cuDNN graphs, fp16 compute with fp32 master weights and
                 loss scaling, and the static-subgraph cache (on a CPU: the cache alone)
  torch          PyTorch eager ResNet-50 on the same batch (on a GPU with AMP,
                 channels-last and cudnn.benchmark), when torch is installed
  cudnn          cuDNN alone (fastchain's graphs on CuPy 14, CuPy's own cuDNN on
                 CuPy 13), fp32 (a GPU's; left out, with the reason, where neither runs)
  fp16           the cuDNN graphs and fp16 on fp32 data cast on the device (the
                 ladder's fp32_preprocessing rung; a GPU's)
  static_graph_bn     static_graph with BatchNormalization's cuDNN graphs on
                      (FASTCHAIN_CUDNN_BN=1; a GPU's; run after static_graph)
  static_graph_stats  static_graph with BatchNormalization's two-level CuPy
                      reductions (FASTCHAIN_CUDNN_BN=stats; a GPU's)

They run in ``VARIANTS``' order: baseline, static_graph, static_graph_bn,
static_graph_stats, torch, cudnn, fp16; one after another,
so their ratios carry whatever drifted between them: indications, not the
side-by-side comparisons of BENCHMARKS.md.

Each variant is built, warmed up (``--warmup`` steps: first calls, graph
builds, the schedule), runs ``--steps`` timed steps, then on a GPU
``--profiled`` more under PyTorch's profiler, each step ended by a device
synchronisation (so a step's work is inside its own window; training
without it overlaps a step's tail with the next step's launches). A variant
that fails is named with its error and the others still run; the report is
written after every variant. Measured:

- the step's wall time (host clock, after the synchronisation; the timed
  steps, without the profiler);
- the host's phases: fastchain's in-process timeline (``enable(timeline=
  ...)``: data, convert, forward, backward, loss_scale, update), medians
  over the timed steps. On a GPU these are the host's time in each phase:
  a phase that waits for the device (a synchronisation) holds the device's
  time too;
- which convolution calls ran on cuDNN graphs and which stayed Chainer's,
  with the reasons (``cudnn_paths``);
- on a GPU, from PyTorch's profiler, which records every kernel and copy of
  the process through CUPTI (CuPy's, cuBLAS's, cuDNN's, NCCL's as well as
  PyTorch's): the device's busy time per step (the union of its kernels and
  copies), its idle share (the part of the step the device waited for the
  host; an upper bound, the profiler's tracing costing the host a little),
  the device time by kind of work (classes of kernel names, ``KINDS``) and
  by the host phase that launched it (a kernel's launch call, matched by its
  correlation id, placed in the timeline's phases; ``located_share`` says
  how much of the device time could be placed), and the kernels that took
  the most time.

Writes JSON and Markdown (``breakdown[-quick].json/.md``) and, with
``--traces DIR``, each variant's profiler trace (Perfetto opens them).
"""

import collections
import json
import os

# PyTorch's profiler leaves CUPTI attached after a session unless this is
# '1' (Kineto reads it when a session stops), and a process it stays
# attached to runs slower: every variant after the first one profiled would
# be timed with it. Set before torch is imported; fastchain captures no CUDA
# graph (the case that variable's default protects).
os.environ.setdefault('TEARDOWN_CUPTI', '1')
import re
import statistics
import sys
import tempfile
import time
import warnings

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

# run in this order: the fullest of fastchain's first after the baseline, then
# its BatchNormalization alternatives (what the next GPU run decides on), and
# the peer (a run cut off at its limit keeps those); cudnn and fp16 then split
# the static_graph variant's gain into its parts
VARIANTS = ('baseline', 'static_graph', 'static_graph_bn', 'static_graph_stats', 'torch',
            'cudnn', 'fp16')
GPU_VARIANTS = ('cudnn', 'fp16', 'static_graph_bn', 'static_graph_stats')  # CPU: baseline's
# the ladder's rung of the same options; static_graph_bn: static_graph's with
# BatchNormalization's cuDNN graphs turned on (FASTCHAIN_CUDNN_BN=1, off by default);
# static_graph_stats: with its two-level CuPy reductions instead (FASTCHAIN_CUDNN_BN=stats)
RUNG = {'fp16': 'fp32_preprocessing', 'static_graph_bn': 'static_graph',
        'static_graph_stats': 'static_graph'}
BN_ON = {'static_graph_bn': '1', 'static_graph_stats': 'stats'}   # the variable's value
BN_ENV = 'FASTCHAIN_CUDNN_BN'           # fastchain.cudnn._layers.BN_ENV
STEP_ANNOTATION = 'fastchain.breakdown.step'
CLASSES = 1000
# kind of device work: the first pattern the lower-cased kernel name matches
KINDS = (
    ('allreduce (NCCL)', r'nccl'),
    ('convolution (im2col + col2im)', r'im2col|col2im'),
    ('batch normalization', r'bn_|batch_norm|batchnorm|update_mean_var'),
    ('convolution (cuDNN)', r'conv|fprop|dgrad|wgrad|implicit_gemm|winograd'),
    ('pooling', r'pool'),
    ('softmax and loss', r'softmax|crossent|nll_loss'),
    # CuPy's two-operand maximum/minimum (Chainer's ReLU), cuDNN's activations
    ('elementwise', r'maximum|minimum|activation'),
    ('layout (NCHW <-> NHWC)', r'nchwtonhwc|nhwctonchw|nchw2nhwc|nhwc2nchw|transpose'),
    ('convolution (cuDNN)', r'cudnn'),      # cuDNN's other kernels: its convolution engines
    ('GEMM', r'gemm|gemv|nvjet|cutlass|xmma|splitkreduce'),
    ('optimizer update', r'momentum|sgd|adam|multi_tensor'),
    ('copy', r'^memcpy|^memset|copy'),
    # CuPy's reductions (cupy_sum, cupy_var_core_float32, ...; Chainer's
    # BatchNormalization statistics among them) and other reduce kernels
    ('reduction', r'^cupy_(sum|prod|max|min|amax|amin|argmax|argmin|mean|var|nanmean|'
                  r'nanvar|nansum|all|any|count_nonzero)|reduce'),
)


def kind(name):
    low = name.lower()
    for label, pattern in KINDS:
        if re.search(pattern, low):
            return label
    return 'elementwise'


# -- the profiler's trace ----------------------------------------------------

def read_trace(trace):
    """From a PyTorch profiler trace (the chrome-trace dict its
    ``export_chrome_trace`` writes; times in microseconds): ``steps`` ((start,
    end) of each ``STEP_ANNOTATION``), ``work`` ((name, start, end,
    correlation) of each kernel, copy and memset on the device) and
    ``launches`` ({correlation: host time of the launch call})."""
    steps, work, launches = [], [], {}
    for e in trace.get('traceEvents', ()):
        if e.get('ph') != 'X':
            continue
        cat, args = e.get('cat'), e.get('args') or {}
        start = float(e['ts'])
        end = start + float(e.get('dur', 0))
        if cat == 'user_annotation' and e.get('name') == STEP_ANNOTATION:
            steps.append((start, end))
        elif cat in ('kernel', 'gpu_memcpy', 'gpu_memset'):
            name = e.get('name', '?')
            if cat != 'kernel' and not name.lower().startswith(('memcpy', 'memset')):
                name = cat.replace('gpu_', '') + ' ' + name
            work.append((name, start, end, args.get('correlation')))
        elif cat in ('cuda_runtime', 'cuda_driver') and args.get('correlation') is not None:
            launches[args['correlation']] = start
    steps.sort()
    work.sort(key=lambda w: w[1])
    return {'steps': steps, 'work': work, 'launches': launches}


def union(intervals):
    """Total length covered by (start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def device_breakdown(read, phase_at=None):
    """Per step (medians over the steps; ms): ``step`` (the annotation's
    window), ``busy`` (the union of the device's work inside it), ``idle_share``;
    totals per step (means; ms) of device time by ``kinds`` and, with
    ``phase_at`` (trace time of a launch -> the host phase, or None), by
    ``phases``; ``top`` kernels by time; ``work`` (how many were recorded)."""
    steps, work = read['steps'], read['work']
    per_step, by_kind, by_phase = [], collections.Counter(), collections.Counter()
    by_name = collections.Counter()
    inside = 0
    for start, end in steps:
        mine = [(max(s, start), min(e, end)) for _, s, e, _ in work if s < end and e > start]
        busy = union(mine)
        per_step.append({'step': (end - start) / 1e3, 'busy': busy / 1e3,
                         'idle_share': 1 - busy / (end - start) if end > start else 0.0})
    for name, s, e, corr in work:
        if not any(s < hi and e > lo for lo, hi in steps):
            continue
        inside += 1
        by_kind[kind(name)] += e - s
        by_name[name] += e - s
        if phase_at is not None:
            launched = read['launches'].get(corr)
            phase = phase_at(launched) if launched is not None else None
            by_phase[phase or 'unknown'] += e - s
    n = len(steps) or 1
    total = sum(by_kind.values())
    result = {'steps': len(steps), 'work': inside,
              'kinds': {k: round(v / n / 1e3, 3) for k, v in by_kind.most_common()},
              'phases': {k: round(v / n / 1e3, 3) for k, v in by_phase.most_common()},
              'top': [(name[:120], round(v / n / 1e3, 3)) for name, v in by_name.most_common(8)]}
    if phase_at is not None:
        # the self-check of the attribution: the share of device time whose
        # launch call was found and placed in a host phase, and how far the
        # steps' clock offsets spread
        result['located_share'] = round(1 - by_phase.get('unknown', 0) / total, 4) \
            if total else None
        result['offset_spread_us'] = getattr(phase_at, 'spread_us', None)
    if per_step:
        for key in ('step', 'busy', 'idle_share'):
            result[key] = round(statistics.median(s[key] for s in per_step), 4)
    return result


def phase_locator(ranges, host_starts, trace_starts):
    """trace time (us) -> the innermost host phase (timeline ranges, ns of
    ``time.perf_counter_ns``) at that time: 'other' inside a step and none of
    its phases, None outside the steps. The two clocks are matched by
    the steps: the median of (trace start - host start) over them."""
    from fastchain.nvtx._summary import PHASES
    if not host_starts or len(host_starts) != len(trace_starts):
        return None
    offsets = [t * 1e3 - h for h, t in zip(host_starts, trace_starts)]
    offset = statistics.median(offsets)
    spans = sorted((r.start, r.end, r.depth, r.category) for r in ranges
                   if r.category in PHASES or (r.category, r.name) == ('step', 'step'))

    def at(trace_us):
        ns = trace_us * 1e3 - offset
        best = None
        for start, end, depth, category in spans:
            if start > ns:
                break
            if end >= ns and (best is None or depth >= best[0]):
                best = (depth, category)
        if best is None:
            return None
        return 'other' if best[1] == 'step' else best[1]    # in a step, in none of its phases
    at.spread_us = round((max(offsets) - min(offsets)) / 1e3, 1)
    return at


# -- the variants --------------------------------------------------------------

def chainer_variant(name, device, batch, crop, width, timeline):
    """(step, close, handle, the enable() options) of one of the Chainer variants."""
    import chainer
    import chainer.links as L
    from chainer import training
    import fastchain
    from fastchain.models import ResNet
    from ladder import rung_options
    # fp16's rung with fp32 data, cast on the device (the ladder's fp32_preprocessing)
    gpu = device.xp is not numpy
    options, _ = rung_options(RUNG.get(name, name), gpu, fp16_ok=gpu)
    options.update(autotune=False, loader_workers=0, prefetch_to_device=False,
                   timeline=timeline)
    if name in BN_ON:       # read by the layer at each call; the run loop puts it back
        os.environ[BN_ENV] = BN_ON[name]
    handle = fastchain.enable(**options)
    # the timeline is read in this process: its trace, chart and summary files
    # (written when the handle is disabled) are not wanted
    handle.resources['timeline'].save = lambda *a, **k: None
    numpy.random.seed(0)
    model = L.Classifier(ResNet(50, CLASSES, width=width))
    model.to_device(device)
    optimizer = chainer.optimizers.MomentumSGD(lr=0.01)
    optimizer.setup(model)
    rng = numpy.random.RandomState(1)
    data = chainer.datasets.TupleDataset(
        rng.uniform(-1, 1, (2 * batch, 3, crop, crop)).astype(numpy.float32),
        rng.randint(0, CLASSES, 2 * batch).astype(numpy.int32))
    iterator = chainer.iterators.SerialIterator(data, batch, shuffle=False)
    updater = training.StandardUpdater(iterator, optimizer, device=device)

    def close():
        updater.finalize()
        for h in reversed(fastchain.active_handles()):
            h.disable()
    return updater.update, close, handle, options


def torch_variant(device, batch, crop, width):
    """(step, close, None, its settings) of PyTorch's variant
    (``torch_resnet.trainer``) on the same kind of synthetic batch."""
    import torch
    import torch_resnet
    on_gpu = device.xp is not numpy
    dev = torch.device('cuda', device.device.id) if on_gpu else torch.device('cpu')
    torch.manual_seed(0)
    train = torch_resnet.trainer(CLASSES, dev, width=width)
    rng = numpy.random.RandomState(1)
    x_host = torch.from_numpy(rng.uniform(-1, 1, (batch, 3, crop, crop)).astype(numpy.float32))
    t_host = torch.from_numpy(rng.randint(0, CLASSES, batch).astype(numpy.int64))
    if on_gpu:
        x_host, t_host = x_host.pin_memory(), t_host.pin_memory()

    def close():
        train.optimizer.zero_grad(set_to_none=True)
        train.optimizer.state.clear()       # its momentum buffers, on the device
    return (lambda: train(x_host, t_host)), close, None, {
        'amp': on_gpu, 'channels_last': on_gpu, 'cudnn_benchmark': on_gpu}


def measure(step, sync, steps, warmup, profiled=0):
    """Runs ``warmup`` steps, ``steps`` timed steps, then ``profiled`` steps
    under PyTorch's profiler (its own: CUPTI's tracing costs the host a
    little per launch, so the timed steps run without it), each step ended
    by ``sync``. Returns {'walls': seconds of each timed step, 'starts' and
    'profiled_walls': host start ns and seconds of each profiled step,
    'trace': the profiler's trace dict or None, 'profiled_from': host ns
    where the profiled steps began}."""
    for _ in range(warmup):
        step()
    sync()
    walls = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        step()
        sync()
        walls.append((time.perf_counter_ns() - start) / 1e9)
    out = {'walls': walls, 'starts': [], 'profiled_walls': [], 'trace': None,
           'profiled_from': time.perf_counter_ns()}
    if not profiled:
        return out
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as context:
        with torch.profiler.record_function('fastchain.breakdown.start'):
            pass        # its first call initialises (a millisecond): not in a step's
        for _ in range(profiled):
            with torch.profiler.record_function(STEP_ANNOTATION):
                start = time.perf_counter_ns()
                step()
                sync()
                out['profiled_walls'].append((time.perf_counter_ns() - start) / 1e9)
            out['starts'].append(start)
    with tempfile.TemporaryDirectory(prefix='fastchain-breakdown-') as tmp:
        path = os.path.join(tmp, 'trace.json')
        context.export_chrome_trace(path)
        with open(path) as f:
            out['trace'] = json.load(f)
    return out


def parse(argv=None):
    p = _common.parser('breakdown', __doc__.split('\n\n')[0])
    p.add_argument('--device', default=None,
                   help='@cupy:N or @numpy (default: GPU 0 where one works)')
    p.add_argument('--batch', type=int, default=None, help='default 32 on a GPU, 8 on a CPU')
    p.add_argument('--crop', type=int, default=None, help='image size (224 on a GPU, 32 on a CPU)')
    p.add_argument('--width', type=int, default=64,
                   help="the first stage's width (64: ResNet-50; smaller: a cheaper graph "
                        'of the same shape, for trying the script)')
    p.add_argument('--steps', type=int, default=None, help='measured steps (20; 10 quick)')
    p.add_argument('--warmup', type=int, default=5, help='steps before the measured ones')
    p.add_argument('--profiled', type=int, default=None,
                   help="steps under PyTorch's profiler after the timed ones, on a GPU "
                        '(the device figures; default: half of --steps)')
    p.add_argument('--variants', default=','.join(VARIANTS),
                   help='comma-separated, from: ' + ', '.join(VARIANTS))
    p.add_argument('--traces', metavar='DIR',
                   help="also write each variant's profiler trace here (on a GPU, where the "
                        'profiler runs; Perfetto opens them)')
    args = p.parse_args(argv)
    if args.windows is not None:
        p.error('--windows: the breakdown has no windows; --steps sets how many steps are '
                'timed')
    args.variants = [v.strip() for v in args.variants.split(',') if v.strip()]
    twice = sorted({v for v in args.variants if args.variants.count(v) > 1})
    if twice:
        p.error('--variants: {} given more than once'.format(', '.join(twice)))
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error('--variants: unknown {} (known: {})'.format(', '.join(unknown),
                                                            ', '.join(VARIANTS)))
    return args


def has_torch(gpu):
    try:
        import torch
    except ImportError:
        return False, 'PyTorch is not installed (pip install torch)'
    if gpu and not torch.cuda.is_available():
        return False, "PyTorch here has no CUDA (its CPU build): no kernels to record"
    return True, None


def cudnn_state(gpu):
    """None where fastchain's cuDNN graphs (or CuPy's cuDNN) can run here, or
    why not (as the ladder asks: CuPy 13's cuDNN, else the graphs)."""
    if not gpu:
        return 'no GPU'
    from fastchain.backends import cuda
    status = cuda.cudnn_status()
    if not status.available:
        from fastchain.cudnn._group import graph_status
        status = graph_status()
    return None if status.available else status.why


def run(args):
    import gc
    device = _common.device(args.device)
    gpu = device.xp is not numpy
    args.batch = args.batch or (32 if gpu else 8)
    args.crop = args.crop or (224 if gpu else 32)
    args.steps = args.steps or (10 if args.quick else 20)
    torch_ok, torch_why = has_torch(gpu)
    profiled = (args.steps + 1) // 2 if args.profiled is None else args.profiled
    profiled = profiled if gpu and torch_ok else 0
    no_cudnn = cudnn_state(gpu) if gpu else None

    def sync():
        if gpu:
            device.device.synchronize()

    def release():
        gc.collect()        # Chainer's graphs hold cycles
        if gpu:
            import cupy
            sync()
            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()
            torch = sys.modules.get('torch')
            if torch is not None and torch.cuda.is_initialized():
                torch.cuda.empty_cache()

    rows = _common.Rows('iterations/s')
    details = {'_run': {'cudnn_unavailable': no_cudnn, 'profiled_steps': profiled,
                        'teardown_cupti': os.environ.get('TEARDOWN_CUPTI'),
                        'torch': sys.modules['torch'].__version__ if torch_ok else None}}
    bn_env = os.environ.get(BN_ENV)
    with tempfile.TemporaryDirectory(prefix='fastchain-breakdown-') as workdir:
        for name in args.variants:
            if name in GPU_VARIANTS and not gpu:
                rows.skip(name, 'needs a GPU (on a CPU it would repeat the baseline\'s steps)')
                continue
            if (name == 'cudnn' or name in BN_ON) and no_cudnn:
                rows.skip(name, "fastchain's cuDNN graphs cannot run here: " + no_cudnn)
                continue
            if name == 'torch' and not torch_ok:
                rows.skip(name, torch_why)
                continue
            try:
                details[name] = one_variant(name, args, device, gpu, sync, profiled,
                                            os.path.join(workdir, name + '.json'))
                for wall in details[name].pop('walls'):
                    rows.add(name, 1 / wall)
            except Exception as e:      # named; the variants after it still run
                import traceback
                rows.skip(name, 'failed: {}: {}'.format(type(e).__name__, e))
                details[name] = {'error': traceback.format_exc(limit=8)}
                import fastchain
                for h in reversed(fastchain.active_handles()):
                    cleanup(details, name, 'disabling its fastchain handle', h.disable)
            finally:
                cleanup(details, name, 'giving its memory back', release)
                set_env(BN_ENV, bn_env)
            # written after every variant: a run cut off keeps the variants done
            report(args, device, rows, details, gpu, torch_ok, final=False)
    return report(args, device, rows, details, gpu, torch_ok, final=True)


def set_env(name, value):
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def cleanup(details, name, what, fn):
    """``fn()``; an error in it (a handle's closers, a synchronisation after
    a device error) kept in the report, not raised: the variants after it
    still run."""
    try:
        fn()
    except Exception as e:
        details['_run'].setdefault('cleanup_errors', []).append(
            '{}: {}: {}: {}'.format(name, what, type(e).__name__, e))


def one_variant(name, args, device, gpu, sync, profiled, timeline):
    """Builds, measures and closes one variant: its details (``walls``: the
    timed steps' seconds, for the rows)."""
    from fastchain.cudnn import _paths
    from fastchain.nvtx import _summary
    _paths.forget()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')     # "fp16 is slower on a CPU", etc.
        if name == 'torch':
            step, close, handle, options = torch_variant(device, args.batch, args.crop,
                                                         args.width)
        else:
            step, close, handle, options = chainer_variant(name, device, args.batch,
                                                           args.crop, args.width, timeline)
    try:
        measured = measure(step, sync, args.steps, args.warmup, profiled)
    finally:
        close()
    walls = measured['walls']
    detail = {'options': {k: v for k, v in options.items() if k != 'timeline'},
              'walls': walls, 'step_ms': round(statistics.median(walls) * 1e3, 3),
              'walls_ms': [round(w * 1e3, 3) for w in walls]}
    if measured['profiled_walls']:
        detail['profiled_step_ms'] = round(statistics.median(measured['profiled_walls']) * 1e3,
                                           3)
    ranges = []
    if handle is not None:
        ranges = list(handle.resources['timeline'].ranges)
        # the host's phases of the timed steps (not of the profiled ones)
        timed = [r for r in ranges if r.start < measured['profiled_from']]
        summary = _summary.summarize(timed, skip=args.warmup)
        detail['host_phases_ms'] = {p: round(v, 3) for p, v in summary['median_ms'].items()
                                    if v}
        detail['host_steps_ms'] = [round(sum(s[p] for p in _summary.PHASES) / 1e6, 3)
                                   for s in summary['per_step']]
    paths = _paths.summary()
    if paths:
        # which calls ran on cuDNN graphs, which not, and why: over all the
        # variant's steps (warm-up, timed and profiled)
        detail['cudnn_paths'] = paths
        detail['cudnn_paths_steps'] = args.warmup + args.steps + profiled
    if measured['trace'] is not None:
        read = read_trace(measured['trace'])
        trace_starts = [s for s, _ in read['steps']]
        at = phase_locator(ranges, measured['starts'], trace_starts) if ranges else None
        detail['device'] = device_breakdown(read, at)
        if handle is not None and at is None:
            # a Chainer variant whose device time could not be placed in phases: said
            detail['device']['located_share'] = None
            detail['device']['not_located'] = (
                'no timeline ranges' if not ranges else
                '{} profiled steps on the host, {} in the trace'.format(
                    len(measured['starts']), len(trace_starts)))
        if args.traces:
            os.makedirs(args.traces, exist_ok=True)
            with open(os.path.join(args.traces, name + '.trace.json'), 'w') as f:
                json.dump(measured['trace'], f)
    return detail


def report(args, device, rows, details, gpu, torch_ok, final):
    config = {'batch': args.batch, 'crop': args.crop, 'width': args.width,
              'steps': args.steps, 'warmup': args.warmup, 'device': str(device),
              'quick': args.quick, 'variants_asked': args.variants, 'traces': args.traces,
              'run': details.get('_run'),
              'variants': {k: v for k, v in details.items() if not k.startswith('_')}}
    ratios = {'{}/baseline'.format(v): rows.ratio(v, 'baseline') for v in VARIANTS[1:]}
    ratios['static_graph/torch'] = rows.ratio('static_graph', 'torch')
    for name in BN_ON:
        ratios[name + '/static_graph'] = rows.ratio(name, 'static_graph')
    notes = describe(details, gpu, torch_ok, args.traces)
    if not final:
        notes.append('Written after {}: the run had not finished.'.format(
            ', '.join(config['variants']) or 'no variant'))
    return _common.write('breakdown', args, config, rows, ratios, notes, quiet=not final)


def describe(details, gpu, torch_ok, traces=None):
    """The notes: how it was measured, then one paragraph per variant."""
    run = details.get('_run', {})
    ran = [n for n, d in details.items() if not n.startswith('_') and 'error' not in d]
    how = ('Each step ends with a device synchronisation; iterations/s are of such steps, '
           'timed without the profiler. The variants ran one after another, not alternated '
           '(each is built once): drift between them is not cancelled, so their ratios are '
           'indications; the ladder is the speed comparison (with loading, alternated, '
           'without the synchronisation). Autotune off in fastchain\'s variants (cuDNN\'s '
           'heuristic plans).')
    if 'torch' in ran:
        how += (' PyTorch ran {}; it has no host phases here (the timeline records '
                'Chainer\'s).'.format('with AMP, channels-last and cudnn.benchmark, as its '
                                        'users train' if gpu else 'in fp32'))
    if 'fp16' in ran:
        how += (' The fp16 variant is the ladder\'s fp32_preprocessing rung\'s options: fp32 '
                'data cast on the device, fp16 compute with fp32 master weights and loss '
                'scaling.')
    if 'static_graph_bn' in ran:
        how += (' static_graph_bn is static_graph with BatchNormalization\'s cuDNN graphs '
                'turned on (FASTCHAIN_CUDNN_BN=1; off by default until proven on a GPU).')
    if 'static_graph_stats' in ran:
        how += (' static_graph_stats is static_graph with BatchNormalization\'s statistics and '
                'backward sums reduced in two levels by CuPy, no cuDNN graph '
                '(FASTCHAIN_CUDNN_BN=stats; off by default until proven on a GPU).')
    if not gpu:
        how += (' On a CPU: step times and host phases only (no device figures, no traces, '
                'no cuDNN).')
    notes = [how]
    if traces and not gpu:
        notes.append('--traces {}: nothing written (the profiler runs on a GPU only).'
                     .format(traces))
    if gpu and not torch_ok:
        notes.append('No device figures: PyTorch (its profiler records the kernels) is '
                     'missing or has no CUDA here.')
    elif gpu and not run.get('profiled_steps'):
        notes.append('No device figures: --profiled 0.')
    elif gpu:
        notes.append('Device figures from {} more steps under PyTorch\'s profiler (CUPTI: '
                     'every kernel and copy of the process); its tracing costs the host a '
                     'little per launch, so idle shares there are upper bounds (each '
                     'variant\'s profiled_step_ms beside its step_ms). Kinds are classes of '
                     'kernel names (KINDS in benchmarks/breakdown.py); phases are where the '
                     'host launched each kernel.'.format(run.get('profiled_steps')))
    for error in run.get('cleanup_errors', ()):
        notes.append('Error while cleaning up after ' + error)
    if run.get('cudnn_unavailable') and gpu:
        notes.append("fastchain's cuDNN graphs could not run here ({}): the cudnn variant is "
                     'left out and the fp16 and static_graph variants ran Chainer\'s im2col.'
                     .format(run['cudnn_unavailable']))
    for name, d in details.items():
        if name.startswith('_'):
            continue
        if 'error' in d:
            notes.append('{}: failed: {}'.format(name, d['error'].strip().splitlines()[-1]))
            continue
        parts = ['{}: step {:.1f} ms'.format(name, d['step_ms'])]
        dev = d.get('device')
        if dev and dev.get('steps'):
            if not dev['work']:
                parts.append('the profiler recorded no device work of this process '
                             '(the device shares are unknown)')
            else:
                parts.append('under the profiler {:.1f} ms, device busy {:.1f} ms, idle {:.0%} '
                             'of the step (the host\'s part)'.format(
                                 d.get('profiled_step_ms', 0), dev['busy'], dev['idle_share']))
                parts.append('device time by kind: ' + ', '.join(
                    '{} {:.1f} ms'.format(k, v) for k, v in list(dev['kinds'].items())[:6]))
                if dev['phases']:
                    parts.append('by the phase that launched it: ' + ', '.join(
                        '{} {:.1f} ms'.format(k, v) for k, v in dev['phases'].items()))
                located = dev.get('located_share')
                if dev.get('not_located'):
                    parts.append('WARNING: the device time could not be placed in phases ({})'
                                 .format(dev['not_located']))
                elif located is not None and located < 0.9:
                    parts.append('WARNING: only {:.0%} of the device time was placed in a '
                                 'phase (launch calls not found, or the clocks not matched: '
                                 'offsets spread {} us)'.format(located,
                                                                dev.get('offset_spread_us')))
        phases = d.get('host_phases_ms')
        if phases:
            parts.append('host phases (median ms): ' + ', '.join(
                '{} {:.1f}'.format(k, v) for k, v in sorted(phases.items(),
                                                           key=lambda kv: -kv[1])))
        conv = (d.get('cudnn_paths') or {}).get('conv forward')
        if conv:
            parts.append('convolution forward calls over its {} steps: '.format(
                d.get('cudnn_paths_steps')) + ', '.join(
                '{} {}'.format(k, v) for k, v in conv['paths'].items()))
        notes.append('; '.join(parts) + '.')
    return notes


def main(argv=None):
    run(parse(argv))


if __name__ == '__main__':
    main()
