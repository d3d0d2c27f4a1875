"""Data-parallel training with real MPI processes (2 ranks on the CPU)."""

import os
import subprocess
import sys
import time

import pytest

from fastchain import distributed
from fastchain.backends import mpi

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'dp_script.py')
pytestmark = pytest.mark.mpi


def mpirun(scenario, tmp_path, n=2, timeout=120, env=None, extra=()):
    out = tmp_path / (scenario + ''.join(extra))
    out.mkdir()
    full_env = dict(os.environ, **(env or {}))
    start = time.monotonic()
    r = subprocess.run([mpi.mpiexec_path(), '-n', str(n), sys.executable, SCRIPT, scenario,
                        str(out)] + list(extra), capture_output=True, text=True,
                       timeout=timeout, env=full_env)
    r.seconds = time.monotonic() - start
    r.ok = sorted(p.name for p in out.iterdir() if p.name.startswith('ok.'))
    return r


@pytest.mark.parametrize('how', ['in_place', 'overlap', 'overlap_static', 'fp16'])
def test_n_ranks_equal_one_process_with_n_times_the_batch(how, tmp_path):
    # 'overlap' runs the capture-during-backward path (NCCL's) over MPI.
    r = mpirun('equivalence', tmp_path, extra=[how])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.ok == ['ok.0', 'ok.1'], r.stderr[-4000:]


@pytest.mark.parametrize('scenario', [
    'sharding',             # disjoint, equal-size shards
    'scatter_root',         # rank 0's lazy dataset read on every rank; unpicklable: said
    'scatter_same',         # every rank's copy: different copies refused, nothing read
    'evaluator',            # metrics are the mean over examples of all ranks
    'rank0_extensions',     # reporting on rank 0 only
    'snapshot_resume',      # a snapshot from rank 0 restores every rank exactly
    'no_gradient',          # a parameter with no gradient: zero-filled, no hang
    'average',              # the in-place average: exactly sum/N, every array once
    'tied_overlap',         # a parameter listed twice, its uses growing: redone, exact
    'odd_gradients',        # shared, read-only, transposed gradients on some ranks only
    'agreement',            # overlap on one rank's step and not another's: still paired
    'loss_scale_agreement',  # NaN on one rank: every rank skips the same step
    'same_batches',         # scatter_dataset forgotten: said once, on rank 0
    'unequal_batches',      # ranks at different batch sizes: said once, on rank 0
])
def test_scenario(scenario, tmp_path):
    r = mpirun(scenario, tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.ok == ['ok.0', 'ok.1'], r.stderr[-4000:]


def test_a_gradient_two_parameters_share_is_averaged_once_on_three_ranks(tmp_path):
    r = mpirun('shared_average', tmp_path, n=3)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.ok == ['ok.0', 'ok.1', 'ok.2'], r.stderr[-4000:]


def test_a_rank_that_raises_ends_every_rank_with_the_error_shown_once(tmp_path):
    r = mpirun('raise', tmp_path)
    assert r.returncode != 0 and r.ok == []
    assert r.stderr.count('ValueError: boom on purpose') == 1
    assert '[rank 1] fastchain: aborting all 2 ranks' in r.stderr
    assert r.seconds < 30


def test_a_killed_rank_ends_the_job(tmp_path):
    r = mpirun('kill', tmp_path)
    assert r.returncode != 0 and r.ok == []
    assert r.seconds < 30


def test_a_killed_rank_with_a_loader_worker_ends_the_job_in_seconds(tmp_path):
    # (its worker held the job until the collective timeout, 300 s by default)
    r = mpirun('kill_with_loader', tmp_path, env={'FASTCHAIN_COLLECTIVE_TIMEOUT': '60'})
    assert r.returncode != 0 and r.ok == []
    assert 'did not complete within' not in r.stderr, r.stderr[-3000:]
    assert r.seconds < 30, r.stderr[-3000:]


def test_a_hung_rank_times_out_naming_rank_and_operation(tmp_path):
    r = mpirun('hang', tmp_path, env={'FASTCHAIN_COLLECTIVE_TIMEOUT': '11'})
    assert r.returncode != 0 and r.ok == []
    assert 'rank 0 of 2: allreduce of gradient bucket' in r.stderr
    assert 'did not complete within 11 s' in r.stderr
    # which rank it waits for (a review: 'another rank has crashed or hangs')
    assert 'rank 1 had not been waiting in a collective of this communicator for 5 s: ' \
        'crashed, hangs, still computing' in r.stderr, r.stderr[-3000:]
    assert r.seconds < 30         # not the 120 s the hung rank sleeps


@pytest.mark.parametrize('how', ['exit', 'exit0'])
def test_a_rank_that_exits_ends_every_rank_in_seconds(how, tmp_path):
    # sys.exit() raises nothing the excepthook sees: rank 0 would wait in its
    # next allreduce for the collective timeout (set to 60 s here).
    r = mpirun(how, tmp_path, env={'FASTCHAIN_COLLECTIVE_TIMEOUT': '60'})
    assert r.returncode != 0 and r.ok == []
    assert ('rank 0 of 2: rank 1 has ended its process (sys.exit() or the end of its '
            'script) while this rank waits for it in allreduce of gradient bucket') \
        in r.stderr, r.stderr
    # a rank that ended normally: unequal step counts, named with the fix (a
    # new-user trial's hand-made shards of 170 and 150 got no hint)
    assert 'the ranks ran different numbers of steps: shards of unequal length? ' \
        'distributed.scatter_dataset gives each rank the same number' in r.stderr
    if how == 'exit':
        assert r.stderr.count('rank 1 stops on purpose') == 1
    assert 'did not complete within' not in r.stderr
    assert r.seconds < 30


EARLY = '''
import sys
from fastchain import distributed
from fastchain.backends import mpi
rank, size = mpi.launch_rank()
if rank == 1:
    if sys.argv[1] == 'after_mpi':
        from mpi4py import MPI
    if sys.argv[1] == 'exit':
        sys.exit(0)
    raise ValueError('rank 1 fails before its communicator')
from fastchain import distributed
distributed.create_communicator('mpi', timeout=5)
print('rank 0 went on', flush=True)
'''


@pytest.mark.parametrize('how', ['before_mpi', 'after_mpi', 'exit'])
def test_a_rank_that_ends_before_its_communicator_ends_the_job(how):
    # MPI's initialisation (before_mpi, exit) and the node split (after_mpi)
    # wait for every rank: rank 0 would wait there for ever.
    start = time.monotonic()
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, '-c', EARLY, how],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and 'went on' not in r.stdout
    assert ("rank 0 of 2: the communicator's set-up did not complete within 5 s: not every "
            "rank reached create_communicator()") in r.stderr, r.stderr
    assert time.monotonic() - start < 30


def test_an_infinite_timeout_means_no_deadline():
    # FASTCHAIN_COLLECTIVE_TIMEOUT=inf: the set-up's deadline thread raised
    # OverflowError (and aborted the job).
    script = ('import numpy\nfrom fastchain import distributed\n'
              'with distributed.create_communicator("mpi") as comm:\n'
              '    assert comm.timeout == float("inf")\n'
              '    comm.allreduce(numpy.ones(2, "f"), "step")\n'
              'print("done", flush=True)\n')
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, '-c', script],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, FASTCHAIN_COLLECTIVE_TIMEOUT='inf'))
    assert r.returncode == 0 and r.stdout.count('done') == 2, r.stderr[-3000:]
    assert 'Traceback' not in r.stderr, r.stderr[-3000:]


def test_a_timeout_that_is_not_a_positive_number_is_refused():
    for bad in (float('nan'), 0, -5, 'soon'):
        with pytest.raises(ValueError, match='timeout=.* is not a positive number of seconds'):
            distributed.create_communicator('mpi', timeout=bad)


FINALIZES = '''
import numpy
from mpi4py import MPI
from fastchain import distributed
comm = distributed.create_communicator('mpi')
comm.allreduce(numpy.ones(2, 'f'), 'one allreduce')
MPI.Finalize()          # the script's own; fastchain says nothing at exit after it
print('done', comm.rank, flush=True)
'''

POINT_TO_POINT = '''
import time
from fastchain import distributed
comm = distributed.create_communicator('mpi', timeout=30)
if comm.rank == 1:
    time.sleep(2.5)     # rank 0 has long ended (normally) by now
    comm.send_obj('late', 2, what='rank 1 to rank 2')
elif comm.rank == 2:
    assert comm.recv_obj(1, what='rank 2 from rank 1') == 'late'
print('done', comm.rank, flush=True)
'''


TWO_ROUNDS = '''
import time
import numpy
from fastchain import distributed
for round in range(3):
    with distributed.create_communicator('mpi', timeout=60) as comm:
        comm.allreduce(numpy.ones(2, 'f'), 'step')
        if comm.rank == 0:
            time.sleep(2.5)     # rank 1 waits past the grace in the next collective
        comm.allreduce(numpy.ones(2, 'f'), 'after a slow rank 0')
print('done', comm.rank, flush=True)
'''


SUB_COMMUNICATOR = '''
import time
import numpy
from mpi4py import MPI
from fastchain import distributed
world = MPI.COMM_WORLD
pair = world.Split(0 if world.rank < 2 else 1, world.rank)     # ranks 0 and 1
with distributed.create_communicator('mpi', timeout=60) as comm:     # all 3
    comm.allreduce(numpy.ones(2, 'f'), 'step')
# each rank's finalize message is still queued at its peers, on a context MPI
# may give the pair's communicator, where rank 2 does not exist
if world.rank < 2:
    with distributed.create_communicator('mpi', mpi_comm=pair, timeout=60) as sub:
        if sub.rank == 0:
            time.sleep(2.5)     # rank 1 waits (and listens) in the next collective
        sub.allreduce(numpy.ones(2, 'f'), 'pair step')
print('done', world.rank, flush=True)
'''


@pytest.mark.parametrize('script, n', [(FINALIZES, 2), (POINT_TO_POINT, 3), (TWO_ROUNDS, 2),
                                       (SUB_COMMUNICATOR, 3)])
def test_a_rank_that_ends_normally_never_aborts_the_others(script, n):
    # A script that finalises MPI itself; and, with 3 ranks, rank 0 ending
    # while ranks 1 and 2 still talk to each other (not waiting for rank 0).
    r = subprocess.run([mpi.mpiexec_path(), '-n', str(n), sys.executable, '-c', script],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # Every rank got to its end (mpiexec may interleave the ranks' lines).
    assert r.stdout.count('done') == n, r.stdout
    assert 'has ended its process' not in r.stderr and 'finalizing' not in r.stderr


LEAVES_EARLY = '''
import time
import numpy
from fastchain import distributed
with distributed.create_communicator('mpi', timeout=60) as comm:
    for step in range(2 if comm.rank == 1 else 5):
        comm.allreduce(numpy.ones(2, 'f'), 'allreduce of step {}'.format(step))
time.sleep(30)      # rank 1 lives on: it has not exited
'''


def test_a_rank_that_finalizes_while_the_others_train_ends_the_job_in_seconds():
    # Rank 1's with block ended after 2 steps, rank 0's after 5: rank 0 waited
    # for the 60 s timeout, and its message blamed a crash.
    start = time.monotonic()
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, '-c', LEAVES_EARLY],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert ('rank 0 of 2: rank 1 has finalized its communicator (comm.finalize(), or the end '
            'of its with block) while this rank waits for it in allreduce of step 2') \
        in r.stderr, r.stderr
    assert 'did not complete within' not in r.stderr
    assert time.monotonic() - start < 25


THREADS = '''
import os, sys, threadpoolctl
from fastchain import distributed
comm = distributed.create_communicator('mpi')
# Every BLAS loaded (NumPy's OpenBLAS; SciPy's too where Chainer imported it).
blas = sorted({i['num_threads'] for i in threadpoolctl.threadpool_info()
               if i['user_api'] == 'blas'})
with open(os.path.join(sys.argv[1], str(comm.rank)), 'w') as f:
    f.write('rank {} blas {} env {}'.format(comm.rank, blas, os.environ.get('OMP_NUM_THREADS')))
'''


@pytest.mark.parametrize('env, expected', [
    ({}, None),                                         # the node's cores / 2
    ({'FASTCHAIN_THREADS_PER_PROCESS': '3'}, 3),
    ({'OPENBLAS_NUM_THREADS': '2'}, 2),                 # the user's own setting is kept
])
def test_each_rank_gets_its_share_of_the_cores_for_blas_threads(env, expected, tmp_path):
    from fastchain.distributed import _threads
    clean = {k: v for k, v in os.environ.items()
             if k not in _threads.USER_VARIABLES + (_threads.VARIABLE,)}
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, '-c', THREADS,
                        str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env=dict(clean, **env))
    assert r.returncode == 0, r.stderr
    if expected is None:
        expected = max(1, len(os.sched_getaffinity(0)) // 2)
    lines = [(tmp_path / str(k)).read_text() for k in (0, 1)]
    assert [line.split(' env')[0] for line in lines] == [
        'rank {} blas [{}]'.format(k, expected) for k in (0, 1)], r.stderr
    said = [line for line in r.stderr.splitlines() if 'BLAS/OpenMP' in line]
    assert len(said) == 1, r.stderr                     # rank 0, once
    if 'OPENBLAS_NUM_THREADS' in env:
        assert 'left as OPENBLAS_NUM_THREADS=2 sets them' in said[0]
        assert all(line.endswith('env None') for line in lines)
    else:
        assert '{} BLAS/OpenMP thread(s) per process'.format(expected) in said[0]
        assert all(line.endswith('env {}'.format(expected)) for line in lines)


def test_different_models_are_refused_at_start(tmp_path):
    r = mpirun('mismatch', tmp_path)
    assert r.returncode != 0
    assert r.stderr.count('rank 1 built a different model than rank 0') == 1
    assert "'/predictor/l1/W' is ((16, 6), 'float32') on rank 0" in r.stderr
    assert r.seconds < 30


def test_a_custom_loop_on_lazily_shaped_links_trains_from_its_first_update(tmp_path):
    """The script's own forward and backward, then ``opt.update()``, on
    ``L.Linear(None, n)`` links (a new-user trial: refused on every rank,
    even on one process). Seeded alike, the ranks train as one process with
    their batches together from the first step."""
    r = mpirun('lazy_loop', tmp_path, extra=['alike'])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.ok == ['ok.0', 'ok.1'], r.stderr[-4000:]


def test_a_custom_loop_on_lazily_shaped_links_drawn_apart_stops_naming_the_fix(tmp_path):
    r = mpirun('lazy_loop', tmp_path, extra=['apart'])
    assert r.returncode != 0 and r.ok == []
    assert r.stderr.count('the ranks drew different initial values for the parameters') == 1
    assert 'call optimizer.update(lossfun, *inputs) for the first step' in r.stderr
    assert r.seconds < 30


def test_ranks_in_collectives_that_do_not_match_end_the_job_in_seconds_naming_them(tmp_path):
    """Rank 0 in one more collective than rank 1: each waits for the other
    for ever (the timeout, minutes later, blamed a crash). The script sets
    the stall to 1 s (5 s by default)."""
    r = mpirun('apart', tmp_path)
    assert r.returncode != 0 and r.ok == []
    said = [line for line in r.stderr.splitlines() if 'do not match' in line]
    assert len(said) == 1, r.stderr[-3000:]
    assert ("rank 0 in its collective #3 (snapshot: every rank's iterators, MPI Iallgather); "
            "rank 1 in its collective #3 (allreduce of bucket 0, MPI Allreduce of 12 bytes)"
            ) in said[0]
    assert 'did not complete within' not in r.stderr
    assert r.seconds < 30


def test_a_snapshot_extension_on_rank_0_only_is_named_in_seconds(tmp_path):
    # a new-user trial: the extension under `if comm.rank == 0` waited the
    # whole timeout, then said a rank had crashed or hung
    r = mpirun('snapshot_rank0', tmp_path)
    assert r.returncode != 0 and r.ok == []
    said = [line for line in r.stderr.splitlines() if 'do not match' in line]
    assert len(said) == 1, r.stderr[-3000:]
    assert "rank 0 receiving from rank 1 (snapshot: rank 1's iterators" in said[0]
    assert 'rank 1 in its collective #' in said[0] and 'MPI Allreduce' in said[0]
    assert 'multi_node_snapshot and the multi-node evaluator go on every rank' in said[0]
    assert r.seconds < 30


def test_ranks_that_wait_for_each_other_in_turn_are_left_to_train(tmp_path):
    # each rank stalls in turn (past the 1 s stall, told to the peer) while
    # the other computes: the peer learns the wait ended, nothing is said
    r = mpirun('turns', tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.ok == ['ok.0', 'ok.1'] and 'do not match' not in r.stderr


@pytest.mark.parametrize('waits, stuck', [
    ({0: ('coll', 3, 'Iallgather'), 1: ('coll', 3, 'Allreduce')}, True),
    ({0: ('coll', 3, 'Allreduce'), 1: ('coll', 3, 'Allreduce')}, False),   # a slow one
    ({0: ('coll', 3, 'Allreduce'), 1: ('coll', 4, 'Allreduce')}, True),
    ({0: ('recv', 1), 1: ('coll', 17, 'Allreduce')}, True),
    ({0: ('recv', 1), 1: ('send', 0), 2: ('coll', 5, 'Ibarrier')}, False),  # a long message
    ({0: ('recv', 1), 1: ('recv', 0)}, True),
    ({0: ('recv', 1), 1: ('recv', 2), 2: ('send', 0)}, True),
    ({0: ('recv', -2), 1: ('send', 0), 2: ('coll', 5, 'Ibarrier')}, False),   # any source
    ({0: ('recv', -2), 1: ('send', 2), 2: ('coll', 5, 'Ibarrier')}, True),
    ({0: ('send', 1), 1: ('send', 0)}, True),
])
def test_which_waits_can_never_complete(waits, stuck):
    from fastchain.distributed._departures import _none_can_complete
    assert _none_can_complete(waits) is stuck


def test_single_process_runs_the_same_script():
    # Without mpiexec: a world of one; the optimizer works and averages nothing.
    code = '''
import numpy, chainer, chainer.links as L
from fastchain import distributed
comm = distributed.create_communicator()
assert (comm.rank, comm.size) == (0, 1)
m = L.Classifier(L.Linear(3, 2))
opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm).setup(m)
opt.update(m, numpy.ones((4, 3), 'f'), numpy.zeros(4, 'i'))
print('ok')
'''
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == 'ok', r.stderr


def test_fastchain_run_is_mpiexec():
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), 'fastchain-run'),
                        '-n', '3', '--dry-run', 'train.py', '--epochs', '2'],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [mpi.mpiexec_path(), '-n', '3', sys.executable, 'train.py',
                                '--epochs', '2']
    # 'python script.py' (as mpiexec takes it) and a module are understood too
    for given, expected in ((['python3', 'train.py', '-x'], ['python3', 'train.py', '-x']),
                            (['-m', 'pkg.train', '--lr', '1'],
                             [sys.executable, '-m', 'pkg.train', '--lr', '1'])):
        r = subprocess.run([os.path.join(os.path.dirname(sys.executable), 'fastchain-run'),
                            '-n', '2', '--dry-run'] + given,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [mpi.mpiexec_path(), '-n', '2'] + expected
    # usage errors name what is missing (status 2), before mpiexec sees them
    for given, message in ((['-n', '2'], 'give the training script to run'),
                           (['-n', '2', '--hostfile', '/no/hosts', 'train.py'],
                            '--hostfile /no/hosts: no such file'),
                           (['-n', '2', '/no/train.py'], '/no/train.py: no such script'),
                           (['-n', '2', 'python', '/no/train.py', '-x'],
                            '/no/train.py: no such script')):
        r = subprocess.run([os.path.join(os.path.dirname(sys.executable), 'fastchain-run')]
                           + given, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr, r.stderr


def test_fastchain_run_says_when_the_python_named_is_not_its_own(tmp_path):
    # (a review: run without the venv activated, PATH's python had no
    # chainer, and every rank failed on the import)
    run = os.path.join(os.path.dirname(sys.executable), 'fastchain-run')
    elsewhere = tmp_path / 'python3'
    elsewhere.write_text('#!/bin/sh\n')
    elsewhere.chmod(0o755)
    env = dict(os.environ, PATH='{}:{}'.format(tmp_path, os.environ['PATH']))
    r = subprocess.run([run, '-n', '2', '--dry-run', 'python3', 'train.py'],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and 'python3 is {}, not in the folder'.format(elsewhere) \
        in r.stderr, r.stderr
    assert 'fastchain-run -n N script.py' in r.stderr
    own = os.path.basename(sys.executable)      # this environment's: nothing said
    r = subprocess.run([run, '-n', '2', '--dry-run', sys.executable, 'train.py'],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and 'not in the folder' not in r.stderr, (own, r.stderr)


@pytest.mark.gpu
def test_nccl_communicator_averages_gpu_arrays():
    # One process: NCCL with a world of one still goes through set-up and the
    # collective on the device (make gpu-check runs this on a GPU machine).
    import cupy
    from fastchain import distributed
    comm = distributed.create_communicator('nccl')
    comm.device().use()
    a = cupy.arange(10, dtype=cupy.float32)
    comm.allreduce(a, 'test allreduce')
    cupy.testing.assert_array_equal(a, cupy.arange(10, dtype=cupy.float32) * comm.size)



def _faked_world_of_two(comm, device, how, monkeypatch):
    """With one rank, the gradient sync returns before its buckets (a world
    of one has nothing to average), so the world is made to read two, for
    the test only. The bucket path then runs:
    packing, each bucket's allreduce (during backward with overlap), the
    wait, the average; the sum over the one real rank, over two, halves each
    gradient, so each step is plain SGD's at half the learning rate."""
    import numpy
    import chainer
    import chainer.functions as F
    import chainer.links as L
    from fastchain import distributed
    from fastchain.distributed import _optimizer, _same_batches
    from fastchain.distributed._optimizer import gradient_sync_of
    # the set-up's check that every rank has the same model gathers over the
    # real world of one: left out; the collectives still pair the one rank
    monkeypatch.setattr(_optimizer, 'check_same_model', lambda *args: None)
    # and so is the check that the ranks' batches differ (an allgather too)
    monkeypatch.setattr(_same_batches, 'TRIES', 0)
    comm.size = 2
    numpy.random.seed(0)
    model = L.Classifier(chainer.Sequential(L.Linear(8, 16), F.relu, L.Linear(16, 3)))
    model.to_device(device)
    reference = model.copy(mode='copy')
    opt = distributed.create_multi_node_optimizer(
        chainer.optimizers.SGD(0.1), comm, bucket_cap_mb=0.0001,
        overlap=(how == 'overlap'), fp16_allreduce=(how == 'fp16')).setup(model)
    ref_opt = chainer.optimizers.SGD(0.05).setup(reference)
    rng = numpy.random.RandomState(1)
    for _ in range(3):
        x = device.send(rng.rand(4, 8).astype(numpy.float32))
        t = device.send(rng.randint(0, 3, 4).astype(numpy.int32))
        opt.update(model, x, t)
        ref_opt.update(reference, x, t)
    # fp16 on the wire rounds each averaged gradient to 11 bits
    rtol, atol = (2e-2, 2e-3) if how == 'fp16' else (1e-5, 1e-6)
    for (name, p), (_, q) in zip(sorted(model.namedparams()), sorted(reference.namedparams())):
        numpy.testing.assert_allclose(chainer.backends.cuda.to_cpu(p.array),
                                      chainer.backends.cuda.to_cpu(q.array),
                                      rtol=rtol, atol=atol, err_msg=name)
    sync = gradient_sync_of(opt)
    assert len(sync.buckets) > 1, len(sync.buckets)
    if how == 'overlap':
        assert (sync.overlapped_steps, sync.redone_steps) == (2, 0)


@pytest.mark.parametrize('how', ['overlap', 'fp16'])
def test_the_bucket_path_over_mpi_in_one_process(how, monkeypatch):
    """The check the NCCL test below makes on a GPU, over MPI on the CPU
    (one process, no mpiexec): its expectations hold where the path is known."""
    pytest.importorskip('mpi4py')
    import chainer
    from fastchain import distributed
    _faked_world_of_two(distributed.create_communicator('mpi'), chainer.get_device('@numpy'),
                        how, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize('how', ['overlap', 'fp16'])
def test_nccl_bucket_path_on_one_gpu(how, monkeypatch):
    """One GPU, one rank: NCCL's bucket path on the device (see
    ``_faked_world_of_two``), set up before the world is faked (NCCL would
    otherwise wait for a second rank)."""
    from fastchain import distributed
    comm = distributed.create_communicator('nccl')
    device = comm.device()
    device.use()
    comm._setup()
    _faked_world_of_two(comm, device, how, monkeypatch)


@pytest.mark.parametrize('nbytes, text', [(25 * 2 ** 20, '25.0 MiB'), (3 * 2 ** 19, '1.5 MiB'),
                                          (12800, '12.5 KiB'), (96, '96 bytes')])
def test_a_bucket_is_named_with_a_size_that_says_something(nbytes, text):
    # a small bucket read "(0.0 MB)" in the messages of a collective that timed out
    from fastchain.distributed._sync import size_text
    assert size_text(nbytes) == text
