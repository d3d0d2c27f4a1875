"""A job's process-wide hooks, and Ctrl-C under mpiexec, with real MPI processes
(2 ranks on the CPU)."""

import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from fastchain.backends import mpi

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'faults_script.py')
pytestmark = pytest.mark.mpi


def test_finalize_gives_back_the_hooks_and_leaves_a_users_own(tmp_path):
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, SCRIPT, 'hooks',
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ['ok.0', 'ok.1'], r.stderr
    # Nothing said at exit by the communicator left alive (other libraries'
    # warnings aside: Chainer's import of pkg_resources warns on old setuptools).
    said = [line for line in r.stderr.splitlines()
            if ('fastchain' in line or '[rank' in line or 'Traceback' in line)
            and 'BLAS/OpenMP thread' not in line]     # said once, at the start
    assert said == [], r.stderr


def test_sys_exit_in_a_thread_ends_that_thread_only(tmp_path):
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, SCRIPT, 'thread_exit',
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ['ok.0', 'ok.1'], r.stderr
    assert 'aborting' not in r.stderr, r.stderr


def test_nothing_of_fastchains_reaches_a_communicator_made_after_its_own(tmp_path):
    # a reviewer's case: the peers' stall and finalize messages, unread when
    # a communicator was finalised, reached the script's next duplicate of
    # the world (MPI reuses a freed context)
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, SCRIPT, 'reuse',
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ['ok.0', 'ok.1'], r.stderr


def _ctrl_c_as_in_a_terminal():
    # A job started in the background by a non-interactive shell inherits
    # SIGINT ignored, and Python then keeps it ignored (see
    # tests/data/test_iterator.py): give mpiexec, and through it the ranks,
    # a terminal's default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _job_in_a_terminal(scenario, tmp_path, err_path):
    """2 ranks of ``scenario``; mpiexec leads its own process group, as a job
    in a terminal does; stderr goes to ``err_path``, so waiting never depends
    on descendants closing a pipe."""
    with open(err_path, 'w') as err:
        return subprocess.Popen([mpi.mpiexec_path(), '-n', '2', sys.executable, SCRIPT,
                                 scenario, str(tmp_path)], stdout=subprocess.PIPE,
                                stderr=err, start_new_session=True,
                                preexec_fn=_ctrl_c_as_in_a_terminal)


def _read_lines(stream, n, timeout):
    """The first ``n`` lines of a pipe, waiting at most ``timeout`` seconds."""
    text, deadline = b'', time.monotonic() + timeout
    while text.count(b'\n') < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([stream], [], [], left)[0]:
            break
        chunk = os.read(stream.fileno(), 4096)
        if not chunk:
            break
        text += chunk
    return text.decode().splitlines()


def _kill_if_ours(pid):
    try:
        with open('/proc/{}/cmdline'.format(pid), 'rb') as f:
            if b'faults_script.py' in f.read():
                os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
        pass


PF_EXITING = 0x4     # the kernel's flag of a task inside exit


def _alive(pid):
    """Whether ``pid`` can still run code: not gone, not a zombie, and not
    already on its way out. Hydra's proxy ends the job's ranks with SIGKILL
    and exits without reaping them: just after mpiexec returns, a killed rank
    (reparented to init) may still be tearing down its memory, with SIGKILL
    pending or inside exit (traced: about one run in six on two busy cores)."""
    try:
        with open('/proc/{}/stat'.format(pid)) as f:
            fields = f.read().rsplit(')', 1)[1].split()
        with open('/proc/{}/status'.format(pid)) as f:
            pending = [int(line.split()[1], 16) for line in f
                       if line.startswith(('SigPnd:', 'ShdPnd:'))]
    except FileNotFoundError:
        return False
    killed = any(mask & (1 << (signal.SIGKILL - 1)) for mask in pending)
    return fields[0] != 'Z' and not killed and not int(fields[6]) & PF_EXITING


@pytest.mark.parametrize('scenario', [
    'ctrl_c_in_python',     # every rank takes the interrupt in Python (the loader)
    'ctrl_c_in_allreduce',  # rank 0 sits in MPI's blocking Allreduce when it comes
])
def test_ctrl_c_ends_every_rank_quietly_and_frees_the_loaders_memory(scenario, tmp_path):
    err_path = tmp_path / 'stderr.txt'
    pids, mpich = [], []
    proc = _job_in_a_terminal(scenario, tmp_path, err_path)
    try:
        lines = _read_lines(proc.stdout, 2, 60)
        ready = [line.split()[1:] for line in lines if line.startswith('ready ')]
        assert len(ready) == 2, '{}\n{}'.format(lines, err_path.read_text()[-6000:])
        pids = [int(p) for pid, workers, _, _ in ready for p in [pid] + workers.split(',')]
        loader = [s for _, _, shm, _ in ready for s in shm.split(',')]
        mpich = sorted({s for _, _, _, shm in ready for s in shm.split(',')})
        assert len(pids) == 6 and len(loader) == 2, ready      # 2 ranks, 2 workers each
        assert all(os.path.exists(s) for s in loader)

        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)          # what Ctrl-C in the terminal does
        proc.wait(timeout=60)
        seconds = time.monotonic() - start
        alive = [p for p in pids if _alive(p)]          # loader workers included
        left = [s for s in loader if os.path.exists(s)]
        err = err_path.read_text()
        out = '\n'.join(_read_lines(proc.stdout, 1000, 5))

        assert proc.returncode == 130, 'exit status {}\n{}\n{}'.format(
            proc.returncode, out[-2000:], err[-6000:])
        assert 'Traceback' not in err + out, err[-4000:]
        assert err.count('fastchain: interrupted') == 2, err
        assert alive == [] and left == []
        assert seconds < 10, seconds     # a second's grace at most, not the timeout
        if scenario == 'ctrl_c_in_python':
            assert [s for s in mpich if os.path.exists(s)] == []    # MPI finalised
        else:
            assert '[rank 0] fastchain: interrupted while blocked in allreduce of step' \
                in err, err
    finally:
        if proc.poll() is None:     # a failure above: end the job, gently first
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()     # hydra's proxy then kills the ranks
                proc.wait(10)
        for pid in pids:
            _kill_if_ours(pid)
        proc.stdout.close()
        # MPICH removes its segment in MPI_Finalize, which a rank that leaves
        # a blocked Allreduce cannot call (nor an aborted job): remove ours.
        for path in mpich:
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.parametrize('scenario', ['ctrl_c_saving_short', 'ctrl_c_saving_long'])
def test_ctrl_c_waits_for_a_peer_saving_and_says_when_it_cuts_it_short(scenario, tmp_path):
    # (a review: a rank blocked in a collective ended the job 5 s after
    # Ctrl-C, cutting short a peer writing its model on the way out, silently)
    err_path, mpich = tmp_path / 'stderr.txt', []
    proc = _job_in_a_terminal(scenario, tmp_path, err_path)
    try:
        lines = _read_lines(proc.stdout, 2, 60)
        ready = [line.split()[1:] for line in lines if line.startswith('ready ')]
        assert len(ready) == 2, '{}\n{}'.format(lines, err_path.read_text()[-6000:])
        mpich = sorted({s for fields in ready for s in fields[-1].split(',') if s})
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        err = err_path.read_text()
        assert proc.returncode == 130, err[-4000:]
        waiting = ('[rank 0] fastchain: waiting up to 4 s for rank(s) 1 to end (their exit '
                   'handlers may be saving); Ctrl-C again ends the job now')
        cut = '[rank 0] fastchain: ending the job with rank(s) 1 still running'
        if scenario == 'ctrl_c_saving_short':       # waited for: saved
            assert (tmp_path / 'saved.1').exists() and cut not in err, err[-4000:]
        else:
            assert waiting in err and 'a peer has already stopped' not in err, err[-4000:]
            assert cut in err and 'may be cut short' in err, err[-4000:]
            assert not (tmp_path / 'saved.1').exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        for path in mpich:
            if os.path.exists(path):
                os.unlink(path)


def test_an_aborted_job_leaves_no_loader_workers_or_shared_memory(tmp_path):
    # The rank that raises aborts the job (MPI_Abort: no exit handler runs)
    # and mpiexec kills the other one: both loaders' /dev/shm segments were
    # left behind, one per failure.
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, SCRIPT,
                        'raise_with_loader', str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    ready = [line.split()[1:] for line in r.stdout.splitlines() if line.startswith('ready ')]
    mpich = sorted({s for *_, shm in ready for s in shm.split(',') if s})
    try:
        assert r.returncode != 0 and len(ready) == 2, r.stdout + r.stderr[-4000:]
        assert 'rank 1 fails with its loader running' in r.stderr
        pids = [int(p) for pid, workers, _, _ in ready for p in [pid] + workers.split(',')]
        loader = [s for _, _, shm, _ in ready for s in shm.split(',')]
        assert len(pids) == 6 and len(loader) == 2, ready
        deadline = time.monotonic() + 10      # a killed rank's workers notice within 1 s
        while time.monotonic() < deadline and (
                [p for p in pids if _alive(p)] or [s for s in loader if os.path.exists(s)]):
            time.sleep(0.1)
        assert [p for p in pids if _alive(p)] == []
        assert [s for s in loader if os.path.exists(s)] == []
    finally:
        for path in mpich:          # an aborted job cannot finalise MPI
            if os.path.exists(path):
                os.unlink(path)


def _departures_of(size, left):
    """A Departures of ``size`` ranks (this one rank 0) whose peers' messages
    are ``left`` (no MPI: check() is replaced)."""
    from fastchain.distributed import _departures
    d = object.__new__(_departures.Departures)
    d._size = size
    d.check = lambda after_announcing=False: dict(left)
    return d


def test_a_rank_leaving_a_blocked_call_waits_for_every_peers_announcement():
    # Each peer announces after its exit handlers; only then does the blocked
    # rank abort the job (MPI_Abort: the peers' MPI_Finalize waits for it).
    from fastchain.distributed import _departures as d
    left = {}
    waiting = _departures_of(3, left)
    start = time.monotonic()
    assert waiting.settle(limit=0.3) is False            # no peer has said anything
    assert 0.3 <= time.monotonic() - start < 2
    left[1] = (time.monotonic(), d.EXITED)
    threading.Timer(0.3, lambda: left.update({2: (time.monotonic(), d.LEFT_BLOCKED)})).start()
    start = time.monotonic()
    assert waiting.settle(limit=10) is True
    assert 0.25 < time.monotonic() - start < 5
