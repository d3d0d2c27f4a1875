"""benchmarks/ladder.py's --time-limit, on stand-in rungs: the windows stop
before one would end past the limit, the tuning pass takes at most its
share, and the report's numbers say how many windows ran."""

import argparse
import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'benchmarks'))
import _common  # noqa: E402
import ladder  # noqa: E402


def stand_in(seconds_per_step):
    def build():
        return (lambda: time.sleep(seconds_per_step)), (lambda: None)
    return build


def args_for(time_limit, windows):
    return argparse.Namespace(time_limit=time_limit, windows=windows, quick=True,
                              started=time.monotonic())


def test_windows_stop_before_one_would_end_past_the_limit():
    # a window: 2 rungs x (4 warm-up + 4 timed) steps of 0.02 s = 0.32 s at least
    builders = {'baseline': stand_in(0.02), 'baseline_again': stand_in(0.02)}
    rows = _common.Rows('iterations/s')
    measured = ladder.run_windows(args_for(0.5, 5), builders, rows)
    assert (measured['windows'], measured['windows_planned']) == (1, 5)
    assert [len(v) for v in rows.windows.values()] == [1, 1]


def test_without_a_limit_every_window_runs():
    builders = {'baseline': stand_in(0.001)}
    rows = _common.Rows('iterations/s')
    measured = ladder.run_windows(args_for(None, 3), builders, rows)
    assert (measured['windows'], measured['windows_planned']) == (3, 3)
    assert len(rows.windows['baseline']) == 3


def test_the_tuning_pass_ends_at_its_share_of_the_limit(monkeypatch):
    from fastchain import tune
    # one key whose choice is never decided: only the time ends the pass
    monkeypatch.setattr(tune, 'summary',
                        lambda: {'loader_workers': {'keys': 1, 'decided': 0}})
    start = time.monotonic()
    tuning = ladder.settle_tuning(lambda: time.sleep(0.01), 10_000, seconds=0.3)
    assert 8 <= tuning['steps'] < 200
    assert time.monotonic() - start < 5
    assert tuning['undecided'] == {'loader_workers': 1}
    # its share: half of what the limit leaves
    assert abs(ladder.tuning_seconds(args_for(100, 3)) - 50) < 1
    assert ladder.tuning_seconds(args_for(None, 3)) is None


def test_rounds_of_turns_end_when_on_round_says_so():
    import _turns

    class Fake:
        def turn(self, settle, steps, timeout):
            return 0.01

    seen = []
    _turns.rounds({'a': Fake(), 'b': Fake()}, 10, 1, 4, lambda n, s: seen.append(n),
                  on_round=lambda r: r == 2)
    assert len(seen) == 6           # three rounds of two turns, then the stop


class _Clock:
    """A clock a step advances by its cost: the tuner's picks then follow
    the costs, not how a loaded machine happened to schedule a sleep."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        return self.now


def _virtual_clock(monkeypatch, tuner):
    clock = _Clock()
    monkeypatch.setattr(tuner, 'time', clock)
    return clock


def test_a_choice_timed_over_whole_steps_left_by_the_tuning_is_decided_early(monkeypatch):
    """A loader-like choice whose turns need more steps than the pass has:
    the pass ends at its step limit and the choice takes the fastest count
    it timed, so the windows after it run under one count, not a turn's."""
    from fastchain.tune import _tuner
    monkeypatch.setattr(_tuner, 'enabled', True)
    monkeypatch.setattr(_tuner, 'forced', {})
    _tuner.forget()
    clock = _virtual_clock(monkeypatch, _tuner)
    turns = _tuner.Turns(settle=3, timed=2)
    cost = {'4': 0.004, '2': 0.001, '1': 0.003}
    ran = []

    def step():
        name = turns.step('loader_workers', ('pool',), ('4', '2', '1'))
        ran.append(name)
        clock.now += cost[name]

    try:
        # a turn is 5 steps, recorded as the next begins: 3 untimed turns,
        # then '4' and '2' timed (recorded at steps 21 and 26); 27 steps
        # leave '1' without a trial
        tuning = ladder.settle_tuning(step, 27, step_limit=27)
        assert tuning['undecided'] == {}
        [early] = tuning['decided_early']
        assert early['kind'] == 'loader_workers' and early['picked'] == '2'
        assert early['trials'] == {'4': 1, '2': 1, '1': 0}
        after = len(ran)
        for _ in range(10):
            step()
        assert set(ran[after:]) == {'2'}
        assert ladder.decided_early({'all': tuning}) == {'all': [
            "loader_workers ('pool',): 2 (trials {'4': 1, '2': 1, '1': 0})"]}
    finally:
        _tuner.forget()


def test_the_pass_goes_past_its_step_limit_while_a_whole_step_choice_measures(monkeypatch):
    from fastchain.tune import _tuner
    monkeypatch.setattr(_tuner, 'enabled', True)
    monkeypatch.setattr(_tuner, 'forced', {})
    monkeypatch.setattr(_tuner, 'TRIALS', 2)
    _tuner.forget()
    clock = _virtual_clock(monkeypatch, _tuner)
    turns = _tuner.Turns(settle=1, timed=1)
    cost = {'2': 0.003, '1': 0.001}

    def step():
        clock.now += cost[turns.step('loader_workers', ('pool',), ('2', '1'))]

    try:
        # turns of 2 steps: 2 untimed, then 2 timed each; decided at step 13
        tuning = ladder.settle_tuning(step, 8, step_limit=100)
        assert 8 < tuning['steps'] < 100
        assert tuning['decided_early'] == [] and tuning['undecided'] == {}
        assert [c['picked'] for c in _tuner.choices('loader_workers')] == ['1']
    finally:
        _tuner.forget()


class OutOfMemoryError(Exception):
    """Named as CuPy's and PyTorch's are."""


def test_the_largest_batch_is_the_last_that_fit_and_other_errors_are_raised(monkeypatch):
    import chainer
    import chainer.links as L
    import fastchain.models

    class Tiny(chainer.Chain):
        def __init__(self, depth, n_classes, limit=128):
            super().__init__()
            self.limit = limit
            with self.init_scope():
                self.fc = L.Linear(None, n_classes)

        def forward(self, x):
            if x.shape[0] > self.limit:
                raise OutOfMemoryError('out of memory allocating {} bytes'.format(x.nbytes))
            return self.fc(x)

    monkeypatch.setattr(fastchain.models, 'ResNet', Tiny)
    released = []
    device = chainer.get_device('@numpy')
    best, tried = ladder.largest_batch(device, 4, 3, lambda: None,
                                       lambda: released.append(1))
    assert best == 128
    assert tried == {64: 'fits', 128: 'fits', 256: 'out of memory'}
    assert len(released) == 3           # the memory given back after every try

    class Broken(chainer.Chain):
        def forward(self, x):
            raise ValueError('a real defect')

    monkeypatch.setattr(fastchain.models, 'ResNet', lambda depth, n: Broken())

    with pytest.raises(ValueError, match='a real defect'):
        ladder.largest_batch(device, 4, 3, lambda: None, lambda: None)


def test_a_rung_out_of_memory_is_named_and_the_others_go_on():
    def too_big():
        raise OutOfMemoryError('out of memory allocating 1 GiB')
    builders = {'baseline': stand_in(0.001), 'fp16': too_big}
    rows = _common.Rows('iterations/s')
    args = args_for(None, 2)
    args.batch = 512
    measured = ladder.run_windows(args, builders, rows)
    assert measured['windows'] == 2 and len(rows.windows['baseline']) == 2
    assert 'fp16' not in rows.windows
    assert rows.unavailable == [{'name': 'fp16', 'why': 'out of memory at batch 512: '
                                                        'out of memory allocating 1 GiB'}]


def test_batch_max_needs_a_gpu():
    import subprocess
    r = subprocess.run([sys.executable, os.path.join(HERE, '..', 'benchmarks', 'ladder.py'),
                        '--batch', 'max', '--device', '@numpy', '--results', '/nonexistent'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "--batch max: the largest batch that fits is a GPU's" in r.stderr


def test_past_the_limit_inside_a_window_the_rest_is_left_out_and_reported():
    # each rung's window: 4 warm-up + 4 timed steps of 0.025 s = 0.2 s: b
    # starts 0.1 s before the limit, c after it
    builders = {n: stand_in(0.025) for n in ('a', 'b', 'c')}
    rows = _common.Rows('iterations/s')
    reports = []
    measured = ladder.run_windows(args_for(0.3, 3), builders, rows,
                                  on_window=reports.append)
    assert measured['cut_mid_window'] and measured['windows'] == 1
    assert {n: len(v) for n, v in rows.windows.items()} == {'a': 1, 'b': 1}
    # written as it went: after each rung (a, b), then at the window's end
    assert [r['windows'] for r in reports] == [0, 0, 1]


def test_on_a_gpu_a_rung_with_loader_workers_warms_up_past_their_buffer():
    gpu = argparse.Namespace(gpu=True, workers=16)
    cpu = argparse.Namespace(gpu=False, workers=16)
    for rung in ('multiprocess', 'static_graph', 'all', 'torch'):
        assert ladder.warmup_steps(rung, gpu) == ladder.WARMUP_ITERATIONS + 4 * 16
        assert ladder.warmup_steps(rung, cpu) == ladder.WARMUP_ITERATIONS
    for rung in ('baseline', 'cudnn', 'autotune', 'fp16', 'fp32_preprocessing',
                 'baseline_again'):
        assert ladder.warmup_steps(rung, gpu) == ladder.WARMUP_ITERATIONS


def test_a_rung_out_of_memory_after_measured_windows_keeps_them_and_is_noted():
    calls = {'n': 0}

    def grows():
        calls['n'] += 1
        if calls['n'] > 1:
            raise OutOfMemoryError('out of memory allocating 2 GiB')
        return stand_in(0.001)()
    rows = _common.Rows('iterations/s')
    args = args_for(None, 3)
    args.batch = 256
    measured = ladder.run_windows(args, {'baseline': stand_in(0.001), 'big': grows}, rows)
    assert len(rows.windows['big']) == 1 and len(rows.windows['baseline']) == 3
    assert rows.unavailable == []               # measured once: not listed as never run
    assert measured['out_of_memory'] == {'big': 'window 2: out of memory allocating 2 GiB'}


def test_rungs_left_out_are_listed_and_all_still_tunes_for_a_tuned_rung(monkeypatch):
    """--rungs: only the rungs asked for are timed; the others are listed
    with the reason; the "all" rung runs the tuning pass (its choices are
    what the tuned rungs run with) without being timed."""
    built = []

    def builder(name):
        def build():
            built.append(name)
            return (lambda: time.sleep(0.001)), (lambda: None)
        return build

    tuned_with = []
    monkeypatch.setattr(ladder, 'tune_first',
                        lambda build, limit, seconds=None: tuned_with.append(build) or {})
    builders = {n: builder(n) for n in ('baseline', 'cudnn', 'autotune', 'all', 'torch')}
    rows = _common.Rows('iterations/s')
    args = args_for(None, 2)
    args.rungs = ['baseline', 'autotune']
    timed = ladder.timed_rungs(args, builders, rows)
    assert timed == ['baseline', 'autotune']
    assert {u['name']: u['why'] for u in rows.unavailable} == {
        n: 'left out of this run (--rungs)' for n in ('cudnn', 'all', 'torch')}
    measured = ladder.run_windows(args, builders, rows, timed=timed)
    assert tuned_with == [builders['all']]          # a tuned rung is timed: "all" tunes
    assert sorted(rows.windows) == ['autotune', 'baseline']
    assert set(built) == {'baseline', 'autotune'} and measured['windows'] == 2
    # no tuned rung timed: no tuning pass
    tuned_with.clear()
    ladder.run_windows(args, builders, _common.Rows('iterations/s'), timed=['baseline', 'torch'])
    assert tuned_with == []


@pytest.mark.parametrize('text, message', [
    ('baseline,autotun', 'unknown rung(s) autotun; choose from baseline, cudnn'),
    ('cudnn,autotune', 'baseline must be among them'),
])
def test_rungs_must_be_known_and_include_the_baseline(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace('(', r'\(')
                       .replace(')', r'\)')):
        ladder.rung_list(text)
    assert ladder.rung_list(' baseline, torch ') == ['baseline', 'torch']


def test_loading_is_timed_apart_and_named_with_its_share_of_the_baseline(tmp_path):
    """The first GPU run's cudnn rung gained 1.35x where the talk's gained
    2x: the baseline loads its JPEGs in the training process. The ladder
    times that loading apart and says its share of the baseline's step."""
    from fastchain.data import make_demo_dataset
    paths = make_demo_dataset(str(tmp_path / 'jpegs'), n_train=2, n_val=0, size=(40, 60),
                              seed=1)
    loading = ladder.time_loading(paths, batch=4, crop=32, batches=3)
    assert loading['batches'] == 3 and loading['ms'] > 0
    note = ladder.loading_note({'ms': 150.0, 'batches': 8}, baseline=4.0)
    assert note.endswith('median 150.0 ms over 8 batches, 60% of the baseline\'s step '
                         '(250.0 ms).')
    assert ladder.loading_note({'ms': 150.0, 'batches': 8}, None).endswith('8 batches.')


def test_windows_read_autotune_choices_from_the_cache_file_and_keep_them(tmp_path):
    """--tune-cache in the windows mode (a GPU's): the first run measures
    and writes its choices; the next run on the same machine reads them and
    measures nothing again, and the report says how many it read."""
    import fastchain
    from fastchain.tune import _tuner
    calls = {'fast': 0, 'slow': 0}

    def fast():
        calls['fast'] += 1

    def slow():
        calls['slow'] += 1
        time.sleep(0.002)

    def build_all():
        handle = fastchain.enable(autotune=True, loader_workers=0, static_graph=False)
        step = lambda: _tuner.call('ladder_cache_test', ('key', 1),
                                   (('slow', slow), ('fast', fast)))
        return step, handle.disable

    def run():
        builders = {'baseline': stand_in(0.001), 'all': build_all}
        args = args_for(None, 1)
        args.tune_cache = str(tmp_path / 'tune.json')
        return ladder.run_windows(args, builders, _common.Rows('iterations/s'))
    try:
        first = run()
        assert first['tune_cache']['read'] == 0 and first['tune_cache']['holds'] >= 1
        assert calls['slow'] > 0            # measured
        assert _tuner.pick('ladder_cache_test', ('key', 1)) == 'fast'
        _tuner.forget('ladder_cache_test')  # a new process, as far as the tuner knows
        calls.update(fast=0, slow=0)
        second = run()
        assert second['tune_cache']['read'] >= 1
        assert calls == {'fast': calls['fast'], 'slow': 0} and calls['fast'] > 0
    finally:
        _tuner.forget('ladder_cache_test')
