"""Run under `mpiexec -n N`: one scenario of a distributed learner per call.

    mpiexec -n 2 python learners_script.py SCENARIO LEARNER OUTDIR

Each scenario checks its assertions on every rank and writes
`OUTDIR/ok.<rank>` when they hold (and what it measured in
`OUTDIR/result.<rank>.json`).
"""

import json
import os
import sys
import warnings

import numpy

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
from chainer.training import extensions

from fastchain import distributed
from fastchain.precision import scaler_of
from script_common import data, enable_fp16, poison_mlp

SCENARIO, LEARNER, OUT = sys.argv[1:4]
comm = distributed.create_communicator('mpi')
rank, size = comm.rank, comm.size
BATCH = 4

LEARNERS = {
    'allreduce': lambda: distributed.AllReduce(),
    '1bit': lambda: distributed.QuantizedSGD(1),
    '1bit_noef': lambda: distributed.QuantizedSGD(1, error_feedback=False),
    '2bit': lambda: distributed.QuantizedSGD(2),
    'fp16': lambda: distributed.QuantizedSGD(16),
    'bmuf': lambda: distributed.BlockMomentum(2 * BATCH),
    'bmuf_plain': lambda: distributed.BlockMomentum(2 * BATCH, block_momentum=0.5,
                                                    block_lr=0.9, nesterov=False),
    'avg': lambda: distributed.ModelAveraging(2 * BATCH),
}


class MLP(chainer.Chain):
    def __init__(self, bn=False, lazy=False):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(None if lazy else 6, 16)
            self.l2 = L.Linear(16, 16)
            self.l3 = L.Linear(16, 3)
            if bn:
                self.bn = L.BatchNormalization(16)
        self.use_bn = bn

    def forward(self, x):
        h = F.relu(self.l1(x))
        if self.use_bn:
            h = self.bn(h)
        return self.l3(F.relu(self.l2(h)))


def params(model):
    return {n: p.array.copy() for n, p in sorted(model.namedparams())}


def gather(value):
    return comm.allgather_obj(value, what='test gather')


def identical_everywhere(model):
    mine = params(model)
    return all(all(numpy.array_equal(other[n], mine[n]) for n in mine)
               for other in gather(mine))


def done(**result):
    with open(os.path.join(OUT, 'result.{}.json'.format(rank)), 'w') as f:
        json.dump(result, f)
    with open(os.path.join(OUT, 'ok.{}'.format(rank)), 'w') as f:
        f.write('ok')


def batches(shard, k):
    return chainer.dataset.concat_examples(shard[k * BATCH:(k + 1) * BATCH])


# -- scenarios ---------------------------------------------------------------------


class Params(chainer.Link):
    def __init__(self):
        super().__init__()
        rng = numpy.random.RandomState(0)
        with self.init_scope():
            self.w = chainer.Parameter(rng.randn(12, 40).astype(numpy.float32))
            self.c = chainer.Parameter(rng.randn(5, 3, 3, 3).astype(numpy.float32))
            self.b = chainer.Parameter(rng.randn(17).astype(numpy.float32))


def error_feedback():
    """SGD with lr 1 over random per-rank gradients: the weights move by the
    sum of the averaged decoded gradients, which error feedback makes the
    mean over ranks of (true gradient sum - final residual)."""
    link = Params()
    learner = LEARNERS[LEARNER]()
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(lr=1.0), comm,
                                                  learner=learner).setup(link)
    learner.batch_size = 1
    sent = []
    real = comm.allgather

    def counting(array, what='allgather'):
        sent.append(array.nbytes)
        return real(array, what)
    comm.allgather = counting
    start = params(link)
    true_sum = {n: numpy.zeros_like(a) for n, a in start.items()}
    rng = numpy.random.RandomState(100 + rank)
    steps = 7
    for _ in range(steps):
        for n, p in sorted(link.namedparams()):
            p.grad = rng.randn(*p.shape).astype(numpy.float32) * 3
            true_sum[n] += p.grad
        opt.update()
    names = [n for n, _ in link.namedparams()]
    residual = dict(zip(names, learner.residuals))
    everyone = gather((true_sum, residual))
    for n, value in params(link).items():
        expect = sum(t[n] - (r[n] if learner.error_feedback else 0)
                     for t, r in everyone) / size
        err = numpy.abs((start[n] - value) - expect).max()
        if learner.error_feedback:
            assert err < 1e-4 * steps * 3, (n, err)
        else:
            assert err > 1e-2, (n, err)       # without it, the encoding's loss stays lost
    assert identical_everywhere(link)
    values = sum(p.size for p in link.params())
    per_step = sent[:2] if learner.bits != 16 else sent[:1]
    codes = -(-values * learner.bits // 8)
    assert per_step[0] == codes, (per_step, codes)          # bits packed, measured
    report = learner.report()
    assert report['bytes_per_step'] == (size - 1) * sum(per_step), (report, per_step)
    done(values=values, code_bytes=per_step[0], bytes_per_step=report['bytes_per_step'],
         dense_allreduce_bytes=2 * (size - 1) * values * 4 // size)


def model_averaging():
    """Each rank's plain twin trains on the same batches; at each block's
    end the learner's model is the twins' mean (BN statistics too)."""
    numpy.random.seed(1 + rank)
    model = L.Classifier(MLP(bn=True))
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm,
                                                  learner=LEARNERS[LEARNER]())
    opt.setup(model)                       # broadcasts rank 0's weights
    twin = model.copy(mode='copy')
    twin_opt = chainer.optimizers.SGD(0.1).setup(twin)
    shard = distributed.scatter_dataset(data(96), comm)
    blocks = 0
    for k in range(6):
        x, t = batches(shard, k)
        opt.update(model, x, t)
        twin_opt.update(twin, x, t)
        if (k + 1) % 2:
            assert not identical_everywhere(model)      # mid-block: the ranks' own
            continue
        blocks += 1
        mine = {n: p.array for n, p in twin.namedparams()}
        mine.update({'bn/avg_mean': twin.predictor.bn.avg_mean,
                     'bn/avg_var': twin.predictor.bn.avg_var})
        everyone = gather(mine)
        mean = {n: sum(e[n] for e in everyone) / size for n in mine}
        got = {n: p.array for n, p in model.namedparams()}
        got.update({'bn/avg_mean': model.predictor.bn.avg_mean,
                    'bn/avg_var': model.predictor.bn.avg_var})
        for n in mean:
            if size == 2:
                numpy.testing.assert_array_equal(got[n], mean[n], err_msg=n)
            else:      # MPI may add 4 ranks in another order than this sum
                numpy.testing.assert_allclose(got[n], mean[n], rtol=1e-6, atol=1e-7,
                                              err_msg=n)
        assert identical_everywhere(model)
        twin.copyparams(model)
        twin.predictor.bn.avg_mean[...] = model.predictor.bn.avg_mean
        twin.predictor.bn.avg_var[...] = model.predictor.bn.avg_var
    assert distributed.learner_of(opt).blocks == blocks == 3
    done()


def warm_start():
    """Bitwise identical ranks (and the same weights as the exact allreduce)
    for the first distributed_after samples; then the learner's own rule."""
    after = 3 * BATCH * size
    runs = {}
    for name in (LEARNER, 'allreduce'):
        numpy.random.seed(5)
        model = L.Classifier(MLP())
        opt = distributed.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(0.1), comm, learner=LEARNERS[name](),
            distributed_after=after)
        opt.setup(model)
        shard = distributed.scatter_dataset(data(96), comm)
        history = []
        for k in range(5):
            x, t = batches(shard, k)
            warming = distributed.learner_of(opt).warming
            opt.update(model, x, t)
            history.append((warming, identical_everywhere(model), params(model)))
        runs[name] = history
    mine = runs[LEARNER]
    assert [w for w, _, _ in mine] == [True, True, True, False, False]
    for k in range(3):
        assert mine[k][1], k                            # identical on every rank
        for n, value in mine[k][2].items():             # and the exact allreduce's
            numpy.testing.assert_array_equal(value, runs['allreduce'][k][2][n])
    if LEARNER.startswith('bmuf') or LEARNER == 'avg':
        assert not mine[3][1]                           # block 1, step 1: the rank's own
        assert mine[4][1]                               # block end: averaged
    else:
        assert mine[3][1] and mine[4][1]                # the same decoded average
        assert any((mine[4][2][n] != runs['allreduce'][4][2][n]).any() for n in mine[4][2])
    done()


def make_trainer(out, stop, learner, per_rank_snapshot=True, seed=0, lazy=False,
                 rank_order=False):
    numpy.random.seed(seed)
    model = L.Classifier(MLP(bn=True, lazy=lazy))
    opt = chainer.optimizers.MomentumSGD(0.05)
    opt.setup(model)
    shard = distributed.scatter_dataset(data(96), comm, shuffle=True, seed=1)
    # rank_order: each rank shuffles its shard with a generator of its own
    sampler = chainer.iterators.ShuffleOrderSampler(numpy.random.RandomState(7 + rank)) \
        if rank_order else None
    it = chainer.iterators.SerialIterator(shard, BATCH, shuffle=None if rank_order else True,
                                          order_sampler=sampler)
    updater = distributed.DataParallelUpdater(it, opt, comm, learner=learner,
                                              distributed_after=2 * BATCH * size)
    trainer = training.Trainer(updater, (stop, 'iteration'), out=out)
    snap = extensions.snapshot(filename='snap_{.updater.iteration}')
    if per_rank_snapshot:
        trainer.extend(distributed.multi_node_snapshot(comm, snap), trigger=(5, 'iteration'))
    elif rank == 0:
        trainer.extend(snap, trigger=(5, 'iteration'))
    return trainer, model, opt


def resume(lazy=False):
    """A snapshot mid-block (iteration 5 of blocks of 2) written through
    multi_node_snapshot: the resumed run ends where the straight one does,
    bit for bit, on every rank. ``lazy``: a model whose first layer gets its
    shape at the first update, loaded before it."""
    out = os.path.join(OUT, 'train')
    trainer, model, _ = make_trainer(out, 9, LEARNERS[LEARNER](), lazy=lazy)
    apart = []      # at the snapshot: the ranks' models differ (mid-block)
    trainer.extend(lambda t: apart.append(not identical_everywhere(model)),
                   trigger=(5, 'iteration'))
    trainer.run()       # ends mid-block too: finished, every rank holds W
    assert identical_everywhere(model)      # (lazy: bound inside this run)
    straight = params(model)
    comm.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        resumed, model2, opt2 = make_trainer(os.path.join(OUT, 'resumed'), 9,
                                             LEARNERS[LEARNER](), seed=99, lazy=lazy)
        chainer.serializers.load_npz(os.path.join(out, 'snap_5'), resumed)   # every rank
        assert resumed.updater.iteration == 5
        resumed.run()
    assert not [w for w in caught if 'fastchain' in str(w.message)], \
        [str(w.message) for w in caught]
    for name, value in params(model2).items():
        numpy.testing.assert_array_equal(value, straight[name], err_msg=name)
    learner = distributed.learner_of(opt2)
    assert (learner.steps, learner.samples, learner.started) == (9, 9 * BATCH * size, True)
    # The bytes are this process's, and so is what they are divided by (they
    # were divided by the whole training's samples: 9 steps', not 4).
    report = learner.report()
    assert (report['steps'], report['samples_since_start'], report['samples']) == (
        4, 4 * BATCH * size, 9 * BATCH * size), report
    assert report['bytes_sent'] > 0 and report['bytes_per_sample'] == \
        report['bytes_sent'] / (4 * BATCH), report
    assert identical_everywhere(model2)
    # resumed where its stop trigger is met already: no step, and the ranks
    # still end on W (finish applies the loaded state first)
    again, model3, opt3 = make_trainer(os.path.join(OUT, 'again'), 5, LEARNERS[LEARNER](),
                                       seed=98, lazy=lazy)
    chainer.serializers.load_npz(os.path.join(out, 'snap_5'), again)
    again.run()
    learner3 = distributed.learner_of(opt3)
    if not lazy and LEARNER != '1bit':      # (lazy: never bound, nothing to end)
        assert (learner3.blocks, learner3.block_samples) == (2, 0), learner3.blocks
        assert identical_everywhere(model3)
    done(mid_block=apart == [True] if LEARNER != '1bit' else None)


def resume_rank_state():
    """Each rank shuffles with its own generator and keeps its own
    BatchNormalization statistics: a resumed run through multi_node_snapshot
    ends where the straight one does on every rank, statistics and the
    iterator's place included (every rank loaded rank 0's: rank 1 walked
    its shard in rank 0's order, its statistics became rank 0's)."""
    out = os.path.join(OUT, 'train')
    trainer, model, _ = make_trainer(out, 11, LEARNERS[LEARNER](), rank_order=True)
    trainer.run()
    straight = persistents_and_params(model)
    position = trainer.updater.get_iterator('main').current_position
    comm.barrier()
    resumed, model2, _ = make_trainer(os.path.join(OUT, 'resumed'), 11, LEARNERS[LEARNER](),
                                      seed=99, rank_order=True)
    chainer.serializers.load_npz(os.path.join(out, 'snap_5'), resumed)   # every rank
    resumed.run()
    for name, value in persistents_and_params(model2).items():
        numpy.testing.assert_array_equal(value, straight[name], err_msg=name)
    assert resumed.updater.get_iterator('main').current_position == position
    differ = gather(persistents_and_params(model2)['/predictor/bn/avg_mean'].tolist())
    done(statistics_differ=differ[0] != differ[1])


def persistents_and_params(model):
    found = params(model)
    for path, link in model.namedlinks():
        for name in link._persistent:
            found['{}/{}'.format(path.rstrip('/'), name)] = numpy.array(link.__dict__[name])
    return found


def bmuf_formula():
    """Two ranks, block momentum > 0: after each block the model every rank
    holds is the paper's start model S, computed here from each rank's plain
    twin (SGD, no momentum state) trained from S on the same batches."""
    numpy.random.seed(1 + rank)
    model = L.Classifier(MLP())
    learner = LEARNERS[LEARNER]()
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm,
                                                  learner=learner)
    opt.setup(model)
    twin = model.copy(mode='copy')
    twin_opt = chainer.optimizers.SGD(0.1).setup(twin)
    shard = distributed.scatter_dataset(data(96), comm)
    f32 = numpy.float32
    m, lr = f32(learner.block_momentum), f32(learner.block_lr)
    assert m > 0
    w = {n: p.array.copy() for n, p in model.namedparams()}
    d = {n: numpy.zeros_like(a) for n, a in w.items()}
    start = {n: a.copy() for n, a in w.items()}
    for k in range(8):
        x, t = batches(shard, k)
        opt.update(model, x, t)
        twin_opt.update(twin, x, t)
        if (k + 1) % 2:
            continue
        everyone = gather({n: p.array for n, p in twin.namedparams()})
        for n in w:
            mean = sum(e[n] for e in everyone) / size
            d[n] = m * d[n] + lr * (mean - start[n])
            w[n] = w[n] + d[n]
            start[n] = w[n] + m * d[n] if learner.nesterov else w[n]
            numpy.testing.assert_allclose(dict(model.namedparams())[n].array, start[n],
                                          rtol=1e-5, atol=1e-6, err_msg=n)
        twin.copyparams(model)
    assert learner.blocks == 4
    done()


def resume_rank0():
    """The same with Chainer's snapshot on rank 0 alone: it says, when it is
    written and when it is loaded, that it does not hold every rank's state."""
    out = os.path.join(OUT, 'train')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        trainer, _, _ = make_trainer(out, 6, LEARNERS[LEARNER](), per_rank_snapshot=False)
        trainer.run()
    saved = [str(w.message) for w in caught if 'written by rank 0 alone' in str(w.message)]
    assert len(saved) == (1 if rank == 0 else 0), saved
    assert 'distributed.multi_node_snapshot' in saved[0] if saved else True
    comm.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        resumed, _, _ = make_trainer(os.path.join(OUT, 'resumed'), 6, LEARNERS[LEARNER](),
                                     per_rank_snapshot=False)
        chainer.serializers.load_npz(os.path.join(out, 'snap_5'), resumed)
    loaded = [str(w.message) for w in caught if "rank 0's state only" in str(w.message)]
    assert len(loaded) == (0 if rank == 0 else 1), loaded
    done()


def trainer_run():
    """Every learner under Trainer, with an evaluator: it learns, and it says
    what it sent."""
    numpy.random.seed(0)
    model = L.Classifier(MLP())
    opt = chainer.optimizers.MomentumSGD(0.1)
    opt.setup(model)
    shard = distributed.scatter_dataset(data(400), comm, shuffle=True, seed=2)
    it = chainer.iterators.SerialIterator(shard, 8)
    learner = LEARNERS[LEARNER]()
    updater = distributed.DataParallelUpdater(it, opt, comm, learner=learner)
    trainer = training.Trainer(updater, (8, 'epoch'), out=os.path.join(OUT, 'run'))
    test = data(200, seed=9)
    ev = distributed.create_multi_node_evaluator(extensions.Evaluator(
        chainer.iterators.SerialIterator(distributed.scatter_dataset(test, comm), 50,
                                         repeat=False, shuffle=False), model), comm)
    trainer.extend(ev, trigger=(8, 'epoch'))
    if rank == 0:
        trainer.extend(extensions.LogReport(trigger=(8, 'epoch')))
    trainer.run()
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    with reporter.scope({}):
        accuracy = float(ev.evaluate()['main/accuracy'])
    assert accuracy > 0.8, accuracy
    report = learner.report()
    assert report['steps'] == 8 * len(shard) // 8 and report['exchanges'] > 0
    done(accuracy=accuracy, report=report)


def fp16_skip():
    """fp16 with the loss scaler: a NaN on rank 1 at step 2 skips that step
    on every rank, and the quantizer's residuals are left as they were."""
    handle = enable_fp16()
    numpy.random.seed(0)
    net = MLP()
    step = poison_mlp(net, rank)
    model = L.Classifier(net)
    learner = LEARNERS[LEARNER]()
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm,
                                                  learner=learner)
    opt.setup(model)
    scaler = scaler_of(opt)
    shard = distributed.scatter_dataset(data(96), comm)
    decisions = []
    for k in range(4):
        step['k'] = k
        x, t = batches(shard, k)
        before = params(model)
        residuals = [r.copy() for r in learner.residuals] \
            if getattr(learner, 'residuals', None) is not None else None
        opt.update(model, x.astype(numpy.float16), t)
        decisions.append(scaler.stepped)
        if k == 2:
            for name, value in params(model).items():
                numpy.testing.assert_array_equal(value, before[name], err_msg=name)
            if residuals is not None:
                for a, b in zip(residuals, learner.residuals):
                    numpy.testing.assert_array_equal(a, b)
    assert decisions == [True, True, False, True], decisions
    everyone = gather((decisions, scaler.scale))
    assert all(e == everyone[0] for e in everyone), everyone
    if isinstance(learner, distributed.QuantizedSGD):
        assert learner.fallback_steps == 1
        assert identical_everywhere(model)
    handle.disable()
    done()


def raising():
    """A rank that raises between two block exchanges ends every rank."""
    model = L.Classifier(MLP())
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm,
                                                  learner=LEARNERS[LEARNER]())
    opt.setup(model)
    shard = distributed.scatter_dataset(data(96), comm)
    for k in range(6):
        if k == 3 and rank == 1:
            raise ValueError('boom on purpose')
        opt.update(model, *batches(shard, k))
    done()


def rank_settings():
    """Rank 1 sets up its learner or exchange differently (LEARNER names
    how): named at set-up, before any exchange."""
    other = rank == 1
    learner, options = {
        'block_lr': (distributed.BlockMomentum(8, block_lr=0.5 if other else 1.0), {}),
        'bits': (distributed.QuantizedSGD(2 if other else 1), {}),
        'kind': (distributed.ModelAveraging(8) if other else distributed.BlockMomentum(8), {}),
        'bucket': (None, dict(bucket_cap_mb=1 if other else 25)),
    }[LEARNER]
    model = L.Classifier(MLP())
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm,
                                                  learner=learner, **options)
    opt.setup(model)
    opt.update(model, *batches(distributed.scatter_dataset(data(32), comm), 0))
    done()


def finish():
    """A block-momentum run that stops mid-block (5 steps, blocks of 2)
    leaves every rank the global model W: a Trainer's run on its own end,
    a custom loop by learner.finish()."""
    numpy.random.seed(0)
    model = L.Classifier(MLP())
    opt = chainer.optimizers.MomentumSGD(0.1)
    learner = distributed.BlockMomentum(2 * BATCH)      # momentum 1 - 1/2, look-ahead
    shard = distributed.scatter_dataset(data(96), comm, shuffle=True, seed=2)
    if LEARNER == 'trainer':
        opt.setup(model)
        it = chainer.iterators.SerialIterator(shard, BATCH)
        updater = distributed.DataParallelUpdater(it, opt, comm, learner=learner)
        training.Trainer(updater, (5, 'iteration'), out=os.path.join(OUT, 'run')).run()
    else:
        distributed.create_multi_node_optimizer(opt, comm, learner=learner).setup(model)
        for k in range(5):
            opt.update(model, *batches(shard, k))
        assert not identical_everywhere(model)          # mid-block: each rank its own
        learner.finish()
    assert learner.blocks == 3 and learner.block_samples == 0, learner.blocks
    assert identical_everywhere(model)
    for p, w in zip(learner.params, learner.global_model):
        assert numpy.array_equal(p.array, w)            # W, not the look-ahead
    assert all(not d.any() for d in learner.delta)
    done()


SCENARIOS = {'finish': finish, 'rank_settings': rank_settings, 'error_feedback': error_feedback, 'model_averaging': model_averaging,
             'warm_start': warm_start, 'resume': resume,
             'resume_lazy': lambda: resume(lazy=True), 'bmuf_formula': bmuf_formula,
             'resume_rank0': resume_rank0, 'resume_rank_state': resume_rank_state,
             'trainer': trainer_run, 'fp16_skip': fp16_skip, 'raise': raising}
SCENARIOS[SCENARIO]()
