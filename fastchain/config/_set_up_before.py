"""Optimizers set up and updaters built before an ``enable()`` that asked for
an option acting at setup (fp16, static_graph, fused_update, loader_workers,
prefetch_to_device): left as they were, and named."""

import warnings

from fastchain.config._warning import FastchainWarning


def warn(handle):
    """fp16, static_graph and fused_update act when an optimizer is set up,
    loader_workers and prefetch_to_device when a StandardUpdater is built: one
    made before they were asked for is left as it was, which is named
    (fused_update, the loader and the prefetch only when asked for: on by
    default, fused_update would be named in every script that enables after
    its setup)."""
    states = handle.states

    def asked(names):
        return [n for n in names if n in states and states[n].requested and states[n].active]
    names = asked(('fp16', 'static_graph', 'fused_update'))
    loading = asked(('loader', 'prefetch_to_device'))
    if not names and not loading:
        return
    missed = _missed(names, loading)
    for optimizer in missed.get('not_chains', ()):
        _name_not_chain(optimizer, 3)
    for name in names:
        missed_now = missed[name]
        if missed_now:  # with fp16, said to fail (a new-user trial met it unannounced)
            fp16 = ''
            if name == 'fp16' and _float32(missed_now):
                fp16 = (" Its model keeps its float32 weights, and the batches are cast to "
                        "float16 now: the first step will fail with Chainer's 'float32 != "
                        "float16' type error.")
            elif name == 'fp16':    # built under an earlier enable(fp16=True), since disabled
                fp16 = (' Its float16 model has neither fp32 master weights nor a loss scaler '
                        'now (an earlier enable(fp16=True) gave them, and its handle was '
                        'disabled).')
            warnings.warn(
                'fastchain: {} acts when an optimizer is set up; {} set up before this '
                'enable() ({}) {} unchanged.{} Call fastchain.enable() before building the '
                'model and optimizer.setup(model)'.format(
                    name, 'an optimizer' if len(missed_now) == 1 else
                    '{} optimizers'.format(len(missed_now)),
                    ', '.join('{} of {}'.format(type(o).__name__, type(o.target).__name__)
                              for o in missed_now[::-1][:3]),      # the newest first
                    'is' if len(missed_now) == 1 else 'are', fp16), FastchainWarning, stacklevel=3)
    updaters = missed['updaters']
    if updaters:
        warnings.warn(
            'fastchain: {} act{} when a StandardUpdater is built; {} built before this '
            'enable() keep{} {} SerialIterator: nothing loads in worker processes for {}. Call '
            'fastchain.enable() before building the updater'.format(
                ' and '.join('loader_workers' if n == 'loader' else n for n in loading),
                '' if len(loading) > 1 else 's',
                'an updater' if len(updaters) == 1 else '{} updaters'.format(len(updaters)),
                's' if len(updaters) == 1 else '', 'its' if len(updaters) == 1 else 'their',
                'it' if len(updaters) == 1 else 'them'), FastchainWarning, stacklevel=3)


def _missed(names, loading):
    """{name: [optimizer]} for each of ``names``, 'not_chains' (models the
    static-graph cache cannot take, not named yet) and 'updaters' (built
    before ``loading`` was asked for, of the kind the loader takes): from one
    pass over the heap, and a second after collecting garbage only where the
    first found any (not counting garbage not collected yet)."""
    import gc
    from chainer.optimizer import GradientMethod
    from chainer.training.updaters import StandardUpdater
    from fastchain.data._group import _DONE, takes

    def scan():
        optimizers, updaters = [], []
        for o in gc.get_objects():
            # type(), not isinstance(): the latter reads __class__, which some
            # objects (lazy modules' proxies) answer with a warning
            kind = type(o)
            if issubclass(kind, GradientMethod):
                if getattr(o, 'target', None) is not None:
                    optimizers.append(o)
            # (an updater of the script's own may name its iterators otherwise)
            elif (loading and issubclass(kind, StandardUpdater) and o not in _DONE
                  and takes(getattr(o, '_iterators', {}).get('main'))):
                updaters.append(o)
        found = {name: [o for o in optimizers if not _applied(name, o)] for name in names}
        if 'static_graph' in names:
            found['not_chains'] = [o for o in optimizers if _not_a_chain(o)]
        found['updaters'] = updaters
        return found
    if not any(scan().values()):
        return {name: [] for name in names + ['not_chains', 'updaters']}
    for _ in range(2):      # (a second pass frees what the first let go)
        gc.collect()
    return scan()


def _float32(optimizers):
    """Any of their models with float32 parameters."""
    import numpy
    return any(p.dtype == numpy.float32 for o in optimizers for p in o.target.params()
               if p.array is not None)


def _applied(name, optimizer):
    import chainer
    if name == 'fused_update':
        from fastchain.kernels._update import is_fused, supported
        rules = [p.update_rule for p in optimizer.target.params()]
        return not any(r is not None and supported(r) and not is_fused(r)
                       and 'update_core_cpu' not in vars(r) for r in rules)
    if name == 'fp16':
        from fastchain.precision._attach import scaler_of
        return (optimizer.__dict__.get('_use_fp32_update') is True
                or scaler_of(optimizer) is not None)
    from fastchain.static._cache import is_cached
    from fastchain.static._group import chain_of
    chain = chain_of(optimizer.target)
    # a forward decorated with fastchain.static_graph caches on its first call
    decorated = hasattr(getattr(type(chain), 'forward', None), '__fastchain_static__')
    return (not isinstance(chain, chainer.Chain) or is_cached(chain) or decorated
            or 'forward' in vars(chain))


def _not_a_chain(optimizer):
    """Its model is a Link the static-graph cache cannot take, not named yet."""
    import chainer
    from fastchain.static._group import _NOT_CACHED, chain_of
    chain = chain_of(optimizer.target)
    return not isinstance(chain, chainer.Chain) and chain not in _NOT_CACHED


def _name_not_chain(optimizer, stacklevel):
    """Named the way the setup layer names a model set up after (and kept
    for the report), once."""
    from fastchain.static._group import _NOT_CACHED, chain_of, not_cached
    chain = chain_of(optimizer.target)
    if chain not in _NOT_CACHED:
        not_cached(chain, stacklevel + 1)
