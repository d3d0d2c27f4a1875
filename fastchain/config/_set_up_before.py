"""Optimizers set up before an ``enable()`` that asked for an option acting at
setup (fp16, static_graph): left as they were, and named."""

import warnings

from fastchain.config._warning import FastchainWarning


def warn(handle):
    """fp16, static_graph and fused_update act when an optimizer is set up:
    one set up before they were asked for is left as it was, which is named
    (fused_update only when asked for: on by default, it would be named in
    every script that enables after its setup)."""
    names = [name for name in ('fp16', 'static_graph', 'fused_update') if name in handle.states
             and handle.states[name].requested and handle.states[name].active]
    for name in names:
        if name == 'static_graph':
            _not_chains()
        missed_now = _live(lambda o: not _applied(name, o))
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


    _updaters(handle)


def _updaters(handle):
    """loader_workers and prefetch_to_device act when a StandardUpdater is
    built: one built before they were asked for keeps its SerialIterator,
    which is named (only when asked for, as fused_update)."""
    asked = [name for name in ('loader', 'prefetch_to_device') if name in handle.states
             and handle.states[name].requested and handle.states[name].active]
    if not asked:
        return
    import gc
    from chainer.training.updaters import StandardUpdater
    from fastchain.data._group import _DONE, takes

    def found():
        # (an updater of the script's own may name its iterators otherwise)
        return [u for u in gc.get_objects() if issubclass(type(u), StandardUpdater)
                and u not in _DONE and takes(getattr(u, '_iterators', {}).get('main'))]
    missed = found()
    if missed:
        gc.collect()        # not counting garbage not collected yet
        missed = found()
    if missed:
        warnings.warn(
            'fastchain: {} act{} when a StandardUpdater is built; {} built before this '
            'enable() keep{} {} SerialIterator: nothing loads in worker processes for {}. Call '
            'fastchain.enable() before building the updater'.format(
                ' and '.join('loader_workers' if n == 'loader' else n for n in asked),
                '' if len(asked) > 1 else 's',
                'an updater' if len(missed) == 1 else '{} updaters'.format(len(missed)),
                's' if len(missed) == 1 else '', 'its' if len(missed) == 1 else 'their',
                'it' if len(missed) == 1 else 'them'), FastchainWarning, stacklevel=4)


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


def _live(select):
    """The optimizers set up (with a target) that ``select`` picks, not
    counting garbage not collected yet."""
    import gc
    from chainer.optimizer import GradientMethod

    def found():
        # type(), not isinstance(): the latter reads __class__, which some
        # objects (lazy modules' proxies) answer with a warning
        return [o for o in gc.get_objects() if issubclass(type(o), GradientMethod)
                and getattr(o, 'target', None) is not None and select(o)]
    if found():
        for _ in range(2):      # (a second pass frees what the first let go)
            gc.collect()
    return found()


def _not_chains():
    """A model that is not a Chain set up before: named the way the setup
    layer names one set up after (and kept for the report), once."""
    import chainer
    from fastchain.static._group import _NOT_CACHED, chain_of, not_cached

    def refused(optimizer):
        chain = chain_of(optimizer.target)
        return not isinstance(chain, chainer.Chain) and chain not in _NOT_CACHED
    for optimizer in _live(refused):
        chain = chain_of(optimizer.target)
        if chain not in _NOT_CACHED:
            not_cached(chain, 4)
