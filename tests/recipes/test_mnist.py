"""The MNIST recipe: one process, 2 MPI ranks, resume; its README's diff."""

import difflib
import json
import os
import subprocess
import sys

import numpy
import pytest

HERE = os.path.join(os.path.dirname(__file__), '..', '..', 'recipes', 'mnist')
SCRIPT = os.path.join(HERE, 'train_mnist.py')


@pytest.fixture(scope='module')
def small_mnist(tmp_path_factory):
    """A learnable stand-in for MNIST: 10 classes of 784-pixel vectors."""
    rng = numpy.random.RandomState(0)

    def make(n):
        t = rng.randint(0, 10, n).astype(numpy.int32)
        x = (rng.rand(n, 784) * 0.3).astype(numpy.float32)
        for i, c in enumerate(t):
            x[i, c * 78:(c + 1) * 78] += 0.7
        return x, t
    (xa, ta), (xb, tb) = make(400), make(100)
    path = str(tmp_path_factory.mktemp('mnist') / 'mnist.npz')
    numpy.savez(path, x_train=xa, t_train=ta, x_test=xb, t_test=tb)
    return path


def run(cmd, timeout=300):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def accuracy(out):
    with open(os.path.join(out, 'log')) as f:
        return [e['validation/main/accuracy'] for e in json.load(f)]


def test_one_process(tmp_path, small_mnist):
    run([sys.executable, SCRIPT, '--data', small_mnist, '-e', '3', '-u', '50', '-b', '20',
         '-o', str(tmp_path)])
    acc = accuracy(str(tmp_path))
    assert len(acc) == 3 and acc[-1] > 0.5


@pytest.mark.mpi
def test_two_ranks_and_resume(tmp_path, small_mnist):
    from fastchain.backends import mpi
    base = [mpi.mpiexec_path(), '-n', '2', sys.executable, SCRIPT, '--data', small_mnist,
            '-u', '50', '-b', '20']
    run(base + ['-e', '2', '-o', str(tmp_path / 'a')])
    acc = accuracy(str(tmp_path / 'a'))
    assert len(acc) == 2 and acc[-1] > 0.3      # chance is 0.1
    snapshot = tmp_path / 'a' / 'snapshot_iter_20'   # 200 examples per rank / 20
    assert snapshot.exists()
    run(base + ['-e', '3', '-o', str(tmp_path / 'b'), '--resume', str(snapshot)])
    with open(tmp_path / 'b' / 'log') as f:
        assert [e['epoch'] for e in json.load(f)] == [1, 2, 3]


def test_readme_shows_the_current_diff():
    plain = open(os.path.join(HERE, 'train_mnist_plain.py')).read().splitlines(True)
    ours = open(os.path.join(HERE, 'train_mnist.py')).read().splitlines(True)
    diff = ''.join(difflib.unified_diff(plain, ours, 'train_mnist_plain.py',
                                        'train_mnist.py'))
    assert diff in open(os.path.join(HERE, 'README.md')).read()
