"""Everything fastchain has to prove on a GPU node, in one offline command.

    python benchmarks/gpu_check.py --quick            # well inside ten minutes
    python benchmarks/gpu_check.py                    # the full form
    python benchmarks/gpu_check.py --pack OUT.tar.gz  # also one archive of the results

Runs in the Python it is started with (the node's own, with fastchain installed
from the wheelhouse, or a venv): no package index, no ``make setup``. Each
step is a subprocess with its own time limit; its output goes to
``RESULTS/logs/<step>.log`` and its status, seconds and the figures it found
to ``RESULTS/gpu_check.json`` (written after every step, so a cut-off run
still says how far it got). A step that fails does not stop the others.

Steps: ``doctor`` (``fastchain doctor --json``), ``gpu_tests`` (the
``gpu``-marked tests), ``resnet_fp32`` / ``resnet_fp16`` (the recipe on
synthetic data, every accelerator that works there, ``--fp16`` for the
second), ``resnet_demo`` (the recipe on the generated JPEGs, with the
device prefetcher), ``nvtx`` (a recipe run with the NVTX injection recorder
attached, counting the ranges received: ``nsys`` cannot report on the node),
``nccl`` (the NCCL communicator with one rank), then the benchmarks: ladder,
overhead, loader, nvtx_cost (their ``--quick`` forms with ``--quick``).
``--steps`` picks some; ``--device @numpy`` runs the same on a CPU (to try
the script itself: the GPU-only steps then say why they were skipped).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPE = os.path.join(ROOT, 'recipes', 'resnet50', 'train.py')

STEPS = ('doctor', 'gpu_tests', 'resnet_fp32', 'resnet_fp16', 'resnet_demo', 'nvtx', 'nccl',
         'ladder', 'overhead', 'loader', 'nvtx_cost')
GPU_ONLY = ('nccl',)


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
        # Only the files that hold GPU tests: the others need hypothesis,
        # which the node does not have.
        'gpu_tests': ([py, '-m', 'pytest', '-m', 'gpu', '-rs', '-p', 'no:cacheprovider']
                      + gpu_test_files(), {}, 300 if quick else 900),
        'resnet_fp32': (recipe + ['--data', 'synthetic', '--all', '--iterations', iters,
                                  '--out', os.path.join(runs, 'fp32')] + size, {}, 300),
        'resnet_fp16': (recipe + ['--data', 'synthetic', '--all', '--fp16', '--iterations',
                                  iters, '--out', os.path.join(runs, 'fp16')] + size, {}, 300),
        'resnet_demo': (recipe + ['--config', os.path.join(ROOT, 'recipes', 'resnet50',
                                                           'demo.yaml'), '--all',
                                  '--demo-root', os.path.join(runs, 'demo-data'),
                                  '--out', os.path.join(runs, 'demo')]
                        + (['--epochs', '1'] if quick else []), {}, 600),
        'nvtx': (recipe + ['--data', 'synthetic', '--nvtx', '--iterations', '10',
                           '--out', os.path.join(runs, 'nvtx')] + size,
                 {'FASTCHAIN_NVTX_LOG': os.path.join(out, 'logs', 'nvtx_ranges.tsv')}, 300),
        'nccl': ([py, '-m', 'pytest', '-rs', '-p', 'no:cacheprovider', '-k', 'nccl',
                  os.path.join(ROOT, 'tests', 'distributed')], {}, 300),
        'ladder': ([py, os.path.join(HERE, 'ladder.py'), '--device', device] + bench_common,
                   {}, 600 if quick else 1800),
        'overhead': ([py, os.path.join(HERE, 'overhead.py'), '--device', device]
                     + bench_common, {}, 600 if quick else 1800),
        'loader': ([py, os.path.join(HERE, 'loader.py')] + bench_common, {}, 600),
        'nvtx_cost': ([py, os.path.join(HERE, 'nvtx_cost.py')] + bench_common, {}, 600),
    }
    return {name: steps[name] for name in args.steps}


def gpu_test_files():
    found = []
    for base, _, names in os.walk(os.path.join(ROOT, 'tests')):
        for name in sorted(names):
            if name.startswith('test_') and name.endswith('.py'):
                with open(os.path.join(base, name)) as f:
                    if 'mark.gpu' in f.read():
                        found.append(os.path.join(base, name))
    return sorted(found)


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
    m = re.search(r'(\d+) failed', text)
    if m:
        found['failed'] = int(m.group(1))
    if name == 'nvtx':
        log = os.path.join(out, 'logs', 'nvtx_ranges.tsv')
        if os.path.exists(log):
            with open(log) as f:
                kinds = [line.split('\t', 1)[0] for line in f]
            found['nvtx_pushes'] = kinds.count('push')
            found['nvtx_pops'] = kinds.count('pop')
    return found


def run_step(name, argv, env, seconds, out):
    log = os.path.join(out, 'logs', name + '.log')
    start = time.monotonic()
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=seconds,
                           env=dict(os.environ, **env), cwd=ROOT)
        status, text = ('ok' if r.returncode == 0 else 'failed ({})'.format(r.returncode),
                        r.stdout + r.stderr)
        stdout = r.stdout
    except subprocess.TimeoutExpired as e:
        status = 'timed out after {} s'.format(seconds)
        stdout = (e.stdout or b'').decode(errors='replace')
        text = stdout + (e.stderr or b'').decode(errors='replace')
    with open(log, 'w') as f:
        f.write(' '.join(argv) + '\n\n' + text)
    if name == 'doctor' and status == 'ok':
        with open(os.path.join(out, 'doctor.json'), 'w') as f:
            f.write(stdout)         # the JSON alone (warnings went to stderr)
    return {'status': status, 'seconds': round(time.monotonic() - start, 1),
            'figures': figures(name, text, out), 'log': os.path.relpath(log, out)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--quick', action='store_true')
    p.add_argument('--results', default=os.path.join(HERE, 'results', 'gpu'))
    p.add_argument('--steps', default=','.join(STEPS),
                   help='comma-separated, from: ' + ', '.join(STEPS))
    p.add_argument('--device', default='@cupy:0')
    p.add_argument('--batch', type=int, default=32, help="the recipe's batch (the talk's: 32)")
    p.add_argument('--image-size', type=int, default=224, help="the recipe's crop (the talk's: 224)")
    p.add_argument('--pack', metavar='TAR_GZ', help='also write the results as one archive')
    args = p.parse_args(argv)
    args.steps = [s for s in args.steps.split(',') if s]
    unknown = sorted(set(args.steps) - set(STEPS))
    if unknown:
        p.error('unknown step(s) {}; choose from {}'.format(', '.join(unknown),
                                                             ', '.join(STEPS)))
    os.makedirs(os.path.join(args.results, 'logs'), exist_ok=True)
    report = {'started': time.strftime('%Y-%m-%d %H:%M:%S'), 'quick': args.quick,
              'device': args.device, 'python': sys.executable, 'steps': {}}
    on_gpu = args.device.startswith('@cupy')
    for name, (cmd, env, seconds) in plan(args).items():
        if name in GPU_ONLY and not on_gpu:
            report['steps'][name] = {'status': 'skipped: needs a GPU (--device @cupy:0)'}
        else:
            if name == 'nvtx':
                tool, why = nvtx_tool(args.results)
                if tool is None:
                    report['steps'][name] = {'status': 'skipped: recorder not built: ' + why}
                    continue
                env = dict(env, NVTX_INJECTION64_PATH=tool)
            print('gpu_check: {} ...'.format(name), flush=True)
            report['steps'][name] = run_step(name, cmd, env, seconds, args.results)
            print('gpu_check: {} {}'.format(name, report['steps'][name]['status']), flush=True)
        with open(os.path.join(args.results, 'gpu_check.json'), 'w') as f:
            json.dump(report, f, indent=2)
    if args.pack:
        def keep(info):     # no generated JPEGs, no compiled recorder
            skip = '/demo-data' in info.name or info.name.endswith('.so')
            return None if skip else info
        with tarfile.open(args.pack, 'w:gz') as tar:
            tar.add(args.results, arcname='gpu', filter=keep)
    failed = [n for n, s in report['steps'].items() if not s['status'].startswith(('ok',
                                                                                   'skipped'))]
    print('gpu_check: {} step(s) ok or skipped, failed: {}'.format(
        len(report['steps']) - len(failed), ', '.join(failed) or 'none'))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
