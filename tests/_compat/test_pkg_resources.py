"""The pkg_resources stand-in answers Chainer's questions like the original."""

import importlib.metadata

import pytest

from fastchain._compat import _pkg_resources as pr


def test_require_an_installed_package():
    numpy_version = importlib.metadata.version('numpy')
    dists = pr.require('numpy>=1.0')
    assert dists[0].version == numpy_version
    assert pr.get_distribution('numpy').version == numpy_version
    # a requirement, as a string or an object, as pkg_resources took it (the
    # string raised DistributionNotFound, the object a TypeError)
    from packaging.requirements import Requirement
    for req in ('numpy>=1', Requirement('numpy>=1')):
        assert pr.get_distribution(req).version == numpy_version


def test_version_conflict_and_missing_distribution():
    with pytest.raises(pr.VersionConflict):
        pr.require('numpy<1.0')
    with pytest.raises(pr.DistributionNotFound):
        pr.require('no-such-package-fastchain-test')
    # Chainer catches ResolutionError for both.
    assert issubclass(pr.VersionConflict, pr.ResolutionError)
    assert issubclass(pr.DistributionNotFound, pr.ResolutionError)


def test_chainer_with_requires_skips_by_requirement():
    from chainer import testing
    import unittest

    class T(unittest.TestCase):
        @testing.with_requires('numpy>=1.0')
        def test_runs(self):
            pass

        @testing.with_requires('numpy<1.0')
        def test_skipped(self):
            pass

    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(T).run(result)
    assert not result.errors and not result.failures
    assert [t.id().rsplit('.', 1)[1] for t, _ in result.skipped] == ['test_skipped']
