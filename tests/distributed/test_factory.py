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


def test_a_bad_thread_count_is_refused_before_mpi_starts(monkeypatch):
    # (a review: checked after MPI's start, every rank printed it)
    import sys
    monkeypatch.setenv('FASTCHAIN_THREADS_PER_PROCESS', 'zero')
    monkeypatch.setitem(sys.modules, 'mpi4py', None)    # MPI is not reached
    with pytest.raises(ValueError, match="FASTCHAIN_THREADS_PER_PROCESS='zero' is not a "
                                         'positive number of threads. Fix: .*=1'):
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


@pytest.mark.mpi
def test_a_launcher_of_another_mpi_is_named_not_n_trainings_alone():
    # (a review: under Open MPI's launcher, with mpi4py on MPICH, each process
    # was rank 0 of 1, trained alone, wrote into the same folder, and exited 0)
    rank, size = 'OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE'
    import os
    import subprocess
    import sys
    env = dict(os.environ, **{rank: '1', size: '2'})
    for name in ('PMI_RANK', 'PMI_SIZE', 'PMI_FD', 'PMI_PORT', 'PMI_ID'):
        env.pop(name, None)
    r = subprocess.run([sys.executable, '-c', 'from fastchain import distributed\n'
                        "distributed.create_communicator('mpi')"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0
    assert ('started as rank 1 of 2 ({}=2), but MPI sees a job of one process'.format(size)
            in r.stderr), r.stderr[-3000:]
    assert 'fastchain-run -n 2' in r.stderr
    env[size] = '1'     # a launcher's job of one process: as before
    r = subprocess.run([sys.executable, '-c', 'from fastchain import distributed\n'
                        "print(distributed.create_communicator('mpi').size)"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.split()[-1] == '1', r.stderr[-3000:]


_MIXED = '''
from fastchain.backends import cuda
from mpi4py import MPI
if MPI.COMM_WORLD.rank == 0:
    cuda.available = lambda: True       # rank 0 as on a node with a GPU
from fastchain import distributed
distributed.create_communicator('auto')
'''


@pytest.mark.mpi
def test_ranks_that_disagree_on_auto_are_told_which_has_no_gpu(tmp_path):
    # (a review: decided on each rank alone, a node without a GPU took 'mpi'
    # while the others set up NCCL, and failed in MPI with no word of why)
    import re
    import subprocess
    import sys
    from fastchain.backends import mpi
    script = tmp_path / 'mixed.py'
    script.write_text(_MIXED)
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, str(script)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    said = re.findall(r"found a usable GPU on some ranks and none on rank 1 \((.+?)\), so "
                      "the ranks cannot agree on NCCL", r.stderr)
    assert len(said) == 2 and said[0], r.stderr[-3000:]     # on every rank, with why
    assert "pass 'mpi'" in r.stderr
