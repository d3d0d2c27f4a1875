"""Time to average ResNet-50's gradients over N processes.

The gradient set has ResNet-50's real parameter shapes (161 arrays, 25.6 M
values, 102 MB in fp32). Side by side, window by window:

  limit       the faster, window by window, of two bare transports of the
              same bytes, nothing packed or averaged: one MPI Allreduce of a
              single buffer (limit_one_buffer), and one per bucket of
              fastchain's sizes on views of that buffer (limit_buckets; one big
              Allreduce was slower than the buckets here, so alone it was no
              limit: a review)
  fastchain   fastchain's GradientSync as the communicator has it: with MPI
              each gradient reduced in place (the small ones packed
              together), blocking, and averaged; with NCCL packed into 25 MB
              buckets, reduced, averaged and unpacked into every param.grad
  fastchain_packed (or _in_place)  the same sync in the form fastchain did
              not choose for this communicator (what the choice is against)
  averaging_only  the scale of every gradient by 1/N alone, no transport
  chainermn   ChainerMN's communicator shipped with Chainer 7.8.1
              (``multi_node_mean_grad``; 'naive' is the one that runs on
              CPU arrays: one allreduce per parameter)

Started with ``mpiexec -n N`` (or it starts itself with ``--processes N``,
default 2). Rows are synchronisations per second; ``fastchain/limit`` is the
limit's time over fastchain's. The averaged gradients of fastchain and
ChainerMN are compared for equality.
"""

import os
import subprocess
import sys
import time

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def in_mpi():
    return any(int(os.environ.get(v, '1')) > 1 for v in
               ('PMI_SIZE', 'OMPI_COMM_WORLD_SIZE', 'MV2_COMM_WORLD_SIZE'))


def model_with_grads(rank, device):
    import chainer.links as L
    from fastchain.models import resnet50
    model = L.Classifier(resnet50(1000))
    model.to_device(device)
    rng = numpy.random.RandomState(rank)
    for p in model.params():
        p.grad = device.send(rng.standard_normal(p.shape).astype(numpy.float32))
    return model


def main(argv=None):
    p = _common.parser('allreduce', __doc__)
    p.add_argument('--processes', type=int, default=2)
    p.add_argument('--bucket-mb', type=float, default=25)
    p.add_argument('--communicator', choices=('mpi', 'nccl'), default='mpi',
                   help='nccl: GPU arrays, one GPU per process (not run here: no GPU)')
    args = p.parse_args(argv)
    if not in_mpi():
        from fastchain.backends import mpi
        cmd = [mpi.mpiexec_path(), '-n', str(args.processes), sys.executable,
               os.path.abspath(__file__)] + sys.argv[1:]
        sys.exit(subprocess.call(cmd))

    import chainermn
    from mpi4py import MPI
    from fastchain import distributed
    comm = distributed.create_communicator(args.communicator)
    rank, size = comm.rank, comm.size
    windows = args.windows or (5 if args.quick else 9)
    per_window = 2 if args.quick else 4
    device = comm.device()
    device.use()
    xp = device.xp

    def synchronize():
        if xp is not numpy:
            xp.cuda.Device().synchronize()   # read the clock after the GPU is done

    model = model_with_grads(rank, device)
    params = list(model.params())
    n_values = sum(p.size for p in params)
    original = [p.grad.copy() for p in params]
    sync = distributed.GradientSync(comm, params, cap_bytes=int(args.bucket_mb * 2 ** 20))
    peer_name = 'naive' if args.communicator == 'mpi' else 'pure_nccl'
    peer = chainermn.create_communicator(peer_name, MPI.COMM_WORLD)
    flat = xp.empty(n_values, numpy.float32)

    def reset():
        for p, g in zip(params, original):
            p.grad[...] = g
        synchronize()

    def run_limit():
        if xp is numpy:
            MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        else:
            comm.allreduce(flat, 'limit allreduce')

    bucket_views, at = [], 0
    for bucket in sync.buckets:
        n = sum(p.size for p in bucket.params)
        bucket_views.append(flat[at:at + n])
        at += n

    def run_limit_buckets():
        for view in bucket_views:
            if xp is numpy:
                MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)
            else:
                comm.allreduce(view, 'limit allreduce')

    def run_fastchain():
        sync.begin_step()
        sync.finish()

    def run_chainermn():
        peer.multi_node_mean_grad(model)

    # What fastchain's choice for this communicator stands against: the other
    # form (MPI reduces in place: packed into buckets, and back), and the
    # averaging pass alone (a scale of every gradient, no transport)
    other = distributed.GradientSync(comm, params, cap_bytes=int(args.bucket_mb * 2 ** 20))
    other.in_place = not sync.in_place and other.allreduce_dtype is None
    scale = numpy.float32(1.0 / size)

    def run_fastchain_other():
        other.begin_step()
        other.finish()

    def run_averaging_only():
        for p in params:
            p.grad *= scale
        synchronize()

    # Same inputs, same answer: fastchain's average equals ChainerMN's.
    reset()
    run_fastchain()
    ours = [p.grad.copy() for p in params]
    reset()
    run_chainermn()
    identical = all(bool((a == p.grad).all()) for a, p in zip(ours, params))
    max_diff = max(float(abs(a - p.grad).max()) for a, p in zip(ours, params))

    variants = {'limit_one_buffer': run_limit, 'limit_buckets': run_limit_buckets,
                'fastchain': run_fastchain, 'chainermn': run_chainermn,
                'fastchain_packed' if sync.in_place else 'fastchain_in_place':
                run_fastchain_other, 'averaging_only': run_averaging_only}
    rows = _common.Rows('syncs/s')
    for name, fn in variants.items():        # warm-up
        reset()
        fn()
    for w in range(windows):
        for name, fn in variants.items():
            reset()
            MPI.COMM_WORLD.Barrier()
            start = time.perf_counter()
            for _ in range(per_window):
                fn()
            synchronize()
            elapsed = MPI.COMM_WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX)
            rows.add(name, per_window / elapsed)
        rows.add('limit', max(rows.windows['limit_one_buffer'][-1],
                              rows.windows['limit_buckets'][-1]))
        if rank == 0:
            print('window {}/{}: '.format(w + 1, windows) + ', '.join(
                '{} {:.1f} ms'.format(n, 1e3 / v[-1]) for n, v in rows.windows.items()),
                flush=True)
    if rank != 0:
        return
    ratios = {'fastchain/limit': rows.ratio('fastchain', 'limit'),
              'fastchain/chainermn': rows.ratio('fastchain', 'chainermn')}
    config = {'processes': size, 'communicator': args.communicator,
              'transport': 'MPI ({})'.format(MPI.Get_library_version().split('\n')[0].strip())
              if args.communicator == 'mpi' else 'NCCL',
              'arrays': len(params), 'values': n_values,
              'megabytes_fp32': round(n_values * 4 / 2 ** 20, 1),
              'buckets': len(sync.buckets), 'bucket_mb': args.bucket_mb,
              'windows': windows, 'syncs_per_window': per_window,
              'chainermn_communicator': peer_name,
              'results_identical_to_chainermn': identical,
              'max_abs_difference_vs_chainermn': max_diff}
    if args.communicator == 'mpi':
        rows.skip('chainermn_flat', "ChainerMN's 'flat' and NCCL communicators need CuPy "
                  'arrays (this run: the MPI communicator, on the CPU)')
        rows.skip('fastchain_nccl', 'needs GPUs and --communicator nccl (make gpu-check on '
                  'a GPU machine)')
    notes = ['Every process holds the same 161 gradient arrays of ResNet-50; a sync '
             'leaves their mean over the processes in every param.grad. The limit moves '
             'the same bytes bare, as one buffer and as buckets of fastchain\'s sizes, '
             'and leaves them summed in place (no packing, no averaging); the limit is '
             'the faster of the two in each window.']
    _common.write('allreduce', args, config, rows, ratios, notes)


if __name__ == '__main__':
    main()
