"""``fastchain-run -n N script.py [args]``: mpiexec with the right Python.

A thin convenience over MPI's own launcher (no process management of its
own): it finds the ``mpiexec`` installed with fastchain's ``mpi`` extra (or
on PATH) and runs ``mpiexec -n N [--hostfile F] <this python> script.py args``.
"""

import argparse
import os
import sys


def main(argv=None):
    p = argparse.ArgumentParser(
        prog='fastchain-run', description='Start N processes of a training script with MPI')
    p.add_argument('-n', '--np', type=int, required=True, help='number of processes')
    p.add_argument('--hostfile', help='hosts to spread the processes over (mpiexec -f)')
    p.add_argument('--dry-run', action='store_true', help='print the command only')
    p.add_argument('script')
    p.add_argument('args', nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    from fastchain.backends import mpi as mpi_backend
    mpiexec = mpi_backend.mpiexec_path()
    if mpiexec is None:
        raise SystemExit('fastchain-run: no mpiexec found. Fix: ' + mpi_backend.MPI_EXTRA)
    if args.np < 1:
        raise SystemExit('fastchain-run: -n must be at least 1')
    cmd = [mpiexec, '-n', str(args.np)]
    if args.hostfile:
        cmd += ['-f', args.hostfile]
    cmd += [sys.executable, args.script] + args.args
    if args.dry_run:
        print(' '.join(cmd))
        return 0
    os.execv(mpiexec, cmd)


if __name__ == '__main__':
    sys.exit(main())
