"""Device prefetch: batch k+1 is fetched, converted and copied while batch k
computes.

A background thread pulls from the iterator and runs the converter; the
training loop gets batches whose arrays are already on the device. On a GPU
the conversion runs on a side stream and the training stream waits on an
event before using the arrays (the thin CUDA edge below); on the CPU the
thread alone gives the overlap.

The thread fetches a batch ahead only where the iterator says that changes
nothing (``may_fetch_ahead()``): a batch whose ``next()`` draws from NumPy's
global RNG (the next epoch's order from an order sampler, as SerialIterator
draws it) is fetched and converted by the training loop's own call, at the
moment SerialIterator would fetch it; the thread then starts again after it.
"""

import queue
import threading

import numpy

import chainer
from chainer.dataset import convert
from chainer.dataset import iterator as iterator_module

from fastchain.data import _follow
from fastchain.data._edge import cuda_edge as _cuda_edge
from fastchain.data._errors import DataLoadError
from fastchain.data._transforms import Normalize

_END = object()
_HERE = object()        # the next batch is the training loop's to fetch


class PreparedBatch(list):
    """A batch (list of examples) whose converted arrays come with it."""

    arrays = None
    event = None
    stacked = None      # the loader's stacked arrays (``LoadedBatch.stacked``), kept

    @classmethod
    def of(cls, batch):
        prepared = cls(batch)
        prepared.stacked = getattr(batch, 'stacked', None)
        return prepared


class _Passthrough(convert.Converter):
    """The converter to give the updater: prepared batches pass through."""

    def __init__(self, converter, edge=None):
        self.converter = converter
        self.edge = edge

    def __call__(self, batch, device=None):
        if isinstance(batch, PreparedBatch) and batch.arrays is not None:
            if batch.event is not None:     # CUDA: the copy must be done
                self.edge.consume(batch)
            return batch.arrays
        return convert._call_converter(self.converter, batch, device)


class DevicePrefetcher(iterator_module.Iterator):
    """Wraps a fastchain iterator; each batch arrives already converted.

    Use ``prefetcher.converter`` as the updater's converter::

        it = DevicePrefetcher(MultiprocessIterator(train, 32), device=device)
        updater = StandardUpdater(it, optimizer, converter=it.converter,
                                  device=device)

    Args:
        iterator: a :class:`MultiprocessIterator`, or any iterator that
            :meth:`can_wrap` accepts (its position is what gets saved in
            snapshots: the prefetched batch is re-fetched on resume).
        converter: the converter to run ahead (default ``concat_examples``).
        device: where the arrays go (default: the current device).
        depth (int): batches prepared ahead, >= 1 (default 1).
        convert_ahead (bool): run the converter ahead, in the prefetch
            thread (default); False: only the batches are fetched ahead and
            the converter runs in the training loop, as in Chainer (for a
            converter that draws random numbers or keeps state: ahead, its
            draws would interleave with the model's otherwise). The thread
            sees the training thread's ``chainer.config`` as it was when it
            started.

    Attributes:
        skipped (list): with an iterator that skips bad examples, the ones
            the batches taken left out (the iterator's own list also has those
            of batches fetched ahead and given back, e.g. at a snapshot).

    .. note::
       Over a MultiprocessIterator with ``rng='global'`` (what
       ``fastchain.enable()`` puts in place of a SerialIterator), the batch
       that reaches the end of an epoch is not prepared ahead where fetching
       it draws the next order from the order sampler (NumPy's global RNG):
       that happens in the training loop's ``next()``, where SerialIterator
       draws it, and costs that batch's overlap. With ``n_workers=0`` there,
       no batch is prepared ahead (loading one may draw from that RNG too).
    """

    def __init__(self, iterator, converter=convert.concat_examples, device=None,
                 depth=1, convert_ahead=True):
        if not self.can_wrap(iterator):
            raise TypeError(
                'DevicePrefetcher needs an iterator with next(), serialize(), reset() '
                'and seek() (to give back what it read ahead), e.g. '
                'fastchain.data.MultiprocessIterator (n_workers=0 loads in this '
                'process); got {}'.format(type(iterator).__name__))
        if not callable(converter):
            raise TypeError('converter must be callable (batch, device) -> arrays, '
                            'got {!r}'.format(converter))
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError('depth (batches prepared ahead) must be an int >= 1, '
                             'got {!r}'.format(depth))
        self.iterator = iterator
        self.device = None if device is None else chainer.get_device(device)
        # Made here, not in the thread: a CUDA stream belongs to the device
        # current where it is made (the thread's is device 0).
        self._edge = _cuda_edge(self.device)
        self.converter = _Passthrough(converter, self._edge)
        self._convert = converter
        self.depth = depth
        self.convert_ahead = bool(convert_ahead)
        # what the batches taken left out (an iterator skipping bad examples
        # also lists those of batches fetched ahead and given back)
        self.skipped = []
        self._finalized = False
        self._ended = None          # the error the loading stopped at
        self._copy_state()
        self._start()

    @staticmethod
    def can_wrap(iterator):
        """Whether a DevicePrefetcher can wrap ``iterator``.

        It reads ahead, so it must be able to give back what the training
        loop did not use: the iterator needs ``seek(epoch, current_position,
        is_new_epoch, previous_epoch_detail)`` besides Chainer's ``next()``,
        ``serialize()`` and ``reset()``. :class:`MultiprocessIterator` has
        them; Chainer's own iterators have no ``seek``. An optional
        ``may_fetch_ahead()`` says when the next batch must be fetched by
        the training loop itself.
        """
        return all(callable(getattr(iterator, name, None))
                   for name in ('next', 'serialize', 'reset', 'seek'))

    @property
    def batch_size(self):
        return self.iterator.batch_size

    @batch_size.setter
    def batch_size(self, value):
        self.iterator.batch_size = value        # (fastchain's refuses another)

    def _copy_state(self, state=None):
        state = state or _state_of(self.iterator)
        (self.epoch, self.current_position, self.is_new_epoch,
         self.epoch_detail, self.previous_epoch_detail) = state

    def _start(self):
        """Start fetching ahead, unless the next batch is the consumer's."""
        self._queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = None
        if not self._may_fetch_ahead():
            return
        # chainer.config is per thread: the thread starts with this one's
        self._config = dict(vars(chainer.config._local))
        self._thread = threading.Thread(target=self._run, name='fastchain-prefetch', daemon=True)
        self._thread.start()

    def _may_fetch_ahead(self):
        ahead = getattr(self.iterator, 'may_fetch_ahead', None)
        return ahead is None or ahead()

    def _run(self):
        it = self.iterator
        edge = self._edge
        vars(chainer.config._local).update(self._config)
        try:
            while not self._stop.is_set():
                if not self._may_fetch_ahead():
                    self._put(_HERE)
                    return
                skipped = _skipped_of(it)
                try:
                    batch = PreparedBatch.of(it.next())
                except StopIteration:
                    self._put(_END)
                    return
                skipped = _left_out(it, skipped)
                if self.convert_ahead:
                    with edge() as done:
                        batch.arrays = convert._call_converter(self._convert, batch,
                                                               self.device)
                    batch.event = done.event
                # Chainer's reporter is per thread: what the iterator reported
                # here is reported again where the batch is taken
                if not self._put((batch, _state_of(it), skipped)):
                    return
        except BaseException as e:      # hand it to the training loop
            self._put(e)

    def _fetch_here(self):
        """The next batch, fetched and converted in the consumer's thread;
        then fetching ahead starts again where it may."""
        it = self.iterator
        skipped = _skipped_of(it)
        try:
            batch = PreparedBatch.of(it.next())
        except StopIteration:
            return _END         # (and again at the next call)
        if self.convert_ahead:
            batch.arrays = convert._call_converter(self._convert, batch, self.device)
        item = batch, _state_of(it), _left_out(it, skipped)
        self._start()
        return item

    def _put(self, item):
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self):
        if self._finalized:
            raise RuntimeError('fastchain: this DevicePrefetcher was finalized; '
                               'make a new one')
        if self._ended is not None:
            raise RuntimeError(
                "fastchain: the loader stopped at the error above ({}: {}) and does not go on "
                "past it, where Chainer's SerialIterator goes on with the next batch. Fix: "
                "leave bad examples out with fastchain.data.MultiprocessIterator(..., "
                "on_error='skip'), or keep Chainer's iterator (under fastchain.enable(), "
                'loader_workers=0)'.format(type(self._ended).__name__,
                                           str(self._ended).split('\n')[0])) from self._ended
        item = _HERE if self._thread is None else self._get()
        if item is _HERE:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            try:
                item = self._fetch_here()
            except Exception as e:
                self._ended = e
                self._hand_back(e)
                raise
        if item is _END:
            if self._thread is not None:
                self._put(_END)     # keep answering StopIteration
            self.previous_epoch_detail = self.epoch_detail      # as Chainer's iterators say
            raise StopIteration
        if isinstance(item, BaseException):
            self._ended = item
            self._hand_back(item)
            raise item
        batch, state, skipped = item
        self._copy_state(state)
        if skipped is not None:
            self.skipped += skipped
            chainer.report({'skipped_examples': len(skipped)})
        return batch

    next = __next__

    def _hand_back(self, error):
        """An example that failed to load (``error``): the loader stopped,
        past that batch as Chainer's iterators stand. Where it serves the
        script's iterator (``enable()``'s loader), that one is handed back
        there and the updater goes on with it serially, as plain Chainer goes
        on after an error the script caught; else this one stays stopped,
        saying so at the next call."""
        if isinstance(error, DataLoadError) and _follow.followed(self):
            self._copy_state()
            self.finalize()

    def _get(self):
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError('fastchain: the prefetch thread ended '
                                       'without a batch or an error') from None

    @property
    def repeat(self):
        return self.iterator.repeat

    def _stop_thread(self):
        self._stop.set()
        if self._thread not in (None, threading.current_thread()):    # (a __del__ there)
            self._thread.join()

    def reset(self):
        self._stop_thread()
        self.iterator.reset()
        self._copy_state()
        self._start()

    def serialize(self, serializer):
        """The consumer's position is saved; prefetched batches are not."""
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        self._stop_thread()
        if loading:
            # The iterator restarts its loading at the loaded position.
            self.iterator.serialize(serializer)
            self._copy_state()
        else:
            # Save what the training loop has seen, not what was fetched.
            self._give_back()
            self.iterator.serialize(serializer)
        # Prepared batches are dropped; the restarted thread re-fetches them.
        if not self._finalized:
            self._start()

    def _give_back(self):
        """Move the iterator back to where the training loop is."""
        self.iterator.seek(self.epoch, self.current_position, self.is_new_epoch,
                           self.previous_epoch_detail)

    def finalize(self):
        self._finalized = True
        thread = getattr(self, '_thread', None)    # None: __init__ raised
        if thread is not None and thread.is_alive():
            self._stop_thread()
        if hasattr(self, 'iterator'):
            self.iterator.finalize()
        if callable(getattr(_follow, 'release', None)):     # (None at the exit)
            _follow.release(self)


def _skipped_of(it):
    """How many examples ``it`` has left out so far, where it skips bad ones
    (its ``next()`` reports how many it left out, in the calling thread)."""
    if getattr(it, 'on_error', None) != 'skip':
        return None
    return len(it.skipped)


def _left_out(it, before):
    """What ``it`` left out since ``before`` (None: it does not skip): the batch just taken's."""
    return None if before is None else it.skipped[before:]


def _state_of(it):
    return (it.epoch, it.current_position, it.is_new_epoch, it.epoch_detail,
            it.previous_epoch_detail)


class ImageConverter(convert.Converter):
    """uint8 image batches to normalised arrays on the device.

    Concatenates on the host (uint8), copies to the device, then applies
    :class:`Normalize` there, producing Chainer's compute dtype (fp16 under
    ``enable(fp16=True)``). Labels stay int32.
    """

    def __init__(self, normalize=None):
        self.normalize = normalize or Normalize()

    def __call__(self, batch, device=None):
        stacked = getattr(batch, 'stacked', None)
        if stacked is not None and stacked[0] is not None:
            # The iterator already has the images as one array (no stacking).
            x = convert.to_device(device, stacked[0])
            t = convert.to_device(device, numpy.asarray([ex[1] for ex in batch],
                                                        numpy.int32))
        else:
            x, t = convert.concat_examples(batch, device)
        return self.normalize(x), t
