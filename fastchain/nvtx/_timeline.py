"""fastchain's own recorder of its ranges, for users without Nsight Systems.

It receives the same push/pop/mark calls as NVTX, keeps them in memory with
``time.perf_counter_ns`` timestamps, and writes a Chrome-trace JSON (opens in
Perfetto or chrome://tracing), a PNG chart of the per-phase time of a step,
and the summary of :mod:`fastchain.nvtx._summary` (median per-step figures;
one-off events such as a snapshot or an evaluation listed by name and
duration, and hatched and named in the chart).
"""

import json
import os
import threading
import time

from fastchain.nvtx import _summary
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

    def chrome_trace(self):
        """The Trace Event Format dict (times in microseconds)."""
        events = []
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
        return {'traceEvents': events, 'displayTimeUnit': 'ms',
                'otherData': {'source': 'fastchain timeline', 'domain': 'fastchain'}}

    def open_ranges(self):
        """(name, category) of the ranges pushed and not popped yet, outermost
        first: at save time, a sign of unbalanced push/pop calls."""
        return [(name, category) for stack in list(self._stacks.values())
                for name, category, _ in stack]

    def summary(self, skip=1):
        result = _summary.summarize(self.ranges, skip=skip)
        result['unclosed'] = self.open_ranges()
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
        png = _summary.plot(result, base + '.png')
        self.saved = {'summary': result, 'json': path, 'txt': base + '.txt', 'png': png}
        return result


def _chrome_colour(category):
    # Chrome's tracing viewer only takes its own palette names; keep one per
    # category so the trace reads like the nsys timeline.
    palette = {'step': 'grey', 'data': 'good', 'convert': 'thread_state_runnable',
               'forward': 'rail_response', 'backward': 'rail_animation',
               'allreduce': 'rail_idle', 'loss_scale': 'bad', 'update': 'rail_load',
               'extension': 'generic_work', 'link': 'yellow', 'mark': 'terrible'}
    return palette.get(category, 'generic_work') if category in CATEGORIES else 'generic_work'
