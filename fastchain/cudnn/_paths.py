"""Which path each cuDNN-able operation took, and why, for ``doctor`` and
``handle.report()``.

Per operation (:data:`fastchain.cudnn._keys.CONV_OPS` and ``BN_OPS``), the
calls per path (``'graph'``, ``'cupy-cudnn'``, ``'statistics'``, ``'chainer'``) and, for the
calls that did not take a graph, the reasons with their counts. Counting is
a dictionary update per call.
"""

import collections
import threading

_lock = threading.Lock()
calls = collections.defaultdict(collections.Counter)     # op -> path -> calls
reasons = collections.defaultdict(collections.Counter)   # op -> reason -> calls


def record(op, path, reason=None):
    with _lock:
        calls[op][path] += 1
        if reason is not None:
            reasons[op][reason] += 1


def summary():
    """``{op: {'paths': {path: calls}, 'reasons': {reason: calls}}}``."""
    with _lock:
        return {op: {'paths': dict(calls[op]), 'reasons': dict(reasons.get(op, {}))}
                for op in sorted(calls)}


def describe(summary):
    """One line per operation: 'conv forward: graph 212, chainer 4 (cover_all=True: 4)'."""
    lines = []
    for op, entry in summary.items():
        paths = ', '.join('{} {}'.format(p, n) for p, n in
                          sorted(entry['paths'].items(), key=lambda i: -i[1]))
        why = '; '.join('{}: {}'.format(r, n) for r, n in
                        sorted(entry['reasons'].items(), key=lambda i: -i[1]))
        lines.append('{}: {}{}'.format(op, paths, ' ({})'.format(why) if why else ''))
    return lines


def forget():
    with _lock:
        calls.clear()
        reasons.clear()
