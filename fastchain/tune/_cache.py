"""autotune's choices kept in a file (``enable(tune_cache=PATH)``), so the
next run on the same machine skips the measurements.

The file is JSON: ``{"format": 1, "machines": {FINGERPRINT: {"saved": ISO
time, "machine": {...}, "choices": {KIND: {repr(key): {"names", "picked",
"median_ms", "label"}}}}}}``. The fingerprint is what a choice's speed
depends on besides its key: the CPU and core count, the GPUs, Python,
NumPy and its BLAS, Chainer, CuPy, cuDNN and fastchain's versions; another
machine's (or another version's) choices are kept in the file but not used.
Keys are those of the measurements (a convolution's by function, shapes,
dtypes and geometry; the loader's by dataset size, batch and worker count,
not by model). Only choices between bitwise-equal alternatives are kept
(all autotune makes), so a stale entry can cost speed, never change a
result; a choice whose alternatives differ from the stored ones (a new
option, another worker count) is measured again.

Read when the handle is enabled; written when it is disabled and at the
process's exit (each write merges this process's decided choices into what
the file holds, through a temporary file and a rename, under a lock on
the file's folder, or ``PATH.lock`` where that cannot be locked: ranks that
save at once each keep their choices). A file of
a newer format (a newer fastchain) is not used and left as it is, said
once. A file that cannot
be read, parsed or used gives one warning naming it, is kept beside as
``PATH.unusable`` and measured around, and a new file is written; a JSON
file that is not a cache at all (a script's own configuration given by
mistake) is refused, not replaced.
"""

import datetime
import json
import contextlib
import errno
import os
import socket
import threading
import warnings

FORMAT = 1
_lock = threading.Lock()


def fingerprint():
    """(text, dict): what a choice's speed depends on besides its key."""
    from fastchain import __version__
    from fastchain.doctor._report import machine
    m = machine()
    described = {k: m.get(k) for k in ('cpu', 'cores', 'python', 'numpy', 'blas', 'chainer',
                                       'cupy', 'cudnn')}
    described['gpus'] = [g.get('name') for g in m.get('gpus') or ()]
    described['fastchain'] = __version__
    return json.dumps(described, sort_keys=True), described


_warned = set()


def _read(path):
    """The file's contents, {} where there is none; a warning (and {}) where
    it cannot be used, the file kept beside as ``PATH.unusable``; a JSON
    file that is not a cache at all refused (it would be replaced)."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or 'machines' not in data or \
                not isinstance(data.get('format'), int) or isinstance(data['format'], bool):
            raise ForeignFile(
                '{} is not a fastchain autotune cache (a JSON object with a whole-number '
                '"format" and "machines"), and enable(tune_cache=...) would replace it: '
                'give the cache another path'.format(path))
        if isinstance(data['format'], int) and data['format'] > FORMAT:
            raise NewerFormat(data['format'])
        problem = _problem(data)
        if problem is not None:
            raise ValueError(problem)
        return data
    except (ForeignFile, NewerFormat):
        raise
    except (OSError, ValueError) as e:
        from fastchain.config import _patches
        from fastchain.config._warning import FastchainWarning
        aside = path + '.unusable'
        try:
            os.replace(path, aside)     # nothing lost: a new cache is written in its place
            kept = '; it is kept as {}'.format(aside)
        except OSError:
            kept = ''
        message = ('fastchain: the autotune cache {} could not be used ({}){}; autotune '
                   'measures again and a new file will be written'.format(path, e, kept))
        if message not in _warned:
            _warned.add(message)
            warnings.warn(message, FastchainWarning, stacklevel=_patches.user_stacklevel())
        return {}


class ForeignFile(ValueError):
    """A JSON file that is not an autotune cache (refused, not replaced)."""


class NewerFormat(Exception):
    """A cache a newer fastchain wrote: not used, not replaced (two versions
    sharing a path would destroy each other's choices; a review)."""


def _newer(path, error):
    from fastchain.config import _patches
    from fastchain.config._warning import FastchainWarning
    message = ('fastchain: the autotune cache {} was written by a newer fastchain (format {}, '
               'this one reads {}): it is not used, and left as it is; give this version '
               'another tune_cache path'.format(path, error.args[0], FORMAT))
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, FastchainWarning, stacklevel=_patches.user_stacklevel())


def _problem(data):
    """What makes a file of the cache's format unusable, or None (every
    entry is checked before any is used: a wrong one failed later, in a
    convolution, with a raw error)."""
    if data.get('format') != FORMAT:
        return 'format {!r}, not {}'.format(data.get('format'), FORMAT)
    if not isinstance(data.get('machines'), dict):
        return '"machines" is not an object'
    for machine in data['machines'].values():
        if not isinstance(machine, dict) or not isinstance(machine.get('choices', {}), dict):
            return 'a machine entry or its "choices" is not an object'
        for kind, entries in machine.get('choices', {}).items():
            if not isinstance(entries, dict):
                return 'the {!r} choices are not an object'.format(kind)
            for key, choice in entries.items():
                if not _valid(choice):
                    return 'the {!r} choice for {} is not one autotune wrote'.format(kind, key)
    return None


def _valid(choice):
    if not isinstance(choice, dict):
        return False
    names, times = choice.get('names'), choice.get('median_ms', {})
    return (isinstance(names, list) and all(isinstance(n, str) for n in names)
            and choice.get('picked') in names and isinstance(times, dict)
            and all(isinstance(t, (int, float)) and not isinstance(t, bool) or t is None
                    for t in times.values()))


def load(path):
    """Makes this machine's choices in ``path`` known to the tuner; returns
    how many were read."""
    from fastchain.tune import _tuner
    key, _ = fingerprint()
    with _lock:
        try:
            entry = _read(path).get('machines', {}).get(key, {})
        except NewerFormat as e:
            _newer(path, e)
            entry = {}
    known = {(kind, key_repr): choice
             for kind, entries in (entry.get('choices') or {}).items()
             for key_repr, choice in entries.items()}
    _tuner.know(known)
    return len(known)


def save(path):
    """Merges this process's decided choices into ``path``; returns how many
    it holds for this machine."""
    from fastchain.tune import _tuner
    key, described = fingerprint()
    decided = _tuner.decided()
    with _lock, _file_lock(path):
        try:
            data = _read(path) or {'format': FORMAT, 'machines': {}}
        except NewerFormat as e:
            _newer(path, e)
            return 0
        entry = data['machines'].setdefault(key, {'choices': {}})
        entry['machine'] = described
        entry['saved'] = datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec='seconds')
        choices = entry.setdefault('choices', {})
        for (kind, key_repr), choice in decided.items():
            choices.setdefault(kind, {})[key_repr] = choice
        # (the host too: two machines' processes may share a path and a pid)
        tmp = '{}.tmp.{}.{}'.format(path, socket.gethostname(), os.getpid())
        with open(tmp, 'w') as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write('\n')
        os.replace(tmp, path)
    return sum(len(v) for v in choices.values())


@contextlib.contextmanager
def _file_lock(path):
    """Held by one process at a time: an advisory lock on the cache's folder
    (no file is left beside the cache), or where the file system refuses
    that (NFS emulates ``flock`` with POSIX locks, which a folder opened for
    reading cannot hold) on ``PATH.lock``. Without it, processes saving at
    once each merged into what the file held before the others wrote, and
    the last rename kept only its own choices (a review: 3 of 4 ranks'
    kept). Where no lock can be taken, the write goes on without it."""
    fd = _locked(os.path.dirname(os.path.abspath(path)), os.O_RDONLY, 'flock')
    if fd is None:
        fd = _locked(path + '.lock', os.O_RDWR | os.O_CREAT, 'lockf')
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)        # (the lock goes with it)


LOCK_WAIT = 30.0    # seconds; a lock held longer (a stale one on NFS) is passed over


def _locked(name, flags, how):
    """A descriptor of ``name`` holding an exclusive lock, or None (no lock
    here, or one still held by another after ``LOCK_WAIT``: a save at exit
    must not hang on it)."""
    import time
    try:
        import fcntl
        fd = os.open(name, flags, 0o666)
    except (ImportError, OSError):
        return None
    lock = fcntl.flock if how == 'flock' else fcntl.lockf
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:    # (held: EAGAIN, or EACCES from lockf)
            if e.errno in (errno.EAGAIN, errno.EACCES) and time.monotonic() < deadline:
                time.sleep(0.02)
                continue
        os.close(fd)
        return None
