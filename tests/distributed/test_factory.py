"""create_communicator's checks, made before MPI is touched."""

import numpy
import pytest

from fastchain import distributed
from tests.helpers import OneRank


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="one of 'auto', 'mpi', 'nccl', got 'gloo'"):
        distributed.create_communicator('gloo')


@pytest.mark.parametrize('value', ['abc', '0', '-5', 'nan'])
def test_a_bad_collective_timeout_names_the_variable_and_the_fix(value, monkeypatch):
    monkeypatch.setenv('FASTCHAIN_COLLECTIVE_TIMEOUT', value)
    with pytest.raises(ValueError, match='FASTCHAIN_COLLECTIVE_TIMEOUT=.* is not a positive '
                                         'number of seconds. Fix: .*=900'):
        distributed.create_communicator('mpi')


def test_scatter_dataset_refuses_a_root_that_is_not_a_rank():
    # It failed with a bare IndexError from the list of who has data.
    for root in (1, -1, '0', numpy.int64(3)):
        with pytest.raises(ValueError, match=r"root=.* is not a rank of this job \(0 to 0\)"):
            distributed.scatter_dataset(list(range(8)), OneRank(), root=root)


def test_scatter_dataset_refuses_options_given_by_position():
    # ChainerMN's order is (dataset, comm, root, shuffle, seed): by position,
    # scatter_dataset(ds, comm, 0, True) ran as shuffle=0, seed=True.
    with pytest.raises(TypeError, match=r'scatter_dataset\(dataset, comm, 0, True\): give '
                                        r'shuffle, seed and root by name'):
        distributed.scatter_dataset(list(range(8)), OneRank(), 0, True)
