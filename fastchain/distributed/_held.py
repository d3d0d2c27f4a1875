"""A data-parallel layer on a ``Trainer`` method, in force only while some
object needs it (a block learner: ``Trainer.run``; a multi-node snapshot:
``Trainer.serialize``), so that a process with none of them runs Chainer's
trainer untouched."""

import threading
import weakref

from fastchain.config import _patches


def _trainer():
    from chainer.training import trainer
    return trainer.Trainer


class HeldLayer:
    """The 'distributed' layer ``layer`` on ``Trainer.<name>``, installed at
    the first :meth:`acquire` and removed when the last object that
    acquired it is collected."""

    def __init__(self, name, layer):
        self._name = name
        self._layer = layer
        self._lock = threading.Lock()
        self._leases = set()

    def acquire(self, holder):
        """The layer, in force as long as ``holder`` lives."""
        token = object()
        with self._lock:
            self._leases.add(token)
            if len(self._leases) == 1:
                _patches.wrap(_trainer(), self._name, 'distributed', self._layer)
        weakref.finalize(holder, self._release, token)

    def _release(self, token):
        with self._lock:
            self._leases.discard(token)
            if not self._leases:
                _patches.unwrap(_trainer(), self._name, 'distributed')
