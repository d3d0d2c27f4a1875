"""Device time of the NCCL allreduce in the timeline: timing events on the
NCCL stream (stand-ins for CuPy's streams and events: no GPU here), placed on
the host clock through an anchor, shown on a device track of the trace and
counted per step in the summary; and the same from an nsys export's NCCL
kernels."""

import os
import sqlite3
import sys
import types

import pytest

from fastchain.distributed import _nccl
from fastchain.nvtx import _annotator, _summary
from fastchain.nvtx._timeline import Timeline

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..')
sys.path.insert(0, os.path.join(ROOT, 'profiling'))
import summarize  # noqa: E402

MS = 1_000_000


class Clock:
    """The device's clock: an event completes at the time the stream has
    reached when it is recorded (each launch advances it)."""

    def __init__(self, offset):
        self.now = offset       # device ns; the host clock is unrelated
        self.synchronized = 0


class Event:
    def __init__(self, clock, t):
        self.clock, self.t = clock, t

    def synchronize(self):
        self.clock.synchronized += 1


class Stream:
    ptr = 7

    def __init__(self, clock):
        self.clock = clock
        self.recorded = []
        self.waits = []

    def record(self):
        event = Event(self.clock, self.clock.now)
        self.recorded.append(event)
        return event

    def wait_event(self, event):
        self.waits.append(event)


@pytest.fixture
def fake_cupy(monkeypatch):
    clock = Clock(offset=10 ** 12)
    compute = Stream(clock)
    cupy = types.ModuleType('cupy')
    cupy.cuda = types.SimpleNamespace(
        get_current_stream=lambda: compute,
        get_elapsed_time=lambda a, b: (b.t - a.t) / 1e6)
    nccl = types.SimpleNamespace(NCCL_SUM=0, NCCL_FLOAT16=6, NCCL_FLOAT32=7, NCCL_FLOAT64=8,
                                 NCCL_UINT8=1)
    cupy.cuda.nccl = nccl
    monkeypatch.setitem(sys.modules, 'cupy', cupy)
    monkeypatch.setitem(sys.modules, 'cupy.cuda', cupy.cuda)
    monkeypatch.setitem(sys.modules, 'cupy.cuda.nccl', nccl)
    return clock


class FakeNccl:
    """allReduce takes 3 ms of device time on the stream it is given."""

    def __init__(self, clock):
        self.clock = clock
        self.calls = 0

    def allReduce(self, send, recv, count, dtype, op, stream):
        self.calls += 1
        self.clock.now += 3 * MS


class Array:
    size = 10
    dtype = types.SimpleNamespace(name='float32')
    data = types.SimpleNamespace(ptr=1)


def communicator(clock):
    comm = object.__new__(_nccl.NcclCommunicator)
    comm._nccl = FakeNccl(clock)
    comm._stream = Stream(clock)
    comm._track = None
    comm.intra_rank = 0
    return comm


@pytest.fixture
def recording(monkeypatch):
    """fastchain's annotator with a timeline attached (as enable(timeline=...) does)."""
    timeline = Timeline()
    fake = types.SimpleNamespace(timeline=timeline)
    monkeypatch.setattr(_annotator, '_annotator', fake)
    return timeline


def test_an_allreduce_is_timed_on_the_nccl_stream_while_a_timeline_records(
        fake_cupy, recording):
    comm = communicator(fake_cupy)
    recording.push('step', 'step')
    event, what = comm.allreduce_start(Array(), 'allreduce of gradient bucket 0 (1.0 MB)')
    fake_cupy.now += 5 * MS                     # other work on the NCCL stream
    comm.allreduce_start(Array(), 'allreduce of gradient bucket 1 (1.0 MB)')
    recording.pop()
    # The event handed back for the wait is the timeline's end event.
    assert event is comm._stream.recorded[-3]
    assert fake_cupy.synchronized == 1          # the anchor, once; no event read yet
    (first, second) = recording.resolve_device()
    assert [d.name for d in (first, second)] == [
        'allreduce of gradient bucket 0 (1.0 MB)', 'allreduce of gradient bucket 1 (1.0 MB)']
    assert {d.track for d in (first, second)} == {'NCCL stream (GPU 0)'}
    assert first.end - first.start == 3 * MS and second.end - second.start == 3 * MS
    assert second.start - first.end == 5 * MS   # device gaps kept on the host clock
    # The anchor is the stream's first event, at the same device time as the
    # first allreduce's start here: both map to the anchor's host time.
    anchor_event, anchor_host = comm._track._anchor
    assert anchor_event is comm._stream.recorded[0]
    assert first.start == anchor_host
    step = recording.ranges[0]
    assert step.start <= first.launched <= second.launched <= step.end


def test_no_timeline_no_timing_events(fake_cupy, monkeypatch):
    monkeypatch.setattr(_annotator, '_annotator', types.SimpleNamespace(timeline=None))
    comm = communicator(fake_cupy)
    comm.allreduce_start(Array(), 'bucket 0')
    assert len(comm._stream.recorded) == 1      # only the event the wait needs
    assert comm._track is None
    monkeypatch.setattr(_annotator, '_annotator', None)     # annotator never made
    comm.allreduce_start(Array(), 'bucket 1')
    assert len(comm._stream.recorded) == 2


def test_trace_has_a_device_track_and_the_summary_the_device_time(
        fake_cupy, recording, tmp_path):
    comm = communicator(fake_cupy)
    for i in range(3):
        recording.push('step', 'step')
        recording.push('backward', 'backward')
        comm.allreduce_start(Array(), 'allreduce of gradient bucket 0 (1.0 MB)')
        recording.pop()
        recording.pop()
    trace = recording.chrome_trace()
    names = {e['tid']: e['args']['name'] for e in trace['traceEvents']
             if e.get('name') == 'thread_name'}
    assert 'NCCL stream (GPU 0)' in names.values()
    device_tid = [t for t, n in names.items() if n == 'NCCL stream (GPU 0)'][0]
    on_device = [e for e in trace['traceEvents']
                 if e['tid'] == device_tid and e['ph'] == 'X']
    assert len(on_device) == 3 and all(e['dur'] == 3000.0 for e in on_device)
    summary = recording.save(str(tmp_path / 'timeline.json'), skip=0)
    assert summary['median_ms']['allreduce_device'] == pytest.approx(3.0)
    text = open(str(tmp_path / 'timeline.txt')).read()
    assert '(on device)' in text


def test_device_work_counts_in_the_step_that_launched_it():
    ranges = [_summary.Range('step', 'step', 1, 0, 10 * MS, 0),
              _summary.Range('forward', 'forward', 1, 0, 10 * MS, 1),
              _summary.Range('step', 'step', 1, 10 * MS, 20 * MS, 0),
              _summary.Range('forward', 'forward', 1, 10 * MS, 20 * MS, 1)]
    device = [
        # Launched in step 1, ran on the device during step 2: step 1's.
        _summary.DeviceRange('a', 'allreduce', 'gpu', 12 * MS, 16 * MS, 9 * MS),
        _summary.DeviceRange('b', 'allreduce', 'gpu', 17 * MS, 18 * MS, 15 * MS),
        _summary.DeviceRange('c', 'other', 'gpu', 11 * MS, 19 * MS, 15 * MS)]
    result = _summary.summarize(ranges, skip=0, device=device)
    assert [s['allreduce_device'] / MS for s in result['per_step']] == [4.0, 1.0]
    assert result['median_ms']['allreduce_device'] == pytest.approx(2.5)
    assert 'allreduce_device' not in _summary.summarize(ranges, skip=0)['median_ms']


def nsys_export(path, runtime=True):
    db = sqlite3.connect(path)
    db.executescript('''
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL,
            deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,
            correlationId INTEGER, globalPid INTEGER, shortName INTEGER NOT NULL);
    ''')
    db.executemany('INSERT INTO StringIds VALUES (?, ?)',
                   [(1, 'ncclDevKernel_AllReduce_Sum_f32_RING_LL'), (2, 'sgemm_128x64')])
    pid = 4242 << 24
    db.executemany('INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, ?, ?, ?, ?)', [
        (2 * MS, 8 * MS, 7, 11, pid, 2),        # a GEMM: not an allreduce
        (12 * MS, 16 * MS, 21, 12, pid, 1),     # NCCL, launched at 9 ms
        (25 * MS, 26 * MS, 21, 13, pid, 1)])    # NCCL, launched at 15 ms
    if runtime:
        db.executescript('''CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL,
            end INTEGER NOT NULL, eventClass INTEGER, globalTid INTEGER,
            correlationId INTEGER, nameId INTEGER);''')
        db.executemany('INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, 0)', [
            (1 * MS, 1 * MS + 10, pid | 5, 11), (9 * MS, 9 * MS + 10, pid | 5, 12),
            (15 * MS, 15 * MS + 10, pid | 5, 13),
            # The same correlation id in another process of the report.
            (19 * MS, 19 * MS + 10, (4343 << 24) | 5, 13)])
    db.commit()
    return db


def test_nsys_nccl_kernels_are_device_allreduce_counted_at_their_launch(tmp_path):
    db = nsys_export(str(tmp_path / 'r.sqlite'))
    device = summarize.read_device(db)
    assert [(d.start, d.end, d.launched) for d in device] == [
        (12 * MS, 16 * MS, 9 * MS), (25 * MS, 26 * MS, 15 * MS)]
    assert device[0].track == 'GPU 0 stream 21'
    db = nsys_export(str(tmp_path / 'no-runtime.sqlite'), runtime=False)
    assert [d.launched for d in summarize.read_device(db)] == [12 * MS, 25 * MS]


def test_on_a_gpu_the_summary_says_its_phases_are_host_time(monkeypatch):
    """Where a GPU is in use the phases are host time (kernels run
    asynchronously): the text says so and qualifies the diagnosis."""
    from fastchain.backends import cuda
    from fastchain.nvtx import _summary
    ranges = [_summary.Range('step', 'step', 1, 0, 10_000_000, 0),
              _summary.Range('forward', 'forward', 1, 0, 6_000_000, 1)]
    result = _summary.summarize(ranges, skip=0)
    plain = _summary.format_summary(result)
    assert 'host time' not in plain and '\ndiagnosis: ' in plain
    result['host_time_on_gpu'] = True
    text = _summary.format_summary(result)
    assert _summary.HOST_TIME_NOTE in text and '\ndiagnosis (host time): ' in text
    # the timeline sets it from the device probe
    monkeypatch.setattr(cuda, 'available', lambda: True)
    from fastchain.nvtx._timeline import Timeline
    timeline = Timeline()
    timeline.ranges = ranges
    assert timeline.summary(skip=0)['host_time_on_gpu'] is True


def test_a_timeline_written_at_an_abort_leaves_out_device_work_not_done():
    """An aborted job writes its timeline without waiting for the device: a
    stream stuck on a dead peer would block that wait for ever (a reviewer's
    finding); the work not done is left out, the rest is placed."""
    class Stuck:
        done = False

        def synchronize(self):
            raise AssertionError('waited for a stream that never finishes')

    class Done:
        done = True

        def __init__(self, t):
            self.t = t

        def synchronize(self):
            pass
    track = types.SimpleNamespace(label='NCCL stream', host_ns=lambda event: event.t)
    timeline = Timeline()
    timeline.device_range('bucket 0', 'allreduce', track, Done(10), Done(20), 5)
    timeline.device_range('bucket 1', 'allreduce', track, Done(30), Stuck(), 25)
    timeline.wait_device = False
    assert [(d.name, d.start, d.end) for d in timeline.resolve_device()] == [
        ('bucket 0', 10, 20)]
    timeline.device_range('bucket 2', 'allreduce', track, Done(40), Stuck(), 35)
    timeline.wait_device = True
    with pytest.raises(AssertionError, match='never finishes'):
        timeline.resolve_device()
