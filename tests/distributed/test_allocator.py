"""glibc's allocator keeps gradient-sized arrays on the heap once a
communicator exists (they were mapped and unmapped at every step after MPI's
initialisation: see fastchain/distributed/_allocator.py)."""

import os
import platform
import subprocess
import sys

import pytest

from fastchain.distributed import _allocator

STEPS = '''
import resource, numpy, chainer, chainer.links as L, chainer.functions as F
rs = numpy.random.RandomState(0)
train = chainer.datasets.TupleDataset(rs.rand(1500, 64).astype(numpy.float32),
                                      rs.randint(0, 10, 1500).astype(numpy.int32))
model = L.Classifier(chainer.Sequential(L.Linear(None, 1000), F.relu, L.Linear(None, 1000),
                                        F.relu, L.Linear(None, 10)))
model(train[:1][0][0][None], train[:1][0][1][None])
model.cleargrads()
from fastchain import distributed       # MPI starts after the model exists
comm = distributed.create_communicator()
opt = distributed.create_multi_node_optimizer(chainer.optimizers.Adam(), comm).setup(model)
updater = chainer.training.StandardUpdater(chainer.iterators.SerialIterator(train, 100), opt)
for _ in range(5):
    updater.update()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    updater.update()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
'''


def faults_per_step(**env):
    clean = {k: v for k, v in os.environ.items() if k not in _allocator.USER_VARIABLES}
    r = subprocess.run([sys.executable, '-c', STEPS], capture_output=True, text=True,
                       timeout=120, env=dict(clean, OPENBLAS_NUM_THREADS='1', **env))
    assert r.returncode == 0, r.stderr
    return float(r.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason='glibc only')
def test_a_training_step_maps_no_fresh_pages_once_a_communicator_exists():
    # A 1000x1000 float32 array is 977 pages: without the fix (and with
    # FASTCHAIN_KEEP_MALLOC=1) this script faulted 3,874 pages a step on the
    # project's machine (MPICH 5.0.2); the heap serves them now.
    assert faults_per_step() < 100


def test_the_users_own_setting_is_left_alone():
    _allocator._done.clear()
    try:
        assert _allocator.settle({'MALLOC_TRIM_THRESHOLD_': '0'}) is False
    finally:
        _allocator._done.clear()


@pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason='glibc only')
@pytest.mark.parametrize('value, sets', [('1', False), ('yes', False), ('0', True),
                                         ('false', True), ('', True)])
def test_keep_malloc_reads_its_value(value, sets):
    # any non-empty value counted as "keep", 0 too (a new-user trial)
    _allocator._done.clear()
    try:
        assert _allocator.settle({'FASTCHAIN_KEEP_MALLOC': value}) is sets
    finally:
        _allocator._done.clear()


def test_keep_malloc_with_another_value_is_refused_by_name():
    _allocator._done.clear()
    try:
        with pytest.raises(ValueError, match=r"FASTCHAIN_KEEP_MALLOC='maybe': set it to 1"):
            _allocator.settle({'FASTCHAIN_KEEP_MALLOC': 'maybe'})
    finally:
        _allocator._done.clear()
