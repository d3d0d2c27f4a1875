"""benchmarks/ladder.py's --time-limit, on stand-in rungs: the windows stop
before one would end past the limit, the tuning pass takes at most its
share, and the report's numbers say how many windows ran."""

import argparse
import os
import sys
import time

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
