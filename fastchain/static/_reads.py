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
_recording = {}         # thread id -> reads found there ('file:line')
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


@contextlib.contextmanager
def watching():
    """Inside: reads of variables' values by user code on this thread are
    listed in the yielded list as ``'file:line'`` (the first few)."""
    import chainer
    me = threading.get_ident()
    if me in _recording:        # nested (a chain cached inside a cached chain)
        yield _recording[me]
        return
    reads = []
    with _lock:
        if not _recording:
            for name in _GETTERS:
                _patches.wrap(chainer.Variable, name, 'static_graph', _getter_layer)
        _recording[me] = reads
    try:
        yield reads
    finally:
        with _lock:
            del _recording[me]
            if not _recording:
                for name in _GETTERS:
                    _patches.unwrap(chainer.Variable, name, 'static_graph')


def reason(reads):
    return ("the model is not static: its forward reads a variable's values in Python "
            '({}): what it computes from them (a branch, a constant) would be replayed '
            'from the first batch on every later one. Compute it with chainer.functions '
            'instead, or leave this model uncached'.format(', '.join(reads)))
