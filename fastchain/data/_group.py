"""The input-pipeline group of ``fastchain.enable``."""

from fastchain.config._options import Group, Option, State, boolean
from fastchain.data._iterator import MultiprocessIterator, available_cores
from fastchain.data._prefetch import DevicePrefetcher


def _workers(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError('expected a number of worker processes >= 0')
    return value


class LoaderGroup(Group):
    name = 'loader'
    options = (
        Option('loader_workers', 'worker processes for the updater\'s '
               'SerialIterator (default: the cores available; 0: off)',
               check=_workers),
        boolean('prefetch_to_device', 'convert and copy batch k+1 while batch k '
                'computes (default: on with the loader)'),
    )

    def probe(self):
        return [State('loader', True, False), State('prefetch_to_device', True, False)]

    def apply(self, values, explicit, recorder):
        workers = values['loader_workers']
        workers = available_cores() if workers is None else workers
        prefetch = values['prefetch_to_device']
        prefetch = workers > 0 if prefetch is None else prefetch
        loader = State('loader', True, workers > 0, requested='loader_workers' in explicit,
                       setting=workers)
        device = State('prefetch_to_device', True, prefetch,
                       requested='prefetch_to_device' in explicit, setting=prefetch)
        if workers > 0 or prefetch:
            _wrap_updater_init(recorder, workers, prefetch)
        return [loader, device]


def upgrade_iterator(iterator, workers):
    """A MultiprocessIterator equivalent to a SerialIterator (same dataset,
    batch size, repeat and shuffle; the order's seed is drawn from NumPy's
    global RNG, so ``numpy.random.seed`` still makes a run repeatable)."""
    import numpy
    return MultiprocessIterator(
        iterator.dataset, iterator.batch_size, repeat=iterator.repeat,
        shuffle=iterator._shuffle is not False or iterator.order_sampler is not None,
        seed=int(numpy.random.randint(2**31)), n_workers=workers)


def _wrap_updater_init(recorder, workers, prefetch):
    """While enabled, a StandardUpdater built with a plain SerialIterator
    gets the multiprocess loader and device prefetch instead."""
    from chainer.iterators import SerialIterator, ShuffleOrderSampler
    from chainer.training.updaters import StandardUpdater
    init = StandardUpdater.__init__

    def init_with_loader(self, iterator, optimizer, *args, **kwargs):
        init(self, iterator, optimizer, *args, **kwargs)
        main = self._iterators['main']
        if type(main) is not SerialIterator or not isinstance(
                main.order_sampler, (type(None), ShuffleOrderSampler)):
            return      # the script chose its iterator or its order: leave it
        if workers > 0:
            main = upgrade_iterator(main, workers)
        if prefetch and hasattr(main, 'reset') and hasattr(main, '_pool'):
            main = DevicePrefetcher(main, self.converter, self.input_device)
            self.converter = main.converter
        self._iterators['main'] = main

    init_with_loader.__wrapped__ = init
    recorder.set_attr(StandardUpdater, '__init__', init_with_loader,
                      label='StandardUpdater.__init__')


GROUP = LoaderGroup()
