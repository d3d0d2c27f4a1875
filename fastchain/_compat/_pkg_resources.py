"""The part of ``pkg_resources`` that Chainer 7.8.1 uses, on importlib.metadata.

Chainer calls ``require``, ``get_distribution(...).version`` and
``WorkingSet().require`` and catches ``DistributionNotFound``,
``VersionConflict`` and ``ResolutionError``. setuptools 82 removed
``pkg_resources``; Chainer's ``import pkg_resources`` lines are rewritten to
import this module instead (it is never put in ``sys.modules`` under that
name, so other code still sees no pkg_resources).
"""

import importlib.metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


class ResolutionError(Exception):
    """A requirement could not be met."""


class DistributionNotFound(ResolutionError):
    """No installed distribution has the requirement's name."""


class VersionConflict(ResolutionError):
    """The installed distribution's version is outside the requirement."""


class Distribution:
    def __init__(self, project_name, version):
        self.project_name = project_name
        self.version = version

    def __repr__(self):
        return '{} {}'.format(self.project_name, self.version)


def get_distribution(name):
    """The installed distribution ``name`` names: a project name, a requirement
    string (``'numpy>=1'``) or a requirement object, as pkg_resources took
    (raises if absent; the version is not checked, as there)."""
    name = Requirement(name).name if isinstance(name, str) else name.name
    try:
        version = importlib.metadata.version(canonicalize_name(name))
    except importlib.metadata.PackageNotFoundError:
        raise DistributionNotFound(
            'The {!r} distribution was not found'.format(name)) from None
    return Distribution(name, version)


def require(*requirements):
    """Check each requirement string; returns the matching distributions.

    Unlike pkg_resources, dependencies of the requirements are not walked:
    Chainer only asks whether one package is present at a given version.
    """
    found = []
    for text in requirements:
        req = Requirement(text)
        dist = get_distribution(req.name)
        if req.specifier and not req.specifier.contains(
                dist.version, prereleases=True):
            raise VersionConflict(
                '{} is installed but {} is required'.format(dist, text))
        found.append(dist)
    return found


class WorkingSet:
    def require(self, *requirements):
        return require(*requirements)
