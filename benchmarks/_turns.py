"""Variants timed in short turns, each in a process of its own that is
stopped while the others run.

On a shared machine the speed drifts over tens of seconds while nothing
changes (``drift.py`` measures it: step times correlated well beyond the
next step). Windows of whole rebuilt variants, one
after another, put seconds to minutes between a rung and the baseline it is
compared with, and such a shift lands in one and not the other. Here every
variant is built once, in a child process, and they take turns of a few
steps each, in a new order each round: a round of all of them takes
seconds, so a round's ratios share the machine's state.

A variant's background work (loader workers decoding ahead, a prefetch
thread) must not run during another's turn, or it would be timed for free:
each child is the leader of a process group of its own (its workers are in
it) and the whole group is stopped (SIGSTOP) between its turns, at a step
boundary, and continued (SIGCONT) for its next one. A turn runs ``settle``
untimed steps (caches the other variants evicted) and then ``steps`` timed
ones; the clock is read in the child, after the device is synchronised.

Nothing is left running or stopped (:class:`Coordinator`): on an error, or
SIGTERM, the coordinator asks each variant to finish and kills its group;
if the coordinator itself dies, a watchdog process it started kills the
groups (and where the kernel hangs up a stopped group orphaned by the
coordinator's death, as in the coordinator's own session, it does so too).

Child side: :func:`serve` (the child's ``main`` builds the variant and calls
it). The protocol is one JSON object per line: commands on the child's
stdin, replies on a pipe of their own (``--reply-fd``), so what a library
prints cannot be taken for a reply.
"""

import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback

REPLY_FD_FLAG = '--reply-fd'
POLL_SECONDS = 0.25


class RungFailed(RuntimeError):
    """A variant's process failed or went silent: names it and what it said."""


class Rung:
    """One variant in a child process (``argv`` runs :func:`serve`)."""

    def __init__(self, name, argv, env=None):
        self.name = name
        read, write = os.pipe()
        try:
            self.proc = subprocess.Popen(
                list(argv) + [REPLY_FD_FLAG, str(write)], stdin=subprocess.PIPE,
                pass_fds=(write,), process_group=0, env=env, text=True)
        finally:
            os.close(write)
        self._replies = read
        self._buffer = b''

    # -- stop and go ---------------------------------------------------------

    def _signal(self, sig):
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self):
        self._signal(signal.SIGSTOP)

    def resume(self):
        self._signal(signal.SIGCONT)

    # -- protocol ------------------------------------------------------------

    def _send(self, **command):
        try:
            self.proc.stdin.write(json.dumps(command) + '\n')
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._failed('its stdin is closed')

    def reply(self, timeout):
        """The child's next reply (a dict); RungFailed if it errs, exits or
        says nothing for ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while b'\n' not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self._failed('no reply within {:.0f} s'.format(timeout))
            # Its workers hold the pipe open too: watch the process itself.
            ready, _, _ = select.select([self._replies], [], [], min(left, POLL_SECONDS))
            if not ready:
                if self.proc.poll() is not None and \
                        not select.select([self._replies], [], [], 0)[0]:
                    self._failed('it exited')      # and wrote nothing before it did
                continue
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
                self._failed('it exited')
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b'\n', 1)
        message = json.loads(line)
        if 'error' in message:
            self._failed('it raised:\n' + message['error'])
        return message

    def _failed(self, what):
        code = self.proc.poll()
        raise RungFailed('variant {!r}: {}{}'.format(
            self.name, what, '' if code is None else ' (exit status {})'.format(code)))

    def turn(self, settle, steps, timeout):
        """Runs one turn; returns the timed steps' seconds. The group is
        stopped again afterwards."""
        self.resume()
        try:
            self._send(do='turn', settle=settle, steps=steps)
            return self.reply(timeout)['seconds']
        finally:
            self.stop()

    def close(self, timeout=60):
        """Asks the child to finish (its reply, e.g. what it measured, is
        returned) and reaps it; kills its group if it does not."""
        bye = None
        if self._replies is None:
            return None         # closed (or killed) already
        try:
            self.resume()
            self._send(do='quit')
            bye = self.reply(timeout)
            self.proc.wait(timeout)
        except (RungFailed, subprocess.TimeoutExpired):
            pass
        finally:
            self.kill()
        return bye

    def kill(self):
        """The whole group, workers included (idempotent)."""
        if self._replies is None:
            return
        self._signal(signal.SIGKILL)
        self._signal(signal.SIGCONT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        if self._replies is not None:
            os.close(self._replies)
            self._replies = None


def rounds(rungs, n_rounds, settle, steps, record, timeout=600, on_round=None, seed=0):
    """``n_rounds`` rounds of one turn per rung, each round in an order of
    its own (shuffled with ``seed``), so no rung keeps the same neighbours
    or the same distance from the one it is compared with: an A/A pair
    measures the noise every pair sees. ``record(name, seconds)`` gets each
    turn's timed seconds, in the order they run. ``on_round(r)`` is called
    after each round; a true answer ends the rounds there."""
    import random
    shuffle = random.Random(seed).shuffle
    names = list(rungs)
    for r in range(n_rounds):
        order = list(names)
        shuffle(order)
        for name in order:
            record(name, rungs[name].turn(settle, steps, timeout))
        if on_round is not None and on_round(r):
            return


WATCHDOG = """
import os, signal, sys
groups = set()
for line in sys.stdin:
    if line.strip() == 'done':
        groups.clear()
    elif line.strip():
        groups.add(int(line))
for group in groups:
    for sig in (signal.SIGKILL, signal.SIGCONT):
        try:
            os.killpg(group, sig)
        except OSError:
            pass
"""


class Coordinator:
    """Owns the variants' processes (``with Coordinator() as c: c.start(...)``).

    On leaving the block, each variant is asked to finish (briefly) and
    then its group is killed; SIGTERM leaves the block too. A watchdog
    process, in a group of its own, holds a pipe from this process and kills
    every group it was told of if this process dies without saying it is
    done (where the kernel would not hang up the stopped groups: under a
    reaper in the same session, as in a container)."""

    def __init__(self):
        self.rungs = {}
        self.watchdog = None
        self._term = None

    def __enter__(self):
        self.watchdog = subprocess.Popen([sys.executable, '-c', WATCHDOG],
                                         stdin=subprocess.PIPE, process_group=0, text=True)
        self._term = signal.signal(signal.SIGTERM, _exit_on_term)
        return self

    def start(self, name, argv, env=None):
        rung = Rung(name, argv, env)
        self.rungs[name] = rung
        self.watchdog.stdin.write('{}\n'.format(rung.proc.pid))
        self.watchdog.stdin.flush()
        return rung

    def __exit__(self, *exc):
        try:
            for rung in self.rungs.values():
                rung.close(timeout=15)
        finally:
            try:
                self.watchdog.stdin.write('done\n')
                self.watchdog.stdin.close()
                self.watchdog.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.watchdog.kill()
            signal.signal(signal.SIGTERM, self._term)
        return False


def _exit_on_term(signum, frame):
    sys.exit(128 + signum)


# -- the child ----------------------------------------------------------------

def reply_fd(argv):
    """(the reply pipe's fd from ``argv``, argv without it)."""
    i = argv.index(REPLY_FD_FLAG)
    return int(argv[i + 1]), argv[:i] + argv[i + 2:]


def serve(fd, build, sync=lambda: None):
    """The child's loop. ``build()`` returns ``(step, close, info)``: one
    training step, the teardown (its return value goes back with the last
    reply) and what the build measured (goes back with the first); ``sync``
    waits for the device. Exits the process when told to, or when the
    coordinator is gone."""
    # Hung up with the coordinator (its stopped orphaned group), whatever
    # the parent's handler was; workers forked later inherit this.
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    out = os.fdopen(fd, 'w', buffering=1)

    def send(**message):
        out.write(json.dumps(message, default=str) + '\n')

    try:
        step, close, info = build()
    except BaseException:
        send(error=traceback.format_exc())
        sys.exit(1)
    send(ready=info)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command['do'] == 'quit':
                send(bye=close())
                return
            for _ in range(command['settle']):
                step()
            sync()
            start = time.perf_counter()
            for _ in range(command['steps']):
                step()
            sync()
            send(seconds=time.perf_counter() - start)
    except BaseException:
        send(error=traceback.format_exc())
        sys.exit(1)
    # stdin closed: the coordinator is gone
    close()
