"""The NCCL communicator's wait, with stand-ins for CuPy's streams and events
(no GPU here): the compute stream waits on the allreduce's event without a
host synchronisation, and a watchdog keeps the deadline."""

import sys
import types

import pytest

from fastchain.distributed import _nccl


class Event:
    def __init__(self):
        self.finished = False
        self.queried = 0

    @property
    def done(self):
        self.queried += 1
        return self.finished


class Comm:
    timeout = 5.0
    intra_rank = 0

    def __init__(self):
        self.aborted, self.checked = [], []

    def abort_timeout(self, what):
        self.aborted.append(what)

    def check_peers(self, what, since, peer=None):
        self.checked.append(what)


@pytest.fixture
def fake_cupy(monkeypatch):
    waits = []
    stream = types.SimpleNamespace(wait_event=waits.append)
    cupy = types.ModuleType('cupy')
    cupy.cuda = types.SimpleNamespace(get_current_stream=lambda: stream)
    monkeypatch.setitem(sys.modules, 'cupy', cupy)
    return waits


def test_waiting_for_an_allreduce_is_a_stream_dependency_not_a_host_wait(fake_cupy):
    comm = object.__new__(_nccl.NcclCommunicator)
    comm._pending = _nccl._Pending(Comm())
    comm._pending.thread = object()     # no watchdog thread in this test
    event = Event()
    comm.allreduce_wait((event, 'allreduce of gradient bucket 0'))
    assert fake_cupy == [event]         # the compute stream waits on it
    assert event.queried == 0           # and the host did not
    assert [e[1] for e in comm._pending.events] == ['allreduce of gradient bucket 0']


def test_the_watchdog_drops_what_completed_and_aborts_past_the_deadline(monkeypatch):
    watched = Comm()
    pending = _nccl._Pending(watched)
    pending.thread = object()
    done, stuck = Event(), Event()
    done.finished = True
    pending.add(done, 'bucket 0')
    pending.add(stuck, 'bucket 1')
    assert pending.look() == 1 and watched.aborted == []
    assert watched.checked == ['bucket 1']      # a peer that left is looked for
    now = _nccl.time.monotonic()
    monkeypatch.setattr(_nccl.time, 'monotonic', lambda: now + watched.timeout + 1)
    pending.look()
    assert watched.aborted == ['bucket 1']
    stuck.finished = True
    assert pending.look() == 0


def test_a_host_array_given_to_nccl_is_named_with_the_fix():
    """A model not yet on the GPU when its optimizer is made data-parallel
    used to fail inside CuPy ('memoryview' has no 'ptr')."""
    import numpy
    comm = object.__new__(_nccl.NcclCommunicator)
    with pytest.raises(TypeError, match=r'the nccl communicator works on CuPy arrays on the '
                                        r'GPU, not ndarray \(move the model to comm.device\(\)'):
        comm._dtype(numpy.zeros(3, numpy.float32))
