"""The MNIST recipe: one process, 2 MPI ranks, resume; its README's diff."""

import ast
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
    # resumed by another number of processes: named before Chainer restores
    # the iterators (it failed there: "could not broadcast input array from
    # shape (200,) into shape (400,)")
    one = [sys.executable, SCRIPT, '--data', small_mnist, '-u', '50', '-b', '20', '-e', '3']
    r = subprocess.run(one + ['-o', str(tmp_path / 'c'), '--resume', str(snapshot)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and 'broadcast' not in r.stderr, r.stderr[-3000:]
    assert 'this snapshot holds the iterators and statistics of 2 ranks, and this job has ' \
        '1: resume it with mpiexec -n 2' in r.stderr, r.stderr[-3000:]
    run(one + ['-e', '1', '-o', str(tmp_path / 'd')])
    r = subprocess.run(base + ['-e', '3', '-o', str(tmp_path / 'e'), '--resume',
                               str(tmp_path / 'd' / 'snapshot_iter_20')],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and 'broadcast' not in r.stderr, r.stderr[-3000:]
    assert 'this snapshot holds the iterators and statistics of 1 ranks, and this job has ' \
        '2: resume it with mpiexec -n 1' in r.stderr, r.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.parametrize('learner', ['1bit', 'block_momentum'])
def test_the_learner_is_one_argument_and_resumes_from_every_ranks_snapshot(
        tmp_path, small_mnist, learner):
    from fastchain.backends import mpi
    base = [mpi.mpiexec_path(), '-n', '2', sys.executable, SCRIPT, '--data', small_mnist,
            '-u', '50', '-b', '20', '--learner', learner, '--distributed-after', '200']
    run(base + ['-e', '2', '-o', str(tmp_path / 'a')])
    assert accuracy(str(tmp_path / 'a'))[-1] > 0.3      # chance is 0.1
    snapshot = tmp_path / 'a' / 'snapshot_iter_20'
    r = run(base + ['-e', '3', '-o', str(tmp_path / 'b'), '--resume', str(snapshot)])
    assert "rank 0's state only" not in r.stderr         # every rank's part was in it
    with open(tmp_path / 'b' / 'log') as f:
        assert [e['epoch'] for e in json.load(f)] == [1, 2, 3]
    # The learner went on from the snapshot (its count of samples and its
    # phase were loaded before the lazily shaped MLP's first update).
    report = ast.literal_eval(r.stdout.split('learner: ', 1)[1].splitlines()[0])
    assert report['samples'] == 3 * 400 and report['warm_start_over'], report
    assert report['steps'] == 10                          # this run's own steps


def test_the_default_data_are_real_digits_and_nothing_is_downloaded(tmp_path):
    # HOME and Chainer's dataset root in tmp_path: nothing may be fetched or
    # left behind (the old recipe left an empty ~/.chainer/dataset).
    env = dict(os.environ, HOME=str(tmp_path / 'home'),
               CHAINER_DATASET_ROOT=str(tmp_path / 'home' / 'datasets'))
    out = tmp_path / 'out'
    r = subprocess.run([sys.executable, SCRIPT, '-e', '4', '-u', '100', '-o', str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    acc = accuracy(str(out))
    assert len(acc) == 4 and acc[-1] > 0.8      # 8x8 digits; chance is 0.1
    assert not (tmp_path / 'home').exists()


def write_idx(folder, gz, n_train=60, n_test=20):
    """MNIST's four files in IDX form, with images whose class is readable
    from their brightest row."""
    import gzip
    rng = numpy.random.RandomState(1)
    arrays = {}
    for prefix, n in (('train', n_train), ('t10k', n_test)):
        t = rng.randint(0, 10, n).astype(numpy.uint8)
        x = rng.randint(0, 60, (n, 28, 28)).astype(numpy.uint8)
        x[numpy.arange(n), t * 2] = 255
        arrays[prefix] = x, t
        for kind, body, header in (
                ('images-idx3-ubyte', x, [0x803, n, 28, 28]),
                ('labels-idx1-ubyte', t, [0x801, n])):
            raw = b''.join(v.to_bytes(4, 'big') for v in header) + body.tobytes()
            name = folder / '{}-{}{}'.format(prefix, kind, '.gz' if gz else '')
            with (gzip.open if gz else open)(name, 'wb') as f:
                f.write(raw)
    return arrays


def test_a_folder_named_mnist_is_read_not_refused(tmp_path, monkeypatch):
    sys.path.insert(0, HERE)
    try:
        import mnist_data
    finally:
        sys.path.remove(HERE)
    (tmp_path / 'mnist').mkdir()
    write_idx(tmp_path / 'mnist', gz=True)
    monkeypatch.chdir(tmp_path)
    train, test = mnist_data.read('mnist')
    assert len(train) == 60 and len(test) == 20


@pytest.mark.parametrize('gz', [False, True])
def test_mnists_own_files_are_read_and_converted(tmp_path, gz):
    sys.path.insert(0, HERE)
    try:
        import mnist_data
    finally:
        sys.path.remove(HERE)
    arrays = write_idx(tmp_path, gz)
    from chainer.dataset import concat_examples
    train, test = mnist_data.read(str(tmp_path))
    x, t = concat_examples(train[:])
    assert x.shape == (60, 784) and x.dtype == numpy.float32 and t.dtype == numpy.int32
    numpy.testing.assert_array_equal(t, arrays['train'][1])
    numpy.testing.assert_array_equal(x, arrays['train'][0].reshape(60, -1) / numpy.float32(255))
    # The converter writes the same arrays into one .npz, which --data reads.
    npz = tmp_path / 'mnist.npz'
    r = subprocess.run([sys.executable, os.path.join(HERE, 'mnist_data.py'), str(tmp_path),
                        str(npz)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and '60 training and 20 test images' in r.stdout, r.stderr
    again, again_test = mnist_data.read(str(npz))
    numpy.testing.assert_array_equal(concat_examples(again[:])[0], x)
    numpy.testing.assert_array_equal(concat_examples(again_test[:])[1],
                                     concat_examples(test[:])[1])


@pytest.mark.parametrize('case, expected', [
    ('mnist', 'MNIST does not ship with fastchain and the recipe never downloads it'),
    ('missing', 'no such file or folder'),
    ('no_files', 'no train-images-idx3-ubyte (or train-images-idx3-ubyte.gz)'),
    ('corrupt', 'not an IDX image file'),
    ('truncated', 'the file is truncated or corrupt'),
    ('bad_npz', 'not a readable .npz file'),
    ('npy', 'not a readable .npz file (one array, not an archive of four)'),
    ('script', 'not an .npz file (an .npz is a zip archive of arrays)'),
])
def test_data_that_cannot_be_read_is_named_with_the_fix(tmp_path, case, expected):
    spec = str(tmp_path / 'nowhere') if case == 'missing' else str(tmp_path)
    if case == 'mnist':
        spec = 'mnist'
    if case == 'bad_npz':
        numpy.savez(tmp_path / 'm.npz', x_train=numpy.zeros(3))
        spec = str(tmp_path / 'm.npz')
        (tmp_path / 'm.npz').write_bytes((tmp_path / 'm.npz').read_bytes()[:40])
    if case == 'npy':
        numpy.save(tmp_path / 'm.npy', numpy.zeros(3))
        spec = str(tmp_path / 'm.npy')
    if case == 'script':        # numpy's own words were about pickled data
        (tmp_path / 'train.py').write_text('print(1)\n')
        spec = str(tmp_path / 'train.py')
    if case in ('corrupt', 'truncated'):
        write_idx(tmp_path, gz=False)
        name = tmp_path / 'train-images-idx3-ubyte'
        raw = name.read_bytes()
        name.write_bytes(b'<html>' + raw[6:] if case == 'corrupt' else raw[:-10])
    r = subprocess.run([sys.executable, SCRIPT, '--data', spec, '-o', str(tmp_path / 'o')],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr
    assert expected in r.stderr and '--data' in r.stderr, r.stderr


@pytest.mark.parametrize('script', ['train_mnist.py', 'train_mnist_plain.py'])
@pytest.mark.parametrize('argv, expected', [
    (['--epoch', '0'], 'argument --epoch/-e: expected at least 1, got 0'),
    (['-b', '0'], 'argument --batchsize/-b: expected at least 1, got 0'),
    (['-u', 'many'], "argument --unit/-u: expected a whole number, got 'many'")])
def test_a_count_below_one_is_refused_by_name(tmp_path, script, argv, expected):
    """--epoch 0 ended in a ZeroDivisionError inside Chainer's trigger, and
    --batchsize 0 in 'batch is empty', after the data was read."""
    r = subprocess.run([sys.executable, os.path.join(HERE, script)] + argv
                       + ['-o', str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr
    assert expected in r.stderr, r.stderr


def test_readme_shows_the_current_diff():
    plain = open(os.path.join(HERE, 'train_mnist_plain.py')).read().splitlines(True)
    ours = open(os.path.join(HERE, 'train_mnist.py')).read().splitlines(True)
    diff = ''.join(difflib.unified_diff(plain, ours, 'train_mnist_plain.py',
                                        'train_mnist.py'))
    assert diff in open(os.path.join(HERE, 'README.md')).read()


SEEDED = '''
import os, runpy, sys
import numpy
from fastchain import distributed
scatter = distributed.scatter_dataset
if sys.argv[1] == 'in order':       # the data order as the plain script has it
    distributed.scatter_dataset = lambda ds, comm, shuffle=False, **kw: scatter(
        ds, comm, shuffle=False, **kw)
script = sys.argv[2]
sys.argv = [script] + sys.argv[3:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
numpy.random.seed(5)
runpy.run_path(script, run_name='__main__')
'''


def test_the_fastchain_form_trains_as_the_plain_script_in_the_same_order(tmp_path,
                                                                          small_mnist):
    """The README: on one process the logs differ only by scatter_dataset's
    shuffle; in the plain script's order, bit for bit."""
    def train(script, how, out):
        run([sys.executable, '-c', SEEDED, how, os.path.join(HERE, script), '--data',
             small_mnist, '-e', '2', '-u', '50', '-b', '20', '-o', str(tmp_path / out)])
        with open(tmp_path / out / 'log') as f:
            return [{k: v for k, v in e.items() if k != 'elapsed_time'} for e in json.load(f)]
    plain = train('train_mnist_plain.py', 'as is', 'plain')
    assert train('train_mnist.py', 'in order', 'ours') == plain
    assert train('train_mnist.py', 'as is', 'shuffled') != plain
