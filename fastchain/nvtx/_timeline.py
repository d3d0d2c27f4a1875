"""fastchain's own recorder of its ranges, for users without Nsight Systems.

It receives the same push/pop/mark calls as NVTX, keeps them in memory with
``time.perf_counter_ns`` timestamps, and writes a Chrome-trace JSON (opens in
Perfetto or chrome://tracing), a PNG chart of the per-phase time of a step,
and the summary of :mod:`fastchain.nvtx._summary` (median per-step figures;
one-off events such as a snapshot or an evaluation listed by name and
duration, and hatched and named in the chart).

Device work the host only launches (the NCCL allreduce of a gradient bucket,
on its own stream, which the compute stream waits for without the host) is
timed with a pair of CUDA events per launch through a :class:`DeviceTrack`
and placed on the host clock through an anchor: one event recorded on the
stream and waited for by the host, once per track, so a device time is the
anchor's host time plus the events' elapsed time (exact to the
synchronisation's latency, microseconds, and to CUDA's event resolution,
about half a microsecond). The events are read when the trace or the summary
is made, not in the step.
"""

import json
import os
import threading
import time

from fastchain.nvtx import _chart, _summary
from fastchain.nvtx._annotator import CATEGORIES


class Timeline:
    """Records ranges (name, category, thread, start, end) and marks."""

    def __init__(self):
        self.ranges = []        # _summary.Range
        self.marks = []         # (name, category, thread, time)
        self._stacks = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.saved = None       # what save() wrote
        self.device_ranges = []     # _summary.DeviceRange, resolved
        self._device_pending = []   # (name, category, track, start, end events, launched)
        # False when written as a job is aborted: a device stream stuck on a
        # dead peer would block the wait for ever; work not done is left out
        self.wait_device = True

    def push(self, name, category):
        tid = threading.get_ident()
        stack = self._stacks.setdefault(tid, [])
        stack.append((name, category, time.perf_counter_ns()))

    def pop(self):
        end = time.perf_counter_ns()
        tid = threading.get_ident()
        stack = self._stacks.get(tid)
        if not stack:
            return
        name, category, start = stack.pop()
        with self._lock:
            self.ranges.append(_summary.Range(name, category, tid, start, end, len(stack)))

    def mark(self, name, category):
        with self._lock:
            self.marks.append((name, category, threading.get_ident(), time.perf_counter_ns()))

    def device_range(self, name, category, track, start_event, end_event, launched):
        """Device work between two timing events of ``track`` (a
        :class:`DeviceTrack`), launched by the host at ``launched`` (ns)."""
        with self._lock:
            self._device_pending.append((name, category, track, start_event, end_event,
                                         launched))

    def resolve_device(self):
        """Reads the pending device events (waiting for each to complete) into
        :attr:`device_ranges`. Called by the trace and the summary."""
        with self._lock:
            pending, self._device_pending = self._device_pending, []
        for name, category, track, start, end, launched in pending:
            if not self.wait_device and not end.done:
                continue
            end.synchronize()
            self.device_ranges.append(_summary.DeviceRange(
                name, category, track.label, track.host_ns(start), track.host_ns(end),
                launched))
        return self.device_ranges

    def chrome_trace(self):
        """The Trace Event Format dict (times in microseconds). Device work
        has a track of its own per stream, after the host's threads."""
        events = []
        device = self.resolve_device()
        threads = sorted({r.thread for r in self.ranges} | {m[2] for m in self.marks})
        tid_of = {t: i for i, t in enumerate(threads)}
        for r in sorted(self.ranges, key=lambda r: (r.start, -r.end)):
            events.append({'name': r.name, 'cat': r.category, 'ph': 'X',
                           'ts': r.start / 1e3, 'dur': (r.end - r.start) / 1e3,
                           'pid': self._pid, 'tid': tid_of[r.thread],
                           'cname': _chrome_colour(r.category)})
        for name, category, thread, t in self.marks:
            events.append({'name': name, 'cat': category, 'ph': 'i', 's': 't',
                           'ts': t / 1e3, 'pid': self._pid, 'tid': tid_of[thread]})
        for thread, i in tid_of.items():
            label = 'main' if thread == threading.main_thread().ident else 'thread {}'.format(i)
            events.append({'name': 'thread_name', 'ph': 'M', 'pid': self._pid, 'tid': i,
                           'args': {'name': label}})
        tracks = {}
        for d in sorted(device, key=lambda d: d.start):
            tid = tracks.setdefault(d.track, len(tid_of) + len(tracks))
            events.append({'name': d.name, 'cat': d.category, 'ph': 'X',
                           'ts': d.start / 1e3, 'dur': (d.end - d.start) / 1e3,
                           'pid': self._pid, 'tid': tid, 'cname': _chrome_colour(d.category),
                           'args': {'launched_us': d.launched / 1e3}})
        for label, tid in tracks.items():
            events.append({'name': 'thread_name', 'ph': 'M', 'pid': self._pid, 'tid': tid,
                           'args': {'name': label}})
        return {'traceEvents': events, 'displayTimeUnit': 'ms',
                'otherData': {'source': 'fastchain timeline', 'domain': 'fastchain'}}

    def open_ranges(self):
        """(name, category) of the ranges pushed and not popped yet, outermost
        first: at save time, a sign of unbalanced push/pop calls."""
        return [(name, category) for stack in list(self._stacks.values())
                for name, category, _ in stack]

    def summary(self, skip=1):
        device = self.resolve_device()
        result = _summary.summarize(self.ranges, skip=skip, device=device or None)
        result['unclosed'] = self.open_ranges()
        from fastchain.backends import cuda
        result['host_time_on_gpu'] = cuda.available()      # the phases' caveat there
        return result

    def save(self, path, skip=1):
        """Write ``path`` (JSON trace), ``path`` with .png (chart) and .txt
        (summary). Returns the summary; ``self.saved`` holds it too, with the
        paths written (``png`` is None where no chart could be drawn)."""
        with open(path, 'w') as f:
            json.dump(self.chrome_trace(), f)
        result = self.summary(skip=skip)
        base = os.path.splitext(path)[0]
        with open(base + '.txt', 'w') as f:
            f.write(_summary.format_summary(result) + '\n')
        png = _chart.plot(result, base + '.png')
        if png is None and os.path.exists(base + '.png'):
            # an earlier run's chart would sit beside this run's trace and
            # summary as if it were theirs (a new-user trial read it so)
            os.remove(base + '.png')
        self.saved = {'summary': result, 'json': path, 'txt': base + '.txt', 'png': png}
        return result


class DeviceTrack:
    """Times launches on one CUDA stream for a :class:`Timeline`:
    ``token = track.begin()`` before the launch, ``track.end(token, name,
    category)`` after it (both record a timing event on the stream). The
    first ``begin`` anchors the stream to the host clock (module docstring)."""

    def __init__(self, timeline, label, stream):
        self.timeline = timeline
        self.label = label
        self.stream = stream
        self._anchor = None         # (event, host ns)

    def begin(self):
        launched = time.perf_counter_ns()
        if self._anchor is None:
            event = self.stream.record()
            event.synchronize()
            self._anchor = (event, time.perf_counter_ns())
        return self.stream.record(), launched

    def end(self, token, name, category, event=None):
        """``event``: one already recorded on the stream right after the
        launch (it then serves both the caller and the timeline)."""
        start, launched = token
        end = event if event is not None else self.stream.record()
        self.timeline.device_range(name, category, self, start, end, launched)
        return end

    def host_ns(self, event):
        import cupy
        anchor, host = self._anchor
        return host + int(round(cupy.cuda.get_elapsed_time(anchor, event) * 1e6))


def _chrome_colour(category):
    # Chrome's tracing viewer only takes its own palette names; keep one per
    # category so the trace reads like the nsys timeline.
    palette = {'step': 'grey', 'data': 'good', 'convert': 'thread_state_runnable',
               'forward': 'rail_response', 'backward': 'rail_animation',
               'allreduce': 'rail_idle', 'loss_scale': 'bad', 'update': 'rail_load',
               'extension': 'generic_work', 'link': 'yellow', 'mark': 'terrible'}
    return palette.get(category, 'generic_work') if category in CATEGORIES else 'generic_work'
