"""Reads of array values from Python while a cached chain is recorded.

The cache replays the graph recorded on the first batch of a key. A forward
that reads a variable's values in Python (``float(h.array.mean())``,
``if x.data.max() > 0``, ``int(n.array)``) can compute from them a branch or a
constant that the replay then freezes; the verified steps catch it only if
the data happen to change the result within them. So while a schedule is
recorded, the ``array`` and ``data`` getters of Chainer's Variable carry a
``static_graph`` layer that notes where such a read comes from; a read by
the model's own code (outside Chainer and fastchain), on the recording
thread, makes the cache refuse the model, naming the line. A read that only
takes the array's ``shape``, ``ndim``, ``dtype`` or ``size``
(``h.data.shape[0]``) is not a read of values (the reader's next bytecode
instruction tells); ``Variable.item()`` counts as a read by its caller.

``chainer.report`` is watched the same way: a replay runs none of the
forward's Python, so what a cached forward reports (``chainer.report({'h':
F.mean(h)}, self)``) was missing from the observation from the first
unverified replay on, silently (LogReport's entry simply vanished). A call of
``chainer.report``, ``chainer.reporter.report`` or ``Reporter.report`` while
a schedule is recorded makes the cache refuse the model, naming the line.
"""

import contextlib
import dis
import os
import sys
import threading

from fastchain.config import _patches

_GETTERS = ('array', 'data')
_VARIABLE = os.path.join('chainer', 'variable.py')
_NOT_VALUES = frozenset({'shape', 'ndim', 'dtype', 'size', 'itemsize', 'nbytes', 'device'})
_lock = threading.Lock()
_recording = {}         # thread id -> reads found there ('file:line'), .reports too
_next = {}              # code object -> {instruction offset: (opname, argval) after it}


def _folders():
    import chainer
    import fastchain
    libraries = tuple(os.path.dirname(m.__file__) + os.sep for m in (chainer, fastchain))
    return libraries, os.path.dirname(_patches.__file__) + os.sep


def _next_instruction(frame):
    code = frame.f_code
    table = _next.get(code)
    if table is None:
        if len(_next) > 1000:
            _next.clear()
        found = list(dis.get_instructions(code))
        table = _next[code] = {a.offset: (b.opname, b.argval)
                               for a, b in zip(found, found[1:])}
    return table.get(frame.f_lasti, (None, None))


def _getter_layer(next_, variable):
    reads = _recording.get(threading.get_ident())
    if reads is not None and len(reads) < 3:
        libraries, dispatch = _folders()
        # The reader: the frame that used the getter (above the dispatcher).
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(dispatch):
            frame = frame.f_back
        if frame is not None and frame.f_code.co_name == 'item' and \
                frame.f_code.co_filename.endswith(_VARIABLE):
            frame = frame.f_back        # Variable.item(): its caller reads the value
        if frame is not None and not frame.f_code.co_filename.startswith(libraries):
            opname, argval = _next_instruction(frame)
            if not (opname in ('LOAD_ATTR', 'LOAD_METHOD') and argval in _NOT_VALUES):
                where = '{}:{}'.format(os.path.basename(frame.f_code.co_filename),
                                       frame.f_lineno)
                if where not in reads:
                    reads.append(where)
    return next_(variable)


def _report_layer(next_, *args, **kwargs):
    found = _recording.get(threading.get_ident())
    if found is not None:
        _note_report(found)
        if found.stand_in is not None and args and args[0] is found.stand_in:
            return None     # no reporter of the user's was current: nothing to report to
    return next_(*args, **kwargs)


def _note_report(found):
    if len(found.reports) < 3:
        _, dispatch = _folders()
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith(dispatch)
                                     or frame.f_code.co_filename in (__file__, _reporter())):
            frame = frame.f_back
        if frame is not None:
            where = '{}:{}'.format(os.path.basename(frame.f_code.co_filename), frame.f_lineno)
            if where not in found.reports:
                found.reports.append(where)


def _reporter():
    import chainer.reporter
    return chainer.reporter.__file__


class Found(list):
    """The reads of values found (``'file:line'``); ``reports``: the calls
    of ``chainer.report`` found."""

    def __init__(self):
        super().__init__()
        self.reports = []
        self.stand_in = None    # the reporter made current while none of the user's is


def _report_points():
    import chainer
    import chainer.reporter
    return ((chainer.reporter, 'report'), (chainer, 'report'), (chainer.Reporter, 'report'))


@contextlib.contextmanager
def watching():
    """Inside: reads of variables' values by user code on this thread are
    listed in the yielded list as ``'file:line'`` (the first few), calls of
    ``chainer.report`` in its ``reports``."""
    import chainer
    me = threading.get_ident()
    if me in _recording:        # nested (a chain cached inside a cached chain)
        yield _recording[me]
        return
    found = Found()
    with _lock:
        if not _recording:
            for name in _GETTERS:
                _patches.wrap(chainer.Variable, name, 'static_graph', _getter_layer)
            for owner, name in _report_points():
                _patches.wrap(owner, name, 'static_graph', _report_layer)
        _recording[me] = found
    if not chainer.reporter._get_reporters():
        # A report with no reporter current does nothing, and calls nothing
        # a layer sees when its name was imported before the layer was put
        # on (``from chainer.reporter import report``); a later step may have
        # a reporter. A stand-in made current receives it (and drops it).
        found.stand_in = chainer.Reporter()
        found.stand_in.__enter__()
    try:
        yield found
    finally:
        if found.stand_in is not None:
            found.stand_in.__exit__(None, None, None)
        with _lock:
            del _recording[me]
            if not _recording:
                for name in _GETTERS:
                    _patches.unwrap(chainer.Variable, name, 'static_graph')
                for owner, name in _report_points():
                    _patches.unwrap(owner, name, 'static_graph')


def reason(reads):
    return ("the model is not static: its forward reads a variable's values in Python "
            '({}): what it computes from them (a branch, a constant) would be replayed '
            'from the first batch on every later one. Compute it with chainer.functions '
            'instead, or leave this model uncached'.format(', '.join(reads)))


def report_reason(reports):
    return ("the model reports values from inside its forward (chainer.report at {}): a "
            "replay runs none of the forward's Python, so from the first replay on they "
            'would be missing from the observation (LogReport, PrintReport). Report them '
            'outside the cached chain (from the loss function, as L.Classifier does around '
            'its predictor), or leave this model uncached'.format(', '.join(reports)))
