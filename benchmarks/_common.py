"""What every fastchain benchmark shares: arguments, windows, the JSON.

Conventions (../shared/BENCHMARKS.md): warm up first; alternate the variants
window by window so drift hits all of them; report the median of the windows
with (min, max); record the machine; every ratio A/B is speed of A over speed
of B.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, 'results')


def parser(name, doc):
    p = argparse.ArgumentParser(prog='benchmarks/{}.py'.format(name), description=doc)
    p.add_argument('--json', metavar='PATH', help='write the results as JSON here')
    p.add_argument('--quick', action='store_true',
                   help='the CI-sized run (minutes on 2 cores)')
    p.add_argument('--windows', type=int, default=None,
                   help='measurement windows per variant (median reported)')
    p.add_argument('--results', default=RESULTS,
                   help='directory for the JSON/Markdown copies (default: benchmarks/results)')
    return p


def device(spec):
    """The Chainer device ``spec`` names (default: GPU 0 if usable, else
    '@numpy'), made current; exits naming why where it cannot be used."""
    from fastchain.backends import cuda
    try:
        found = cuda.get_device(spec)
    except RuntimeError as e:
        sys.exit(str(e))
    found.use()
    return found


def machine():
    from fastchain.doctor._report import machine as describe
    m = describe()
    m['argv'] = sys.argv[1:]
    m['date'] = time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())
    m['commit'] = commit()
    return m


def commit():
    """The commit the code measured is at, ``+changes`` when fastchain/ or
    benchmarks/ (its results aside) differ from it; None outside a git
    checkout."""
    import subprocess
    here = os.path.dirname(HERE)
    try:
        head = subprocess.run(['git', 'rev-parse', '--short=12', 'HEAD'], cwd=here,
                              capture_output=True, text=True, timeout=10)
        changed = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no',
                                  '--', 'fastchain', 'benchmarks',
                                  ':!benchmarks/results'], cwd=here,
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ('+changes' if changed.stdout.strip() else '')


class Rows:
    """Collects windows per variant and turns them into BENCHMARKS.md rows."""

    def __init__(self, unit):
        self.unit = unit
        self.windows = {}       # name -> [value, ...] (speeds: higher is better)
        self.extra = {}
        self.unavailable = []

    def add(self, name, value, **extra):
        self.windows.setdefault(name, []).append(value)
        if extra:
            self.extra.setdefault(name, {}).update(extra)

    def skip(self, name, why):
        self.unavailable.append({'name': name, 'why': why})

    def median(self, name):
        return statistics.median(self.windows[name])

    def rows(self):
        out = []
        for name, values in self.windows.items():
            row = {'name': name, 'value': round(statistics.median(values), 3),
                   'unit': self.unit,
                   'spread': [round(min(values), 3), round(max(values), 3)],
                   'windows': len(values)}
            row.update(self.extra.get(name, {}))
            out.append(row)
        return out

    def ratio(self, a, b):
        if a in self.windows and b in self.windows:
            return round(self.median(a) / self.median(b), 3)
        return None


def write(name, args, config, rows, ratios, notes=None, quiet=False):
    """Print a Markdown table (unless ``quiet``) and write the JSON (to
    --json, and to results/)."""
    result = {
        'benchmark': name,
        'machine': machine(),
        'config': config,
        'rows': rows.rows(),
        'unavailable': rows.unavailable,
        'ratios': {k: v for k, v in ratios.items() if v is not None},
    }
    if notes:
        result['notes'] = notes
    text = markdown(result)
    if not quiet:
        print(text)
    stem = os.path.join(args.results, name + ('-quick' if args.quick else ''))
    paths = [args.json] if args.json else []
    paths.append(stem + '.json')
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, 'w') as f:
            json.dump(result, f, indent=2, default=str)
            f.write('\n')
    with open(stem + '.md', 'w') as f:
        f.write(text)
    result['results_dir'] = args.results
    return result


def markdown(result):
    m = result['machine']
    lines = ['## {}'.format(result['benchmark']), '',
             'Machine: {} ({} cores), {} GPU{}; Python {}, NumPy {}{}, Chainer {}.'.format(
                 m.get('cpu'), m.get('cores'),
                 ', '.join(g['name'] for g in m.get('gpus') or []) or 'no',
                 ' (driver {}, CUDA {}, CuPy {})'.format(
                     m.get('nvidia_driver'), m.get('cuda_runtime'), m.get('cupy'))
                 if m.get('gpus') else '',
                 m.get('python'), m.get('numpy'),
                 ' ({})'.format(m['blas']) if m.get('blas') else '', m.get('chainer')),
             ] + (['Run: {}, commit {}.'.format(m['date'], m.get('commit') or 'unknown')]
                  if m.get('date') else []) + [
             '', '| variant | median | unit | spread (min, max) | windows |',
             '| --- | --- | --- | --- | --- |']
    for r in result['rows']:
        lines.append('| {} | {} | {} | {} - {} | {} |'.format(
            r['name'], r['value'], r['unit'], r['spread'][0], r['spread'][1],
            r['windows']))
    for u in result['unavailable']:
        lines.append('| {} | not run | | {} | |'.format(u['name'], u['why']))
    if result['ratios']:
        lines += ['', '| ratio | value |', '| --- | --- |']
        lines += ['| {} | {} |'.format(k, v) for k, v in result['ratios'].items()]
    for note in result.get('notes', []):
        lines += ['', note]
    return '\n'.join(lines) + '\n'


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out
