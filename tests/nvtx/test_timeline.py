"""The built-in timeline and the step summary, on CPU."""

import json
import re
import time
import warnings

import numpy
import pytest
from hypothesis import given, settings, strategies as st

import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions

import fastchain
from fastchain.nvtx import _summary
from fastchain.nvtx._annotator import annotator
from fastchain.nvtx._summary import Range


def train(tmp_path, iterations=5, extend=None, log_every=1, **options):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        handle = fastchain.enable(loader_workers=0, **options)
    x = numpy.random.RandomState(0).randn(32, 4).astype(numpy.float32)
    t = (x[:, 0] > 0).astype(numpy.int32)
    model = L.Classifier(L.Linear(4, 2))
    opt = chainer.optimizers.SGD(0.1).setup(model)
    it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), 8)
    trainer = training.Trainer(training.StandardUpdater(it, opt),
                               (iterations, 'iteration'), out=str(tmp_path / 'out'))
    trainer.extend(extensions.LogReport(trigger=(log_every, 'iteration')))
    if extend is not None:
        extend(trainer)
    trainer.run()
    handle.disable()
    return handle


def test_timeline_records_every_phase_and_writes_trace_chart_summary(tmp_path):
    path = str(tmp_path / 'trace.json')
    train(tmp_path, timeline=path)
    trace = json.load(open(path))
    spans = [e for e in trace['traceEvents'] if e['ph'] == 'X']
    assert {e['cat'] for e in spans} == {'step', 'data', 'convert', 'forward', 'backward',
                                          'update', 'extension'}
    assert sum(e['name'] == 'step' for e in spans) == 5
    assert all(e['dur'] >= 0 for e in spans)
    marks = [e['name'] for e in trace['traceEvents'] if e['ph'] == 'i']
    assert marks == ['epoch 1']         # 32 examples / batch 8 = 4 steps per epoch
    summary = open(str(tmp_path / 'trace.txt')).read()
    assert 'fastchain step breakdown (4 steps, 1 warm-up left out)' in summary
    assert 'diagnosis:' in summary
    png = tmp_path / 'trace.png'
    assert png.exists() and png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert annotator().timeline is None         # detached on disable


def test_timeline_with_nvtx_false_is_refused():
    with pytest.raises(ValueError, match='timeline'):
        fastchain.enable(nvtx=False, timeline='x.json')


def test_a_timeline_path_may_be_a_pathlib_path(tmp_path):
    # (refused as "expected the path of the trace JSON to write", a path given)
    with fastchain.enable(timeline=tmp_path / 'trace.json', loader_workers=0) as h:
        assert h.options['timeline'] == str(tmp_path / 'trace.json')
    assert (tmp_path / 'trace.json').exists()
    with pytest.raises(ValueError, match=r'timeline.*\(str or os.PathLike\), got 3'):
        fastchain.enable(timeline=3)


def test_a_timeline_path_that_would_lose_the_trace_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is a folder; give a file path, e.g. .*trace.json"):
        fastchain.enable(timeline=str(tmp_path))
    for name in ('t.png', 'T.TXT'):     # the chart and the summary's own names
        with pytest.raises(ValueError, match=r'written beside the trace, as .*[tT]\.png and '
                           r'\.txt: give the trace its own name, e.g. .*\.json'):
            fastchain.enable(timeline=str(tmp_path / name))


def test_a_relative_timeline_path_is_the_folder_enable_saw(tmp_path, monkeypatch):
    (tmp_path / 'run').mkdir()
    monkeypatch.chdir(tmp_path)
    train(tmp_path, timeline='trace.json',
          extend=lambda trainer: monkeypatch.chdir(tmp_path / 'run'))   # before disable()
    assert (tmp_path / 'trace.json').exists() and (tmp_path / 'trace.txt').exists()
    assert not (tmp_path / 'run' / 'trace.json').exists()


def test_a_later_nvtx_false_over_a_timeline_warns(tmp_path):
    outer = fastchain.enable(timeline=str(tmp_path / 'x.json'), loader_workers=0)
    try:
        with pytest.warns(fastchain.FastchainWarning, match=r"nvtx=False keeps the timeline "
                          r"'.*x.json' of an earlier handle from recording anything"):
            inner = fastchain.enable(nvtx=False)
        inner.disable()
    finally:
        outer.disable()


def test_a_timeline_never_disabled_is_written_at_exit(tmp_path):
    """A script that does not disable its handle still gets its trace (and
    is told where it went), as the autotune cache is saved at exit."""
    import subprocess
    import sys
    path = tmp_path / 'trace.json'
    script = tmp_path / 'script.py'
    script.write_text(
        'import numpy, chainer, chainer.links as L, fastchain\n'
        'fastchain.enable(timeline={!r}, loader_workers=0)\n'
        'model = L.Classifier(L.Linear(4, 2))\n'
        'opt = chainer.optimizers.SGD(0.1).setup(model)\n'
        'x = numpy.ones((8, 4), numpy.float32); t = numpy.zeros(8, numpy.int32)\n'
        'for _ in range(3):\n'
        '    opt.update(model, x, t)\n'.format(str(path)))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'fastchain: the timeline was written at exit to {}'.format(path) in r.stderr
    assert json.load(open(path))['traceEvents'] and (tmp_path / 'trace.txt').exists()


def test_no_profiler_means_no_annotation_installed():
    from chainer.training.updaters import StandardUpdater
    before = StandardUpdater.__dict__['__init__']
    with fastchain.enable(loader_workers=0) as h:
        assert StandardUpdater.__dict__['__init__'] is before
        assert not h.states['nvtx'].active and 'no profiler' in h.states['nvtx'].why


def test_nvtx_true_without_a_tool_says_the_ranges_go_nowhere():
    with pytest.warns(UserWarning, match='go nowhere'):
        h = fastchain.enable(nvtx=True, loader_workers=0)
    assert h.states['nvtx'].active
    h.disable()


def step(t, phases, thread=1, extension=0, gap=0):
    """A step range starting at t with the given (category, ns) children and
    ``gap`` ns of unannotated time at its end."""
    out, cursor = [], t
    for category, ns in phases:
        out.append(Range(category, category, thread, cursor, cursor + ns, 1))
        cursor += ns
    cursor += gap
    out.insert(0, Range('step', 'step', thread, t, cursor, 0))
    if extension:
        out.append(Range('extension log', 'extension', thread, cursor, cursor + extension, 0))
    return out, cursor + extension


def steps(n, phases, extension=0, gap=0):
    ranges, t = [], 0
    for _ in range(n):
        rs, t = step(t, phases, extension=extension, gap=gap)
        ranges += rs
    return ranges


def test_summary_shares_and_input_bound_diagnosis():
    ms = 1_000_000
    ranges = steps(5, [('data', 4 * ms), ('convert', 1 * ms), ('forward', 2 * ms),
                       ('backward', 2 * ms), ('update', 1 * ms)], extension=0)
    result = _summary.summarize(ranges, skip=1)
    assert result['steps'] == 4
    assert result['median_ms']['data'] == pytest.approx(4.0)
    assert result['share']['data'] == pytest.approx(0.4)
    assert result['diagnosis'] == 'input-bound: 40% of each step is waiting for data'


def test_summary_other_time_extensions_and_compute_bound():
    ms = 1_000_000
    ranges = steps(3, [('forward', 5 * ms), ('backward', 4 * ms)], extension=1 * ms,
                   gap=1 * ms)
    result = _summary.summarize(ranges, skip=0)
    assert result['median_ms']['other'] == pytest.approx(1.0)
    assert result['median_ms']['extension'] == pytest.approx(1.0)
    assert result['one_offs'] == []         # an extension every step is no one-off
    assert result['diagnosis'].startswith('compute-bound: forward, backward and update')


def test_a_phase_with_no_range_reads_none_recorded_not_zero():
    # fp32 has no loss_scale ranges: "0.00 ms" read as measured and free
    ms = 1_000_000
    ranges = steps(3, PHASES_10MS)
    ranges += [Range('loss_scale', 'loss_scale', 1, 1 * ms, 1 * ms, 1)]   # a 0 ns one
    text = _summary.format_summary(_summary.summarize(ranges, skip=0))
    row = next(l for l in text.splitlines() if l.startswith('loss_scale'))
    assert row.split()[1:3] == ['0.00', '0.0%'], row        # recorded: a figure
    text = _summary.format_summary(_summary.summarize(ranges[:-1], skip=0))
    rows = {l.split()[0]: l for l in text.splitlines()[2:11]}
    assert rows['loss_scale'].split()[1:] == ['-', '-', 'none', 'recorded'], rows
    assert rows['extension'].endswith('none recorded') and 'none' not in rows['other']
    assert rows['forward'].split()[1] == '4.00'



def test_device_idle_from_kernels():
    ms = 1_000_000
    ranges = steps(2, [('forward', 5 * ms), ('backward', 5 * ms)])
    kernels = [(0, 2 * ms), (1 * ms, 3 * ms), (10 * ms, 12 * ms)]   # overlap merged
    result = _summary.summarize(ranges, kernels=kernels, skip=0)
    assert result['device_idle'] == pytest.approx((0.7 + 0.8) / 2)
    assert result['diagnosis'].startswith('host-bound: the device is idle 75%')


PHASES_10MS = [('data', 1_000_000), ('convert', 1_000_000), ('forward', 4_000_000),
               ('backward', 3_000_000), ('update', 1_000_000)]


def test_a_snapshot_once_is_a_one_off_named_in_the_summary_not_the_diagnosis():
    # Issue #22: 12 steps of 10 ms and one 6.8 s snapshot after step 7 read
    # "extension-bound" when the figures were means over the steps.
    ms = 1_000_000
    ranges, t = [], 0
    for i in range(12):
        rs, t = step(t, PHASES_10MS, extension=6800 * ms if i == 6 else 0)
        ranges += [r._replace(name='extension snapshot') if r.category == 'extension' else r
                   for r in rs]
    result = _summary.summarize(ranges, skip=1)
    assert not result['diagnosis'].startswith('extension-bound')
    assert result['diagnosis'].startswith('compute-bound')
    assert result['median_ms']['extension'] == 0
    assert result['total_ms'] == pytest.approx(10.0)
    assert [(e['name'], e['step'], e['ms']) for e in result['one_offs']] == [
        ('extension snapshot', 7, pytest.approx(6800.0))]
    assert result['mean_step_ms'] == pytest.approx((11 * 10 + 6800) / 11)
    text = _summary.format_summary(result)
    assert 'extension snapshot: 6800.0 ms in step 7' in text
    assert 'more than 3x its median' in text        # the rule is spelled out
    assert 'diagnosis: compute-bound' in text


def test_one_off_rule_a_slow_phase_yes_small_or_regular_events_no():
    ms = 1_000_000
    ranges, t = [], 0
    for i in range(9):
        phases = [(c, 20 * ms if c == 'data' and i == 4 else n) for c, n in PHASES_10MS]
        # 'log' every step (jitter 1-1.2 ms); 'tiny' once, under a quarter of a step.
        rs, t = step(t, phases, extension=(1 + 0.2 * (i % 2)) * ms)
        ranges += [r._replace(name='extension log') if r.category == 'extension' else r
                   for r in rs]
        if i == 2:
            ranges.append(Range('extension tiny', 'extension', 1, t, t + ms // 10, 0))
            t += ms // 10
    result = _summary.summarize(ranges, skip=0)
    assert [(e['name'], e['step']) for e in result['one_offs']] == [('data', 5)]
    assert result['median_ms']['data'] == pytest.approx(1.0)
    assert result['diagnosis'].startswith('compute-bound')
    assert 'data: 20.0 ms in step 5 (median 1.0 ms)' in _summary.format_summary(result)


def test_timeline_of_a_run_with_a_slow_extension_once(tmp_path):
    def sleep_once(trainer):
        time.sleep(0.4)

    def extend(trainer):
        trainer.extend(sleep_once, name='sleep_once', trigger=(6, 'iteration'))
    path = str(tmp_path / 'trace.json')
    train(tmp_path, iterations=10, extend=extend, log_every=100, timeline=path)
    summary = open(str(tmp_path / 'trace.txt')).read()
    found = re.search(r'extension sleep_once: ([0-9.]+) ms in step (\d+)', summary)
    assert found, summary
    assert float(found.group(1)) >= 400 and found.group(2) == '6'
    diagnosis = summary.split('diagnosis: ')[1]
    assert not diagnosis.startswith('extension-bound'), summary
    assert (tmp_path / 'trace.png').exists()


def test_summary_warns_of_ranges_left_open():
    from fastchain.nvtx._timeline import Timeline
    timeline = Timeline()
    for _ in range(3):
        timeline.push('step', 'step')
        timeline.push('forward', 'forward')
        timeline.pop()
        timeline.pop()
    timeline.push('step', 'step')
    timeline.push('backward', 'backward')       # never popped
    text = _summary.format_summary(timeline.summary(skip=0))
    assert 'fastchain step breakdown (3 steps, 0 warm-up left out)' in text
    assert 'warning: 2 range(s) never closed (step, backward)' in text


def test_the_capture_range_is_not_a_step():
    # FASTCHAIN_CAPTURE puts a 'capture' range (category 'step') around steps.
    ranges = [r._replace(depth=r.depth + 1) for r in steps(4, PHASES_10MS)]
    ranges.append(Range('capture', 'step', 1, 0, max(r.end for r in ranges), 0))
    result = _summary.summarize(ranges, skip=0)
    assert result['steps'] == 4 and result['total_ms'] == pytest.approx(10.0)


def test_allreduce_between_phases_counts_once_within_the_step():
    ms = 1_000_000
    ranges = steps(3, [('forward', 5 * ms), ('allreduce', 2 * ms)])
    result = _summary.summarize(ranges, skip=0)
    assert result['median_ms']['allreduce'] == pytest.approx(2.0)
    assert result['median_ms']['other'] == pytest.approx(2.0)
    assert result['total_ms'] == pytest.approx(7.0)


def test_an_evaluation_every_fourth_step_is_listed_once_with_each_time():
    ms = 1_000_000
    ranges, t = [], 0
    for i in range(1, 13):
        rs, t = step(t, PHASES_10MS, extension=50 * ms if i % 4 == 0 else 0)
        ranges += [r._replace(name='extension validation') if r.category == 'extension'
                   else r for r in rs]
    result = _summary.summarize(ranges, skip=1)
    assert [e['step'] for e in result['one_offs']] == [4, 8, 12]
    assert not result['diagnosis'].startswith('extension-bound')
    assert _summary.one_off_lines(result) == [
        'extension validation: 3 times, 150.0 ms in all (steps 4, 8, 12: 50.0, 50.0, 50.0 ms)']


RANKS_SCRIPT = '''
import sys, warnings
import numpy, chainer
import chainer.links as L
import fastchain
from fastchain import distributed
with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    handle = fastchain.enable(timeline=sys.argv[1], loader_workers=0)
comm = distributed.create_communicator('mpi')
x = numpy.random.RandomState(comm.rank).randn(16, 4).astype(numpy.float32)
model = L.Classifier(L.Linear(4, 2))
opt = distributed.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm).setup(model)
it = chainer.iterators.SerialIterator(
    chainer.datasets.TupleDataset(x, (x[:, 0] > 0).astype(numpy.int32)), 4)
updater = chainer.training.StandardUpdater(it, opt)
for _ in range(3):
    updater.update()
if sys.argv[2:] == ['raise'] and comm.rank == 1:
    raise ValueError('rank 1 fails on purpose')
handle.disable()
comm.finalize()
'''


@pytest.mark.mpi
def test_each_rank_of_a_data_parallel_job_writes_its_own_timeline(tmp_path):
    # Every rank used to write the one path given: the last one's was all
    # that was left.
    import subprocess
    import sys
    from fastchain.backends import mpi
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, '-c', RANKS_SCRIPT,
                        str(tmp_path / 'trace.json')], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ['trace.json', 'trace.png', 'trace.rank1.json', 'trace.rank1.png',
                     'trace.rank1.txt', 'trace.txt'] or names == [
        'trace.json', 'trace.rank1.json', 'trace.rank1.txt', 'trace.txt'], names
    pids = []
    for name in ('trace.json', 'trace.rank1.json'):
        events = json.load(open(tmp_path / name))['traceEvents']
        assert any(e.get('name') == 'update' for e in events), name
        pids.append({e['pid'] for e in events if 'pid' in e})
    assert not pids[0] & pids[1]        # two processes' own events


@pytest.mark.mpi
def test_the_rank_that_ends_a_data_parallel_job_writes_its_timeline_first(tmp_path):
    # a new-user trial: a rank that raised aborted the job (MPI_Abort runs no
    # exit handler) and no timeline was left, the failing rank's least of all
    import subprocess
    import sys
    from fastchain.backends import mpi
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, '-c', RANKS_SCRIPT,
                        str(tmp_path / 'trace.json'), 'raise'], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and 'rank 1 fails on purpose' in r.stderr
    assert 'the timeline was written before the job was aborted to {}'.format(
        tmp_path / 'trace.rank1.json') in r.stderr, r.stderr[-3000:]
    events = json.load(open(tmp_path / 'trace.rank1.json'))['traceEvents']
    assert sum(e.get('name') == 'update' for e in events) == 3
    assert '(2 steps, 1 warm-up left out)' in (tmp_path / 'trace.rank1.txt').read_text()


def _phases_scanning_everything(step, thread_ranges, starts, following):
    """The summary's per-step scan as it was: every range of the thread for
    every step (quadratic in the run's length; the reference here)."""
    return _summary._step_figures(step, thread_ranges, following)


@given(st.lists(st.tuples(
    st.lists(st.tuples(st.sampled_from(_summary.PHASES[:6] + ('allreduce', 'link')),
                       st.integers(0, 5)), max_size=5),
    st.integers(0, 3), st.integers(0, 3), st.booleans()), min_size=1, max_size=12),
    st.integers(0, 3), st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), max_size=4))
@settings(max_examples=80, deadline=None)
def test_the_summary_looks_at_each_steps_own_ranges_as_the_full_scan_did(shapes, skip, others):
    """Each step is summarised from the ranges that start in it and the
    extensions up to the next one (found by bisection: the full scan of
    every range for every step took minutes at exit for a long run, a
    new-user trial), with the same figures as the full scan."""
    ranges, t = [], 0
    for phases, gap, extension, nested in shapes:
        rs, t = step(t, [(c, ns * 1000) for c, ns in phases if c != 'link'],
                     extension=extension * 1000, gap=gap * 1000)
        if nested and len(rs) > 1:      # an allreduce inside a phase, a range on another thread
            child = rs[1]
            rs.append(Range('allreduce b0', 'allreduce', 1, child.start, child.end, 2))
            rs.append(Range('load', 'data', 2, child.start, child.end + 500, 0))
        ranges += rs
        t += gap * 300
    for begin, length in others:    # steps of another thread, overlapping the first's
        rs, _ = step(begin * 1000, [('forward', length * 400), ('update', length * 300)],
                     thread=3, extension=length * 100)
        ranges += rs
    fast = _summary.summarize(list(ranges), skip=skip)
    import unittest.mock
    with unittest.mock.patch.object(_summary, '_phases', _phases_scanning_everything):
        full = _summary.summarize(list(ranges), skip=skip)
    assert fast == full


def test_a_timeline_path_an_enabled_handle_writes_is_refused(tmp_path):
    # a new-user trial: the outer handle, written last, replaced the inner
    # one's trace and summary with an empty record, its chart left as it was
    path = str(tmp_path / 'trace.json')
    outer = fastchain.enable(timeline=path, loader_workers=0)
    try:
        with pytest.raises(ValueError, match='is the timeline of a handle still enabled'):
            fastchain.enable(timeline=str(tmp_path / '.' / 'trace.json'))
        inner = fastchain.enable(timeline=str(tmp_path / 'inner.json'))     # another path
        inner.disable()
    finally:
        outer.disable()
    fastchain.enable(timeline=path).disable()       # free again once disabled


def test_a_run_with_no_chart_leaves_no_earlier_runs_chart_beside_its_trace(tmp_path):
    from fastchain.nvtx._timeline import Timeline
    path = str(tmp_path / 'trace.json')
    (tmp_path / 'trace.png').write_bytes(b'an earlier run')
    Timeline().save(path)                   # no step: no chart
    assert sorted(p.name for p in tmp_path.iterdir()) == ['trace.json', 'trace.txt']


@pytest.mark.parametrize('window, said', [
    ('100:120', 'the run ended at iteration 5, before the window opened: nothing was captured'),
    ('4:9', 'the run ended at iteration 5, inside the window: its capture range was left open'),
    ('2:5', None)])
def test_a_capture_window_the_run_does_not_reach_is_said(tmp_path, monkeypatch, window, said):
    # a new-user trial: FASTCHAIN_CAPTURE=100:120 on a 15-step run said nothing,
    # and nsys would have recorded nothing
    from fastchain.config import FastchainWarning
    monkeypatch.setenv('FASTCHAIN_CAPTURE', window)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        train(tmp_path, iterations=5, timeline=str(tmp_path / 'trace.json'))
    ours = [str(w.message) for w in caught if issubclass(w.category, FastchainWarning)
            and 'FASTCHAIN_CAPTURE' in str(w.message)]
    assert len(ours) == (0 if said is None else 1), ours
    if said is not None:
        assert ours[0].startswith('fastchain: FASTCHAIN_CAPTURE={}: '.format(window))
        assert said in ours[0]


def test_a_run_that_fails_says_nothing_of_the_capture_window(tmp_path, monkeypatch):
    # its own error is what it ends with (a warning turned into an error
    # would have replaced it)
    monkeypatch.setenv('FASTCHAIN_CAPTURE', '100:120')

    def fail(trainer):
        raise RuntimeError('the run fails on purpose')
    with warnings.catch_warnings():
        warnings.simplefilter('error', fastchain.FastchainWarning)
        with pytest.raises(RuntimeError, match='on purpose'):
            train(tmp_path, iterations=5, timeline=str(tmp_path / 't.json'),
                  extend=lambda trainer: trainer.extend(fail, trigger=(2, 'iteration')))
    for h in fastchain.active_handles():
        h.disable()


def test_the_last_step_of_a_capture_window_keeps_its_extensions():
    """The capture range closes inside the window's last step, before its
    extensions run: they sit a level above that step and were dropped."""
    ms = 1_000_000
    ranges, t = [], 0
    for i in range(6):
        rs, t = step(t, PHASES_10MS, extension=5 * ms)
        inside = 1 <= i <= 4           # the window: steps 2 to 5
        ranges += [r._replace(depth=r.depth + (inside and (r.category != 'extension'
                                                           or i < 4)))
                   for r in rs]
    # from step 2's start to step 5's end (steps of 10 ms, each with 5 ms of extension)
    ranges.append(Range('capture', 'step', 1, 15 * ms, 70 * ms, 0))
    result = _summary.summarize(ranges, skip=0)
    assert [s['extension'] for s in result['per_step']] == [5 * ms] * 6


def test_a_steps_extensions_end_at_the_next_step_of_its_own_thread():
    """Another thread's steps (a second updater in a thread, another process
    of an export) do not cut a step's extensions off."""
    ms = 1_000_000
    ranges = steps(4, PHASES_10MS, extension=3 * ms)
    for i in range(4):       # thread 3's steps start while thread 1's extensions run
        rs, _ = step(i * 13 * ms + 11 * ms, [('forward', 1 * ms)], thread=3)
        ranges += rs
    result = _summary.summarize(ranges, skip=0)
    ones = [s for s in result['per_step'] if s['window'][0] % (13 * ms) == 0]
    assert [s['extension'] for s in ones] == [3 * ms] * 4


def _idle_by_scanning(per_step, kernels):
    """The device-idle figure as it was computed: every kernel for every step."""
    import statistics
    kernels = sorted(kernels)
    idle = []
    for s in per_step:
        lo, hi = s['window']
        busy, cursor = 0, lo
        for k0, k1 in kernels:
            if k0 >= hi:
                break
            a, b = max(k0, cursor), min(k1, hi)
            if b > a:
                busy += b - a
                cursor = b
        idle.append(1 - busy / max(1, hi - lo))
    return statistics.median(idle)


@given(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 6)), min_size=1, max_size=10),
       st.lists(st.tuples(st.integers(-5, 250), st.integers(0, 30)), max_size=30),
       st.lists(st.tuples(st.integers(-5, 250), st.integers(0, 9)), max_size=12))
@settings(max_examples=150, deadline=None)
def test_device_idle_and_allreduce_on_device_by_bisection_as_by_scanning(
        shapes, kernels, launches):
    """Each step looks only at the kernels and launches in its window (the
    scan of all of them for every step grew with the square of a run's
    steps: seconds for a thousand, minutes for ten thousand)."""
    from fastchain.nvtx._summary import DeviceRange
    ranges, t = [], 0
    for forward, extension in shapes:
        rs, t = step(t, [('forward', forward)], extension=extension)
        ranges += rs
    kernels = [(a, a + n) for a, n in kernels]
    device = [DeviceRange('nccl', 'allreduce', 'GPU 0', a, a + n, a) for a, n in launches]
    result = _summary.summarize(ranges, kernels=kernels or None, skip=0, device=device)
    if kernels:
        assert result['device_idle'] == pytest.approx(
            _idle_by_scanning(result['per_step'], kernels), abs=1e-12)
    for s in result['per_step']:
        lo, hi = s['window']
        assert s['allreduce_device'] == sum(n for a, n in launches if lo <= a <= hi)
