"""Learning curves of the distributed learners: when does each one pay?

CNTK 2.2's experiment (seed 002: ResNet-20 on CIFAR-10 at 1, 2 and 4 nodes,
1-bit SGD and block momentum, with and without a warm start) on what this
machine can run: ResNet-20 (``fastchain.models.CifarResNet``, 0.27 M
parameters) on scikit-learn's handwritten digits (1,797 real 8x8 images
shipped inside the scikit-learn package, nothing downloaded), each image
upsampled to 32x32 (CIFAR's size) by repeating each pixel 4x4; 1,437 for
training, 360 held out.

Every run trains the same global batch (``--batch``, split evenly over the
processes) with MomentumSGD from the same initial weights and the same data
order per rank, and evaluates the held-out accuracy of the model the ranks
hold every ``--eval-every`` samples (for the block learners, at the first
block end from there, where their ranks agree; a run ends at a block end). Learners: the exact allreduce, 1-bit SGD with and without
error feedback, block momentum (BMUF) and model averaging (blocks of
``--block-steps`` steps), each with and without a warm start
(``distributed_after`` = ``--warm-epochs`` epochs of samples).

Communication on a slow link is **computed, not measured**: this machine's
processes talk over shared memory, so each learner's bytes sent per step
(counted by the learner: ring algorithms) are turned into seconds at stated
link speeds and added to the step time measured here. ``samples/s @ L`` is
the global batch over that step time; ``LEARNER/allreduce @ L`` compares it
with the allreduce at the same process count. With more processes than
cores (4 on this 2-core machine) the measured compute per step is inflated
by the sharing, which understates the link's share; it says so in the JSON.
"""

import json
import os
import subprocess
import sys
import time

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

LINKS = {'1 Gbit/s': 1e9 / 8, '10 Gbit/s': 10e9 / 8, '100 Gbit/s': 100e9 / 8}
LEARNERS = ('allreduce', '1bit', '1bit_noef', 'bmuf', 'avg')
LABELS = {'allreduce': 'allreduce', '1bit': '1-bit + error feedback',
          '1bit_noef': '1-bit, no error feedback', 'bmuf': 'block momentum',
          'avg': 'model averaging'}


def digits(size):
    """scikit-learn's digits, (N, 1, size, size) float32 in [0, 1], and labels."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.images / 16.0).astype(numpy.float32)
    rep = size // 8
    x = x.repeat(rep, axis=1).repeat(rep, axis=2)[:, None]
    t = d.target.astype(numpy.int32)
    order = numpy.random.RandomState(0).permutation(len(t))
    x, t = x[order], t[order]
    return (x[:1437], t[:1437]), (x[1437:], t[1437:])


def make_learner(name, block_size):
    from fastchain import distributed
    return {'allreduce': lambda: distributed.AllReduce(),
            '1bit': lambda: distributed.QuantizedSGD(1),
            '1bit_noef': lambda: distributed.QuantizedSGD(1, error_feedback=False),
            'bmuf': lambda: distributed.BlockMomentum(block_size),
            'avg': lambda: distributed.ModelAveraging(block_size)}[name]()


def child(args):
    import chainer
    import chainer.links as L
    from chainer.training import extensions
    from fastchain import distributed
    from fastchain.models import CifarResNet
    comm = distributed.create_communicator('mpi')
    (x, t), (xt, tt) = digits(args.size)
    per_rank = args.batch // comm.size
    numpy.random.seed(0)
    model = L.Classifier(CifarResNet(20, 10, args.width, in_channels=1))
    learner = make_learner(args.learner, args.block_steps * per_rank)
    warm = int(args.warm_epochs * len(t))
    optimizer = distributed.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(args.lr), comm, learner=learner,
        distributed_after=warm)
    optimizer.setup(model)
    shard = distributed.scatter_dataset(chainer.datasets.TupleDataset(x, t), comm,
                                        shuffle=True, seed=1)
    order = chainer.iterators.ShuffleOrderSampler(numpy.random.RandomState(10 + comm.rank))
    it = chainer.iterators.SerialIterator(shard, per_rank, order_sampler=order)
    test = distributed.scatter_dataset(chainer.datasets.TupleDataset(xt, tt), comm)
    # Each rank's shard in one batch: Chainer's Evaluator averages over
    # batches, so batches of 60 and 30 (90 a rank at 4 processes) weighed the
    # short one's examples double (accuracies in 480ths, not 360ths).
    evaluator = distributed.create_multi_node_evaluator(extensions.Evaluator(
        chainer.iterators.SerialIterator(test, len(test), repeat=False, shuffle=False), model),
        comm)
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    steps = int(args.epochs * len(t)) // args.batch
    blocks = isinstance(learner, distributed.BlockMomentum)

    def accuracy():
        it_ = evaluator.get_iterator('main')
        it_.reset()
        with reporter.scope({}):
            return float(evaluator.evaluate()['main/accuracy'])

    def agreed():
        # Block learners' ranks hold their own models inside a block: their
        # model is the one every rank holds once the block is exchanged.
        return not blocks or not learner.started or learner.block_samples == 0

    curve = [(0, accuracy())]
    step_times = []
    step, due = 0, args.eval_every
    warm_steps = warm_bytes = 0         # the warm start's share, as the learner counted it
    while step < steps or not agreed():      # past the end only to finish a block
        step += 1
        xs, ts = chainer.dataset.concat_examples(it.next())
        comm.barrier()
        start = time.perf_counter()
        optimizer.update(model, xs, ts)
        step_times.append(comm.allreduce_obj(time.perf_counter() - start, op='max'))
        if not learner.started:
            warm_steps, warm_bytes = step, learner.stats['bytes_sent']
        seen = step * args.batch
        if seen >= due and agreed():
            curve.append((seen, accuracy()))
            while due <= seen:
                due += args.eval_every
    if curve[-1][0] != step * args.batch:
        curve.append((step * args.batch, accuracy()))
    steps = step
    report = learner.report()
    if comm.rank == 0:
        after = step_times[warm_steps:] or step_times
        print('RESULT ' + json.dumps({
            'curve': curve, 'report': report, 'steps': steps,
            'step_s': float(numpy.median(step_times)),
            'step_s_after_warm_start': float(numpy.median(after)),
            'bytes_per_step_after_warm_start': (report['bytes_sent'] - warm_bytes)
            / max(steps - warm_steps, 1),
            'params': int(sum(p.size for p in model.params()))}))


def main(argv=None):
    p = _common.parser('learners', __doc__)
    p.add_argument('--processes', default='1,2,4', help='process counts (default 1,2,4)')
    p.add_argument('--learners', default=','.join(LEARNERS))
    p.add_argument('--epochs', type=float, default=None)
    p.add_argument('--batch', type=int, default=32, help='global batch')
    p.add_argument('--lr', type=float, default=0.05)
    p.add_argument('--width', type=int, default=None,
                   help='first stage channels (default 16: ResNet-20; --quick: 8)')
    p.add_argument('--size', type=int, default=None,
                   help='input side, 8, 16 or 32 (default 32; --quick: 16)')
    p.add_argument('--block-steps', type=int, default=4,
                   help='steps per block for block momentum and model averaging')
    p.add_argument('--warm-epochs', type=float, default=1.0)
    p.add_argument('--eval-every', type=int, default=640, help='samples between evaluations')
    p.add_argument('--no-warm-variants', action='store_true',
                   help='only the runs without a warm start')
    p.add_argument('--learner', help=_hidden())
    p.add_argument('--child', action='store_true', help=_hidden())
    args = p.parse_args(argv)
    args.epochs = args.epochs or (1.0 if args.quick else 3.0)
    args.width = args.width or (8 if args.quick else 16)
    args.size = args.size or (16 if args.quick else 32)
    if args.size not in (8, 16, 32):
        raise SystemExit('--size must be 8, 16 or 32 (the 8x8 digits, each pixel repeated)')
    if args.child:
        return child(args)
    from fastchain.backends import mpi
    processes = [int(n) for n in args.processes.split(',')]
    learners = args.learners.split(',')
    for n in processes:
        if args.batch % n:
            raise SystemExit('--batch {} does not split evenly over {} processes'.format(
                args.batch, n))
    runs = []
    for n in processes:
        for name in (['allreduce'] if n == 1 else learners):
            for warm in ([0.0] if n == 1 or args.no_warm_variants or name == 'allreduce'
                         else [0.0, args.warm_epochs]):
                runs.append((n, name, warm))
    results = []
    env = dict(os.environ, FASTCHAIN_THREADS_PER_PROCESS=os.environ.get(
        'FASTCHAIN_THREADS_PER_PROCESS', ''))
    if not env['FASTCHAIN_THREADS_PER_PROCESS']:
        del env['FASTCHAIN_THREADS_PER_PROCESS']
    for k, (n, name, warm) in enumerate(runs):
        cmd = [mpi.mpiexec_path(), '-n', str(n), sys.executable, os.path.abspath(__file__),
               '--child', '--learner', name, '--warm-epochs', str(warm)]
        for key in ('epochs', 'batch', 'lr', 'width', 'size', 'block_steps', 'eval_every'):
            cmd += ['--' + key.replace('_', '-'), str(getattr(args, key))]
        started = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if out.returncode != 0:
            raise SystemExit('run {} x {} (warm {}) failed:\n{}'.format(
                n, name, warm, out.stderr[-3000:]))
        line = next(l for l in out.stdout.splitlines() if l.startswith('RESULT '))
        result = json.loads(line[len('RESULT '):])
        result.update(processes=n, learner=name, warm_epochs=warm,
                      wall_s=round(time.monotonic() - started, 1))
        results.append(result)
        print('[{}/{}] {} process(es), {}{}: final accuracy {:.3f}, {:.0f} bytes/step, '
              '{:.3f} s/step ({:.0f} s)'.format(
                  k + 1, len(runs), n, LABELS[name],
                  ' + warm start' if warm else '', result['curve'][-1][1],
                  result['bytes_per_step_after_warm_start'], result['step_s'],
                  result['wall_s']), flush=True)
    return summarise(args, results)


def name_of(r):
    return '{}{}@{}'.format(r['learner'], '+warm' if r['warm_epochs'] else '', r['processes'])


def summarise(args, results):
    rows = _common.Rows('accuracy')
    ratios = {}
    by_name = {name_of(r): r for r in results}
    for r in results:
        comm_share = r['report']['comm_seconds'] / max(r['step_s'] * r['steps'], 1e-9)
        speeds = {}
        for link, rate in LINKS.items():
            step = r['step_s_after_warm_start'] + r['bytes_per_step_after_warm_start'] / rate
            speeds[link] = args.batch / step
        extra = dict(bytes_per_sample=round(r['bytes_per_step_after_warm_start']
                                            / (args.batch / r['processes']), 1),
                     final_accuracy=round(r['curve'][-1][1], 4),
                     comm_share=round(comm_share, 4),
                     comm_share_at={link: round((r['bytes_per_step_after_warm_start'] / rate)
                                                / (r['step_s_after_warm_start']
                                                   + r['bytes_per_step_after_warm_start']
                                                   / rate), 3)
                                    for link, rate in LINKS.items()},
                     samples_per_s_at={k: round(v, 2) for k, v in speeds.items()},
                     curve=r['curve'], step_s=round(r['step_s'], 4), learner=r['report'][
                         'learner'], wall_s=r['wall_s'])
        rows.add(name_of(r), r['curve'][-1][1], **extra)
        r['speeds'] = speeds
    for r in results:
        base = by_name.get('allreduce@{}'.format(r['processes']))
        if base is None or r is base:
            continue
        for link in LINKS:
            ratios['{}/allreduce@{}'.format(name_of(r).split('@')[0], r['processes'])
                   + ' @ ' + link] = round(r['speeds'][link] / base['speeds'][link], 3)
    config = {'model': 'ResNet-20 (CifarResNet, width {})'.format(args.width),
              'data': "scikit-learn digits, {0}x{0} (pixels repeated), 1437 train / 360 "
                      "held out".format(args.size),
              'global_batch': args.batch, 'optimizer': 'MomentumSGD(lr={}, momentum 0.9)'
              .format(args.lr), 'epochs': args.epochs, 'block_steps': args.block_steps,
              'warm_start_epochs': args.warm_epochs, 'eval_every_samples': args.eval_every,
              'links': list(LINKS), 'communicator': 'mpi (shared memory)',
              'link_time': 'computed: bytes per step / link speed, added to the measured '
                           'step time (not measured on a link)'}
    notes = ['Values are held-out accuracies at the end of the run; samples/s at each link '
             'speed are computed from the measured step time and the bytes each rank sent '
             '(ring algorithms), not measured on such a link.',
             'Processes beyond the cores (4 on a 2-core machine) share them: the measured '
             'compute per step is inflated, so the link share is understated there.']
    result = _common.write('learners', args, config, rows, ratios, notes)
    plot(args, results)
    return result


def plot(args, results):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    counts = sorted({r['processes'] for r in results if r['processes'] > 1}) or [1]
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4.5), squeeze=False)
    colors = dict(zip(LEARNERS, ['black', 'tab:blue', 'tab:orange', 'tab:green', 'tab:red']))
    single = [r for r in results if r['processes'] == 1]
    for ax, n in zip(axes[0], counts):
        for r in single + [r for r in results if r['processes'] == n and n > 1]:
            xs, ys = zip(*r['curve'])
            label = ('1 process' if r['processes'] == 1 else LABELS[r['learner']]) + \
                (' + warm start' if r['warm_epochs'] else '')
            ax.plot(xs, ys, color='grey' if r['processes'] == 1 else colors[r['learner']],
                    linestyle='--' if r['warm_epochs'] else '-', label=label, linewidth=1.3)
        ax.set_title('{} processes'.format(n))
        ax.set_xlabel('samples seen (all ranks)')
        ax.set_ylabel('held-out accuracy')
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc='lower right')
    fig.suptitle('ResNet-20 on digits (32x32): distributed learners')
    fig.tight_layout()
    path = os.path.join(args.results, 'learners' + ('-quick' if args.quick else '') + '.png')
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print('plot: ' + path)


def _hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == '__main__':
    main()
