"""The ``fastchain`` console script: ``fastchain doctor [--json]``, ``--version``."""

import argparse
import json
import sys


def _yes(flag):
    return 'yes' if flag else 'no'


def _why(s):
    parts = [p for p in (s.get('why'), 'fix: ' + s['fix'] if s.get('fix') else None) if p]
    return '  ({})'.format('; '.join(parts)) if parts else ''


def _outcome(call, s):
    """One line: what ``call`` does here (``enable(fp16=True): on``, ...)."""
    line = '{}: {}'.format(call, 'on' if s['active'] else 'off')
    if s['active'] and s.get('note'):
        # A note enable() also warns with is a warning (fp16 on a CPU); others
        # (the loader keeping in-memory datasets serial) are notes.
        said = any(s['note'] in w for w in s.get('warnings') or ())
        return line + ('  - warning: ' if said else '  - note: ') + s['note']
    return line + _why(s)


def _print_accelerators(rep, out):
    """Each accelerator as ``report(preview=True)`` gives it: what ``enable()``
    does here, and what asking for one it leaves off would do."""
    print('\naccelerators: what fastchain.enable() with no arguments does on this '
          'machine\n(tried in this process and undone: the doctor trains nothing, '
          'so nothing is in force here):', file=out)
    for name, s in rep['accelerators'].items():
        here = s['enable_here']
        line = '  {:20s} available: {:3s} '.format(name, _yes(s['available']))
        if s['available']:
            line += _outcome('enable()', here)
        else:
            line += 'enable(): off here{}{}'.format(
                ' (on by default where available)' if s['on_by_default'] else '',
                _why(here))
        print(line, file=out)
        for call, tried in s['requested_here'].items():
            print('  {:20s} {}'.format('', _outcome('enable({})'.format(call), tried)),
                  file=out)


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
    if rep['environment']:
        print('\nenvironment:', file=out)
        for v in rep['environment']:
            print('  {}={}  {}'.format(v['name'], v['value'], v['meaning'] if v['ok'] else
                                       'WRONG: ' + v['error']), file=out)
    _print_accelerators(rep, out)
    if rep['patch_points'] or rep['settings']:
        print('\nin force in this process ({} handle(s)):'.format(rep['enabled_handles']),
              file=out)
        for point, layers in rep['patch_points'].items():
            print('  {:52s} {}'.format(point, ', '.join(layers)), file=out)
        for label in rep['settings']:
            print('  {}'.format(label), file=out)


def version_line():
    """``fastchain X (Chainer Y)``, read without importing Chainer (so it
    works even where Chainer cannot be imported)."""
    from fastchain import __version__
    from fastchain.doctor._report import _dist_version
    return 'fastchain {} (Chainer {})'.format(
        __version__, _dist_version('chainer') or 'not installed')


class _Version(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS,
                 default=argparse.SUPPRESS, help="print fastchain's and Chainer's "
                 'versions and exit'):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog='fastchain', description='fastchain command-line tools')
    parser.add_argument('--version', action=_Version)
    sub = parser.add_subparsers(dest='command', required=True)
    doctor = sub.add_parser('doctor', help='describe this machine and what '
                            'fastchain can accelerate on it')
    doctor.add_argument('--json', action='store_true',
                        help='print the report as JSON')
    doctor.add_argument('--version', action=_Version)
    args = parser.parse_args(argv)

    if args.command == 'doctor':
        from fastchain.doctor._report import report
        rep = report(mpi=True, preview=True)
        if args.json:
            json.dump(rep, sys.stdout, indent=2, default=str)
            print()
        else:
            _print_human(rep, sys.stdout)
    return 0


if __name__ == '__main__':
    sys.exit(main())
