"""Emits fastchain's NVTX ranges: one domain, named categories, fixed colours.

Ranges go to the ``nvtx`` package, which hands them to whatever tool is
attached through NVTX's injection interface (Nsight Systems sets
``NVTX_INJECTION64_PATH``); with no tool attached its domain is a dummy and
each call costs a few hundred nanoseconds. When a :class:`Timeline` is
recording, every range is also kept in Python for fastchain's own trace.
"""

import contextlib
import threading

DOMAIN = 'fastchain'

# Category -> ARGB colour. Stable across runs so timelines compare at a glance.
CATEGORIES = {
    'step': 0xFF9E9E9E,         # one training iteration (updater.update)
    'data': 0xFF2CA02C,         # waiting for the next batch
    'convert': 0xFF17BECF,      # conversion and host-to-device copy
    'forward': 0xFF1F77B4,
    'backward': 0xFFFF7F0E,
    'allreduce': 0xFF9467BD,    # one gradient bucket
    'loss_scale': 0xFFD62728,   # the overflow check and the scale update
    'update': 0xFF8C564B,       # the optimizer update
    'extension': 0xFF7F7F7F,    # one trainer extension
    'link': 0xFFBCBD22,         # per-link forward/backward (optional)
    'mark': 0xFFE377C2,         # epoch boundaries, skipped steps
}


class Annotator:
    """push/pop/mark into the ``fastchain`` domain (and the timeline, if any)."""

    def __init__(self):
        import nvtx
        self._domain = nvtx.get_domain(DOMAIN)
        self._attributes = {}
        self._lock = threading.Lock()
        self._local = threading.local()     # depth, generation: per thread
        self.timeline = None

    def _attrs(self, message, category):
        key = (message, category)
        attrs = self._attributes.get(key)
        if attrs is None:
            with self._lock:
                attrs = self._domain.get_event_attributes(
                    message=message, color=CATEGORIES[category], category=category)
                self._attributes[key] = attrs
        return attrs

    def push(self, message, category):
        self._domain.push_range(self._attrs(message, category))
        local = self._local
        local.depth = getattr(local, 'depth', 0) + 1
        timeline = self.timeline
        if timeline is not None:
            timeline.push(message, category)

    def pop(self):
        local = self._local
        depth = getattr(local, 'depth', 0)
        if depth == 0:          # nothing of fastchain's is open in this thread
            return
        local.depth = depth - 1
        self._domain.pop_range()
        timeline = self.timeline
        if timeline is not None:
            timeline.pop()

    def depth(self):
        """How many of fastchain's ranges are open in this thread."""
        return getattr(self._local, 'depth', 0)

    def generation(self):
        """Counts the :meth:`unwind` calls that closed something in this
        thread: a range recorded under an older generation was closed by one."""
        return getattr(self._local, 'generation', 0)

    def unwind(self, depth):
        """Close this thread's ranges down to ``depth``: where an exception
        went through code that opens a range in one call and closes it in
        another (a link's forward, the backward range of ``update``), those
        left open are closed by the range around them, so the ranges after
        it nest as they would have."""
        if self.depth() <= depth:
            return
        while self.depth() > depth:
            self.pop()
        local = self._local
        local.generation = getattr(local, 'generation', 0) + 1

    def mark(self, message, category='mark'):
        self._domain.mark(self._attrs(message, category))
        timeline = self.timeline
        if timeline is not None:
            timeline.mark(message, category)

    @contextlib.contextmanager
    def range(self, message, category):
        self.push(message, category)
        depth = self.depth()
        try:
            yield
        finally:
            if self.depth() >= depth:       # not closed by a range around it
                self.unwind(depth)          # those left open inside
                self.pop()


_annotator = None
_annotator_lock = threading.Lock()


def annotator():
    """The process's :class:`Annotator` (made on first use, not at import)."""
    global _annotator
    if _annotator is None:
        with _annotator_lock:
            if _annotator is None:
                _annotator = Annotator()
    return _annotator
