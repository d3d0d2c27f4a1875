"""benchmarks/_turns.py, the ladder's way of timing rungs: each variant in a
process group of its own, stopped (workers and threads included) while the
others take their turns; failures name the variant and nothing is left
running or stopped."""

import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'benchmarks'))
import _turns  # noqa: E402

CHILD = os.path.join(HERE, 'turns_child.py')
pytestmark = pytest.mark.skipif(not hasattr(os, 'killpg'), reason='needs POSIX signals')


def rung(name, mode, tmp_path):
    ticks = str(tmp_path / name)
    return _turns.Rung(name, [sys.executable, '-P', CHILD, mode, ticks]), ticks


def size(path):
    return os.path.getsize(path) if os.path.exists(path) else 0


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:        # a zombie still answers kill(0): ask /proc whether it runs
        with open('/proc/{}/stat'.format(pid)) as f:
            return f.read().split(')')[-1].split()[0] != 'Z'
    except OSError:
        return True


def gone(pid, seconds=10):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_stopped_variant_does_no_work_in_the_background(tmp_path):
    r, ticks = rung('a', 'ok', tmp_path)
    try:
        pid = r.reply(60)['ready']['pid']
        time.sleep(0.3)
        r.stop()
        time.sleep(0.1)         # what was being written lands
        before = {k: size(ticks + '.' + k) for k in ('worker', 'thread')}
        assert all(before.values()), before     # both ran before the stop
        time.sleep(0.5)
        assert {k: size(ticks + '.' + k) for k in before} == before
        seconds = r.turn(settle=1, steps=3, timeout=30)
        assert 0.03 <= seconds < 5
        after = {k: size(ticks + '.' + k) for k in before}
        assert all(after[k] > before[k] for k in before), (before, after)
        assert r.stopped
        time.sleep(0.1)
        stopped_at = dict((k, size(ticks + '.' + k)) for k in before)
        time.sleep(0.4)
        assert {k: size(ticks + '.' + k) for k in before} == stopped_at
        bye = r.close()['bye']
        assert bye['steps'] == 4        # one settling step and three timed
        assert gone(pid) and gone(bye['worker'])
    finally:
        r.kill()


def test_rounds_rotate_and_record_every_turn():
    calls = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def turn(self, settle, steps, timeout):
            calls.append(self.name)
            return 0.5

    rungs = {n: Fake(n) for n in 'abc'}
    recorded = []
    _turns.rounds(rungs, 4, 1, 2, lambda name, s: recorded.append((name, s)))
    assert calls == list('abc' 'bca' 'cab' 'abc')
    assert recorded == [(n, 0.5) for n in calls]


def test_a_build_that_raises_is_reported_with_the_variant_and_its_error(tmp_path):
    r, _ = rung('broken', 'build_error', tmp_path)
    try:
        with pytest.raises(_turns.RungFailed, match=r"(?s)'broken'.*ValueError: no such rung"):
            r.reply(60)
        assert r.proc.wait(10) == 1
    finally:
        r.kill()


def test_a_variant_that_dies_in_a_turn_is_named_with_its_status(tmp_path):
    r, _ = rung('dies', 'die', tmp_path)
    try:
        r.reply(60)
        r.stop()
        with pytest.raises(_turns.RungFailed, match=r"'dies'.*exit status 3"):
            r.turn(settle=1, steps=3, timeout=30)
    finally:
        r.kill()


def test_a_silent_variant_times_out_and_is_killed_with_its_workers(tmp_path):
    r, ticks = rung('hangs', 'hang', tmp_path)
    pid = r.reply(60)['ready']['pid']
    r.stop()
    start = time.monotonic()
    with pytest.raises(_turns.RungFailed, match=r"'hangs'.*no reply within 1 s"):
        r.turn(settle=0, steps=1, timeout=1)
    assert time.monotonic() - start < 10
    r.kill()
    assert gone(pid)
    time.sleep(0.2)
    written = size(ticks + '.worker')
    time.sleep(0.3)
    assert size(ticks + '.worker') == written       # its worker is gone too


def test_no_stopped_variant_outlives_a_killed_coordinator(tmp_path):
    """The kernel hangs up a stopped group orphaned by the coordinator's
    death (the variants are in its session), so none stays stopped forever."""
    code = '\n'.join([
        'import sys, os',
        'sys.path.insert(0, {!r})'.format(os.path.join(HERE, '..', 'benchmarks')),
        'import _turns',
        'r = _turns.Rung("a", [sys.executable, "-P", {!r}, "ok", {!r}])'.format(
            CHILD, str(tmp_path / 'a')),
        'print(r.reply(60)["ready"]["pid"], flush=True)',
        'r.stop()',
        'os._exit(0)'])
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    try:
        assert gone(pid), 'the stopped variant outlived its coordinator'
    finally:
        try:
            os.killpg(pid, 9)
        except ProcessLookupError:
            pass
