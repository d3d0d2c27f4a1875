"""Probes of the optional dependencies (one module each, tried once).

Each probe is a function returning a :class:`~fastchain.backends._status.Status`:
whether the dependency is usable here, its version, and if it is not, why and
how to fix it. Nothing is probed at import; results are cached per process.
"""

from fastchain.backends._status import Status

__all__ = ['Status']
