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
    'avg_f64': lambda: distributed.ModelAveraging(2 * BATCH),
    'bmuf_f64': lambda: distributed.BlockMomentum(2 * BATCH),
}
# the model's dtype ('_f64': float64, whose block means must not be rounded to float32)
DTYPE = numpy.float64 if LEARNER.endswith('_f64') else numpy.float32


class MLP(chainer.Chain):
    """``tied``: l2 applied twice, held under a second name too (Chainer
    then lists its parameters under both)."""

    def __init__(self, bn=False, lazy=False, tied=False):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(None if lazy else 6, 16)
            self.l2 = L.Linear(16, 16)
            self.l3 = L.Linear(16, 3)
            if bn:
                self.bn = L.BatchNormalization(16)
            if tied:
                self.again = self.l2
        self.use_bn = bn
        self.tied = tied

    def forward(self, x):
        h = F.relu(self.l1(x))
        if self.use_bn:
            h = self.bn(h)
        h = F.relu(self.l2(h))
        if self.tied:
            h = F.relu(self.again(h))
        return self.l3(h)


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
    x, t = chainer.dataset.concat_examples(shard[k * BATCH:(k + 1) * BATCH])
    return x.astype(DTYPE, copy=False), t


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
    with chainer.using_config('dtype', DTYPE):
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
        assert all(a.dtype == DTYPE for a in got.values())
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
                 rank_order=False, tied=False, how='npz', on_error=False):
    numpy.random.seed(seed)
    model = L.Classifier(MLP(bn=True, lazy=lazy, tied=tied))
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
    snap = extensions.snapshot(filename='snap_{.updater.iteration}', **(
        {'savefun': chainer.serializers.save_hdf5} if how == 'hdf5' else {}),
        snapshot_on_error=on_error)
    # manual: a trigger that has finished when the run resumes after it (the
    # extension is then not initialized)
    trigger = training.triggers.ManualScheduleTrigger([5], 'iteration') \
        if how == 'manual' else (5, 'iteration')
    if per_rank_snapshot:
        trainer.extend(distributed.multi_node_snapshot(comm, snap), trigger=trigger)
        if how == 'two':    # a second, frequent one: its section of snap_5 is empty
            trainer.extend(distributed.multi_node_snapshot(
                comm, extensions.snapshot(filename='latest')), trigger=(2, 'iteration'))
    elif rank == 0:
        trainer.extend(snap, trigger=(5, 'iteration'))
    return trainer, model, opt


def resume(lazy=False, tied=False):
    """A snapshot mid-block (iteration 5 of blocks of 2) written through
    multi_node_snapshot: the resumed run ends where the straight one does,
    bit for bit, on every rank. ``lazy``: a model whose first layer gets its
    shape at the first update, loaded before it. ``tied``: a layer held
    under two names (its state was saved under one and looked for under
    both)."""
    out = os.path.join(OUT, 'train')
    trainer, model, _ = make_trainer(out, 9, LEARNERS[LEARNER](), lazy=lazy, tied=tied)
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
                                             LEARNERS[LEARNER](), seed=99, lazy=lazy,
                                             tied=tied)
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
                                       seed=98, lazy=lazy, tied=tied)
    chainer.serializers.load_npz(os.path.join(out, 'snap_5'), again)
    again.run()
    learner3 = distributed.learner_of(opt3)
    if not lazy and LEARNER != '1bit':      # (lazy: never bound, nothing to end)
        assert (learner3.blocks, learner3.block_samples) == (2, 0), learner3.blocks
        assert identical_everywhere(model3)
    done(mid_block=apart == [True] if LEARNER != '1bit' else None)


def resume_rank_state(how='npz'):
    """Each rank shuffles with its own generator and keeps its own
    BatchNormalization statistics: a resumed run through multi_node_snapshot
    ends where the straight one does on every rank, statistics and the
    iterator's place included (every rank loaded rank 0's: rank 1 walked
    its shard in rank 0's order, its statistics became rank 0's). ``how``:
    'hdf5' (a review: its keys were not listed, and rank 0's state stayed
    silently), 'manual' (a review: a snapshot trigger finished when the run
    resumes; the state waited for an initialize that never came), 'two' (two
    multi_node_snapshot extensions: the one that did not write the file was
    said to hold rank 0's state only)."""
    out = os.path.join(OUT, 'train')
    trainer, model, _ = make_trainer(out, 11, LEARNERS[LEARNER](), rank_order=True, how=how)
    trainer.run()
    straight = persistents_and_params(model)
    position = trainer.updater.get_iterator('main').current_position
    comm.barrier()
    resumed, model2, _ = make_trainer(os.path.join(OUT, 'resumed'), 11, LEARNERS[LEARNER](),
                                      seed=99, rank_order=True, how=how)
    load = chainer.serializers.load_hdf5 if how == 'hdf5' else chainer.serializers.load_npz
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        load(os.path.join(out, 'snap_5'), resumed)   # every rank
        resumed.run()
    assert not [w for w in caught if 'fastchain' in str(w.message)], \
        [str(w.message) for w in caught]
    for name, value in persistents_and_params(model2).items():
        numpy.testing.assert_array_equal(value, straight[name], err_msg=name)
    assert resumed.updater.get_iterator('main').current_position == position
    differ = gather(persistents_and_params(model2)['/predictor/bn/avg_mean'].tolist())
    done(statistics_differ=differ[0] != differ[1])


def resume_on_error():
    """A snapshot written on an error (snapshot_on_error) holds rank 0's
    state only (the other ranks may be gone): resuming from it is said, on
    rank 0 (a review: every rank took rank 0's order and statistics,
    silently)."""
    out = os.path.join(OUT, 'train')
    trainer, _, _ = make_trainer(out, 11, LEARNERS[LEARNER](), rank_order=True, on_error=True)

    def failing(t):
        if t.updater.iteration == 6:
            raise RuntimeError('a failure at iteration 6')
    trainer.extend(failing, trigger=(1, 'iteration'))
    try:
        trainer.run()
        raise AssertionError('the failure did not end the run')
    except RuntimeError as e:
        assert 'iteration 6' in str(e)
    comm.barrier()
    resumed, _, _ = make_trainer(os.path.join(OUT, 'resumed'), 11, LEARNERS[LEARNER](),
                                 seed=99, rank_order=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        chainer.serializers.load_npz(os.path.join(out, 'snap_6'), resumed)
    said = [str(w.message) for w in caught if "holds rank 0's iterators" in str(w.message)]
    assert len(said) == (1 if rank == 0 else 0), said
    assert all('snapshot_on_error' in m and 'not continue identically' in m for m in said)
    assert resumed.updater.iteration == 6
    with warnings.catch_warnings(record=True) as caught:     # at its trigger: not said
        warnings.simplefilter('always')
        chainer.serializers.load_npz(os.path.join(out, 'snap_5'), resumed)
    assert not [w for w in caught if 'fastchain' in str(w.message)]
    done()


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
    with chainer.using_config('dtype', DTYPE):
        model = L.Classifier(MLP())
    learner = LEARNERS[LEARNER]()
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm,
                                                  learner=learner)
    opt.setup(model)
    twin = model.copy(mode='copy')
    twin_opt = chainer.optimizers.SGD(0.1).setup(twin)
    shard = distributed.scatter_dataset(data(96), comm)
    # float32: the twins' arithmetic and the allreduce's may round apart;
    # float64: W and D kept in float64 (rounded to float32 they were 1e-8 off)
    tolerance = dict(rtol=1e-5, atol=1e-6) if DTYPE == numpy.float32 else \
        dict(rtol=1e-13, atol=1e-14)
    m, lr = DTYPE(learner.block_momentum), DTYPE(learner.block_lr)
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
            got = dict(model.namedparams())[n].array
            assert got.dtype == DTYPE, got.dtype
            numpy.testing.assert_allclose(got, start[n], err_msg=n, **tolerance)
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


class Odd(chainer.Link):
    """Parameters whose gradients Chainer does not give arrays of their own."""

    def __init__(self):
        super().__init__()
        rng = numpy.random.RandomState(0)
        with self.init_scope():
            self.a = chainer.Parameter(rng.randn(6, 8).astype(numpy.float32))
            self.b = chainer.Parameter(rng.randn(6, 8).astype(numpy.float32))
            self.c = chainer.Parameter(rng.randn(48).astype(numpy.float32))
            self.d = chainer.Parameter(rng.randn(5).astype(numpy.float32))

    def loss(self, x):
        # a, b and c: one gradient array (c's a view of it with another shape)
        w = self.a + self.b + F.reshape(self.c, (6, 8))
        # d: a read-only broadcast
        return F.sum(F.tanh(F.matmul(x, w))) + F.sum(self.d) * F.sum(x)


def odd_gradients():
    """Shared, reshaped and read-only gradients from the graph: the learner
    updates the model exactly as it does a twin whose gradients are arrays of
    their own with the same values (the average of a, b and c each went into
    one array, the last written won; d's raised)."""
    link, twin = Odd(), Odd()
    opt = distributed.create_multi_node_optimizer(
        chainer.optimizers.SGD(0.1), comm, learner=LEARNERS[LEARNER]()).setup(link)
    twin_opt = distributed.create_multi_node_optimizer(
        chainer.optimizers.SGD(0.1), comm, learner=LEARNERS[LEARNER]()).setup(twin)
    twin.cleargrads()
    twin.loss(numpy.ones((3, 6), numpy.float32)).backward()
    assert twin.a.grad is twin.b.grad and numpy.shares_memory(twin.a.grad, twin.c.grad)
    assert not twin.d.grad.flags.writeable
    for k in range(4):
        x = numpy.random.RandomState(10 * k + rank).randn(3, 6).astype(numpy.float32)
        twin.cleargrads()
        twin.loss(x).backward()
        for p in twin.params():
            p.grad = numpy.array(p.grad, copy=True)
        twin_opt.update()
        opt.update(link.loss, x)
        for n, value in params(link).items():
            numpy.testing.assert_array_equal(value, params(twin)[n], err_msg=n)
    assert identical_everywhere(link)
    done()


def fp16_range():
    """QuantizedSGD(16), an fp32 model: a gradient beyond float16's range on
    one rank (it was encoded as inf and every rank's weights became -inf,
    without a word) makes the step an exact average on every rank, said on
    the rank where it was."""
    link = Params()
    learner = LEARNERS[LEARNER]()
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(lr=1.0), comm,
                                                  learner=learner).setup(link)
    rng = numpy.random.RandomState(200 + rank)
    for k in range(2):
        start = params(link)
        grads = {n: rng.randn(*a.shape).astype(numpy.float32) for n, a in start.items()}
        if k == 0 and rank == 0:
            grads['/w'][3, 4] = 1e5
        for n, p in link.namedparams():
            p.grad = grads[n].copy()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            opt.update()
        said = [str(w.message) for w in caught if '65504' in str(w.message)]
        assert len(said) == (1 if k == 0 and rank == 0 else 0), said
        everyone = gather(grads)
        for n, value in params(link).items():
            assert numpy.isfinite(value).all(), n
            exact = start[n] - (everyone[0][n] + everyone[1][n]) * numpy.float32(0.5)
            if k == 0:
                numpy.testing.assert_array_equal(value, exact, err_msg=n)
            else:       # encoded: near the exact average, not it
                numpy.testing.assert_allclose(value, exact, rtol=0, atol=1e-2, err_msg=n)
        assert learner.fallback_steps == 1, learner.fallback_steps
    assert identical_everywhere(link)
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


SCENARIOS = {'finish': finish, 'rank_settings': rank_settings,
             'error_feedback': error_feedback, 'model_averaging': model_averaging,
             'warm_start': warm_start, 'resume': resume,
             'resume_lazy': lambda: resume(lazy=True),
             'resume_tied': lambda: resume(tied=True), 'bmuf_formula': bmuf_formula,
             'odd_gradients': odd_gradients, 'fp16_range': fp16_range,
             'resume_rank0': resume_rank0, 'resume_rank_state': resume_rank_state,
             'resume_rank_state_hdf5': lambda: resume_rank_state('hdf5'),
             'resume_rank_state_manual': lambda: resume_rank_state('manual'),
             'resume_rank_state_two': lambda: resume_rank_state('two'),
             'resume_on_error': resume_on_error,
             'trainer': trainer_run, 'fp16_skip': fp16_skip, 'raise': raising}
SCENARIOS[SCENARIO]()
