"""Everything fastchain has to prove on a GPU node, in one offline command.

    python benchmarks/gpu_check.py --quick            # inside ten minutes (a deadline of 480 s)
    python benchmarks/gpu_check.py                    # the full form
    python benchmarks/gpu_check.py --pack OUT.tar.gz  # also one archive of the results
    python benchmarks/gpu_check.py --unpack A.tar.gz B.tar.gz   # here: a split run's archives

Runs in the Python it is started with (the node's own, with fastchain installed
from the wheelhouse, or a venv): no package index, no ``make setup``. Each
step is a subprocess in a process group of its own with its own time limit
(past it: SIGTERM, then SIGKILL to the group); its output goes to
``RESULTS/logs/<step>.log`` as it comes, and its status, seconds and the
figures it found to ``RESULTS/gpu_check.json``, which, like the archive of
``--pack``, is rewritten after every step, so a run cut off from outside
still brings back what finished. A step that fails does not stop the others.
``--deadline`` (480 s with ``--quick``) bounds the whole run: each step gets
what is left at most, the ladder ends its windows a margin before
(``--time-limit``), and a step with too little left is skipped and named.

Steps: ``doctor`` (``fastchain doctor --json``), ``gpu_tests`` (the
``gpu``-marked tests), ``resnet_fp32`` / ``resnet_fp16`` (the recipe on
synthetic data, every accelerator that works there, ``--fp16`` for the
second), ``resnet_demo`` (the recipe on the generated JPEGs, with the
device prefetcher), ``nvtx`` (a recipe run with the NVTX injection recorder
attached, counting the ranges received, and the step breakdown from them in
``logs/nvtx_summary.txt``, host time: ``nsys`` cannot report on the node),
``nccl`` (the NCCL communicator with one rank), then the benchmarks:
breakdown (where a step's time goes: host phases, and the device's kernels
through PyTorch's profiler), bn_stats (BatchNormalization's forward: Chainer's,
with fastchain's two-level statistics, cuDNN's graph), ladder, overhead, loader, nvtx_cost (their
``--quick`` forms with ``--quick``).
``--steps`` picks some, in the order given (a full check split over several
commands: ``--unpack`` merges their archives here); ``--device @numpy`` runs
the same on a CPU (to try the script itself: the GPU-only steps then say why
they were skipped).
"""

import argparse
import calendar
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPE = os.path.join(ROOT, 'recipes', 'resnet50', 'train.py')

STEPS = ('doctor', 'gpu_tests', 'resnet_fp32', 'resnet_fp16', 'resnet_demo', 'nvtx', 'nccl',
         'breakdown', 'bn_stats', 'ladder', 'overhead', 'loader', 'nvtx_cost')
GPU_ONLY = ('nccl',)
# Modules a step cannot run without, and where they come from on the node.
NEEDS = {'gpu_tests': ('pytest', 'hypothesis'), 'nccl': ('pytest',)}
WHEELHOUSE_FIX = 'python3 -m pip install --no-index --find-links dist/wheelhouse {}'
TIME_LIMITED = ('ladder',)      # steps that take --time-limit and report what they cut
QUICK_DEADLINE = 480            # well inside a ten-minute command, the install included
MTIME_SLACK = 2                 # seconds: clock granularity of the file systems on the way
MIN_STEP_SECONDS = 30           # a step with less left is skipped, not started
PACK_SECONDS = 15               # kept for the last archive
STEP_MARGIN = 45                # before a time-limited step's kill: its report and charts
GRACE_SECONDS = 15              # between a late step's SIGTERM and its SIGKILL
# pytest steps: SIGINT this long before their limit, so pytest prints its
# summary (each failure, each xfail's and skip's reason) before it is killed
# (the first run on the node lost every reason to a plain kill)
INTERRUPT_SECONDS = 20
PYTEST_STEPS = ('gpu_tests', 'nccl')
# pytest's own report: each test's outcome as it ends (-v: which one hung),
# the reasons of failures, errors, skips and xfails, the slowest tests
PYTEST_REPORT = ['-v', '-rfEsx', '--durations=20']
TUNE_CACHE = 'tune-cache.json'   # the ladder's autotune choices, beside the results
NVTX_WARMUP_STEPS = 5           # left out of the nvtx step's breakdown (first calls, plans)


def plan(args):
    """{step: (argv, env, seconds)} for the steps asked for."""
    py, out, quick = sys.executable, args.results, args.quick
    device = args.device
    runs = os.path.join(out, 'runs')
    iters = '30' if quick else '200'
    recipe = [py, RECIPE, '--device', device, '--no-progress', '--no-snapshots',
              '--log-every', '10']
    size = ['--image-size', str(args.image_size), '--batch-size', str(args.batch)]
    bench_common = ['--results', out] + (['--quick'] if quick else [])
    steps = {
        'doctor': ([py, '-c', "from fastchain.doctor._cli import main; "
                    "main(['doctor', '--json'])"], {}, 120),
        # Only the files that hold GPU tests (some are property-based: the
        # node gets hypothesis from the wheelhouse, see NEEDS).
        'gpu_tests': ([py, '-m', 'pytest', '-m', 'gpu', '-p', 'no:cacheprovider']
                      + PYTEST_REPORT
                      # one test at most this long (pytest-timeout, where installed)
                      + ['-o', 'timeout={}'.format(90 if quick else 300)]
                      + gpu_test_files(),
                      # a third of the cuDNN graphs' generated cases in the quick form
                      {'FASTCHAIN_GPU_CASES': '0.34'} if quick else {}, 300 if quick else 900),
        'resnet_fp32': (recipe + ['--data', 'synthetic', '--all', '--fp32', '--iterations', iters,
                                  '--out', os.path.join(runs, 'fp32')] + size, {}, 300),
        'resnet_fp16': (recipe + ['--data', 'synthetic', '--all', '--fp16', '--iterations',
                                  iters, '--out', os.path.join(runs, 'fp16')] + size, {}, 300),
        'resnet_demo': (recipe + ['--config', os.path.join(ROOT, 'recipes', 'resnet50',
                                                           'demo.yaml'), '--all',
                                  '--demo-root', os.path.join(runs, 'demo-data'),
                                  '--out', os.path.join(runs, 'demo')]
                        + (['--epochs', '1'] if quick else []), {}, 600),
        # autotune off: the ranges are the point, not a first step timing every key
        'nvtx': (recipe + ['--data', 'synthetic', '--nvtx', '--no-autotune', '--iterations',
                           iters, '--out', os.path.join(runs, 'nvtx')] + size,
                 {'FASTCHAIN_NVTX_LOG': os.path.join(out, 'logs', 'nvtx_ranges.tsv')}, 300),
        'nccl': ([py, '-m', 'pytest', '-p', 'no:cacheprovider'] + PYTEST_REPORT
                 + ['-k', 'nccl', os.path.join(ROOT, 'tests', 'distributed')], {}, 300),
        'breakdown': ([py, os.path.join(HERE, 'breakdown.py'), '--device', device, '--batch',
                       str(args.batch), '--crop', str(args.image_size)]
                      + bench_common, {}, 300 if quick else 900),
        # BatchNormalization's forward three ways on ResNet-50's layers (tens of seconds)
        'bn_stats': ([py, os.path.join(HERE, 'bn_stats.py'), '--device', device, '--batch',
                      str(args.batch), '--size', str(args.image_size)]
                     + bench_common, {}, 120 if quick else 300),
        'ladder': ([py, os.path.join(HERE, 'ladder.py'), '--device', device, '--batch',
                    str(args.ladder_batch or args.batch), '--crop', str(args.image_size)]
                   + (['--rungs', args.ladder_rungs] if args.ladder_rungs else [])
                   # autotune's choices kept with the results: a later run on the same
                   # kind of node (the file is committed with them) skips its tuning pass
                   + ['--tune-cache', os.path.join(out, TUNE_CACHE)]
                   + bench_common,
                   {}, 600 if quick else 1800),
        'overhead': ([py, os.path.join(HERE, 'overhead.py'), '--device', device]
                     + bench_common, {}, 600 if quick else 1800),
        'loader': ([py, os.path.join(HERE, 'loader.py')] + bench_common, {}, 600),
        'nvtx_cost': ([py, os.path.join(HERE, 'nvtx_cost.py'), '--device', device]
                      + bench_common, {}, 600),
    }
    return {name: steps[name][:2] + (args.limits.get(name, steps[name][2]),)
            for name in args.steps}


def limits_arg(text):
    """``STEP=SECONDS,...`` -> {step: seconds}."""
    limits = {}
    for item in (i for i in text.split(',') if i.strip()):
        name, _, seconds = item.partition('=')
        name = name.strip()
        if name not in STEPS:
            raise argparse.ArgumentTypeError('unknown step {!r} in {!r}; choose from {}'.format(
                name, item, ', '.join(STEPS)))
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        limits[name] = int(value) if value.is_integer() else value
        if not value > 0 or value == float('inf'):
            raise argparse.ArgumentTypeError('{!r}: give a step=seconds pair, seconds a '
                                             'positive number (e.g. gpu_tests=150)'.format(item))
    return limits


# The GPU test files in this order (pytest runs files in the order given): a
# step cut at its limit has run the ones that say most first. The first run
# was cut inside test_learners.py with the fp16 and non-finite tests not
# reached; files not named here come before the learners.
GPU_TEST_ORDER = ('tests/cudnn/', 'tests/precision/', 'tests/backends/', 'tests/data/',
                  'tests/distributed/test_data_parallel', 'tests/recipes/', None,
                  'tests/distributed/test_learners')


def gpu_test_files():
    found = []
    for base, _, names in os.walk(os.path.join(ROOT, 'tests')):
        for name in sorted(names):
            if name.startswith('test_') and name.endswith('.py'):
                with open(os.path.join(base, name)) as f:
                    if 'mark.gpu' in f.read():
                        found.append(os.path.join(base, name))

    def rank(path):
        rel = os.path.relpath(path, ROOT).replace(os.sep, '/')
        named = [i for i, p in enumerate(GPU_TEST_ORDER) if p and rel.startswith(p)]
        return (named[0] if named else GPU_TEST_ORDER.index(None), rel)
    return sorted(found, key=rank)


def nvtx_tool(out):
    """Builds tests/nvtx/nvtx_recorder.c with the node's compiler; its path,
    or a reason it could not be built."""
    sys.path.insert(0, ROOT)
    from tests.nvtx.conftest import build_recorder
    return build_recorder(os.path.join(out, 'logs', 'libnvtx_recorder.so'))


def figures(name, text, out):
    """The numbers worth keeping from a step's output."""
    found = {}
    m = re.search(r'training: ([\d.]+) images/s', text)
    if m:
        found['images_per_s'] = float(m.group(1))
    for line in text.splitlines():
        m = re.match(r'\s+(\w+)\s+(active|off|unavailable)(.*)', line)
        if m and name.startswith('resnet'):
            found.setdefault('accelerators', {})[m.group(1)] = m.group(2) + m.group(3)
    m = re.search(r'(\d+) passed', text)
    if m:
        found['passed'] = int(m.group(1))
    for outcome in ('failed', 'xfailed', 'skipped'):
        m = re.search(r'(\d+) {}'.format(outcome), text)
        if m:
            found[outcome] = int(m.group(1))
    if name == 'breakdown':
        found.update(breakdown_figures(out))
    if name == 'nvtx':
        log = os.path.join(out, 'logs', 'nvtx_ranges.tsv')
        if os.path.exists(log):
            with open(log) as f:
                kinds = [line.split('\t', 1)[0] for line in f]
            found['nvtx_pushes'] = kinds.count('push')
            found['nvtx_pops'] = kinds.count('pop')
            found.update(nvtx_breakdown(log, os.path.join(out, 'logs', 'nvtx_summary.txt')))
    return found


def breakdown_figures(out):
    """Per variant of benchmarks/breakdown.py's report (the newer of its
    quick and full files): the step, and on a GPU the device's busy time,
    idle share, its three largest kinds of work and phases (ms per step)
    and how much of its time could be placed in a phase; a failed variant's
    error line."""
    reports = [os.path.join(out, stem + '.json') for stem in ('breakdown-quick', 'breakdown')]
    reports = [p for p in reports if os.path.exists(p)]
    if not reports:
        return {}
    with open(max(reports, key=os.path.getmtime)) as f:
        variants = json.load(f).get('config', {}).get('variants', {})
    found = {}
    for variant, d in variants.items():
        if 'error' in d:
            found[variant] = {'error': d['error'].strip().splitlines()[-1]}
            continue
        keep = {'step_ms': d.get('step_ms')}
        device = d.get('device') or {}
        if device.get('work'):
            keep.update(busy_ms=device.get('busy'), idle_share=device.get('idle_share'),
                        kinds=dict(list(device.get('kinds', {}).items())[:3]),
                        phases=dict(list(device.get('phases', {}).items())[:3]),
                        located_share=device.get('located_share'))
        elif device:
            keep['device'] = 'the profiler recorded no device work'
        found[variant] = keep
    return found


def nvtx_breakdown(log, path, skip=NVTX_WARMUP_STEPS):
    """The step breakdown of the recorder's log (profiling/summarize.py's,
    host time: where the step's time goes on the host), written to ``path``;
    its figures, or the reason there are none."""
    try:
        sys.path.insert(0, os.path.join(ROOT, 'profiling'))
        import summarize
        from fastchain.nvtx import _summary
        try:
            result = _summary.summarize(summarize.read_recorder_log(log), skip=skip)
        except summarize.ReportError as e:
            return {'breakdown': 'none: {}'.format(e)}
        with open(path, 'w') as f:
            f.write(_summary.format_summary(result) + '\n')
    except Exception as e:      # the steps after this one must still run
        return {'breakdown': 'failed: {}: {}'.format(type(e).__name__, e)}
    if not result['steps']:
        return {'breakdown': 'none: ' + result['diagnosis']}
    return {'steps_summarized': result['steps'], 'step_ms': round(result['total_ms'], 2),
            'phase_ms': {p: round(v, 2) for p, v in result['median_ms'].items()},
            'diagnosis': result['diagnosis']}


def run_step(name, argv, env, seconds, out, tick=None, every=60):
    """Runs one step in a process group of its own, its output written to
    its log as it comes (a run cut off from outside keeps what the step
    printed); past ``seconds`` the group gets SIGTERM, then SIGKILL. A
    pytest step (``PYTEST_STEPS``) gets SIGINT ``INTERRUPT_SECONDS`` before
    that, so pytest writes its summary (the reasons of failures, skips and
    xfails) into the log. ``tick()`` is called every ``every`` seconds while
    it runs (the archive rewritten: a call cut off mid-step still returns
    the step's log)."""
    log = os.path.join(out, 'logs', name + '.log')
    doctor = os.path.join(out, 'doctor.json')
    start = time.monotonic()
    interrupt = seconds - INTERRUPT_SECONDS \
        if name in PYTEST_STEPS and seconds > 2 * INTERRUPT_SECONDS else None
    with open(log, 'w') as f:
        f.write(' '.join(argv) + '\n\n')
        f.flush()
        # the doctor's JSON alone in its file (its warnings go to the log)
        stdout = open(doctor, 'w') if name == 'doctor' else f
        try:
            proc = subprocess.Popen(argv, stdout=stdout, stderr=f, cwd=ROOT,
                                    start_new_session=True, preexec_fn=_sigint_default,
                                    env=dict(os.environ, PYTHONUNBUFFERED='1', **env))
            rc, interrupted = None, False
            while rc is None and time.monotonic() - start < seconds:
                until = seconds if interrupt is None or interrupted else interrupt
                try:
                    rc = proc.wait(timeout=min(every, max(0.0, until - (
                        time.monotonic() - start))))
                except subprocess.TimeoutExpired:
                    if interrupt is not None and not interrupted and \
                            time.monotonic() - start >= interrupt:
                        interrupted = True
                        signal_group(proc, signal.SIGINT)
                    elif tick is not None:
                        f.flush()
                        tick()
            if rc is None or interrupted:
                # what pytest left (a loader worker ignores SIGINT) must not
                # hold the GPU into the next step
                stop_group(proc)
            if interrupted:
                status = 'timed out after {} s (interrupted at {} s so pytest wrote its ' \
                         'summary)'.format(seconds, interrupt)
            elif rc is None:
                status = 'timed out after {} s'.format(seconds)
            else:
                status = 'ok' if rc == 0 else 'failed ({})'.format(rc)
        finally:
            if stdout is not f:
                stdout.close()
    with open(log) as f:
        text = f.read()
    if name == 'doctor':
        with open(doctor) as f:
            text += f.read()
    return {'status': status, 'seconds': round(time.monotonic() - start, 1),
            'figures': figures(name, text, out), 'log': os.path.relpath(log, out)}


def _sigint_default():
    """In the step's process before it starts: SIGINT back to its default.
    A command started in the background (a non-interactive shell's ``&``, as
    a remote runner may start it) inherits SIGINT ignored, Python then keeps
    it ignored, and the interrupt that makes pytest write its summary would
    do nothing (found when CI, run in the background, lost that summary)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass            # the group is gone


def stop_group(proc, grace=None):
    """SIGTERM to the step's process group (the benchmarks close their
    variants on it), then SIGKILL to what is left of it after ``grace``
    seconds."""
    grace = GRACE_SECONDS if grace is None else grace
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        signal_group(proc, sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def pack(results, path, since=None):
    """The results as one archive (no generated JPEGs, no compiled
    recorder), replaced whole so a run cut off keeps the last one. With
    ``since`` (a time.time()), only the files this run wrote: the results
    folder of a checkout holds the committed files of earlier runs, and an
    archive carrying them would put them back over a newer run's on unpack
    (it did: session 31's third and fourth archives restored the first GPU
    run's ladder and test log over the second's)."""
    def keep(info):
        skip = '/demo-data' in info.name or info.name.endswith('.so')
        stale = since is not None and info.isfile() and info.mtime < since - MTIME_SLACK
        return None if skip or stale else info
    tmp = path + '.part'
    with tarfile.open(tmp, 'w:gz') as tar:
        tar.add(results, arcname='gpu', filter=keep)
    os.replace(tmp, path)


def probe_gpu():
    """fastchain's CuPy probe, asked in a process of its own (this one
    stays without CUDA): {'available', 'why', 'fix', ...}."""
    code = ('import json; from fastchain.backends import cuda; '
            'print(json.dumps(cuda.cupy_status().as_dict()))')
    try:
        r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
        return json.loads(r.stdout.strip().splitlines()[-1])
    except Exception as e:          # no fastchain, a crash, a hang: say which
        return {'available': False, 'why': 'the probe failed: {}'.format(e),
                'fix': 'run `fastchain doctor` in this Python'}


def run_start(report):
    """When the run of a report began, as a time.time(): ``started_epoch``,
    or for an archive written before it was kept, ``started`` read as UTC
    (the node's clock, in whose local time it was written, is UTC; this
    machine's zone does not matter)."""
    if 'started_epoch' in report:
        return report['started_epoch']
    try:
        return calendar.timegm(time.strptime(report['started'], '%Y-%m-%d %H:%M:%S'))
    except (KeyError, TypeError, ValueError, OverflowError):
        return None


def unpack(archives, results):
    """Extracts the archives of several runs (a full check split over
    several commands) into ``results``, in order; their gpu_check.json
    reports become one, each step's latest run kept, and each run's header
    kept under ``runs``. A file older than its run's start is not that
    run's (an archive of an older pack() carries the checkout's committed
    results too) and is not extracted."""
    os.makedirs(results, exist_ok=True)
    merged = {'runs': [], 'steps': {}}
    for path in archives:
        with tarfile.open(path) as tar:
            report = json.load(tar.extractfile('gpu/gpu_check.json'))
            since = run_start(report)
            members = [m for m in tar.getmembers()
                       if m.name != 'gpu/gpu_check.json' and m.name.startswith('gpu/')
                       and '..' not in m.name.split('/') and (m.isfile() or m.isdir())
                       and not (m.isfile() and since is not None
                                and m.mtime < since - MTIME_SLACK)]
            for m in members:
                m.name = m.name[len('gpu/'):] or '.'
            safe = {'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}
            tar.extractall(results, members=members, **safe)
        merged['runs'].append(dict({k: v for k, v in report.items() if k != 'steps'},
                                   archive=os.path.basename(path),
                                   steps=list(report['steps'])))
        for step, result in report['steps'].items():
            # a step a later run only skipped keeps the result of an earlier run
            earlier = merged['steps'].get(step)
            if earlier is None or not result['status'].startswith('skipped') or \
                    earlier['status'].startswith('skipped'):
                merged['steps'][step] = result
    with open(os.path.join(results, 'gpu_check.json'), 'w') as f:
        json.dump(merged, f, indent=2)
    return merged


def parser():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--quick', action='store_true')
    p.add_argument('--results', default=os.path.join(HERE, 'results', 'gpu'))
    p.add_argument('--steps', default=','.join(STEPS),
                   help='comma-separated, from: ' + ', '.join(STEPS))
    p.add_argument('--device', default='@cupy:0')
    p.add_argument('--batch', type=int, default=32,
                   help="the recipe's and the ladder's batch (the talk's: 32)")
    p.add_argument('--ladder-batch', default=None,
                   help="the ladder's batch if not --batch's: a number, or max (the largest "
                        "that fits, probed; written as ladder-bN beside the talk's batch)")
    p.add_argument('--ladder-rungs', default=None, metavar='LIST',
                   help="the ladder's rungs to time, baseline among them (its --rungs; "
                        'default: all that can run)')
    p.add_argument('--limits', type=limits_arg, default={}, metavar='STEP=SECONDS,...',
                   help="a step's own time limit instead of its default (the deadline still "
                        'bounds it), e.g. gpu_tests=150,resnet_fp16=90')
    p.add_argument('--image-size', type=int, default=224,
                   help="the recipe's and the ladder's crop (the talk's: 224)")
    p.add_argument('--pack', metavar='TAR_GZ',
                   help='also write the results as one archive (rewritten after every step)')
    p.add_argument('--deadline', type=float, default=None, metavar='SECONDS',
                   help='seconds for the whole run (default with --quick: {}): each step '
                        'gets what is left at most, the ladder ends its windows a margin '
                        'before, and a step with less than {} s left is skipped and '
                        'named'.format(QUICK_DEADLINE, MIN_STEP_SECONDS))
    p.add_argument('--unpack', nargs='+', metavar='TAR_GZ',
                   help='(here, not on the node) extract the archives of several runs into '
                        '--results, their reports merged; runs nothing')
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.unpack:
        os.makedirs(args.results, exist_ok=True)
        merged = unpack(args.unpack, args.results)
        print('gpu_check: {} run(s), {} step(s) into {}'.format(
            len(merged['runs']), len(merged['steps']), args.results))
        return 0
    args.steps = [s for s in args.steps.split(',') if s]
    unknown = sorted(set(args.steps) - set(STEPS))
    if unknown:
        p.error('unknown step(s) {}; choose from {}'.format(', '.join(unknown),
                                                             ', '.join(STEPS)))
    start = time.monotonic()        # the deadline counts from here, the probe included
    on_gpu = args.device.startswith('@cupy')
    if on_gpu:
        gpu = probe_gpu()
        if not gpu.get('available'):
            print('gpu_check: no usable GPU for {}: {} (fix: {}); to try this script on a '
                  'CPU: --device @numpy'.format(args.device, gpu.get('why'), gpu.get('fix')),
                  file=sys.stderr)
            return 2
    os.makedirs(os.path.join(args.results, 'logs'), exist_ok=True)
    deadline = QUICK_DEADLINE if args.deadline is None and args.quick else args.deadline
    report = {'started': time.strftime('%Y-%m-%d %H:%M:%S'), 'started_epoch': time.time(),
              'quick': args.quick,
              'device': args.device, 'python': sys.executable, 'deadline_s': deadline,
              'steps': {}}
    for name, (cmd, env, seconds) in plan(args).items():
        left = None if deadline is None else deadline - (time.monotonic() - start) - PACK_SECONDS
        missing = [m for m in NEEDS.get(name, ()) if importlib.util.find_spec(m) is None]
        if name in GPU_ONLY and not on_gpu:
            result = {'status': 'skipped: needs a GPU (--device @cupy:0)'}
        elif missing:
            result = {'status': 'failed: {} not installed in {} (fix: {})'.format(
                ', '.join(missing), sys.executable, WHEELHOUSE_FIX.format(' '.join(missing)))}
        elif left is not None and left < MIN_STEP_SECONDS:
            result = {'status': 'skipped: the deadline ({} s) was {} s away'.format(
                deadline, max(0, round(left + PACK_SECONDS)))}
        else:
            tool, why = nvtx_tool(args.results) if name == 'nvtx' else ('', '')
            if env.get('FASTCHAIN_NVTX_LOG') and os.path.exists(env['FASTCHAIN_NVTX_LOG']):
                os.remove(env['FASTCHAIN_NVTX_LOG'])   # the recorder appends
            if tool is None:
                result = {'status': 'skipped: recorder not built: ' + why}
            else:
                if tool:
                    env = dict(env, NVTX_INJECTION64_PATH=tool)
                if left is not None:
                    seconds = int(min(seconds, left))
                if name in TIME_LIMITED:
                    # ends its measurements itself, a margin before the kill
                    cmd = cmd + ['--time-limit', str(max(seconds - STEP_MARGIN, 1))]
                print('gpu_check: {} ...'.format(name), flush=True)
                tick = (lambda: pack(args.results, args.pack, report['started_epoch'])) \
                    if args.pack else None
                result = run_step(name, cmd, env, seconds, args.results, tick=tick)
        report['steps'][name] = result
        print('gpu_check: {} {}'.format(name, result['status']), flush=True)
        with open(os.path.join(args.results, 'gpu_check.json'), 'w') as f:
            json.dump(report, f, indent=2)
        if args.pack:
            pack(args.results, args.pack, report['started_epoch'])
    failed = [n for n, s in report['steps'].items() if not s['status'].startswith(('ok',
                                                                                   'skipped'))]
    print('gpu_check: {} step(s) ok or skipped, failed: {}'.format(
        len(report['steps']) - len(failed), ', '.join(failed) or 'none'))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
