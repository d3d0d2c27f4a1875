"""Reads of array values from Python while a cached chain is recorded.

The cache replays the graph recorded on the first batch of a key. A forward
that reads a variable's values in Python (``float(h.array.mean())``,
``if x.data.max() > 0``, ``int(n.array)``) can compute from them a branch or a
constant that the replay then freezes; the verified steps catch it only if
the data happen to change the result within them. So while a schedule is
recorded, the ``array`` and ``data`` getters of Chainer's Variable carry a
``static_graph`` layer that notes where such a read comes from; a read from
outside Chainer and fastchain (the model's own code) makes the cache refuse
the model, naming the line. Reads of shapes and dtypes (``x.shape``) are not
reads of values and are not watched; ``Variable.item()`` is counted as a read
by its caller.
"""

import contextlib
import os
import sys

from fastchain.config import _patches

_GETTERS = ('array', 'data')
_VARIABLE = os.path.join('chainer', 'variable.py')


def _folders():
    import chainer
    import fastchain
    from fastchain.config import _patches
    libraries = tuple(os.path.dirname(m.__file__) + os.sep for m in (chainer, fastchain))
    return libraries, os.path.dirname(_patches.__file__) + os.sep


@contextlib.contextmanager
def watching():
    """Inside: reads of variables' values by user code are listed in the
    yielded list as ``'file:line'`` (the first few)."""
    import chainer
    libraries, dispatch = _folders()
    reads = []

    def getter_layer(next_, variable):
        # The reader: the frame that used the getter (above the dispatcher).
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(dispatch):
            frame = frame.f_back
        if frame is not None and frame.f_code.co_name == 'item' and \
                frame.f_code.co_filename.endswith(_VARIABLE):
            frame = frame.f_back        # Variable.item(): its caller reads the value
        if frame is not None and not frame.f_code.co_filename.startswith(libraries) \
                and len(reads) < 3:
            where = '{}:{}'.format(os.path.basename(frame.f_code.co_filename),
                                   frame.f_lineno)
            if where not in reads:
                reads.append(where)
        return next_(variable)

    for name in _GETTERS:
        _patches.wrap(chainer.Variable, name, 'static_graph', getter_layer)
    try:
        yield reads
    finally:
        for name in _GETTERS:
            _patches.unwrap(chainer.Variable, name, 'static_graph')


def reason(reads):
    return ("the model is not static: its forward reads a variable's values in Python ({}): what it computes "
            'from them (a branch, a constant) would be replayed from the first batch on '
            'every later one. Compute it with chainer.functions instead, or leave this '
            'model uncached'.format(', '.join(reads)))
