"""Weak scaling of data-parallel training on the hardware present.

The ResNet-50 recipe's step (model, MomentumSGD, DataParallelUpdater,
in-memory data) with a fixed batch per process, at 1 process and at N. On a
CPU each process is one "device": it runs with one BLAS/OpenMP thread, so
N processes use N cores and the 1-process run uses one. ``efficiency@N`` is
the step time at 1 process over the step time at N (1.0: perfect).

The runs alternate (1, N, 1, N, ...), each a fresh ``mpiexec`` with its own
warm-up; each run reports the median step time of its steps.
"""

import json
import os
import statistics
import subprocess
import sys
import time

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def child(args):
    import chainer
    import chainer.links as L
    from fastchain import distributed
    from fastchain.models import ResNet
    comm = distributed.create_communicator('mpi')
    rng = numpy.random.RandomState(comm.rank)
    n = args.batch * 4
    x = rng.randn(n, 3, args.size, args.size).astype(numpy.float32)
    t = rng.randint(0, 10, n).astype(numpy.int32)
    model = L.Classifier(ResNet(50, 10))
    optimizer = chainer.optimizers.MomentumSGD(0.01)
    it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), args.batch)
    updater = distributed.DataParallelUpdater(it, optimizer.setup(model), comm)
    for _ in range(2):
        updater.update()
    times = []
    for _ in range(args.steps):
        comm.barrier()
        start = time.perf_counter()
        updater.update()
        times.append(comm.allreduce_obj(time.perf_counter() - start, op='max'))
    if comm.rank == 0:
        print('RESULT ' + json.dumps({'processes': comm.size,
                                      'step_s': statistics.median(times)}))


def main(argv=None):
    p = _common.parser('scaling', __doc__)
    p.add_argument('--processes', type=int, default=None,
                   help='N (default: the cores available)')
    p.add_argument('--batch', type=int, default=8, help='per process')
    p.add_argument('--size', type=int, default=None, help='input side in pixels')
    p.add_argument('--steps', type=int, default=None)
    p.add_argument('--child', action='store_true', help=argparse_hidden())
    args = p.parse_args(argv)
    args.size = args.size or (32 if args.quick else 64)
    args.steps = args.steps or (4 if args.quick else 8)
    if args.child:
        return child(args)
    from fastchain.backends import mpi
    from fastchain.data import available_cores
    n = args.processes or available_cores()
    if n < 2:
        raise SystemExit('benchmarks/scaling.py compares 1 process with N, and N is {} here '
                         '(--processes, else the cores this process may use); pass '
                         '--processes 2 or more'.format(n))
    runs = args.windows or (3 if args.quick else 5)
    env = dict(os.environ, OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1',
               MKL_NUM_THREADS='1')
    rows = _common.Rows('steps/s')
    for r in range(runs):
        for procs in (1, n):
            cmd = [mpi.mpiexec_path(), '-n', str(procs), sys.executable,
                   os.path.abspath(__file__), '--child', '--batch', str(args.batch),
                   '--size', str(args.size), '--steps', str(args.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
            if out.returncode != 0:
                raise SystemExit(out.stderr[-3000:])
            line = next(l for l in out.stdout.splitlines() if l.startswith('RESULT '))
            result = json.loads(line[len('RESULT '):])
            rows.add('{}_process{}'.format(procs, 'es' if procs > 1 else ''),
                     1.0 / result['step_s'])
        print('run {}/{}: '.format(r + 1, runs) + ', '.join(
            '{} {:.3f} s/step'.format(k, 1 / v[-1]) for k, v in rows.windows.items()),
            flush=True)
    names = list(rows.windows)
    ratios = {'efficiency@{}'.format(n): rows.ratio(names[-1], names[0])}
    config = {'model': 'ResNet-50', 'input': args.size, 'batch_per_process': args.batch,
              'processes': [1, n], 'threads_per_process': 1, 'steps_per_run': args.steps,
              'runs': runs, 'communicator': 'mpi', 'gpus': 0}
    rows.skip('nccl', 'this benchmark runs the MPI communicator on CPU processes; NCCL '
              'over GPUs: make gpu-check on a GPU machine')
    notes = ['Each process is one device (one core, one BLAS thread); the batch per '
             'process is fixed, so N processes do N times the work per step.']
    _common.write('scaling', args, config, rows, ratios, notes)


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == '__main__':
    main()
