#!/usr/bin/env python
"""Profile a training script without Nsight Systems: fastchain's built-in timeline.

    python profiling/timeline.py -o prof/demo recipes/resnet50/train.py \\
        --data demo --all --iterations 30

Runs the script (any Chainer training script: it needs no flag of its own)
in this process inside ``fastchain.enable(timeline=PATH.json)``, which
records fastchain's NVTX ranges in-process. When the script ends, it writes
PATH.json (Chrome trace: open it in ui.perfetto.dev or chrome://tracing),
PATH.png (per-phase chart) and PATH.txt (the step breakdown and diagnosis,
also printed). Like any enable() call, this puts fastchain's default
accelerators in force for a script that does not call fastchain.enable()
itself; a script's own enable(...) options take precedence as usual.

Exit status: the script's own (a failing script's partial timeline is still
written), 2 for a usage error.
"""

import argparse
import os
import runpy
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..'))

USAGE = '%(prog)s [-h] [-o PATH] [--] script.py [script args ...]'


def parser():
    p = argparse.ArgumentParser(
        usage=USAGE, description=__doc__.split('\n\n')[0],
        epilog='\n\n'.join(__doc__.split('\n\n')[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('-o', '--output', default='fastchain_timeline', metavar='PATH',
                   help='path for the .json, .png and .txt (an extension given is dropped) '
                        '(default: %(default)s)')
    p.add_argument('command', nargs=argparse.REMAINDER, metavar='script.py [script args ...]',
                   help='the training script and its arguments')
    return p


def parse(argv):
    p = parser()
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ['--'] else args.command
    if not command:
        p.error('give the training script to run: timeline.py [-o PATH] script.py '
                '[script args ...]')
    if not os.path.isfile(command[0]):
        p.error('{}: no such script'.format(command[0]))
    args.command = command
    if args.output.endswith(('/', os.sep)) or os.path.isdir(args.output):
        p.error('-o {}: a folder; give the files\' path without extension, e.g. -o {}'.format(
            args.output, os.path.join(args.output, 'timeline')))
    root, ext = os.path.splitext(args.output)
    if ext.lower() in ('.json', '.png', '.txt'):
        args.output = root      # -o prof/t.json: prof/t.json, not prof/t.json.json
    folder = os.path.dirname(os.path.abspath(args.output))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        p.error('-o {}: cannot create the folder {} ({})'.format(
            args.output, folder, e.strerror or e))
    return args


def run_script(command):
    """Run ``command`` (script.py args) as ``__main__``, as ``python`` would;
    returns its exit status."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        sys.argv = command[:]
        # The script's folder first, as `python script.py` has it, not this one.
        sys.path[:] = [os.path.dirname(os.path.abspath(command[0]))] + [
            p for p in sys.path if p != HERE]
        runpy.run_path(command[0], run_name='__main__')
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return 0
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
            return 1
        return e.code
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    import fastchain
    from fastchain.nvtx import _group
    trace = args.output + '.json'
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', fastchain.FastchainWarning)
        handle = fastchain.enable(timeline=trace)
    before = len(_group.opened)
    try:
        status = run_script(args.command)
    finally:
        # Writes the trace, chart and summary, even when the script failed.
        handle.disable()
        if sys.exc_info()[0] is not None:
            saved = handle.resources['timeline'].saved or {}
            if saved.get('summary', {}).get('steps'):
                print('timeline.py: the script failed; the timeline up to the failure was '
                      'written to {} and {}'.format(saved.get('json', trace),
                                                    saved.get('txt')), file=sys.stderr)
            else:
                print('timeline.py: the script failed before a training step was recorded '
                      '({} holds none)'.format(saved.get('json', trace)), file=sys.stderr)
    saved = handle.resources['timeline'].saved
    with open(saved['txt']) as f:
        print(f.read())
    own = [path for path in _group.opened[before:] if path != trace]
    if not saved['summary']['steps']:
        if own:
            print('timeline.py: no training step was recorded here: the script records '
                  'its own timeline ({}): a handle it enables takes the ranges while it is '
                  'in force. Read those files, or take timeline= out of the script'.format(
                      ', '.join(own)), file=sys.stderr)
        elif status:
            print('timeline.py: the script ended (status {}) before a training step was '
                  'recorded'.format(status), file=sys.stderr)
        else:
            print('timeline.py: no training step was recorded: fastchain times the update() '
                  'of Chainer StandardUpdaters built while it is enabled; does the script '
                  'train through one, and leave nvtx on?', file=sys.stderr)
    print('trace: {}\nchart: {}'.format(
        saved['json'], saved['png'] or 'not drawn (no step recorded, or no matplotlib)'))
    if status:
        print('timeline.py: the script exited with status {}'.format(status),
              file=sys.stderr)
    return status


if __name__ == '__main__':
    sys.exit(main())
