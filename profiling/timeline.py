#!/usr/bin/env python
"""Profile a recipe without Nsight Systems: fastchain's built-in timeline.

    python profiling/timeline.py -o prof/demo -- recipes/resnet50/train.py \\
        --data demo --all --iterations 30

Runs the recipe with ``--timeline``, which records fastchain's NVTX ranges
in-process, then writes ``prof/demo.json`` (Chrome trace: open it in
ui.perfetto.dev or chrome://tracing), ``prof/demo.png`` (per-phase chart)
and ``prof/demo.txt`` (the step breakdown and diagnosis, also printed).
"""

import argparse
import os
import subprocess
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if '--' not in argv:
        raise SystemExit('usage: timeline.py [-o PATH] -- recipe.py [recipe args]')
    split = argv.index('--')
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('-o', '--output', default='fastchain_timeline',
                   help='path without extension for the .json, .png and .txt')
    args = p.parse_args(argv[:split])
    script = argv[split + 1:]
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    trace = args.output + '.json'
    subprocess.run([sys.executable] + script + ['--timeline', trace], check=True)
    with open(args.output + '.txt') as f:
        print(f.read())
    print('trace: {}\nchart: {}.png'.format(trace, args.output))
    return 0


if __name__ == '__main__':
    sys.exit(main())
