"""The offline wheelhouse (`make wheelhouse`) lists every requirement: each of
fastchain's and Chainer's runtime requirements is either put in it or one the
GPU node has (`make wheelhouse-check` installs from it with --no-index)."""

import importlib.metadata
import os
import re

from packaging.requirements import Requirement

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')


def make_variable(name):
    text = open(os.path.join(ROOT, 'Makefile')).read()
    value = re.search(r'^{} \?= (.*)$'.format(name), text, re.M).group(1)
    return {v.lower() for v in value.split()}


def normal(name):
    return re.sub(r'[-_.]+', '-', name).lower()


def test_every_runtime_requirement_is_in_the_wheelhouse_or_on_the_node():
    import tomllib
    with open(os.path.join(ROOT, 'pyproject.toml'), 'rb') as f:
        ours = tomllib.load(f)['project']['dependencies']
    chainers = importlib.metadata.requires('chainer') or []
    needed = {normal(Requirement(r).name) for r in ours + chainers
              if not Requirement(r).marker or Requirement(r).marker.evaluate(
                  {'extra': ''})} - {'chainer'}
    covered = {normal(n) for n in make_variable('NODE_LACKS') | make_variable('NODE_HAS')}
    assert needed <= covered, 'not in NODE_LACKS or NODE_HAS: {}'.format(
        sorted(needed - covered))
    assert not make_variable('NODE_LACKS') & make_variable('NODE_HAS')
