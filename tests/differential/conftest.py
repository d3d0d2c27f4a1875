"""Applies the mutation ``FASTCHAIN_MUTATION`` names (see mutations.py)."""

import os


def pytest_configure(config):
    name = os.environ.get('FASTCHAIN_MUTATION')
    if name:
        from tests.differential.mutations import MUTATIONS
        MUTATIONS[name]()
