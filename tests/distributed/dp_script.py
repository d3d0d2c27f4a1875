"""Run under `mpiexec -n 2`: one scenario of data-parallel training per call.

    mpiexec -n 2 python dp_script.py SCENARIO OUTDIR

Each scenario checks its own assertions on every rank and writes
`OUTDIR/ok.<rank>` when they hold; the tests read those files and the exit
codes.
"""

import itertools
import os
import signal
import sys
import time
import warnings

import numpy

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
from chainer.training import extensions

from fastchain import distributed
from fastchain.distributed._optimizer import gradient_sync_of
from fastchain.precision import scaler_of
from script_common import data, enable_fp16, poison_mlp

SCENARIO, OUT = sys.argv[1], sys.argv[2]
sys.argv += [''] * (4 - len(sys.argv))      # optional third argument
comm = distributed.create_communicator('mpi')
rank = comm.rank


class MLP(chainer.Chain):
    def __init__(self, unused=False, hidden=16):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, hidden)
            self.l2 = L.Linear(hidden, hidden)
            self.l3 = L.Linear(hidden, 3)
            if unused:
                self.spare = L.Linear(4, 4)     # never called: no gradient

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))


def params(model):
    return {n: p.array.copy() for n, p in model.namedparams()}


def done():
    with open(os.path.join(OUT, 'ok.{}'.format(rank)), 'w') as f:
        f.write('ok')


def same_everywhere(model):
    for name, value in params(model).items():
        others = comm.allgather_obj(value, what='test gather')
        for other in others:
            numpy.testing.assert_array_equal(other, value, err_msg=name)


def equivalence():
    """N ranks x batch b == one process x batch N*b, step by step."""
    numpy.random.seed(1 + rank)         # different init per rank: bcast must fix it
    model = L.Classifier(MLP())
    # overlap=True: the capture path NCCL uses, exercised here over MPI
    # (overlap_static: the model cached, whose replay node has the parameters
    # as inputs, so the capture sees their gradients).
    how = sys.argv[3]
    overlap = how in ('overlap', 'overlap_static')
    opt = distributed.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(0.1), comm, bucket_cap_mb=0.001,
        overlap=overlap, fp16_allreduce=(how == 'fp16'))
    opt.setup(model)
    reference = model.copy(mode='copy')
    if how == 'overlap_static':
        from fastchain.static import cache_state, cache_static_graph
        cache_static_graph(model.predictor)
    ref_opt = chainer.optimizers.MomentumSGD(0.1).setup(reference)
    full = data()
    shard = distributed.scatter_dataset(full, comm)
    b = 4
    for k in range(6):
        x, t = chainer.dataset.concat_examples(shard[k * b:(k + 1) * b])
        opt.update(model, x, t)
        # what one process would see: every rank's batch k, together
        xs = [chainer.dataset.concat_examples(full[r * 32 + k * b:r * 32 + (k + 1) * b])
              for r in range(comm.size)]
        ref_opt.update(reference, numpy.concatenate([a for a, _ in xs]),
                       numpy.concatenate([c for _, c in xs]))
    # fp16 on the wire rounds each averaged gradient to 11 bits.
    rtol, atol = (2e-2, 2e-3) if how == 'fp16' else (1e-5, 1e-6)
    for (name, p), (_, q) in zip(sorted(model.namedparams()), sorted(reference.namedparams())):
        numpy.testing.assert_allclose(p.array, q.array, rtol=rtol, atol=atol, err_msg=name)
    same_everywhere(model)
    sync = gradient_sync_of(opt)
    assert len(sync.buckets) > (0 if how == 'fp16' else 2), len(sync.buckets)
    assert all(b.dtype == (numpy.float16 if how == 'fp16' else numpy.float32)
               for b in sync.buckets)
    expected = 5 if overlap else 0
    assert sync.overlapped_steps == expected and sync.redone_steps == 0, (
        sync.overlapped_steps, sync.redone_steps)
    if how == 'overlap_static':
        state = cache_state(model.predictor)
        assert state['fallback'] is None and sum(state['verified'].values()) >= 2, state
    done()


def sharding():
    full = data(67)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        shard = distributed.scatter_dataset(full, comm, shuffle=True, seed=3)
    assert len(shard) == 33
    if rank == 0:
        assert any('1 of 67 examples are left out' in str(x.message) for x in w)
    mine = sorted(int(numpy.where((full._datasets[0] == shard[i][0]).all(1))[0][0])
                  for i in range(len(shard)))
    everyone = comm.allgather_obj(mine, what='test gather')
    assert not set(everyone[0]) & set(everyone[1])
    assert len(set(everyone[0]) | set(everyone[1])) == 66
    done()


def evaluator():
    model = L.Classifier(MLP())
    distributed.create_multi_node_optimizer(chainer.optimizers.SGD(), comm).setup(model)
    full = data(40, seed=5)
    shard = distributed.scatter_dataset(full, comm)
    it = chainer.iterators.SerialIterator(shard, 5, repeat=False, shuffle=False)
    ev = distributed.create_multi_node_evaluator(extensions.Evaluator(it, model), comm)
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    with reporter.scope({}):
        result = ev.evaluate()
        whole = extensions.Evaluator(chainer.iterators.SerialIterator(
            full, 5, repeat=False, shuffle=False), model).evaluate()
    for key in ('main/loss', 'main/accuracy'):
        assert abs(result[key] - float(whole[key])) < 1e-5, (key, result[key], whole[key])
    # Shards of 1 and 3 examples (hand-made): each rank's mean weighs by its
    # examples (the plain mean of the ranks' means would not be the mean).
    mine = [full[0]] if rank == 0 else [full[1], full[2], full[3]]
    ev = distributed.create_multi_node_evaluator(extensions.Evaluator(
        chainer.iterators.SerialIterator(mine, 5, repeat=False, shuffle=False), model), comm)
    with reporter.scope({}):
        result = ev.evaluate()
        whole = extensions.Evaluator(chainer.iterators.SerialIterator(
            full[:4], 4, repeat=False, shuffle=False), model).evaluate()
    for key in ('main/loss', 'main/accuracy'):
        assert abs(result[key] - float(whole[key])) < 1e-5, (key, result[key], whole[key])
    # a batch size that does not divide the shard (20): said on rank 0, once
    ev = distributed.create_multi_node_evaluator(extensions.Evaluator(
        chainer.iterators.SerialIterator(shard, 6, repeat=False, shuffle=False), model), comm)
    with warnings.catch_warnings(record=True) as w, reporter.scope({}):
        warnings.simplefilter('always')
        ev.evaluate()
        ev.evaluate()
    said = [str(x.message) for x in w if 'multi-node evaluator' in str(x.message)]
    assert len(said) == (0 if rank else 1), said
    assert rank or said[0].startswith('multi-node evaluator: rank 0 evaluated 20 examples in '
                                      'batches of 6 down to 2') and \
        'use a batch size that divides the shard' in said[0], said
    done()


class Noisy(chainer.dataset.DatasetMixin):
    """A lazy dataset that augments: each read draws from NumPy's generator."""

    def __init__(self, n=12):
        self.n = n

    def __len__(self):
        return self.n

    def get_example(self, i):
        return numpy.int64(i), numpy.random.rand()


class OwnGenerator(Noisy):
    """Augments with a generator of its own, seeded differently per rank."""

    def __init__(self):
        super().__init__()
        self.rng = numpy.random.RandomState(100 + rank)

    def get_example(self, i):
        return numpy.int64(i), self.rng.rand()


class Unpicklable(Noisy):
    def __init__(self):
        super().__init__()
        self.transform = lambda x: x


def _unpickle_on_rank0_only():
    if rank != 0:
        raise RuntimeError('no such class here')
    return BadElsewhere()


class BadElsewhere(Noisy):
    def __reduce__(self):
        return _unpickle_on_rank0_only, ()


def jitter(example):
    """A transform defined at a module's top level: it pickles."""
    x, t = example
    return x + numpy.float32(numpy.random.rand()), t


def scatter_root():
    """Only rank 0 has the dataset: a lazy one is sent whole and read on
    every rank, a TransformDataset over arrays as its base's examples and
    its transform (augmentations drawn anew each read on every rank, as in
    ChainerMN); an in-memory one as examples; one that does not pickle as
    examples, said; one a rank cannot unpickle is named on every rank."""
    shard = distributed.scatter_dataset(Noisy() if rank == 0 else None, comm, shuffle=True)
    assert type(shard) is chainer.datasets.SubDataset and type(shard._dataset) is Noisy
    assert shard[0][0] == shard[0][0] and shard[0][1] != shard[0][1]
    mine = [int(shard[i][0]) for i in range(len(shard))]
    everyone = comm.allgather_obj(mine, what='test gather')
    assert sorted(sum(everyone, [])) == list(range(12)), everyone
    full = data(10)
    order = numpy.random.RandomState(4).permutation(10)
    shard = distributed.scatter_dataset(full if rank == 0 else None, comm, shuffle=True,
                                        seed=4)
    for k in range(5):
        numpy.testing.assert_array_equal(shard[k][0], full[order[rank * 5 + k]][0])
    shard = distributed.scatter_dataset(
        chainer.datasets.TransformDataset(full, jitter) if rank == 0 else None, comm,
        shuffle=True, seed=4)
    assert type(shard) is (chainer.datasets.SubDataset if rank == 0
                           else chainer.datasets.TransformDataset)
    for k in range(5):
        x, t = shard[k]
        assert t == full[order[rank * 5 + k]][1]
        noise = x - full[order[rank * 5 + k]][0]
        assert (noise > 0).all() and (noise < 1).all() and numpy.ptp(noise) < 1e-6
        assert (shard[k][0] != x).all()          # drawn anew on every read
    # a transform that does not pickle over data in memory: examples, said
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        shard = distributed.scatter_dataset(
            chainer.datasets.TransformDataset(full, lambda e: e) if rank == 0 else None, comm)
    said = [str(x.message) for x in w if 'cannot be pickled' in str(x.message)]
    assert len(said) == (1 - rank), said
    assert rank or said[0].startswith("scatter_dataset: the transform of rank 0's "
                                      'TransformDataset cannot be pickled') and \
        'augmentations were drawn once' in said[0], said
    assert len(shard) == 5
    # refused on every rank: a lazy dataset that does not pickle (the root
    # would read every rank's files first), one rank 1 cannot unpickle, an
    # example the root cannot read
    for make, expected in (
            (Unpicklable, "rank 0's Unpicklable is not in memory, so it is sent whole"),
            (BadElsewhere, "rank 1 could not unpickle rank 0's dataset (RuntimeError: no such "
                           'class here)'),
            (lambda: chainer.datasets.TransformDataset(full, lambda e: 1 / 0),
             "rank 0 could not read an example of rank 1's shard: ZeroDivisionError")):
        try:
            distributed.scatter_dataset(make() if rank == 0 else None, comm)
        except ValueError as e:
            assert expected in str(e) and 'build the dataset on every rank' in str(e), str(e)
        else:
            raise AssertionError('accepted: ' + expected)
    done()


def scatter_same():
    """Every rank passes a dataset: copies that differ are refused on every
    rank, without reading an example; identical ones pass, sets and objects
    in them too; one of the script's own kind cannot be told and passes."""
    full = data(20)
    split, _ = chainer.datasets.split_dataset_random(full, 12, seed=rank)
    try:
        distributed.scatter_dataset(split, comm)
    except ValueError as e:
        assert "rank 1's differs from rank 0's" in str(e) and \
            'split_dataset_random(data, n, seed=0)' in str(e), str(e)
    else:
        raise AssertionError('different copies were accepted')
    try:
        distributed.scatter_dataset(data(20 + rank), comm)
    except ValueError as e:
        assert 'the ranks have datasets of [20, 21] examples' in str(e), str(e)
    else:
        raise AssertionError('copies of different lengths were accepted')
    split, _ = chainer.datasets.split_dataset_random(full, 12, seed=0)
    assert len(distributed.scatter_dataset(split, comm, shuffle=True, seed=2)) == 6
    # sets iterate in each process's own hash order; object arrays hold addresses
    tags = numpy.empty(20, object)
    tags[:] = [{'cat', 'dog', str(i)} for i in range(20)]
    assert len(distributed.scatter_dataset(
        chainer.datasets.TupleDataset(full._datasets[0], tags), comm)) == 10
    numpy.random.seed(5)
    before = numpy.random.get_state()[1].copy()
    assert len(distributed.scatter_dataset(Noisy(), comm, shuffle=True, seed=2)) == 6
    numpy.testing.assert_array_equal(numpy.random.get_state()[1], before)
    assert len(distributed.scatter_dataset(OwnGenerator(), comm)) == 6
    done()


def make_trainer(out, stop, seed=0):
    numpy.random.seed(seed)
    model = L.Classifier(MLP())
    opt = chainer.optimizers.MomentumSGD(0.05)
    opt.setup(model)
    shard = distributed.scatter_dataset(data(), comm)
    it = chainer.iterators.SerialIterator(shard, 4, shuffle=False)
    updater = distributed.DataParallelUpdater(it, opt, comm)
    trainer = training.Trainer(updater, (stop, 'iteration'), out=out)
    if rank == 0:                       # reporting and snapshots on rank 0 only
        trainer.extend(extensions.LogReport(trigger=(2, 'iteration')))
        trainer.extend(extensions.snapshot(filename='snap_{.updater.iteration}'),
                       trigger=(4, 'iteration'))
    return trainer, model


def snapshot_resume():
    out = os.path.join(OUT, 'train')
    trainer, model = make_trainer(out, 8)
    trainer.run()
    straight = params(model)
    comm.barrier()
    assert os.path.exists(os.path.join(out, 'snap_4'))
    resumed, model2 = make_trainer(os.path.join(OUT, 'resumed'), 8, seed=99)
    chainer.serializers.load_npz(os.path.join(out, 'snap_4'), resumed)   # every rank
    assert resumed.updater.iteration == 4
    resumed.run()
    for name, value in params(model2).items():
        numpy.testing.assert_allclose(value, straight[name], rtol=1e-6, err_msg=name)
    same_everywhere(model2)
    done()


def rank0_extensions():
    trainer, _ = make_trainer(os.path.join(OUT, 'r{}'.format(rank)), 4)
    trainer.run()
    has_log = os.path.exists(os.path.join(OUT, 'r{}'.format(rank), 'log'))
    assert has_log == (rank == 0)
    done()


def no_gradient():
    model = L.Classifier(MLP(unused=True))
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.MomentumSGD(0.1), comm)
    opt.setup(model)
    spare = model.predictor.spare.W.array.copy()
    shard = distributed.scatter_dataset(data(), comm)
    for k in range(3):
        x, t = chainer.dataset.concat_examples(shard[k * 4:(k + 1) * 4])
        opt.update(model, x, t)
    grad = model.predictor.spare.W.grad
    assert grad is not None and not grad.any()          # zero-filled, averaged
    numpy.testing.assert_array_equal(model.predictor.spare.W.array, spare)
    same_everywhere(model)
    done()


def loss_scale_agreement():
    handle = enable_fp16()
    # Seeded: with some initial weights the first fp16 step overflows at the
    # initial scale and is skipped (correctly, on every rank), which this
    # test's expected decisions do not allow for.
    numpy.random.seed(0)
    net = MLP()
    step = poison_mlp(net, rank)
    model = L.Classifier(net)
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm)
    opt.setup(model)
    scaler = scaler_of(opt)
    shard = distributed.scatter_dataset(data(), comm)
    decisions = []
    for k in range(4):
        step['k'] = k
        x, t = chainer.dataset.concat_examples(shard[k * 4:(k + 1) * 4])
        before = params(model)
        opt.update(model, x.astype(numpy.float16), t)
        decisions.append(scaler.stepped)
        if k == 2:
            for name, value in params(model).items():
                numpy.testing.assert_array_equal(value, before[name], err_msg=name)
    assert decisions == [True, True, False, True], decisions
    everyone = comm.allgather_obj((decisions, scaler.scale), what='test gather')
    assert everyone[0] == everyone[1], everyone
    same_everywhere(model)
    handle.disable()
    done()


def failing(how):
    model = L.Classifier(MLP())
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm)
    opt.setup(model)
    shard = distributed.scatter_dataset(data(), comm)
    for k in range(5):
        if k == 2 and rank == 1:
            if how == 'raise':
                raise ValueError('boom on purpose')
            if how == 'kill':
                os.kill(os.getpid(), signal.SIGKILL)
            if how == 'hang':
                time.sleep(120)
            if how == 'exit':
                sys.exit('rank 1 stops on purpose')
            if how == 'exit0':
                sys.exit(0)
        x, t = chainer.dataset.concat_examples(shard[k * 4:(k + 1) * 4])
        opt.update(model, x, t)
    done()


def kill_with_loader():
    """Rank 1, whose batches come from a loader worker, is killed (SIGKILL:
    the out-of-memory killer): its worker must not keep the job waiting (it
    took the collective timeout: the killed rank stayed a zombie while its
    worker held the pipes the process manager waits on)."""
    from fastchain import data as fdata
    model = L.Classifier(MLP())
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm)
    opt.setup(model)
    shard = distributed.scatter_dataset(data(), comm)
    it = fdata.MultiprocessIterator(shard, 4, n_workers=1)
    for k in range(5):
        if k == 2 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x, t = chainer.dataset.concat_examples(it.next())
        opt.update(model, x, t)
    it.finalize()
    done()


def same_batches():
    """Every rank on the whole dataset, in the same order (scatter_dataset
    forgotten): rank 0 says so once, through update(lossfun, *inputs) and
    through update() after the script's own backward; scattered, nothing."""
    from fastchain.distributed._same_batches import SAME_BATCHES
    full = data(40, seed=5)
    for scattered in (False, True):
        for direct in (False, True):
            numpy.random.seed(0)        # the same order on every rank
            model = L.Classifier(MLP())
            opt = distributed.create_multi_node_optimizer(
                chainer.optimizers.SGD(0.1), comm).setup(model)
            shard = distributed.scatter_dataset(full, comm, shuffle=True, seed=1) \
                if scattered else full
            it = chainer.iterators.SerialIterator(shard, 4)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                for _ in range(4):
                    x, t = chainer.dataset.concat_examples(it.next())
                    if direct:
                        model.cleargrads()
                        model(x, t).backward()
                        opt.update()
                    else:
                        opt.update(model, x, t)
            said = [str(w.message) for w in caught if 'had the same loss and inputs' in str(w.message)]
            expected = [SAME_BATCHES.format(n=2, steps=2)] if rank == 0 and not scattered \
                else []
            assert said == expected, (scattered, direct, said)
            assert all(w.filename == __file__ for w in caught
                       if 'had the same loss and inputs' in str(w.message))   # the script's line
    done()


def unequal_batches():
    """Ranks at different batch sizes (a per-rank setting gone wrong): rank 0
    says so once, naming each rank's; at equal sizes nothing (a review: it
    passed unsaid where every trigger counts iterations)."""
    shard = distributed.scatter_dataset(data(40, seed=5), comm, shuffle=True, seed=1)
    for sizes in ((4, 2), (4, 4)):
        numpy.random.seed(0)
        model = L.Classifier(MLP())
        opt = distributed.create_multi_node_optimizer(
            chainer.optimizers.SGD(0.1), comm).setup(model)
        it = chainer.iterators.SerialIterator(shard, sizes[rank])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            for _ in range(3):
                opt.update(model, *chainer.dataset.concat_examples(it.next()))
        said = [w for w in caught if 'batch sizes differ' in str(w.message)]
        if sizes[0] != sizes[1] and rank == 0:
            assert len(said) == 1 and '(rank 0: 4, rank 1: 2)' in str(said[0].message), said
            assert said[0].filename == __file__
        else:
            assert said == [], [str(w.message) for w in said]
    done()


def lazy_loop():
    """A custom loop (the script's own forward and backward, then
    ``update()``) on lazily shaped links: with every rank seeded alike it is
    the N-rank step from the first one; seeded apart, every rank stops at
    the first update naming the fix."""
    def build():
        return L.Classifier(chainer.Sequential(L.Linear(None, 16), F.relu, L.Linear(None, 3)))
    numpy.random.seed(0 if sys.argv[3] == 'alike' else 1 + rank)
    model = build()
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.MomentumSGD(0.1), comm)
    opt.setup(model)
    full = data()
    shard = distributed.scatter_dataset(full, comm)
    b = 4
    for k in range(4):
        x, t = chainer.dataset.concat_examples(shard[k * b:(k + 1) * b])
        loss = model(x, t)
        if k == 0:      # one process from the values the first forward drew
            reference = model.copy(mode='copy')
            ref_opt = chainer.optimizers.MomentumSGD(0.1).setup(reference)
        model.cleargrads()
        loss.backward()
        try:
            opt.update()
        except RuntimeError as e:
            assert sys.argv[3] == 'apart' and k == 0, e
            raise
        xs = [chainer.dataset.concat_examples(full[r * 32 + k * b:r * 32 + (k + 1) * b])
              for r in range(comm.size)]
        ref_opt.update(reference, numpy.concatenate([a for a, _ in xs]),
                       numpy.concatenate([c for _, c in xs]))
    for (name, p), (_, q) in zip(sorted(model.namedparams()), sorted(reference.namedparams())):
        numpy.testing.assert_allclose(p.array, q.array, rtol=1e-5, atol=1e-6, err_msg=name)
    same_everywhere(model)
    done()


def apart(how):
    """The ranks in different collectives (``apart``): the job ends in
    seconds naming each rank's. Ranks that stall in turn, each waiting for
    the other in the same collective (``turns``): nothing is said, the
    training goes on."""
    from fastchain.distributed import _departures
    _departures.STALL, _departures.STALL_GRACE = 1.0, 0.5
    if how == 'apart':
        comm.allgather_obj(rank, what='a test gather')     # both: MPI operations #1, #2
        if rank == 0:                                       # rank 0's #3 and #4
            comm.allgather_obj('extra', what="snapshot: every rank's iterators")
        else:                                               # rank 1's #3
            comm.allreduce(numpy.ones(3, numpy.float32), what='allreduce of bucket 0')
        raise AssertionError('a collective completed on ranks that called different ones')
    if how == 'snapshot':       # a new-user trial: the snapshot on rank 0 only
        trainer, _ = make_trainer(os.path.join(OUT, 'r{}'.format(rank)), 6)
        if rank == 0:
            trainer.extend(distributed.multi_node_snapshot(comm, extensions.snapshot()),
                           trigger=(2, 'iteration'))
        trainer.run()
        raise AssertionError('the training ended with the snapshot on rank 0 only')
    for turn in range(4):
        if rank == turn % 2:
            time.sleep(1.8)     # the other rank stalls, told, waiting for this one
        if turn % 2:
            total = comm.allreduce(numpy.ones(3, numpy.float32), what='turn allreduce')
            assert total.tolist() == [2.0] * 3
        else:
            assert comm.allgather_obj(turn, what='turn gather') == [turn, turn]
    done()


def average():
    """GradientSync in place (MPI's form) leaves in every gradient exactly
    the sum over the ranks times 1/N, each array scaled once: large arrays
    reduced where they lie, small ones packed together (float32) or one by
    one (float64 among them), an array two parameters share (in one bucket or
    two), several buckets."""
    rng = numpy.random.RandomState(10 + rank)
    shapes = [(120, 150), (7,), (3, 5), (40000,), (11,), (130, 140), (2,)]
    dtypes = [numpy.float32] * 6 + [numpy.float64]
    params = [chainer.Parameter(numpy.zeros(s, d)) for s, d in zip(shapes, dtypes)]
    for p in params:
        p.grad = rng.standard_normal(p.shape).astype(p.dtype)
    for i in (0, 4):                            # one array, two parameters
        params.append(chainer.Parameter(numpy.zeros(shapes[i], numpy.float32)))
        params[-1].grad = params[i].grad
    sync = distributed.GradientSync(comm, params, cap_bytes=200000)
    assert sync.in_place and len(sync.buckets) >= 3, (sync.in_place, len(sync.buckets))
    mine = [p.grad.copy() for p in params]
    everyone = comm.allgather_obj(mine, what='test gather')
    sync.begin_step()
    sync.finish()
    for i, p in enumerate(params):
        total = everyone[0][i].copy()
        for other in everyone[1:]:
            total += other[i]
        expected = total * p.dtype.type(1.0 / comm.size)
        numpy.testing.assert_array_equal(p.grad, expected, err_msg=str(i))
    done()


def agreement():
    """With overlap on, one rank's step may overlap (its gradients were
    empty at begin_step) while another's may not: the agreement on a redo is
    still one collective on every rank, so the next collectives pair up."""
    p = chainer.Parameter(numpy.zeros(3, numpy.float32))
    sync = distributed.GradientSync(comm, [p], overlap=True)
    for step in range(3):
        p.grad = None
        if rank == 1:
            p.grad = numpy.full(3, rank + step, numpy.float32)
        sync.begin_step()
        p.grad = numpy.full(3, rank + step, numpy.float32)
        sync.finish()
        expected = sum(r + step for r in range(comm.size)) / comm.size
        numpy.testing.assert_array_equal(p.grad, numpy.full(3, expected, numpy.float32))
        assert comm.allgather_obj(step, what='test gather') == [step] * comm.size
    done()


class Tied(chainer.Chain):
    """One Parameter in two links (z's W is w's), applied a number of times
    that changes from step to step (a variable-length unroll). Chainer lists
    parameters by link name: w's W last, so its bucket leaves first."""

    def __init__(self):
        super().__init__()
        numpy.random.seed(0)
        with self.init_scope():
            self.b = L.Linear(4, 4, nobias=True)
            self.w = L.Linear(4, 4, nobias=True)
            self.z = L.Linear(4, 4, nobias=True)
            with self.z.init_scope():
                self.z.W = self.w.W
        self.repeat = 1

    def forward(self, x):
        h = self.w(self.b(x))
        for _ in range(self.repeat):
            h = self.z(h)
        return F.mean(h * h)


def tied_overlap():
    """A parameter Chainer lists twice, whose uses grow after a step (its
    bucket leaves before its last gradient term): with overlap the step is
    redone and every form equals one process with the ranks' batches
    together."""
    repeats = [1, 2, 1, 1, 3]
    batches = [numpy.random.RandomState(k).randn(comm.size * 2, 4).astype('f')
               for k in range(len(repeats))]
    reference = Tied()
    ref_opt = chainer.optimizers.MomentumSGD(0.01).setup(reference)
    for repeat, x in zip(repeats, batches):
        reference.repeat = repeat
        ref_opt.update(reference, x)
    results = {}
    for overlap in (True, False):
        model = Tied()
        opt = distributed.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(0.01), comm, bucket_cap_mb=1e-6, overlap=overlap)
        opt.setup(model)
        for repeat, x in zip(repeats, batches):
            model.repeat = repeat
            opt.update(model, x[rank * 2:(rank + 1) * 2])
        sync = gradient_sync_of(opt)
        assert sum(p is model.w.W for b in sync.buckets for p in b.params) == 1
        if overlap:
            assert sync.redone_steps >= 2 and sync.overlapped_steps >= 1, (
                sync.redone_steps, sync.overlapped_steps)
        for (name, p), (_, q) in zip(sorted(model.namedparams()),
                                     sorted(reference.namedparams())):
            numpy.testing.assert_allclose(p.array, q.array, rtol=1e-5, atol=1e-6,
                                          err_msg=name)
        results[overlap] = params(model)
    for name, value in results[True].items():
        numpy.testing.assert_array_equal(value, results[False][name], err_msg=name)
    same_everywhere(model)
    done()


class Odd(chainer.Chain):
    """Parameters whose gradients Chainer makes shared (p1 + p2), broadcast
    and read-only (F.sum(s)) or transposed views (t used as t.T), on some
    ranks and not others."""

    def __init__(self):
        super().__init__()
        numpy.random.seed(3)
        with self.init_scope():
            for name in ('p1', 'p2', 't'):
                setattr(self, name, chainer.Parameter(
                    numpy.random.randn(130, 130).astype('f') / 10))
            self.q = chainer.Parameter(numpy.random.randn(7).astype('f'))
            self.s = chainer.Parameter(numpy.ones(5, 'f'))

    def forward(self, x, shared, transposed):
        w = self.p1 + self.p2 if shared else F.matmul(self.p1, self.p2)
        t = F.transpose(self.t) if transposed else self.t
        h = F.tanh(F.matmul(F.matmul(x, w), t))
        return F.mean(h * h) + F.sum(self.q * self.q) + 0.01 * F.sum(self.s)


def odd_gradients():
    """In place (MPI's form, no overlap), with every rank's graph its own:
    each gradient is exactly the sum over the ranks times 1/N, each averaged
    once (a collective per parameter whatever the graph: the ranks'
    collectives must pair up); a read-only gradient trains, as in Chainer."""
    model = Odd()
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm,
                                                  bucket_cap_mb=0.1)
    opt.setup(model)
    for step in range(3):
        x = numpy.random.RandomState(10 * step + rank).randn(4, 130).astype('f')
        model.cleargrads()
        model(x, shared=(step + rank) % 2 == 0, transposed=(step + rank) % 3 == 0).backward()
        local = {n: p.grad.copy() for n, p in model.namedparams()}
        everyone = comm.allgather_obj(local, what='test gather')
        opt.update()
        for name, p in model.namedparams():
            total = everyone[0][name].copy()
            for other in everyone[1:]:
                total += other[name]
            numpy.testing.assert_array_equal(
                p.grad, total * numpy.float32(1.0 / comm.size), err_msg=name)
    same_everywhere(model)
    done()


def shared_average():
    """One gradient array two parameters share, in different buckets, is
    averaged once, and so is one a third parameter's gradient views with
    another shape (3 ranks: averaging the average again would round
    differently)."""
    numpy.random.seed(0)
    model = chainer.Chain()
    with model.init_scope():
        model.p1 = chainer.Parameter(numpy.random.randn(64, 64).astype('f'))
        model.p2 = chainer.Parameter(numpy.random.randn(64, 64).astype('f'))
        model.p3 = chainer.Parameter(numpy.random.randn(64 * 64).astype('f'))
    opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(0.0), comm,
                                                  bucket_cap_mb=1e-6)
    opt.setup(model)
    x = numpy.random.RandomState(rank).randn(8, 64).astype('f')
    model.cleargrads()
    w = model.p1 + model.p2 + F.reshape(model.p3, (64, 64))
    F.sum(F.tanh(F.matmul(x, w))).backward()
    assert model.p1.grad is model.p2.grad
    assert numpy.shares_memory(model.p1.grad, model.p3.grad)
    everyone = comm.allgather_obj(model.p1.grad.copy(), what='test gather')
    opt.update()
    # MPI may add the ranks' values in any order: one of them, averaged once.
    averages = []
    for order in itertools.permutations(range(comm.size)):
        total = everyone[order[0]].copy()
        for r in order[1:]:
            total += everyone[r]
        averages.append(total * numpy.float32(1.0 / comm.size))
    for p in (model.p1, model.p2, model.p3):
        assert any((p.grad.reshape(64, 64) == a).all() for a in averages), p.name
    done()


def mismatch():
    model = L.Classifier(MLP(hidden=16 if rank == 0 else 17))
    distributed.create_multi_node_optimizer(chainer.optimizers.SGD(), comm).setup(model)
    done()


SCENARIOS = {'equivalence': equivalence, 'sharding': sharding, 'evaluator': evaluator,
             'scatter_root': scatter_root, 'scatter_same': scatter_same,
             'snapshot_resume': snapshot_resume, 'rank0_extensions': rank0_extensions,
             'no_gradient': no_gradient, 'loss_scale_agreement': loss_scale_agreement,
             'average': average, 'tied_overlap': tied_overlap,
             'odd_gradients': odd_gradients, 'shared_average': shared_average,
             'agreement': agreement,
             'raise': lambda: failing('raise'), 'kill': lambda: failing('kill'),
             'hang': lambda: failing('hang'), 'exit': lambda: failing('exit'),
             'exit0': lambda: failing('exit0'), 'mismatch': mismatch,
             'kill_with_loader': kill_with_loader,
             'same_batches': same_batches, 'unequal_batches': unequal_batches,
             'lazy_loop': lazy_loop,
             'apart': lambda: apart('apart'), 'turns': lambda: apart('turns'),
             'snapshot_rank0': lambda: apart('snapshot')}
SCENARIOS[SCENARIO]()
