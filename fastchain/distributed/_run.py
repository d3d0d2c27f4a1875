"""``fastchain-run -n N script.py [args]``: mpiexec with the right Python.

A thin convenience over MPI's own launcher (no process management of its
own): it finds the ``mpiexec`` installed with fastchain's ``mpi`` extra (or
on PATH) and runs ``mpiexec -n N [--hostfile F] <this python> script.py args``
(``fastchain-run -n N python script.py`` runs the interpreter named, and
``-m MODULE`` a module).
"""

import argparse
import os
import re
import sys


def main(argv=None):
    p = argparse.ArgumentParser(
        prog='fastchain-run', description='Start N processes of a training script with MPI')
    p.add_argument('-n', '--np', type=int, required=True, help='number of processes')
    p.add_argument('--hostfile', help='hosts to spread the processes over (mpiexec -f)')
    p.add_argument('--dry-run', action='store_true', help='print the command only')
    p.add_argument('script', help='the training script (or: python script.py, or -m MODULE)')
    p.add_argument('args', nargs=argparse.REMAINDER)
    argv = list(sys.argv[1:] if argv is None else argv)
    module, rest = None, []
    i = 0
    while i < len(argv):    # fastchain-run's own options, up to the script or -m
        if argv[i] in ('-n', '--np', '--hostfile'):
            i += 2
        elif argv[i].startswith('-') and argv[i] != '-m':
            i += 1          # --dry-run, -h, --np=3, -n3
        else:
            break
    if i < len(argv) and argv[i] == '-m':
        if i + 1 == len(argv):
            p.error('-m needs a module name')
        module, rest = argv[i + 1], argv[i + 2:]
        argv = argv[:i] + ['-']         # '-' holds the script's place
    if i == len(argv) and not ({'-h', '--help'} & set(argv)):
        p.error('give the training script to run: fastchain-run -n N script.py [args ...]')
    args = p.parse_args(argv)
    if args.hostfile and not os.path.isfile(args.hostfile):
        p.error('--hostfile {}: no such file (one host per line, optionally host:slots)'
                .format(args.hostfile))
    script = None
    if module is not None:
        command = [sys.executable, '-m', module] + rest
    elif re.fullmatch(r'python[0-9.]*', os.path.basename(args.script)):
        command = [args.script] + args.args     # the interpreter named: as given
        if args.args and not args.args[0].startswith('-'):
            script = args.args[0]
        _say_other_python(args.script)
    else:
        command = [sys.executable, args.script] + args.args
        script = args.script
    if script is not None and not args.dry_run and not os.path.exists(script):
        # (a folder or zip with a __main__.py runs as python runs it)
        # (every rank printed "can't open file" and the job went on to fail)
        p.error('{}: no such script'.format(script))
    from fastchain.backends import mpi as mpi_backend
    mpiexec = mpi_backend.mpiexec_path()
    if mpiexec is None:
        raise SystemExit('fastchain-run: no mpiexec found. Fix: ' + mpi_backend.MPI_EXTRA)
    if args.np < 1:
        raise SystemExit('fastchain-run: -n must be at least 1')
    cmd = [mpiexec, '-n', str(args.np)]
    if args.hostfile:
        cmd += ['-f', args.hostfile]
    cmd += command
    if args.dry_run:
        print(' '.join(cmd))
        return 0
    os.execv(mpiexec, cmd)


def _say_other_python(name):
    """The interpreter named is not in this Python's folder (a venv not
    activated: PATH's ``python``): the ranks may lack fastchain (a review:
    every rank failed on 'No module named chainer')."""
    import shutil
    found = shutil.which(name)
    here = os.path.dirname(os.path.abspath(sys.executable))
    if found is None or os.path.dirname(os.path.abspath(found)) != here:
        sys.stderr.write(
            'fastchain-run: {} is {}, not in the folder of the Python fastchain-run runs in '
            '({}): the ranks run without this environment\'s packages unless that one has '
            'them too. Give the script alone (fastchain-run -n N script.py) to run it with '
            '{}\n'.format(name, found or 'not found on PATH', here, sys.executable))


if __name__ == '__main__':
    sys.exit(main())
