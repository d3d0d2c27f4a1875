"""How each process's BLAS/OpenMP threads are chosen (the plan; the MPI test
with real ranks is in test_data_parallel.py)."""

import pytest

from fastchain.distributed import _threads


def test_processes_sharing_the_node_split_its_cores():
    cores = frozenset(range(8))
    assert _threads.plan(cores, [cores] * 3, {})[0] == 2
    assert _threads.plan(cores, [cores] * 16, {})[0] == 1     # never 0


def test_processes_bound_to_their_own_cores_use_them():
    sets = [frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5, 6})]
    assert _threads.plan(sets[2], sets, {})[0] == 3
    assert 'bound' in _threads.plan(sets[0], sets, {})[1]


def test_the_users_setting_wins():
    cores = frozenset(range(4))
    assert _threads.plan(cores, [cores] * 2, {'OMP_NUM_THREADS': '3'}) == (
        None, 'as OMP_NUM_THREADS=3 sets them')
    assert _threads.plan(cores, [cores] * 2,
                         {'FASTCHAIN_THREADS_PER_PROCESS': '4', 'OMP_NUM_THREADS': '3'})[0] == 4


def test_more_threads_than_the_processs_share_of_the_node_is_said():
    # (64 threads a process, 2 processes on 2 cores: an epoch 80 s, not 0.6 s)
    cores = frozenset(range(2))
    threads, what = _threads.plan(cores, [cores] * 2, {'FASTCHAIN_THREADS_PER_PROCESS': '64'})
    assert threads == 64 and 'more than this process\'s share of the node, 1 of its 2 ' \
        'cores for 2 process(es)' in what and 'FASTCHAIN_THREADS_PER_PROCESS=1 fits' in what
    assert _threads.plan(cores, [cores] * 2, {'FASTCHAIN_THREADS_PER_PROCESS': '1'})[1] == \
        'from FASTCHAIN_THREADS_PER_PROCESS'


@pytest.mark.parametrize('bad', ['0', 'two', '-1'])
def test_a_bad_setting_names_the_variable_and_the_fix(bad):
    with pytest.raises(ValueError, match='FASTCHAIN_THREADS_PER_PROCESS=.* Fix: set it'):
        _threads.plan(frozenset({0}), [frozenset({0})], {'FASTCHAIN_THREADS_PER_PROCESS': bad})


@pytest.mark.mpi
def test_a_bad_setting_is_named_by_a_one_process_communicator_too():
    # one process keeps its threads, and took any value without a word
    import os
    import subprocess
    import sys
    env = dict(os.environ, FASTCHAIN_THREADS_PER_PROCESS='abc')
    r = subprocess.run([sys.executable, '-c', 'from fastchain import distributed; '
                        "distributed.create_communicator('mpi')"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0
    assert "FASTCHAIN_THREADS_PER_PROCESS='abc' is not a positive number" in r.stderr
