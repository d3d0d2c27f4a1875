"""autotune's cache file (``enable(tune_cache=PATH)``): the next run on the
same machine takes the stored picks without measuring, and trains to the
same bits; another machine's picks, changed alternatives and a corrupt
file are measured around, the last with a warning naming it."""

import json
import os
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import fastchain
from fastchain.config._enable import FastchainWarning
from fastchain.tune import _cache, _tuner


def _abc(ran):
    return tuple((n, lambda n=n: ran.append(n) or n) for n in 'abc')


def _decide(tuner, path):
    """One 'process': measure key ('k', 'key') with made-up costs, save."""
    tuner.update(a=3.0, b=1.0, c=2.0)
    ran = []
    with fastchain.enable(autotune=True, tune_cache=path, loader_workers=0):
        for _ in range(10):
            _tuner.call('k', ('key', 1), _abc(ran))
    return ran


def test_the_next_run_takes_the_stored_pick_without_measuring(tuner, tmp_path):
    path = str(tmp_path / 'autotune.json')
    assert len(set(_decide(tuner, path))) == 3          # all three measured
    data = json.load(open(path))
    (machine,) = data['machines'].values()
    stored = machine['choices']['k']["('key', 1)"]
    assert stored['picked'] == 'b' and stored['names'] == ['a', 'b', 'c']
    assert stored['median_ms'] == {'a': 3000.0, 'b': 1000.0, 'c': 2000.0}
    assert machine['machine']['cores'] >= 1
    _tuner.forget()                                      # a new process
    tuner.clear()
    ran = []
    with fastchain.enable(autotune=True, tune_cache=path, loader_workers=0) as h:
        assert [_tuner.call('k', ('key', 1), _abc(ran)) for _ in range(3)] == ['b'] * 3
        summary = h.report()['autotune']['choices']['k']
    assert ran == ['b'] * 3                              # nothing else ran
    assert summary['from_cache'] == 1 and summary['decided'] == 1
    assert _tuner.choices('k')[0]['from_cache'] is True
    assert _tuner.describe(_tuner.summary())[0].startswith(
        'k: 1 of 1 keys decided (1 from the autotune cache file): b 1;')


def test_another_machine_or_other_alternatives_are_measured_again(tuner, tmp_path,
                                                                  monkeypatch):
    path = str(tmp_path / 'autotune.json')
    _decide(tuner, path)
    _tuner.forget()
    real = _cache.fingerprint
    monkeypatch.setattr(_cache, 'fingerprint', lambda: (real()[0] + ' elsewhere', {}))
    ran = []
    with fastchain.enable(autotune=True, tune_cache=path, loader_workers=0):
        _tuner.call('k', ('key', 1), _abc(ran))
    assert _tuner.choices('k')[0]['picked'] is None      # measuring
    assert len(json.load(open(path))['machines']) == 2    # both machines kept
    monkeypatch.setattr(_cache, 'fingerprint', real)
    _tuner.forget()
    with fastchain.enable(autotune=True, tune_cache=path, loader_workers=0):
        # The same key with a fourth alternative: the stored pick does not apply.
        _tuner.call('k', ('key', 1), _abc(ran) + (('d', lambda: 'd'),))
        assert _tuner.choices('k')[0]['picked'] is None


def test_a_corrupt_file_is_named_measured_around_and_rewritten(tuner, tmp_path):
    path = tmp_path / 'autotune.json'
    path.write_text('{"format": 1, "machines": ')
    with pytest.warns(FastchainWarning, match='the autotune cache {} could not be used'.format(
            path)) as record:
        ran = _decide(tuner, str(path))
    assert len(set(ran)) == 3
    named = [w for w in record if 'could not be used' in str(w.message)]
    assert len(named) == 1          # at enable(), not again when disable() rewrites it
    assert named[0].filename == __file__        # the user's enable() line
    assert json.load(open(path))['format'] == 1


@pytest.mark.parametrize('spoil', [
    lambda m: m.__setitem__('choices', []),                              # not an object
    lambda m: m['choices'].__setitem__('k', ['b']),
    lambda m: m['choices']['k']["('key', 1)"].__setitem__('median_ms', 'fast'),
    lambda m: m['choices']['k']["('key', 1)"]['median_ms'].__setitem__('b', 'x'),
    lambda m: m['choices']['k']["('key', 1)"].__setitem__('picked', 'z'),
])
def test_a_cache_of_the_right_format_and_wrong_shape_is_named_and_kept(tuner, tmp_path,
                                                                      spoil):
    # valid JSON of the right format with an entry of the wrong shape failed
    # with a raw error at enable(), or later inside a convolution (a trial)
    path = tmp_path / 'autotune.json'
    _decide(tuner, str(path))
    data = json.load(open(path))
    spoil(next(iter(data['machines'].values())))
    path.write_text(json.dumps(data))
    _tuner.forget()
    tuner.clear()
    with pytest.warns(FastchainWarning, match=r'could not be used \(.*\); it is kept as '
                      + str(path) + '.unusable'):
        ran = _decide(tuner, str(path))
    assert len(set(ran)) == 3                               # measured again
    assert json.load(open(str(path) + '.unusable')) == data      # nothing lost
    assert _cache._problem(json.load(open(path))) is None   # a new, usable cache


@pytest.mark.parametrize('text', ['{"lr": 0.1}', '[1, 2]',
                                  '{"format": "npz", "lr": 0.1}',     # a config's own key
                                  '{"format": 1, "lr": 0.1}'])
def test_a_json_file_that_is_no_cache_is_refused_not_replaced(tmp_path, text):
    path = tmp_path / 'settings.json'
    path.write_text(text)
    with pytest.raises(ValueError, match='settings.json is not a fastchain autotune cache'):
        fastchain.enable(tune_cache=str(path), loader_workers=0)
    assert path.read_text() == text
    assert not fastchain.config._enable.active_handles()


def test_a_relative_path_is_the_file_in_the_folder_enable_saw(tuner, tmp_path, monkeypatch):
    (tmp_path / 'run').mkdir()
    monkeypatch.chdir(tmp_path)
    with fastchain.enable(autotune=True, tune_cache='autotune.json', loader_workers=0):
        _tuner.call('k', ('key', 1), _abc([]))
        monkeypatch.chdir(tmp_path / 'run')        # a script that changes folder
    assert (tmp_path / 'autotune.json').exists()
    assert not (tmp_path / 'run' / 'autotune.json').exists()


@pytest.mark.parametrize('exists', [False, True])
def test_with_autotune_off_the_cache_is_neither_read_nor_written(tmp_path, exists):
    """It said 'no effect' and wrote the file all the same (a new-user trial)."""
    path = tmp_path / 'tune.json'
    if exists:
        path.write_text('{"format": 1, "machines": {}} ')    # (a byte a save would drop)
    with pytest.warns(FastchainWarning, match='has no effect while autotune=False'):
        handle = fastchain.enable(autotune=False, tune_cache=str(path), loader_workers=0)
    assert 'tune_cache' not in handle.resources
    handle.disable()
    assert path.exists() == exists
    if exists:
        assert path.read_text() == '{"format": 1, "machines": {}} '


def test_the_cache_cannot_be_one_of_the_timelines_files(tmp_path):
    for name in ('trace.json', 'trace.txt', 'trace.png'):
        with pytest.raises(ValueError, match='is one of the files the timeline'):
            fastchain.enable(tune_cache=str(tmp_path / name),
                             timeline=str(tmp_path / 'trace.json'), loader_workers=0)


def test_the_option_wants_a_file_path(tmp_path):
    with pytest.raises(ValueError, match=r'tune_cache=3\): expected the path of a JSON file'):
        fastchain.enable(tune_cache=3)
    with pytest.raises(ValueError, match='is a folder; give a file path, e.g. .*autotune.json'):
        fastchain.enable(tune_cache=str(tmp_path))
    # checked at enable(), before anything changes: not at disable() after training
    missing = tmp_path / 'no' / 'autotune.json'
    with pytest.raises(ValueError, match="folder '.*no' does not exist .*create it first"):
        fastchain.enable(tune_cache=str(missing))
    (tmp_path / 'a_file').write_text('')
    with pytest.raises(ValueError, match='does not exist as a folder \\(it is a file\\)'):
        fastchain.enable(tune_cache=str(tmp_path / 'a_file' / 'autotune.json'))
    assert not missing.parent.exists()


def test_a_folder_that_refuses_new_files_fails_at_enable_even_for_root(tmp_path):
    # /proc refuses a new file to every user, root included (os.access, which
    # the check used before, says root may write anywhere): the cache would
    # have failed at disable(), after the training.
    with pytest.raises(ValueError, match=r"'/proc/autotune.json' cannot be written "
                       r"\(.*\): .*choose another path"):
        fastchain.enable(tune_cache='/proc/autotune.json')
    assert not fastchain.active_handles()
    if os.geteuid() != 0:       # a read-only folder refuses only non-root users
        folder = tmp_path / 'ro'
        folder.mkdir()
        folder.chmod(0o500)
        with pytest.raises(ValueError, match='Permission denied'):
            fastchain.enable(tune_cache=str(folder / 'autotune.json'))
        folder.chmod(0o700)
    path = tmp_path / 'ok.json'
    fastchain.enable(tune_cache=str(path)).disable()
    assert path.exists() and sorted(os.listdir(tmp_path)) == ['ok.json']   # no probe left


class Net(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 8, 3, pad=1)
            self.c2 = L.Convolution2D(8, 8, 3, stride=2, pad=1)
            self.fc = L.Linear(None, 4)

    def forward(self, x):
        return self.fc(F.relu(self.c2(F.relu(self.c1(x)))))


def _train(steps, **options):
    numpy.random.seed(0)
    model = L.Classifier(Net())
    rng = numpy.random.RandomState(1)
    x = rng.rand(4, 3, 8, 8).astype(numpy.float32)
    t = rng.randint(0, 4, 4).astype(numpy.int32)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with fastchain.enable(loader_workers=0, **options) as h:
            opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
            for _ in range(steps):
                opt.update(model, x, t)
            choices = h.report()['autotune']['choices']
    return [p.array.copy() for p in model.params()], choices


def test_a_model_trained_from_the_cache_is_measured_nowhere_and_bit_for_bit_the_same(
        tmp_path):
    path = str(tmp_path / 'autotune.json')
    _tuner.forget()
    try:
        first, made = _train(12, autotune=True, tune_cache=path)
        assert made['cpu_conv']['decided'] == made['cpu_conv']['keys'] > 0
        assert made['fused_update']['decided'] == made['fused_update']['keys'] > 0
        _tuner.forget()
        second, read = _train(12, autotune=True, tune_cache=path)
        for kind in ('cpu_conv', 'fused_update'):
            assert read[kind]['from_cache'] == read[kind]['keys'] == made[kind]['keys']
            assert all(len(c['trials']) and max(c['trials'].values()) <= 1
                       for c in _tuner.choices(kind))          # no timed trial ran
        _tuner.forget()
        plain, _ = _train(12, autotune=False)
    finally:
        _tuner.forget()
    for a, b, c in zip(first, second, plain):
        assert numpy.array_equal(a, b) and numpy.array_equal(a, c)


def test_a_cache_a_newer_fastchain_wrote_is_not_used_and_left_as_it_is(tuner, tmp_path):
    # (a review: it was moved aside as unusable and replaced, so two versions
    # sharing the path kept destroying each other's choices)
    path = tmp_path / 'autotune.json'
    newer = '{"format": 2, "machines": {"x": {"choices": {"k": "a new layout"}}}}\n'
    path.write_text(newer)
    with pytest.warns(FastchainWarning, match=r'written by a newer fastchain \(format 2, this '
                      r'one reads 1\): it is not used, and left as it is') as record:
        ran = _decide(tuner, str(path))
    assert len(set(ran)) == 3                       # measured
    assert len([w for w in record if 'newer fastchain' in str(w.message)]) == 1
    assert path.read_text() == newer and not (tmp_path / 'autotune.json.unusable').exists()


_SAVING = '''
import sys, time
from fastchain.tune import _cache, _tuner
i, start, path = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
c = _tuner.choice('demo', ('key', i), ['a', 'b'])
c.picked = c.measured = 'b'
c.times = {'a': [0.002], 'b': [0.001]}
_cache.fingerprint()
while time.time() < start:
    pass
_cache.save(path)
'''


def test_processes_saving_at_once_each_keep_their_choices(tmp_path):
    # (a review: four ranks saving at once left 3 of their 4 choices: each
    # merged into the file as it was before the others' renames)
    import subprocess
    import sys
    import time
    path = str(tmp_path / 'autotune.json')
    for trial in range(3):
        start = time.time() + 2.0
        procs = [subprocess.Popen([sys.executable, '-c', _SAVING, str(4 * trial + i),
                                   str(start), path]) for i in range(4)]
        assert [p.wait(timeout=120) for p in procs] == [0] * 4
        (machine,) = json.load(open(path))['machines'].values()
        assert len(machine['choices']['demo']) == 4 * (trial + 1), trial
    assert sorted(os.listdir(str(tmp_path))) == ['autotune.json']     # nothing beside


def test_where_the_folder_cannot_be_locked_a_lock_file_is(tmp_path, monkeypatch):
    # (NFS emulates flock with POSIX locks, which a folder opened for reading
    # cannot hold: the write went on without a lock, silently; a review)
    import errno
    import fcntl
    import subprocess
    import sys

    def refused(fd, op):
        raise OSError(errno.EBADF, 'Bad file descriptor')
    monkeypatch.setattr(fcntl, 'flock', refused)
    path = str(tmp_path / 'autotune.json')
    probe = ('import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\ntry:\n'
             '    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n    print("free")\n'
             'except OSError:\n    print("held")\n')
    with _cache._file_lock(path):
        held = subprocess.run([sys.executable, '-c', probe, path + '.lock'],
                              capture_output=True, text=True, timeout=60).stdout.strip()
    after = subprocess.run([sys.executable, '-c', probe, path + '.lock'],
                           capture_output=True, text=True, timeout=60).stdout.strip()
    assert (held, after) == ('held', 'free')
