#!/usr/bin/env python
"""Run a fastchain training under Nsight Systems for a window of iterations,
export the report to SQLite and print the per-phase breakdown.

    python profiling/nsys_profile.py --iterations 100:120 -o prof/resnet50 -- \\
        recipes/resnet50/train.py --data synthetic --all --iterations 130

Only iterations FIRST..LAST are captured: fastchain opens an NVTX range
'capture' around them (``FASTCHAIN_CAPTURE``), and nsys starts and stops on
it (``--capture-range=nvtx --nvtx-capture=capture@fastchain``). Traced: CUDA,
cuDNN, cuBLAS, NVTX and OS runtime calls. ``--dry-run`` prints the commands.
"""

import argparse
import os
import shlex
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def commands(args, script):
    report = args.output
    profile = [args.nsys, 'profile', '--trace=cuda,cudnn,cublas,nvtx,osrt',
               '--sample=none', '--force-overwrite=true', '-o', report]
    if args.iterations:
        profile += ['--capture-range=nvtx', '--nvtx-capture=capture@fastchain',
                    '--capture-range-end=stop']
    profile += [sys.executable] + script
    export = [args.nsys, 'export', '--type', 'sqlite', '--force-overwrite=true',
              '-o', report + '.sqlite', report + '.nsys-rep']
    summarize = [sys.executable, os.path.join(HERE, 'summarize.py'), report + '.sqlite',
                 '--png', report + '.png']
    return profile, export, summarize


USAGE = '%(prog)s [options] [--] script.py [script args ...]'


def _window(text):
    try:
        first, last = (int(v) for v in text.split(':'))
    except ValueError:
        first = last = 0
    if not 1 <= first <= last:
        raise argparse.ArgumentTypeError(
            '{!r}: expected FIRST:LAST, 1-based and FIRST <= LAST, e.g. 100:120'.format(text))
    return text


def parse(argv):
    p = argparse.ArgumentParser(
        usage=USAGE, description=__doc__.split('\n\n')[0],
        epilog='\n\n'.join(__doc__.split('\n\n')[1:]) + '\n\nExit status: that of the '
               'first command that fails, 2 for a usage error (no nsys, no script).',
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--iterations', metavar='FIRST:LAST', type=_window,
                   help='capture only these iterations (1-based, inclusive)')
    p.add_argument('-o', '--output', default='fastchain_profile', metavar='PATH',
                   help='report path without extension (default: %(default)s)')
    p.add_argument('--nsys', default=shutil.which('nsys') or 'nsys',
                   help='the nsys executable (default: the one on PATH)')
    p.add_argument('--dry-run', action='store_true', help='print the commands, run nothing')
    p.add_argument('command', nargs=argparse.REMAINDER, metavar='script.py [script args ...]',
                   help='the training script and its arguments')
    args = p.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ['--'] else args.command
    if not args.command:
        p.error('give the training script to profile: nsys_profile.py [options] script.py '
                '[script args ...]')
    if not args.dry_run:
        if not args.command[0].startswith('-') and not os.path.isfile(args.command[0]):
            p.error('{}: no such script'.format(args.command[0]))
        if shutil.which(args.nsys) is None:
            p.error('{}: nsys not found: install Nsight Systems (it comes with the CUDA '
                    'toolkit, or from developer.nvidia.com/nsight-systems) or give --nsys '
                    'its path, or use the built-in timeline: profiling/timeline.py'.format(
                        args.nsys))
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    script = args.command
    env = dict(os.environ)
    # nsys matches --nvtx-capture against registered strings only when this
    # is 0; fastchain registers its range names, so either way works.
    env.setdefault('NSYS_NVTX_PROFILER_REGISTER_ONLY', '0')
    if args.iterations:
        env['FASTCHAIN_CAPTURE'] = args.iterations
    steps = commands(args, script)
    if args.dry_run:
        prefix = 'FASTCHAIN_CAPTURE={} '.format(args.iterations) if args.iterations else ''
        for i, cmd in enumerate(steps):
            print((prefix if i == 0 else '') + ' '.join(shlex.quote(c) for c in cmd))
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    for cmd in steps:
        print('+ ' + ' '.join(shlex.quote(c) for c in cmd), flush=True)
        code = subprocess.run(cmd, env=env).returncode
        if code:
            print('nsys_profile.py: error: `{}` exited with status {}'.format(
                ' '.join(shlex.quote(c) for c in cmd[:2]), code), file=sys.stderr)
            return code
    return 0


if __name__ == '__main__':
    sys.exit(main())
