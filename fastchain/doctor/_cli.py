"""The ``fastchain`` console script: ``fastchain doctor [--json]``."""

import argparse
import json
import sys


def _yes(flag):
    return 'yes' if flag else 'no'


def _print_human(rep, out):
    m = rep['machine']
    print('fastchain {}  (Python {}, {})'.format(
        rep['fastchain'], rep['python'], rep['executable']), file=out)
    print('machine: {} | {} cores | {:.1f} GiB'.format(
        m['cpu'], m['cores'], (m['memory_bytes'] or 0) / 2**30), file=out)
    print('packages: ' + ', '.join('{} {}'.format(k, v or '-')
                                   for k, v in rep['packages'].items()), file=out)
    print('\nGPUs:', file=out)
    if not m['gpus']:
        print('  none', file=out)
    for g in m['gpus']:
        print('  [{index}] {name}  sm_{cc}  {mem:.1f} GiB  TensorCores: {tc}'.format(
            index=g['index'], name=g['name'],
            cc=g['compute_capability'].replace('.', ''),
            mem=g['memory_bytes'] / 2**30, tc=_yes(g['tensor_cores'])), file=out)
    print('\ndependencies:', file=out)
    for name, s in rep['dependencies'].items():
        line = '  {:6s} {:3s} {}'.format(name, _yes(s['available']),
                                         s['version'] or '')
        if not s['available']:
            line += '  ({}; fix: {})'.format(s['why'], s['fix'])
        print(line, file=out)
    print('\nChainer shims applied ({}):'.format(len(rep['shims'])), file=out)
    for s in rep['shims']:
        print('  {:20s} {:42s} {}'.format(s['name'], s['module'], s['why']), file=out)
    print('\naccelerators:', file=out)
    for name, s in rep['accelerators'].items():
        line = '  {:20s} available: {:3s} active: {:3s}'.format(
            name, _yes(s['available']), _yes(s['active']))
        if not s['available']:
            line += '  ({}; fix: {})'.format(s['why'], s['fix'])
        print(line, file=out)
    if rep['patch_points'] or rep['settings']:
        print('\nin force in this process ({} handle(s)):'.format(rep['enabled_handles']),
              file=out)
        for point, layers in rep['patch_points'].items():
            print('  {:52s} {}'.format(point, ', '.join(layers)), file=out)
        for label in rep['settings']:
            print('  {}'.format(label), file=out)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog='fastchain', description='fastchain command-line tools')
    sub = parser.add_subparsers(dest='command', required=True)
    doctor = sub.add_parser('doctor', help='describe this machine and what '
                            'fastchain can accelerate on it')
    doctor.add_argument('--json', action='store_true',
                        help='print the report as JSON')
    args = parser.parse_args(argv)

    if args.command == 'doctor':
        from fastchain.doctor._report import report
        rep = report(mpi=True)
        if args.json:
            json.dump(rep, sys.stdout, indent=2, default=str)
            print()
        else:
            _print_human(rep, sys.stdout)
    return 0


if __name__ == '__main__':
    sys.exit(main())
