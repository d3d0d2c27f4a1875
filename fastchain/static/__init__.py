"""Static-subgraph caching with Chainer's static_graph faults fixed.

``fastchain.enable(static_graph=True)`` caches the model of every optimizer
set up while enabled; :func:`static_graph` marks a chain class, instance or
forward method directly (:mod:`fastchain.static._mark`). See
:mod:`fastchain.static._cache` for what is
checked (:mod:`fastchain.static._verify`), :mod:`fastchain.static._functions`
for what each Chainer function does under the cache and
:mod:`fastchain.static._fixes` for what is fixed in Chainer.
"""

from fastchain.static._cache import StaticGraphFallback, cache_state, is_cached
from fastchain.static._mark import cache_static_graph, static_graph
from fastchain.static._outside import StaticGraphOrder

__all__ = ['StaticGraphFallback', 'StaticGraphOrder', 'cache_state', 'cache_static_graph',
           'is_cached', 'static_graph']
