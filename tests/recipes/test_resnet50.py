"""The ResNet-50 recipe runs for a few iterations on tiny data and resumes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

RECIPE = os.path.join(os.path.dirname(__file__), '..', '..', 'recipes', 'resnet50',
                      'train.py')
TINY = ['--image-size', '32', '--width', '8', '--batch-size', '8',
        '--val-batch-size', '8', '--demo-per-class', '4', '--log-every', '2',
        '--no-progress']


def run(tmp_path, *args, out='out'):
    cmd = [sys.executable, RECIPE, '--demo-root', str(tmp_path / 'demo'),
           '--out', str(tmp_path / out)] + TINY + list(args)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def log_of(tmp_path, out='out'):
    with open(tmp_path / out / 'log') as f:
        return json.load(f)


def test_demo_run_writes_log_plots_snapshot_and_speed_report(tmp_path):
    result = run(tmp_path, '--data', 'demo', '--iterations', '6', '--all')
    out = tmp_path / 'out'
    for name in ('log', 'config.json', 'loss.png', 'accuracy.png', 'snapshot_iter_6',
                 'speed.txt'):
        assert (out / name).exists(), name
    assert '== speed report ==' in result.stdout and 'images/s' in result.stdout
    assert 'validation accuracy' in result.stdout
    config = json.loads((out / 'config.json').read_text())
    assert config['args']['iterations'] == 6 and config['args']['all'] is True
    assert config['args']['loaderjobs'] >= 1       # --all turns the loader on
    # What was in force, as the speed report says it (--all turns static_graph
    # on through enable(), not through the --static-graph flag).
    assert config['written'] == 'at the end of training'
    assert config['enable']['given']['static_graph'] is True
    assert config['enable']['resolved']['static_graph'] is True
    assert config['accelerators']['static_graph']['active'] is True
    assert 'static_graph       active' in result.stdout
    assert config['accelerators']['fused_update']['active'] is True
    log = log_of(tmp_path)
    assert [e['iteration'] for e in log] == [2, 4, 6]
    assert 'validation/main/accuracy' in log[-1]


def test_resume_continues_from_the_snapshot(tmp_path):
    # A run of 8 iterations, and the same run resumed from its snapshot at 4:
    # the same losses and rates, bitwise (the learning rate is not in a
    # snapshot: the resumed run's first update used the optimizer's initial
    # rate instead of the schedule's).
    run(tmp_path, '--data', 'demo', '--iterations', '8', '--snapshot-every', '0.1',
        '--keep-snapshots', '0', '--warmup-epochs', '2')    # 4 iterations an epoch
    snapshot = tmp_path / 'out' / 'snapshot_iter_4'
    assert snapshot.exists()
    run(tmp_path, '--data', 'demo', '--iterations', '8', '--resume', str(snapshot),
        '--warmup-epochs', '2', out='resumed')
    log = log_of(tmp_path, 'resumed')
    assert [e['iteration'] for e in log] == [2, 4, 6, 8]    # the log resumes too
    assert log[-1]['epoch'] >= 1
    keys = ('main/loss', 'main/accuracy', 'lr', 'validation/main/loss')
    whole = {e['iteration']: [e.get(k) for k in keys] for e in log_of(tmp_path)}
    assert [[e.get(k) for k in keys] for e in log[2:]] == [whole[6], whole[8]]
    # another model's snapshot: named, with where the original options are
    # (asked to go on with other options, the model's shape still refuses it)
    cmd = [sys.executable, RECIPE, '--demo-root', str(tmp_path / 'demo'), '--data', 'demo',
           '--out', str(tmp_path / 'wider')] + TINY + ['--width', '16', '--iterations', '8',
                                                       '--warmup-epochs', '2',
                                                       '--resume-with-changes',
                                                       '--resume', str(snapshot)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr[-2000:]
    assert '--resume {}: the snapshot does not fit this run'.format(snapshot) in r.stderr
    assert 'its options are in {}'.format(tmp_path / 'out' / 'config.json') in r.stderr
    # a snapshot at the end of the run: said so (it trained 0 iterations, and
    # said only that they were too few to time)
    same = [sys.executable, RECIPE, '--demo-root', str(tmp_path / 'demo'), '--data', 'demo',
            '--out', str(tmp_path / 'again')] + TINY + ['--iterations', '8', '--warmup-epochs',
                                                        '2', '--resume',
                                                        str(tmp_path / 'out' / 'snapshot_iter_8')]
    r = subprocess.run(same, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and 'the snapshot is at iteration 8, the end of this run' \
        in r.stderr, r.stderr[-2000:]
    # a snapshot cut short, or not a snapshot at all: named, no traceback
    cut = tmp_path / 'cut'
    cut.write_bytes(snapshot.read_bytes()[:20000])
    for path in (cut, tmp_path / 'out' / 'log'):
        r = subprocess.run(cmd[:-1] + [str(path)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr[-2000:]
        assert '--resume {}: not a snapshot this recipe can read'.format(path) in r.stderr


def test_list_format_directory_and_yaml_config(tmp_path):
    run(tmp_path, '--data', 'demo', '--iterations', '2')     # makes the files
    (tmp_path / 'cfg.yaml').write_text('iterations: 2\nlabel_smoothing: 0.1\n')
    run(tmp_path, '--data', str(tmp_path / 'demo'), '--config', str(tmp_path / 'cfg.yaml'),
        out='listed')
    config = json.loads((tmp_path / 'listed' / 'config.json').read_text())['args']
    assert config['label_smoothing'] == 0.1 and config['data'] == str(tmp_path / 'demo')


def test_snapshots_are_kept_to_the_limit_with_a_final_one_or_none(tmp_path):
    # 40 training images / batch 8: 5 iterations an epoch; a snapshot every 2
    # (2, 4, 6) and one at the end of a run that is not a whole number of them.
    result = run(tmp_path, '--data', 'demo', '--iterations', '7', '--snapshot-every', '0.4',
                 '--keep-snapshots', '2')
    names = sorted(p.name for p in (tmp_path / 'out').iterdir() if 'snapshot' in p.name)
    assert names == ['snapshot_iter_6', 'snapshot_iter_7']
    size = (tmp_path / 'out' / 'snapshot_iter_7').stat().st_size
    assert 'snapshots: 2 kept in {} (newest snapshot_iter_7, {:.0f} MB;'.format(
        tmp_path / 'out', size / 1e6) in result.stdout
    result = run(tmp_path, '--data', 'demo', '--iterations', '3', '--no-snapshots',
                 out='none')
    assert not [p for p in (tmp_path / 'none').iterdir() if 'snapshot' in p.name]
    assert 'snapshots: none (--no-snapshots)' in result.stdout


def test_a_run_too_short_to_time_says_so(tmp_path):
    result = run(tmp_path, '--data', 'synthetic', '--iterations', '3', '--no-snapshots')
    line = next(l for l in result.stdout.splitlines() if l.startswith('training:'))
    assert line.startswith('training: not measured: 3 iteration(s) are too few'), line
    assert 'n/a' not in line and 'over 1 iterations' not in line


def test_the_timeline_is_written_and_its_files_named(tmp_path):
    trace = tmp_path / 'tl' / 'trace.json'
    result = run(tmp_path, '--data', 'synthetic', '--iterations', '4', '--no-snapshots',
                 '--timeline', str(trace))
    [line] = [l for l in result.stdout.splitlines() if l.startswith('timeline:')]
    for name in ('trace.json', 'trace.txt'):
        assert str(tmp_path / 'tl' / name) in line and (tmp_path / 'tl' / name).exists()
    with open(trace) as f:
        assert json.load(f)['traceEvents']
    assert 'forward' in (tmp_path / 'tl' / 'trace.txt').read_text()


def test_synthetic_data(tmp_path):
    result = run(tmp_path, '--data', 'synthetic', '--iterations', '2', '--fp16')
    assert 'fp16               active' in result.stdout


def test_bad_data_path_and_bad_config(tmp_path):
    cmd = [sys.executable, RECIPE, '--data', str(tmp_path / 'nothing'), '--out',
           str(tmp_path / 'o')] + TINY
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and 'nothing: no such directory' in r.stderr
    assert "expected 'demo', 'synthetic'" in r.stderr
    # a config file's values are checked as the command line's are
    for text, message in (('itrations: 2', "unknown option 'itrations' (did you mean "
                                           "'iterations'?)"),
                          ('image-size: 48', "(did you mean 'image_size'?)"),
                          ('schedule: linear', "schedule (--schedule): 'linear' is not one "
                                               'of cosine, step'),
                          ('depth: 42', 'depth (--depth): 42 is not one of 18, 34, 50'),
                          ('batch_size: eight', "expected an int, got 'eight'"),
                          ('all: 3', 'all (--all): expected true or false, got 3'),
                          ('batch_size: null', 'batch_size (--batch-size): expected a value '
                                               '(its default is 32)'),
                          ('epochs: yes', 'epochs (--epochs): expected a float, got True')):
        (tmp_path / 'bad.yaml').write_text(text + '\n')
        r = subprocess.run(cmd[:2] + ['--config', str(tmp_path / 'bad.yaml')],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and message in r.stderr, (text, r.stderr[-500:])
        assert 'Traceback' not in r.stderr
    r = subprocess.run(cmd[:2] + ['--config', str(tmp_path / 'absent.yaml')],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and 'absent.yaml: No such file or directory' in r.stderr


def _recipe_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location('resnet50_train', RECIPE)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    return train


@pytest.mark.parametrize('argv, message', [
    (['--iterations', '0'], '--iterations 0: expected a number above 0'),
    (['--epochs', '-1'], '--epochs -1.0: expected a number above 0'),
    (['--log-every', '0'], '--log-every 0: expected a number above 0'),
    (['--batch-size', '0'], '--batch-size 0: expected a number above 0'),
    (['--width', '0'], '--width 0: expected a number above 0'),
    (['--weight-decay', '-0.1'], '--weight-decay -0.1: expected a number >= 0'),
    (['--label-smoothing', '1'], '--label-smoothing 1.0: expected a number below 1'),
    (['--momentum', '1.5'], '--momentum 1.5: expected a number below 1'),
])
def test_numbers_out_of_range_are_refused_by_name(argv, message, capsys):
    """Before: --iterations 0 trained the default 90 epochs; --epochs 0 or
    --log-every 0 ended in a ZeroDivisionError after the set-up."""
    with pytest.raises(SystemExit) as e:
        _recipe_module().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def _image_folders(root, broken=None, broken_val=None):
    """train/ and val/ with two classes of small JPEGs; ``broken``
    (``broken_val``): a train (val) file cut short."""
    from PIL import Image
    import numpy
    rng = numpy.random.RandomState(0)
    for split, n in (('train', 8), ('val', 2)):
        for label in ('a', 'b'):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = rng.randint(0, 256, (40, 40, 3)).astype(numpy.uint8)
                Image.fromarray(pixels).save(folder / '{}.jpg'.format(i))
    for split, name in (('train', broken), ('val', broken_val)):
        if name:
            path = root / split / name
            path.write_bytes(path.read_bytes()[:200])


def test_bad_images_stop_with_the_fix_or_are_skipped_and_counted(tmp_path):
    _image_folders(tmp_path / 'ds', broken='a/3.jpg', broken_val='b/1.jpg')
    cmd = [sys.executable, RECIPE, '--data', str(tmp_path / 'ds'), '--out',
           str(tmp_path / 'o'), '--iterations', '4', '--no-snapshots'] + TINY
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert 'a/3.jpg' in r.stderr and 'run with --skip-bad-images' in r.stderr
    r = subprocess.run(cmd + ['--skip-bad-images'], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    log = json.loads((tmp_path / 'o' / 'log').read_text())
    # 16 training images, batch 8, 4 iterations (two epochs), logged every 2:
    # the broken one is left out twice, the log's mean per iteration says so
    assert [e['skipped_examples'] * 2 for e in log] == [1, 1], log
    # the validation image left out is counted too (it was lost: its report
    # was made outside the evaluator's observation)
    assert log[-1]['validation/skipped_examples'] == 1, log[-1]
    listed = json.loads((tmp_path / 'o' / 'skipped.json').read_text())
    assert [(f['file'].endswith('a/3.jpg'), f['times']) for f in listed['training']] == \
        [(True, 2)]
    assert [f['file'].endswith('b/1.jpg') for f in listed['validation']] == [True]
    assert 'left out 1 training image (2 times) and 1 validation image (1 time); ' \
        'listed in' in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize('processes', [1, 2])
def test_a_resumed_run_lists_the_images_left_out_before_its_snapshot(tmp_path, processes):
    """skipped.json of a run resumed at epoch 2 of 4 equals the uninterrupted
    run's: the loaders' lists start afresh on a resume, and held only the
    images left out after it (2 of the 4 times, with the log saying 4).
    Under MPI every process's are gathered into rank 0's snapshot."""
    _image_folders(tmp_path / 'ds', broken='a/3.jpg', broken_val='b/1.jpg')
    cmd = [sys.executable, RECIPE, '--data', str(tmp_path / 'ds'), '--epochs', '4',
           '--skip-bad-images'] + TINY
    if processes > 1:
        from fastchain.backends import mpi
        cmd = [mpi.mpiexec_path(), '-n', str(processes)] + cmd + ['--batch-size', '4']
    said = []
    for out, more in (('whole', []), ('half', ['--epochs', '2']),
                      ('resumed', ['--resume', str(tmp_path / 'half' / 'snapshot_iter_4')])):
        r = subprocess.run(cmd + ['--out', str(tmp_path / out)] + more, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        said.append(r.stdout.splitlines())
    listed = [json.loads((tmp_path / out / 'skipped.json').read_text())
              for out in ('whole', 'resumed')]
    times = [[(f['file'][-7:], f['times']) for f in found['training'] + found['validation']]
             for found in listed]
    assert times[0] == [('a/3.jpg', 4), ('b/1.jpg', 4)], times
    assert times[1] == times[0]
    line = [x for x in said[2] if x.startswith('--skip-bad-images: left out')]
    assert line and line[0].startswith('--skip-bad-images: left out 1 training image (4 times) '
                                       'and 1 validation image (4 times)'), said[2][-5:]


def test_a_list_format_dataset_beside_a_train_folder_is_read_as_lists(tmp_path):
    """train.txt takes precedence: a train/ folder beside it without val/
    is not an error (the validation images may live elsewhere)."""
    root = tmp_path / 'ds'
    _image_folders(root)
    (root / 'val').rename(root / 'held_out')
    for name, folder in (('train.txt', 'train'), ('val.txt', 'held_out')):
        lines = ['{}/{}/{} {}'.format(folder, label, f.name, i)
                 for i, label in enumerate(('a', 'b'))
                 for f in sorted((root / folder / label).iterdir())]
        (root / name).write_text('\n'.join(lines) + '\n')
    cmd = [sys.executable, RECIPE, '--data', str(root), '--out', str(tmp_path / 'o'),
           '--iterations', '1', '--no-snapshots'] + TINY
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_dataset_without_validation_and_a_missing_snapshot_are_named(tmp_path):
    _image_folders(tmp_path / 'ds')
    import shutil
    shutil.rmtree(tmp_path / 'ds' / 'val')
    cmd = [sys.executable, RECIPE, '--out', str(tmp_path / 'o'), '--iterations', '2'] + TINY
    r = subprocess.run(cmd + ['--data', str(tmp_path / 'ds')], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and 'has train but no val' in r.stderr, r.stderr[-1000:]
    r = subprocess.run(cmd + ['--data', 'synthetic', '--resume', str(tmp_path / 'nope')],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and 'nope: no such file (no snapshot_iter_N in {})'.format(
        tmp_path) in r.stderr, r.stderr[-1000:]


def test_validation_folders_take_the_training_classes(tmp_path):
    """val/ without a class is validated on the others, labelled as train/
    labels them (before, every later label shifted); a class train/ lacks
    is refused by name."""
    _image_folders(tmp_path / 'ds')
    import shutil
    shutil.rmtree(tmp_path / 'ds' / 'val' / 'a')
    cmd = [sys.executable, RECIPE, '--data', str(tmp_path / 'ds'), '--out', str(tmp_path / 'o'),
           '--iterations', '1', '--no-snapshots'] + TINY
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'val/ has no folder for 1 of the 2 classes (a); they are not validated' in r.stdout
    shutil.copytree(tmp_path / 'ds' / 'val' / 'b', tmp_path / 'ds' / 'val' / 'c')
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and 'class folder(s) c are not among the 2 classes' in r.stderr
    assert 'Traceback' not in r.stderr


def test_epochs_that_come_to_no_iteration_are_refused(tmp_path):
    r = subprocess.run([sys.executable, RECIPE, '--data', 'synthetic', '--epochs', '0.001',
                        '--out', str(tmp_path / 'o')] + TINY, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr[-1000:]
    assert '--epochs 0.001: less than one of the 8 iterations an epoch has' in r.stderr


def test_loaderjobs_0_keeps_the_loader_off_even_with_all(tmp_path):
    result = run(tmp_path, '--data', 'synthetic', '--iterations', '2', '--all',
                 '--loaderjobs', '0', '--no-snapshots')
    assert 'loader             off: loading in the main process' in result.stdout
    config = json.loads((tmp_path / 'out' / 'config.json').read_text())
    assert config['args']['loaderjobs'] == 0
    r = subprocess.run([sys.executable, RECIPE, '--data', 'synthetic', '--loaderjobs', '-2',
                        '--out', str(tmp_path / 'o')] + TINY, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and '--loaderjobs -2: give how many loader processes' in r.stderr


def test_fp32_keeps_all_in_fp32_and_contradicting_fp16_is_refused(tmp_path, monkeypatch):
    # what --all and --fp32 ask of enable() (on a CPU fp16='auto' is off
    # anyway: the options themselves are what a GPU would get)
    import importlib.util
    import fastchain
    spec = importlib.util.spec_from_file_location('resnet50_train', RECIPE)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    asked = []
    monkeypatch.setattr(fastchain, 'enable', lambda **options: asked.append(options))
    train.enable_accelerators(train.parse_args(['--all']))
    train.enable_accelerators(train.parse_args(['--all', '--fp32']))
    train.enable_accelerators(train.parse_args(['--all', '--no-autotune']))
    assert [a['fp16'] for a in asked] == ['auto', False, 'auto']
    assert [a['autotune'] for a in asked] == [None, None, False]
    result = run(tmp_path, '--data', 'synthetic', '--iterations', '2', '--all', '--fp32')
    assert 'fp16               off' in result.stdout
    r = subprocess.run([sys.executable, RECIPE, '--data', 'synthetic', '--fp16', '--fp32',
                        '--out', str(tmp_path / 'o')] + TINY, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and '--fp16 and --fp32 contradict each other' in r.stderr
    r = subprocess.run([sys.executable, RECIPE, '--data', 'synthetic', '--autotune',
                        '--no-autotune', '--out', str(tmp_path / 'o')] + TINY,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and '--autotune and --no-autotune contradict' in r.stderr


def test_a_gpu_that_cannot_be_used_is_named_with_the_fix(tmp_path):
    from fastchain.backends import cuda
    status = cuda.cupy_status()
    if status.available:
        pytest.skip('a GPU is usable here')
    r = subprocess.run([sys.executable, RECIPE, '--data', 'synthetic', '--device', '@cupy:0',
                        '--out', str(tmp_path / 'o')] + TINY, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().endswith('device @cupy:0: {} (fix: {}; or run on the CPU: '
                                     '@numpy)'.format(status.why, status.fix)), r.stderr
    assert 'Traceback' not in r.stderr


@pytest.mark.mpi
def test_data_parallel_under_mpiexec_with_resume(tmp_path):
    from fastchain.backends import mpi
    common = [mpi.mpiexec_path(), '-n', '2', sys.executable, RECIPE, '--data', 'demo',
              '--demo-root', str(tmp_path / 'demo')] + TINY + ['--batch-size', '4']
    r = subprocess.run(common + ['--iterations', '4', '--snapshot-every', '0.1',
                                 '--out', str(tmp_path / 'dp')],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count('== speed report ==') == 1          # rank 0 only
    assert 'global batch 8 = 2 process(es) x 4' in r.stdout
    config = json.loads((tmp_path / 'dp' / 'config.json').read_text())
    assert config['processes'] == 2
    assert 'BLAS/OpenMP thread(s) per process' in r.stderr      # said by rank 0
    r = subprocess.run(common + ['--iterations', '6', '--resume',
                                 str(tmp_path / 'dp' / 'snapshot_iter_4'),
                                 '--out', str(tmp_path / 'dp2')],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    log = log_of(tmp_path, 'dp2')
    assert [e['iteration'] for e in log] == [2, 4, 6]
    # under mpiexec --seed chose each process's shard: another is refused,
    # said once; one process cannot go on from two, even when asked to
    snapshot = str(tmp_path / 'dp' / 'snapshot_iter_4')
    r = subprocess.run(common + ['--iterations', '6', '--resume', snapshot, '--seed', '7',
                                 '--out', str(tmp_path / 'dp3')],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and r.stderr.count('--seed 0 there, 7 here') == 1, \
        r.stderr[-4000:]
    r = subprocess.run(common[3:] + ['--iterations', '6', '--resume', snapshot,
                                     '--resume-with-changes', '--out', str(tmp_path / 'one')],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr[-4000:]
    assert 'the run that wrote it had processes 2 there, 1 here' in r.stderr
    assert 'cannot change on a resume' in r.stderr and 'broadcast' not in r.stderr
    # a file that is no snapshot: one message, not a note about older recipes first
    cut = tmp_path / 'cut'
    cut.write_bytes(open(snapshot, 'rb').read()[:5000])
    r = subprocess.run(common[3:] + ['--iterations', '6', '--resume', str(cut), '--out',
                                     str(tmp_path / 'cutout')],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and 'not a snapshot this recipe can read' in r.stderr
    assert 'records no settings' not in r.stderr, r.stderr


def test_data_parallel_skip_bad_images_lists_every_processs_images(tmp_path):
    """skipped.json and the closing line hold what every rank left out (the
    broken training image is in one rank's shard, whichever it is)."""
    from fastchain.backends import mpi
    _image_folders(tmp_path / 'ds', broken='a/3.jpg', broken_val='b/1.jpg')
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, RECIPE, '--data',
                        str(tmp_path / 'ds'), '--out', str(tmp_path / 'o'), '--epochs', '2',
                        '--no-snapshots', '--skip-bad-images'] + TINY + ['--batch-size', '4'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    listed = json.loads((tmp_path / 'o' / 'skipped.json').read_text())
    assert [(f['file'].endswith('a/3.jpg'), f['times']) for f in listed['training']] == \
        [(True, 2)]                 # two epochs
    assert [(f['file'].endswith('b/1.jpg'), f['times']) for f in listed['validation']] == \
        [(True, 2)]                 # two evaluations
    assert r.stdout.count('--skip-bad-images: left out 1 training image (2 times)') == 1


@pytest.mark.gpu
def test_all_accelerators_on_a_gpu(tmp_path):
    result = run(tmp_path, '--data', 'demo', '--iterations', '6', '--all',
                 '--device', '@cupy:0')
    from fastchain.backends import cuda
    expected = ['cudnn', 'autotune', 'static_graph']
    if cuda.tensor_cores_available():       # fp16='auto' needs TensorCores
        expected.append('fp16')
    for name in expected:
        line = next(l for l in result.stdout.splitlines() if l.strip().startswith(name))
        assert 'active' in line, line
    # 'active' says the cache is set up; a cache that fell back to
    # define-by-run says so only in its warning
    assert 'StaticGraphFallback' not in result.stderr, result.stderr[-3000:]


def test_the_log_shows_the_rate_each_update_used_from_the_first(tmp_path):
    # linear warm-up: the first update's rate is base/W, the second's 2 base/W
    # (the first update ran at the full base rate, and the log showed each
    # update's next rate)
    run(tmp_path, '--data', 'demo', '--iterations', '3', '--log-every', '1',
        '--warmup-epochs', '5')
    lrs = [e['lr'] for e in log_of(tmp_path)]
    assert lrs[1:] == pytest.approx([2 * lrs[0], 3 * lrs[0]], rel=1e-12), lrs


def test_the_step_schedule_follows_the_runs_length_given_in_iterations():
    sys.path.insert(0, os.path.dirname(RECIPE))
    import train
    args = train.parse_args(['--schedule', 'step', '--warmup-epochs', '0', '--iterations',
                             '90'])
    schedule = train.lr_at(args, 1.0, 10, 90)           # 90 iterations, not 90 epochs
    assert [schedule(i) for i in (0, 29, 30, 59, 60, 79, 80, 89)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01, 0.01, 0.001, 0.001])


def test_an_fp16_snapshot_resumed_in_fp32_starts_from_its_fp32_masters(tmp_path):
    import chainer
    import chainer.links as L
    import numpy
    sys.path.insert(0, os.path.dirname(RECIPE))
    import train
    rng = numpy.random.RandomState(0)
    masters = {'l.W': rng.standard_normal((3, 4)).astype(numpy.float32),
               'l.b': rng.standard_normal(3).astype(numpy.float32)}
    path = str(tmp_path / 'snap.npz')
    numpy.savez(path, **{'updater/optimizer:main/fastchain_fp32_masters/' + k: v
                         for k, v in masters.items()},
                **{'updater/model:main/l/W': masters['l.W'].astype(numpy.float16)})

    def model(dtype):
        with chainer.using_config('dtype', dtype):
            m = chainer.Chain()
            with m.init_scope():
                m.l = L.Linear(4, 3)
        return m

    fp32 = model(numpy.float32)
    assert train.fp32_masters_into(path, fp32) == 2
    assert (fp32.l.W.array == masters['l.W']).all() and (fp32.l.b.array == masters['l.b']).all()
    fp16 = model(numpy.float16)         # fp16 weights: its optimizer loads the masters
    before = fp16.l.W.array.copy()
    assert train.fp32_masters_into(path, fp16) == 0 and (fp16.l.W.array == before).all()
    # end to end: the recipe says so
    run(tmp_path, '--data', 'demo', '--iterations', '2', '--fp16', '--warmup-epochs', '0')
    r = run(tmp_path, '--data', 'demo', '--iterations', '3', '--warmup-epochs', '0',
            '--resume', str(tmp_path / 'out' / 'snapshot_iter_2'), out='fp32')
    assert 'was written by an fp16 run: this fp32 run resumes from its' in r.stderr, r.stderr


def _disturbed_run(tmp_path, args, disturb, **popen):
    """The recipe on the demo data for a run too long to end by itself, with
    ``args``; ``disturb(proc)`` is called once it runs. (status, stderr)."""
    cmd = [sys.executable, RECIPE, '--demo-root', str(tmp_path / 'demo'), '--out',
           str(tmp_path / 'out'), '--data', 'demo', '--iterations', '100000'] + args + TINY
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)
    try:
        disturb(proc)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def test_ctrl_c_ends_the_run_saying_how_to_go_on(tmp_path):
    out = tmp_path / 'out'

    def ctrl_c(proc):
        deadline = time.monotonic() + 120
        while not list(out.glob('snapshot_iter_*')) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)

    # a terminal's SIGINT (a job started in the background inherits it ignored)
    status, err = _disturbed_run(
        tmp_path, ['--snapshot-every', '0.1'], ctrl_c,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert status == 130, err[-3000:]
    assert 'Traceback' not in err, err[-3000:]
    newest = max(out.glob('snapshot_iter_*'), key=os.path.getmtime)
    assert 'interrupted at iteration' in err and '--resume {}'.format(newest) in err, err


def test_a_killed_loader_worker_ends_the_run_with_one_message(tmp_path):
    def cmdline(pid):
        with open('/proc/{}/cmdline'.format(pid), 'rb') as f:
            return f.read()

    def kill_a_worker(proc):
        # the loaders' workers are forks (the recipe's command line; not
        # multiprocessing's resource tracker), the training loader's first
        deadline, workers = time.monotonic() + 120, []
        while len(workers) < 4 and time.monotonic() < deadline:
            time.sleep(0.5)
            with open('/proc/{}/task/{}/children'.format(proc.pid, proc.pid)) as f:
                workers = sorted(int(p) for p in f.read().split()
                                 if cmdline(p) == cmdline(proc.pid))
        time.sleep(1)
        os.kill(workers[0], signal.SIGKILL)

    status, err = _disturbed_run(tmp_path, ['--loaderjobs', '2', '--no-snapshots'],
                                 kill_a_worker)
    assert status == 1, err[-3000:]
    assert 'Traceback' not in err, err[-3000:]
    assert 'was killed by signal SIGKILL' in err and 'run out of memory' in err, err[-3000:]


@pytest.mark.parametrize('jobs', ['0', '2'])
def test_no_image_loading_is_named_with_skip_bad_images_too(tmp_path, jobs):
    for split in ('train', 'val'):
        folder = tmp_path / 'ds' / split / 'a'
        folder.mkdir(parents=True)
        for i in range(8):
            (folder / '{}.jpg'.format(i)).write_bytes(b'not a jpeg' * 20)
    r = subprocess.run([sys.executable, RECIPE, '--data', str(tmp_path / 'ds'), '--out',
                        str(tmp_path / 'o'), '--iterations', '4', '--no-snapshots',
                        '--skip-bad-images', '--loaderjobs', jobs] + TINY,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr[-3000:]
    assert 'fix: check --data {}'.format(tmp_path / 'ds') in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize('release', [False, True])
def test_ctrl_c_inside_a_snapshots_writing_leaves_no_noise_at_exit(tmp_path, release):
    # what the interrupt leaves when it comes while a snapshot's zip is
    # written: its ZipFile, whose file is closed under it, complains when
    # collected ("Exception ignored ... seek of closed file")
    code = '''
import sys, zipfile
sys.path.insert(0, {recipe_dir!r})
import train

def write(path):
    f = open(path, 'wb')
    z = zipfile.ZipFile(f, 'w')
    z.writestr('a', b'x')
    f.close()
    raise KeyboardInterrupt

try:
    write({path!r})
except KeyboardInterrupt as e:
    if {release!r}:
        train.release_quietly(e.__traceback__)
'''.format(recipe_dir=os.path.dirname(RECIPE), path=str(tmp_path / 'snap'), release=release)
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert ('Exception ignored' in r.stderr) is not release, r.stderr


def test_a_resume_with_other_training_options_is_refused_naming_each(tmp_path):
    """A resumed run took new hyper-parameters without a word (the README's
    own resume command without its --config changed the learning rate and
    the warm-up): the snapshot keeps them and a change is named; asked for,
    it goes on, saying so. --epochs and --iterations may change."""
    run(tmp_path, '--data', 'demo', '--iterations', '4', '--warmup-epochs', '2',
        '--label-smoothing', '0.1')
    snapshot = str(tmp_path / 'out' / 'snapshot_iter_4')
    base = [sys.executable, RECIPE, '--demo-root', str(tmp_path / 'demo'), '--data', 'demo',
            '--iterations', '6', '--resume', snapshot] + TINY
    r = subprocess.run(base + ['--out', str(tmp_path / 'b'), '--lr', '0.5'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr[-2000:]
    assert ('--resume {}: the run that wrote it trained with other settings: --label-smoothing '
            '0.1 there, 0.0 here; --lr 0.1 there, 0.5 here; --warmup-epochs 2.0 there, 1.0 '
            'here.'.format(snapshot)) in r.stderr, r.stderr[-2000:]
    assert '(they are in {})'.format(tmp_path / 'out' / 'config.json') in r.stderr
    assert not (tmp_path / 'b' / 'log').exists()
    r = subprocess.run(base + ['--out', str(tmp_path / 'c'), '--lr', '0.5', '--warmup-epochs',
                               '2', '--label-smoothing', '0.1', '--resume-with-changes'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'note: --resume-with-changes: going on from {} with --lr 0.1 there, 0.5 here'.format(
        snapshot) in r.stderr
    run(tmp_path, '--data', 'demo', '--iterations', '6', '--resume', snapshot,
        '--warmup-epochs', '2', '--label-smoothing', '0.1', out='d')
    # a snapshot written before the record was kept: said, not refused
    import numpy
    with numpy.load(snapshot) as npz:
        arrays = {k: npz[k] for k in npz.files if k != 'extensions/run_record/json'}
    numpy.savez(str(tmp_path / 'older.npz'), **arrays)
    r = run(tmp_path, '--data', 'demo', '--iterations', '6', '--resume',
            str(tmp_path / 'older.npz'), '--warmup-epochs', '2', '--label-smoothing', '0.1',
            out='e')
    assert 'older.npz records no settings' in r.stderr
    # a folder given: its newest snapshot named
    r = subprocess.run(base[:-len(TINY) - 1] + [str(tmp_path / 'out')] + TINY +
                       ['--out', str(tmp_path / 'f')], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and '--resume {}: a folder; give a snapshot file (the newest in ' \
        '{} is {})'.format(tmp_path / 'out', tmp_path / 'out', snapshot) in r.stderr, r.stderr


def test_a_batch_larger_than_the_dataset_and_an_unusable_out_are_refused(tmp_path):
    """A batch of 1000 from 40 images ran 25 epochs an iteration, each image
    25 times a batch; an --out or --timeline that cannot be made ended in a
    traceback."""
    for extra, said in ((['--batch-size', '1000'], '--batch-size 1000: the global batch (1 '
                         'process(es) x 1000) is larger than the 40 training examples'),
                        (['--out', '/dev/null/x'], '--out /dev/null/x: cannot make the '
                         'folder'),
                        (['--timeline', '/dev/null/x/t.json'], '--timeline /dev/null/x/t.json: '
                         'cannot make the folder')):
        r = subprocess.run([sys.executable, RECIPE, '--demo-root', str(tmp_path / 'demo'),
                            '--data', 'demo', '--iterations', '2', '--out',
                            str(tmp_path / 'o')] + TINY + extra, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 1 and said in r.stderr and 'Traceback' not in r.stderr, \
            r.stderr[-2000:]
    # synthetic data is sized by the batch (8 of one process): not refused at any scale
    # (it was on 9 processes or more)
    recipe = _recipe_module()
    args = recipe.parse_args(['--data', 'synthetic', '--batch-size', '4'])
    train, _, _ = recipe.make_datasets(args)
    assert len(train) == 32 and recipe.batch_too_large(args, 16, len(train)) is None
    args.data = 'demo'
    assert recipe.batch_too_large(args, 16, 32).startswith('--batch-size 4: the global batch '
                                                           '(16 process(es) x 4)')
    assert recipe.batch_too_large(args, 8, 32) is None


def test_config_json_and_the_speed_report_agree_on_the_recipes_loader(tmp_path):
    """config.json said the loader was off (enable()'s, which the recipe
    turns off to build its own) where the speed report said 2 workers; an
    accelerator off with no reason said only 'off'."""
    result = run(tmp_path, '--data', 'synthetic', '--iterations', '2', '--loaderjobs', '1',
                 '--no-snapshots')
    config = json.loads((tmp_path / 'out' / 'config.json').read_text())
    assert config['accelerators']['loader']['active'] is True
    assert config['accelerators']['loader']['note'].startswith('1 worker process + device')
    assert 'loader_workers' not in config['enable']['given']
    assert 'loader             active: 1 worker process + device prefetch' in result.stdout
    assert 'static_graph       off (not asked for: --static-graph or --all)' in result.stdout


def test_a_value_out_of_range_from_a_config_file_names_the_file(tmp_path, capsys):
    config = tmp_path / 'c.yaml'
    config.write_text('epochs: 0\n')
    with pytest.raises(SystemExit) as e:
        _recipe_module().parse_args(['--config', str(config)])
    assert e.value.code == 2
    assert '--epochs 0.0 (from --config {}): expected a number above 0'.format(config) in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):         # given on the command line: not the file's
        _recipe_module().parse_args(['--config', str(config), '--epochs', '-2'])
    err = capsys.readouterr().err
    assert '--epochs -2.0: expected' in err and 'from --config' not in err
