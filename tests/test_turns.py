"""benchmarks/_turns.py, the ladder's way of timing rungs: each variant in a
process group of its own, stopped (workers and threads included) while the
others take their turns; failures name the variant and nothing is left
running or stopped."""

import contextlib
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'benchmarks'))
import _turns  # noqa: E402
from tests.helpers import gone  # noqa: E402

CHILD = os.path.join(HERE, 'turns_child.py')
pytestmark = pytest.mark.skipif(not hasattr(os, 'killpg'), reason='needs POSIX signals')


@contextlib.contextmanager
def rung(name, mode, tmp_path):
    """(the stand-in variant, its ticks files' stem); its group is killed
    on leaving the block."""
    ticks = str(tmp_path / name)
    r = _turns.Rung(name, [sys.executable, '-P', CHILD, mode, ticks])
    try:
        yield r, ticks
    finally:
        r.kill()


def size(path):
    return os.path.getsize(path) if os.path.exists(path) else 0


def test_a_stopped_variant_does_no_work_in_the_background(tmp_path):
    with rung('a', 'ok', tmp_path) as (r, ticks):
        pid = r.reply(60)['ready']['pid']
        time.sleep(0.3)
        r.stop()
        time.sleep(0.2)         # what was being written lands
        before = {k: size(ticks + '.' + k) for k in ('worker', 'thread')}
        assert all(before.values()), before     # both ran before the stop
        time.sleep(0.5)
        assert {k: size(ticks + '.' + k) for k in before} == before
        seconds = r.turn(settle=1, steps=3, timeout=30)
        assert 0.15 <= seconds < 10     # three steps of 50 ms
        after = {k: size(ticks + '.' + k) for k in before}
        assert all(after[k] > before[k] for k in before), (before, after)
        time.sleep(0.1)
        stopped_at = dict((k, size(ticks + '.' + k)) for k in before)
        time.sleep(0.4)
        assert {k: size(ticks + '.' + k) for k in before} == stopped_at
        bye = r.close()['bye']
        assert bye['steps'] == 4        # one settling step and three timed
        assert gone(pid) and gone(bye['worker'])


def test_every_round_runs_each_rung_once_in_an_order_of_its_own():
    calls = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def turn(self, settle, steps, timeout):
            calls.append(self.name)
            return {'a': 0.5, 'b': 0.25}.get(self.name, 1.0)

    names = 'abcde'
    rungs = {n: Fake(n) for n in names}
    recorded = []
    _turns.rounds(rungs, 30, 1, 2, lambda name, s: recorded.append((name, s)), seed=3)
    orders = [''.join(calls[i:i + 5]) for i in range(0, len(calls), 5)]
    assert len(orders) == 30 and all(sorted(o) == list(names) for o in orders)
    # neighbours change: who runs right before the baseline ('a') is not always the same
    before_a = {o[o.index('a') - 1] for o in orders if o.index('a') > 0}
    assert len(before_a) >= 3, orders
    assert {o[0] for o in orders} == set(names)
    assert recorded == [(n, {'a': 0.5, 'b': 0.25}.get(n, 1.0)) for n in calls]
    again = []
    _turns.rounds({n: Fake(n) for n in names}, 30, 1, 2, lambda n, s: again.append(n), seed=3)
    assert again == calls[150:]         # the same seed, the same orders


def test_a_build_that_raises_is_reported_with_the_variant_and_its_error(tmp_path):
    with rung('broken', 'build_error', tmp_path) as (r, _):
        with pytest.raises(_turns.RungFailed, match=r"(?s)'broken'.*ValueError: no such rung"):
            r.reply(60)
        assert r.proc.wait(10) == 1


def test_a_variant_that_dies_in_a_turn_is_named_with_its_status(tmp_path):
    with rung('dies', 'die', tmp_path) as (r, _):
        r.reply(60)
        r.stop()
        with pytest.raises(_turns.RungFailed, match=r"'dies'.*exit status 3"):
            r.turn(settle=1, steps=3, timeout=30)


def test_a_silent_variant_times_out_and_is_killed_with_its_workers(tmp_path):
    with rung('hangs', 'hang', tmp_path) as (r, ticks):
        r.reply(60)
        r.stop()
        start = time.monotonic()
        with pytest.raises(_turns.RungFailed, match=r"'hangs'.*no reply within 1 s"):
            r.turn(settle=0, steps=1, timeout=1)
        assert time.monotonic() - start < 10
    time.sleep(0.2)
    written = size(ticks + '.worker')
    time.sleep(0.3)
    assert size(ticks + '.worker') == written       # its worker is gone too


COORDINATOR = """
import os, sys, time
sys.path.insert(0, {bench!r})
import _turns
with _turns.Coordinator() as c:
    r = c.start('a', [sys.executable, '-P', {child!r}, 'ok', {ticks!r}])
    with open({pidfile!r}, 'w') as f:
        f.write(str(r.reply(60)['ready']['pid']))
    r.stop()
    if {how!r} == 'dies':
        os._exit(0)
    print('stopped', flush=True)
    time.sleep(120)
"""


def coordinator(tmp_path, how):
    pidfile = tmp_path / 'pid'
    code = COORDINATOR.format(bench=os.path.join(HERE, '..', 'benchmarks'), child=CHILD,
                              ticks=str(tmp_path / 'a'), pidfile=str(pidfile), how=how)
    proc = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    return proc, pidfile


def cleanup(pidfile):
    if pidfile.exists():
        try:
            os.killpg(int(pidfile.read_text()), 9)
        except (ProcessLookupError, ValueError):
            pass


REAPER = """
import ctypes, os, subprocess, sys, time
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:   # PR_SET_CHILD_SUBREAPER
    print('no subreaper'); sys.exit(0)
subprocess.run([sys.executable, '-c', sys.argv[1]], stdout=subprocess.DEVNULL, timeout=120)
pid = int(open(sys.argv[2]).read())
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:    # reap what was handed to us
            pass
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        print('gone'); sys.exit(0)
    time.sleep(0.05)
print('left behind')
"""


def test_no_stopped_variant_outlives_a_killed_coordinator(tmp_path):
    """Under a reaper in the coordinator's session (a container's init, a
    subreaper), the kernel does not hang up the stopped groups a dead
    coordinator leaves: its watchdog kills them."""
    pidfile = tmp_path / 'pid'
    code = COORDINATOR.format(bench=os.path.join(HERE, '..', 'benchmarks'), child=CHILD,
                              ticks=str(tmp_path / 'a'), pidfile=str(pidfile), how='dies')
    try:
        out = subprocess.run([sys.executable, '-c', REAPER, code, str(pidfile)],
                             capture_output=True, text=True, timeout=180)
        if out.stdout.strip() == 'no subreaper':
            pytest.skip('prctl(PR_SET_CHILD_SUBREAPER) is not available here')
        assert out.stdout.strip() == 'gone', out.stdout + out.stderr
    finally:
        cleanup(pidfile)


def test_sigterm_to_the_coordinator_finishes_its_variants(tmp_path):
    proc, pidfile = coordinator(tmp_path, 'waits')
    try:
        assert proc.stdout.readline().strip() == 'stopped'
        pid = int(pidfile.read_text())
        proc.terminate()
        assert proc.wait(60) == 128 + 15
        assert gone(pid)
    finally:
        proc.kill()
        cleanup(pidfile)
