"""Marking a chain for the static cache (:mod:`fastchain.static._cache`):
:func:`static_graph` on a class, an instance or a forward method, and
:func:`cache_static_graph`, what ``enable(static_graph=True)`` calls on each
optimizer's model."""

import functools
import inspect
import weakref

import chainer

from fastchain.config import _patches
from fastchain.static import _fixes
from fastchain.static._cache import STATE, _Cache, is_cached
from fastchain.static._keys import CHAINER_ATTRIBUTES


def _forward_of(cls):
    forward = cls.forward
    return getattr(forward, '__fastchain_static__', forward)


def cache_static_graph(chain, verify_steps=2, verbosity=0, changes=None):
    """Make ``chain``'s forward a cached static subgraph (on this instance).

    Returns a callable that undoes it. See the module docstring for what is
    checked. ``verbosity`` > 0 lets Chainer's own static-graph messages out.
    ``changes``: record the cache there (a handle's), instead of keeping it
    until the undo is called or the chain is collected.
    """
    if not isinstance(chain, chainer.Chain):     # Chainer's static graph asserts it
        raise TypeError(not_a_chain(chain))
    if is_cached(chain):
        raise ValueError('{} is already cached'.format(type(chain).__name__))
    if 'forward' in vars(chain):
        raise ValueError('{} has an instance-level forward of its own, which the cache '
                         'would not replay'.format(type(chain).__name__))
    cache, release = _new_cache(chain, _forward_of(type(chain)), verify_steps, verbosity)

    def cached_forward(plain, *args, **kwargs):
        return cache(plain, args, kwargs)
    functools.update_wrapper(cached_forward, type(chain).forward)
    name = type(chain).__name__
    ref = weakref.ref(chain)
    # a copy of the chain (Link.copy, copy.deepcopy, pickle) is a plain chain:
    # the schedules are this one's (undone last: after the forward's layer)
    _patches.leave_out_of_copies(chain, CHAINER_ATTRIBUTES)
    if changes is not None:
        changes.call('copies of ' + name, functools.partial(_copies_whole, ref))
        point = changes.wrap(chain, 'forward', 'static_graph', cached_forward)
        changes.attach(chain, STATE, cache)
        changes.call('static graph lease of ' + name, release)
        changes.call('static graph schedules of ' + name, cache.forget)
    else:
        point = _patches.wrap(chain, 'forward', 'static_graph', cached_forward)
        _patches.attach(chain, STATE, cache)

    def undo():
        obj = ref()
        if obj is not None:
            _patches.unwrap(obj, 'forward', 'static_graph', point=point)
            _patches.detach(obj, STATE, cache)
        cache.forget()
        release()
        _copies_whole(ref)
    return undo


def _copies_whole(ref):
    chain = ref()
    if chain is not None:
        _patches.leave_out_of_copies(chain, ())


def _new_cache(chain, forward, verify_steps, verbosity):
    release = _fixes.acquire()
    cache = _Cache(chain, forward, verify_steps, verbosity)
    weakref.finalize(chain, release)
    return cache, release


def _cached_method(func, verify_steps):
    """``func`` (a chain's forward) cached per instance on its first call."""

    @functools.wraps(func)
    def forward(self, *args, **kwargs):
        cache = _patches.attached(self, STATE)
        if cache is None:       # the cache lives as long as the instance
            cache, _ = _new_cache(self, func, verify_steps, 0)
            cache.method = True
            _patches.attach(self, STATE, cache)
            _patches.leave_out_of_copies(self, CHAINER_ATTRIBUTES)
        if not cache.method:
            # The instance's forward is cached as a whole: this call comes from
            # inside that cache.
            return func(self, *args, **kwargs)
        return cache(functools.partial(func, self), args, kwargs)
    forward.__fastchain_static__ = func
    return forward


def not_a_chain(link):
    """Why ``link`` (a Link that is not a Chain) is not cached, and the fix."""
    name = link.__name__ if isinstance(link, type) else type(link).__name__
    kind = 'a ChainList' if (isinstance(link, chainer.ChainList) or (
        isinstance(link, type) and issubclass(link, chainer.ChainList))) else 'a single link'
    return ('fastchain static_graph caches chainer.Chain models; {} is {}: wrap it in a '
            'Chain whose forward calls it to cache it'.format(name, kind))


def static_graph(target=None, verify_steps=2):
    """Mark a model for static-subgraph caching.

    On a chain's forward method, the way Chainer's ``@static_graph`` is used
    (each instance is cached on its first call)::

        class Net(chainer.Chain):
            @fastchain.static_graph          # or @fastchain.static_graph(verify_steps=3)
            def forward(self, x): ...

    As a class decorator (every instance of that very class is cached when
    made; a subclass is marked on its own)::

        @fastchain.static_graph
        class Net(chainer.Chain): ...

    or on an instance: ``fastchain.static_graph(model)`` (returns the model).
    Only ``chainer.Chain`` models are cached: a single link or a ChainList
    (``chainer.Sequential``) is refused with ``TypeError``; wrap it in a Chain.
    """
    if target is None:
        return functools.partial(static_graph, verify_steps=verify_steps)
    if isinstance(target, chainer.Chain):
        cache_static_graph(target, verify_steps)
        return target
    if isinstance(target, type) and issubclass(target, chainer.Chain):
        cls = target
        init = cls.__init__

        @functools.wraps(init)
        def init_and_cache(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if type(self) is cls:       # subclasses decide for themselves
                cache_static_graph(self, verify_steps)
        cls.__init__ = init_and_cache
        return cls
    if isinstance(target, chainer.Link) or (isinstance(target, type)
                                             and issubclass(target, chainer.Link)):
        raise TypeError(not_a_chain(target))
    if inspect.isfunction(target):
        return _cached_method(target, verify_steps)
    raise TypeError('fastchain.static_graph marks a chainer.Chain class or instance, or '
                    "a chain's forward method, got {!r}".format(target))
