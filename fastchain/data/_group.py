"""The input-pipeline group of ``fastchain.enable``."""

import functools
import weakref

import numpy

from fastchain.config import _patches
from fastchain.config._options import Group, Option, State, boolean
from fastchain.data._draws import DRAWS_RANDOM
from fastchain.data._iterator import MultiprocessIterator, available_cores
from fastchain.data._prefetch import DevicePrefetcher


def _workers(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError('expected a number of worker processes >= 0')
    return value


def _resolve(values):
    """(workers, prefetch): ``workers`` None means this process's share of
    the node's cores, counted when an updater is built (a communicator made
    after ``enable()`` still counts: see fastchain._node)."""
    workers = values['loader_workers']
    prefetch = values['prefetch_to_device']
    # Without workers nothing can load ahead (see check()); two handles can
    # still combine loader_workers=0 with prefetch_to_device=True.
    some = workers is None or workers > 0
    prefetch = some if prefetch is None else prefetch and some
    return workers, prefetch


def default_workers():
    from fastchain import _node
    return _node.share_of_cores(available_cores())


class LoaderGroup(Group):
    name = 'loader'
    options = (
        Option('loader_workers', 'worker processes for the updater\'s '
               'SerialIterator (default: this process\'s share of the node\'s '
               'cores; 0: off)',
               check=_workers),
        boolean('prefetch_to_device', 'convert and copy batch k+1 while batch k '
                'computes (default: on with the loader; needs loader_workers >= 1)'),
    )

    def check(self, values, explicit):
        if values['prefetch_to_device'] is True and values['loader_workers'] == 0:
            raise ValueError(
                'fastchain.enable(prefetch_to_device=True, loader_workers=0): with no '
                'worker processes the examples load in the training loop (as a '
                "SerialIterator's do, drawing from NumPy's global RNG), so nothing can "
                'be prepared ahead without changing the training. Give loader_workers '
                '>= 1, or leave prefetch_to_device unset.')

    def probe(self):
        return [State('loader', True, False), State('prefetch_to_device', True, False)]

    def plan(self, values, explicit, plan):
        workers, prefetch = _resolve(values)
        if workers is None or workers > 0 or prefetch:
            from chainer.training.updaters import StandardUpdater
            # Workers asked for, or device prefetch (which needs them): used
            # even for a dataset in memory.
            asked = ('loader_workers' in explicit and values['loader_workers'] is not None) \
                or ('prefetch_to_device' in explicit and values['prefetch_to_device'] is True)
            plan.wrap(StandardUpdater, '__init__', 'loader',
                      functools.partial(_updater_layer, (workers, prefetch, asked)))

    def states(self, values, explicit):
        from chainer.training.updaters import StandardUpdater
        layer = _patches.in_force(StandardUpdater, '__init__', 'loader')
        workers, prefetch, asked = layer.args[0] if layer is not None else (0, False, False)
        asked_workers = values['loader_workers']
        loader = State('loader', True, workers is None or workers > 0, setting=asked_workers,
                       requested='loader_workers' in explicit and bool(asked_workers))
        loader.calls = _outcomes()
        if not loader.active:
            loader.why = 'loader_workers=0' if asked_workers == 0 else None
        elif not asked:
            loader.note = IN_MEMORY_NOTE.format(default_workers() if workers is None
                                                else workers)
        device = State('prefetch_to_device', True, prefetch,
                       requested='prefetch_to_device' in explicit
                       and values['prefetch_to_device'] is True,
                       setting=values['prefetch_to_device'])
        if prefetch and loader.active and not asked:
            device.note = ('with the loader\'s workers: an updater that keeps its '
                           'SerialIterator (a dataset in memory, see loader) is not prefetched')
        if (not prefetch and layer is not None) or asked_workers == 0:
            if workers == 0:
                device.why = 'no loader workers to load ahead (loader_workers=0 is in force)'
                device.fix = 'loader_workers >= 1'
            else:
                device.why = 'prefetch_to_device=False'
        return [loader, device]


def upgrade_iterator(iterator, workers, warn_draws=False):
    """A MultiprocessIterator that walks the dataset as the SerialIterator
    ``iterator`` would: its orders come from the same order sampler at the
    same moments (the current one is taken over, the next ones are drawn
    when an epoch ends), from where it stands. Nothing is drawn from NumPy's
    global RNG here: the examples' seed (for datasets that draw random
    numbers in the workers) is derived from its state, so
    ``numpy.random.seed`` still makes a run repeatable. ``warn_draws``: as
    :class:`MultiprocessIterator`'s."""
    sampler = iterator.order_sampler
    it = MultiprocessIterator(
        iterator.dataset, iterator.batch_size, repeat=iterator.repeat,
        shuffle=None if sampler is not None else False, n_workers=workers,
        rng='global', order_sampler=sampler, order=iterator._state.order,
        warn_draws=warn_draws)
    if iterator.epoch or iterator.current_position or \
            iterator.previous_epoch_detail is not None:
        _move_position(iterator, it)       # a script that called next() already
    return it


def _move_position(source, target):
    """``source``'s position, order included, into ``target``, as a snapshot
    moves them."""
    from chainer.serializers import DictionarySerializer, NpzDeserializer
    state = {}
    source.serialize(DictionarySerializer(state))
    target.serialize(NpzDeserializer(state))


IN_MEMORY_NOTE = ('{} workers; an updater whose dataset is arrays in memory already '
                  '(TupleDataset, DictDataset or a list, and their SubDatasets) keeps its '
                  'SerialIterator, since fetching an example is only an index and workers '
                  'would add copying: loader_workers=N uses workers for it anyway')


def _draws_random(iterator):
    """The generators (global, or the dataset's own) the first example of
    ``iterator``'s order draws from (loaded here, the generators put back):
    [] if none, or it fails. A generator of the dataset's own that it seeds
    per example itself is not named: the workers' seeding changes nothing
    there. NumPy's and Python's global ones are named even then: in plain
    Chainer a dataset seeding them also moves what the main process draws
    next (dropout, the next epoch's order), and in the workers it does not."""
    from fastchain.data._draws import KeptGenerators, own_name, seeded_per_example
    from fastchain.data._generators import find
    if not len(iterator.dataset):
        return []
    order = iterator._state.order
    index = numpy.intp(order[iterator.current_position % len(order)] if order is not None
                       else iterator.current_position % len(iterator.dataset))
    with KeptGenerators(find(iterator.dataset)) as kept:
        try:
            iterator.dataset[index]
        except Exception:
            return kept.drew    # a bad example is the loader's to report, in its batch
    if kept.own_drew:
        for path, generator in seeded_per_example(lambda: iterator.dataset[index], kept.own_drew):
            kept.drew.remove(own_name(path, generator))
    return kept.drew


def converts_alike_ahead(converter):
    """Whether ``converter`` gives the same arrays, and the run the same
    random numbers, converting a batch ahead in the prefetch thread:
    Chainer's ``concat_examples`` (also through ``functools.partial``, with
    its own arguments) and fastchain's :class:`ImageConverter`. A script's
    own converter runs in the training loop, as in Chainer: one that draws
    random numbers (mixup, noise) or counts its calls would otherwise draw
    ahead, between the model's draws, and for batches never used. So does an
    ImageConverter given a ``normalize`` of the script's own (a jitter)."""
    from chainer.dataset import convert
    from fastchain.data._prefetch import ImageConverter, Normalize
    if isinstance(converter, functools.partial):
        converter = converter.func
    return converter is convert.concat_examples or (
        type(converter) is ImageConverter and type(converter.normalize) is Normalize)


def in_memory(dataset):
    """True for a dataset whose examples are in memory already: a NumPy
    array or a list, a TupleDataset or DictDataset of arrays, or a SubDataset
    (``scatter_dataset``'s shards, ``split_dataset``) of one of those."""
    import numpy
    from chainer.datasets import DictDataset, SubDataset, TupleDataset
    while type(dataset) is SubDataset:
        dataset = dataset._dataset
    if isinstance(dataset, (numpy.ndarray, list)):
        return True
    if type(dataset) is TupleDataset:
        return all(isinstance(d, (numpy.ndarray, list)) for d in dataset._datasets)
    if type(dataset) is DictDataset:
        return all(isinstance(d, (numpy.ndarray, list)) for d in dataset._datasets.values())
    return False


# What the loader layer did with each updater built while it was in force,
# as long as the updater lives: ('kept', why) or ('loading', iterator).
_DONE = weakref.WeakKeyDictionary()


def _outcomes():
    """For the report: a line per live updater the layer saw (None if none)."""
    lines = []
    for updater, (what, detail) in list(_DONE.items()):
        name = type(updater).__name__
        if what == 'kept':
            lines.append('{}: its iterator kept ({})'.format(name, detail))
            continue
        pool = getattr(detail, '_pool', None)
        workers = getattr(detail, 'n_workers', None)
        loading = getattr(pool, 'active', None) if pool is not None else None
        lines.append('{}: {} worker process{}{}'.format(
            name, workers, '' if workers == 1 else 'es', '' if loading in (None, workers) else
            ', {} of them loading (autotune)'.format(loading)))
    return lines or None


def takes(iterator):
    """Whether the loader layer takes ``iterator`` in its place: a plain
    SerialIterator whose order is Chainer's own (one with an order sampler
    of the script's is left, and said)."""
    from chainer.iterators import SerialIterator, ShuffleOrderSampler
    return type(iterator) is SerialIterator and isinstance(
        iterator.order_sampler, (type(None), ShuffleOrderSampler))


def _updater_layer(setting, next_, updater, *args, **kwargs):
    """While in force, a StandardUpdater built with a plain SerialIterator
    gets the multiprocess loader and device prefetch instead (unless its
    dataset is in memory already and the workers were not asked for). The
    updater keeps them after the handle is disabled (they hold its
    position)."""
    from chainer.iterators import SerialIterator
    from fastchain.data._follow import follow, serve, target_of
    workers, prefetch, asked = setting
    chosen = workers is None        # the default: this process's share of the cores
    workers = default_workers() if chosen else workers
    next_(updater, *args, **kwargs)
    main = updater._iterators['main']
    taken = target_of(main)
    if taken is not None:       # taken by an earlier updater: the same one
        serve(taken, updater, False)    # (its own converter: unprepared batches)
        updater._iterators['main'] = taken
        return
    if not takes(main):
        import chainer.iterators as I
        parallel = (MultiprocessIterator, DevicePrefetcher, I.MultiprocessIterator,
                    I.MultithreadIterator)
        if asked and not isinstance(main, parallel):
            # the script chose its iterator or its order: leave it, and say so
            import warnings
            from fastchain.config._warning import FastchainWarning
            own_order = type(main) is SerialIterator
            warnings.warn(
                'fastchain: loader_workers / prefetch_to_device leave this updater\'s '
                'iterator as it is: {} (the script chose {}), so nothing loads in worker '
                'processes. To have them, use {}'.format(
                    'a SerialIterator with its own order_sampler' if own_order
                    else type(main).__name__ + ', not a SerialIterator',
                    'its order' if own_order else 'its iterator',
                    'fastchain.data.MultiprocessIterator(..., order_sampler=...)' if own_order
                    else 'fastchain.data.MultiprocessIterator, or a SerialIterator'),
                FastchainWarning, stacklevel=_patches.user_stacklevel())
        _DONE[updater] = ('kept', 'the script chose it: {}{}'.format(
            type(main).__name__, ' with its own order_sampler'
            if type(main) is SerialIterator else ''))
        return
    if not asked and in_memory(main.dataset):
        _DONE[updater] = ('kept', 'a SerialIterator over a dataset in memory ({}): see the '
                          'note'.format(type(main.dataset).__name__))
        return      # nothing for workers to do (IN_MEMORY_NOTE)
    drew = _draws_random(main)
    main = upgrade_iterator(main, workers, warn_draws=not drew)
    if drew:
        import warnings
        from fastchain.config._warning import FastchainWarning
        warnings.warn(DRAWS_RANDOM.format(' and '.join(drew)), FastchainWarning,
                      stacklevel=_patches.user_stacklevel())
    if chosen:
        main.tune_workers()     # with autotune: how many of them load
    _DONE[updater] = ('loading', main)
    if prefetch:
        main = DevicePrefetcher(main, updater.converter, updater.input_device,
                                convert_ahead=converts_alike_ahead(updater.converter))
        updater.converter = main.converter
    follow(updater._iterators['main'], main, updater, prefetch)  # the script's object follows it
    updater._iterators['main'] = main


GROUP = LoaderGroup()
