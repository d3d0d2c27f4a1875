"""benchmarks/gpu_check.py, the one command for a GPU node, tried on the CPU:
each step runs in its own process, its status and figures land in
gpu_check.json, and the GPU-only steps say why they were skipped."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from tests.helpers import gone

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmarks',
                      'gpu_check.py')


def test_the_steps_run_and_report_on_a_cpu(tmp_path):
    out = tmp_path / 'gpu'
    r = subprocess.run([sys.executable, SCRIPT, '--quick', '--device', '@numpy',
                        '--steps', 'doctor,gpu_tests,nvtx', '--image-size', '32',
                        '--batch', '2', '--results', str(out), '--pack',
                        str(tmp_path / 'gpu.tar.gz')],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = json.loads((out / 'gpu_check.json').read_text())['steps']
    assert steps['doctor']['status'] == 'ok'
    assert json.loads((out / 'doctor.json').read_text())['fastchain']
    # The GPU tests' files collect and skip here with their reason.
    assert steps['gpu_tests']['status'] == 'ok', steps['gpu_tests']
    assert 'needs a CUDA GPU' in (out / 'logs' / 'gpu_tests.log').read_text()
    nvtx = steps['nvtx']
    if nvtx['status'].startswith('skipped'):
        assert 'recorder not built' in nvtx['status']
    else:
        assert nvtx['status'] == 'ok', nvtx
        assert nvtx['figures']['nvtx_pushes'] == nvtx['figures']['nvtx_pops'] > 0
        assert nvtx['figures']['images_per_s'] > 0
        # the step breakdown of what the recorder received (30 steps, 5 left out)
        figures = nvtx['figures']
        assert figures['steps_summarized'] == 25, figures
        assert 0 < figures['phase_ms']['forward'] < figures['step_ms']
        assert 'fastchain step breakdown (25 steps, 5 warm-up left out)' in \
            (out / 'logs' / 'nvtx_summary.txt').read_text()
    with tarfile.open(tmp_path / 'gpu.tar.gz') as tar:
        names = tar.getnames()
    assert 'gpu/gpu_check.json' in names and not any(n.endswith('.so') for n in names)


def test_an_unknown_step_is_refused():
    r = subprocess.run([sys.executable, SCRIPT, '--steps', 'doctr'], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and 'unknown step(s) doctr; choose from doctor' in r.stderr


def load_script():
    spec = importlib.util.spec_from_file_location('gpu_check', SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A step that starts a child, says so, and ignores SIGTERM: only the kill of
# its whole group ends both.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])
print('CHILD-PID', child.pid)
time.sleep(120)
"""


def test_a_step_past_its_time_is_killed_with_its_children_and_keeps_its_output(
        tmp_path, monkeypatch):
    gpu_check = load_script()
    monkeypatch.setattr(gpu_check, 'GRACE_SECONDS', 1)
    (tmp_path / 'logs').mkdir()
    start = time.monotonic()
    result = gpu_check.run_step('stubborn', [sys.executable, '-c', STUBBORN], {}, 3,
                                str(tmp_path))
    assert result['status'] == 'timed out after 3 s'
    assert time.monotonic() - start < 30
    log = (tmp_path / 'logs' / 'stubborn.log').read_text()
    pid = int(re.search(r'^CHILD-PID (\d+)$', log, re.M).group(1))   # printed live
    assert gone(pid), 'the step\'s child outlived the step'


# A GPU test file in miniature: one passes, one is an expected failure with
# its reason, one hangs past the step's limit with a child that ignores
# SIGINT (as a loader worker does).
HANGING_TESTS = """
import subprocess, sys, time, pytest
def test_passes():
    pass
def test_refused():
    pytest.xfail('cuDNN refused the key: REASON-X')
def test_hangs():
    child = subprocess.Popen([sys.executable, '-c', 'import signal, time; '
                              'signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(120)'])
    with open({pid_file!r}, 'w') as f:
        f.write(str(child.pid))
    time.sleep(120)
"""


def test_a_pytest_step_past_its_time_still_reports_every_reason_and_the_hung_test(
        tmp_path, monkeypatch, request):
    """On the node the first run's GPU tests were cut at their limit and
    the kill took pytest's summary with it: which keys cuDNN refused and
    why, and which test failed, were lost. A pytest step is interrupted
    first, so pytest writes that summary."""
    gpu_check = load_script()
    # margins for a loaded machine: pytest may take seconds to start there,
    # and seconds to write its summary
    monkeypatch.setattr(gpu_check, 'INTERRUPT_SECONDS', 10)
    # as when gpu_check itself was started in the background (a shell's &):
    # SIGINT ignored, which its steps would inherit
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    monkeypatch.setattr(gpu_check, 'GRACE_SECONDS', 1)
    (tmp_path / 'logs').mkdir()
    tests = tmp_path / 'test_node.py'
    pid_file = tmp_path / 'child.pid'
    tests.write_text(HANGING_TESTS.format(pid_file=str(pid_file)))
    argv = [sys.executable, '-m', 'pytest', '-p', 'no:cacheprovider'] + \
        gpu_check.PYTEST_REPORT + [str(tests)]
    start = time.monotonic()
    result = gpu_check.run_step('gpu_tests', argv, {}, 24, str(tmp_path))
    assert result['status'] == 'timed out after 24 s (interrupted at 14 s so pytest wrote ' \
        'its summary)'
    assert time.monotonic() - start < 45
    log = (tmp_path / 'logs' / 'gpu_tests.log').read_text()
    assert 'test_passes PASSED' in log                  # -v: each outcome as it came
    assert 'REASON-X' in log                            # the xfail's reason, from -rx
    assert 'test_hangs' in log and 'KeyboardInterrupt' in log     # where it stopped
    assert result['figures']['passed'] == 1 and result['figures']['xfailed'] == 1
    assert gone(int(pid_file.read_text())), 'a child of the interrupted step outlived it'


def test_the_deadline_skips_what_cannot_start_and_the_archive_is_written(tmp_path):
    out, archive = tmp_path / 'gpu', tmp_path / 'gpu.tar.gz'
    r = subprocess.run([sys.executable, SCRIPT, '--device', '@numpy', '--steps',
                        'doctor,nccl', '--deadline', '20', '--results', str(out),
                        '--pack', str(archive)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((out / 'gpu_check.json').read_text())
    assert report['deadline_s'] == 20
    assert report['steps']['doctor']['status'].startswith(
        'skipped: the deadline (20.0 s) was '), report['steps']
    assert report['steps']['nccl']['status'].startswith('skipped: needs a GPU')
    with tarfile.open(archive) as tar:
        packed = json.load(tar.extractfile('gpu/gpu_check.json'))
    assert packed['steps'] == report['steps']
    assert not os.path.exists(str(archive) + '.part')


def test_quick_has_a_deadline_inside_a_ten_minute_command():
    gpu_check = load_script()
    assert gpu_check.QUICK_DEADLINE + 60 <= 600      # a minute for the offline install


def test_the_archives_of_a_split_run_unpack_into_one_report(tmp_path):
    def run(steps, name):
        out = tmp_path / name
        r = subprocess.run([sys.executable, SCRIPT, '--device', '@numpy', '--steps', steps,
                            '--results', str(out), '--pack', str(tmp_path / (name + '.tgz'))],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return str(tmp_path / (name + '.tgz'))

    first, second = run('nccl', 'one'), run('doctor', 'two')
    results = tmp_path / 'results'
    r = subprocess.run([sys.executable, SCRIPT, '--unpack', first, second, '--results',
                        str(results)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    merged = json.loads((results / 'gpu_check.json').read_text())
    assert [run['steps'] for run in merged['runs']] == [['nccl'], ['doctor']]
    assert merged['steps']['nccl']['status'].startswith('skipped: needs a GPU')
    assert merged['steps']['doctor']['status'] == 'ok'
    assert (results / 'logs' / 'doctor.log').exists()
    assert json.loads((results / 'doctor.json').read_text())['fastchain']


def test_a_step_whose_module_is_missing_names_it_and_the_fix(tmp_path, monkeypatch):
    gpu_check = load_script()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec',
                        lambda name, *a: None if name == 'hypothesis' else real(name, *a))
    rc = gpu_check.main(['--device', '@numpy', '--steps', 'gpu_tests', '--results',
                         str(tmp_path)])
    assert rc == 1
    status = json.loads((tmp_path / 'gpu_check.json').read_text())['steps']['gpu_tests']['status']
    assert status.startswith('failed: hypothesis not installed in ')
    assert 'pip install --no-index --find-links dist/wheelhouse hypothesis' in status


def test_without_a_usable_gpu_it_stops_at_once_naming_why_and_the_fix(tmp_path):
    from fastchain.backends import cuda
    status = cuda.cupy_status()
    if status.available:
        pytest.skip('a GPU is usable here')
    r = subprocess.run([sys.executable, SCRIPT, '--results', str(tmp_path / 'gpu')],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith('gpu_check: no usable GPU for @cupy:0: {} (fix: {}); '
                               'to try this script on a CPU: --device @numpy'.format(
                                   status.why, status.fix)), r.stderr
    assert not (tmp_path / 'gpu').exists()          # nothing run, nothing written


def test_the_archive_is_rewritten_while_a_long_step_runs(tmp_path):
    """A call cut off in the middle of a step still returns that step's log."""
    gpu_check = load_script()
    (tmp_path / 'logs').mkdir()
    ticks = []
    code = "import time; print('halfway', flush=True); time.sleep(2.5)"
    result = gpu_check.run_step('long', [sys.executable, '-c', code], {}, 30, str(tmp_path),
                                tick=lambda: ticks.append(
                                    (tmp_path / 'logs' / 'long.log').read_text()),
                                every=1)
    assert result['status'] == 'ok'
    assert len(ticks) >= 2 and 'halfway' in ticks[-1]


def test_unpacking_keeps_a_result_over_a_later_skip(tmp_path):
    gpu_check = load_script()

    def archive(name, steps):
        d = tmp_path / name / 'gpu'
        d.mkdir(parents=True)
        (d / 'gpu_check.json').write_text(json.dumps({'quick': True, 'steps': steps}))
        path = str(tmp_path / (name + '.tgz'))
        with tarfile.open(path, 'w:gz') as tar:
            tar.add(str(d), arcname='gpu')
        return path

    first = archive('a', {'ladder': {'status': 'ok'}, 'nccl': {'status': 'skipped: x'}})
    second = archive('b', {'ladder': {'status': 'skipped: the deadline'},
                           'nccl': {'status': 'ok'}})
    merged = gpu_check.unpack([first, second], str(tmp_path / 'out'))
    assert merged['steps'] == {'ladder': {'status': 'ok'}, 'nccl': {'status': 'ok'}}


def test_a_step_limit_replaces_its_default_and_the_ladder_gets_its_rungs(tmp_path):
    import argparse
    gpu_check = load_script()
    args = argparse.Namespace(
        results=str(tmp_path), quick=True, device='@cupy:0', image_size=224, batch=32,
        ladder_batch=None, ladder_rungs='baseline,autotune,all,torch',
        steps=['gpu_tests', 'ladder', 'doctor'],
        limits=gpu_check.limits_arg('gpu_tests=150, ladder=200.5'))
    planned = gpu_check.plan(args)
    assert list(planned) == ['gpu_tests', 'ladder', 'doctor']
    assert planned['gpu_tests'][2] == 150 and planned['ladder'][2] == 200.5
    assert planned['doctor'][2] == 120                  # its default
    argv = planned['ladder'][0]
    assert argv[argv.index('--rungs') + 1] == 'baseline,autotune,all,torch'
    # autotune's choices are kept beside the results (packed, committed, read next time)
    assert argv[argv.index('--tune-cache') + 1] == str(tmp_path / 'tune-cache.json')


@pytest.mark.parametrize('text, message', [
    ('gpu_test=150', "unknown step 'gpu_test'"),
    ('gpu_tests=soon', 'a positive number'),
    ('gpu_tests=0', 'a positive number'),
    ('gpu_tests=inf', 'a positive number'),
])
def test_a_wrong_step_limit_is_refused_naming_it(text, message):
    r = subprocess.run([sys.executable, SCRIPT, '--limits', text], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_a_time_limited_step_ends_itself_before_its_own_limit_without_a_deadline(
        tmp_path, monkeypatch):
    gpu_check = load_script()
    seen = {}

    def fake_run_step(name, argv, env, seconds, out, tick=None, every=60):
        seen[name] = (argv, seconds)
        return {'status': 'ok', 'seconds': 0.0, 'figures': {}, 'log': ''}

    monkeypatch.setattr(gpu_check, 'run_step', fake_run_step)
    assert gpu_check.main(['--device', '@numpy', '--steps', 'ladder', '--limits',
                           'ladder=300', '--results', str(tmp_path)]) == 0
    argv, seconds = seen['ladder']
    assert seconds == 300
    assert argv[argv.index('--time-limit') + 1] == str(300 - gpu_check.STEP_MARGIN)


def test_the_gpu_plan_in_developers_md_uses_flags_the_script_takes():
    """The calls DEVELOPERS.md prepares for a session with a GPU (its
    device time is short: a wrong flag there costs a call) parse, with
    known steps and ladder rungs."""
    sys.path.insert(0, os.path.join(os.path.dirname(SCRIPT)))
    import ladder
    gpu_check = load_script()
    with open(os.path.join(os.path.dirname(SCRIPT), '..', 'DEVELOPERS.md')) as f:
        text = f.read()
    plan = text[text.index('## For the next session with a GPU'):]
    plan = plan[:plan.index('\n## ', 1)]
    calls = [' '.join(span.split()) for span in re.findall(r'`([^`]*)`', plan)
             if span.lstrip().startswith('--steps')]
    assert len(calls) >= 2, calls
    for call in calls:
        args = gpu_check.parser().parse_args(call.split())
        steps = args.steps.split(',')
        assert set(steps) <= set(gpu_check.STEPS), call
        assert set(args.limits) <= set(steps), call     # a limit for a step not run
        if args.ladder_rungs:
            assert 'ladder' in steps and ladder.rung_list(args.ladder_rungs), call


def test_breakdown_figures_come_from_the_newer_report(tmp_path):
    gpu_check = load_script()
    assert gpu_check.breakdown_figures(str(tmp_path)) == {}

    def write(stem, variants, mtime):
        path = tmp_path / (stem + '.json')
        path.write_text(json.dumps({'config': {'variants': variants}}))
        os.utime(path, (mtime, mtime))
    device = {'work': 40, 'busy': 30.0, 'idle_share': 0.7, 'located_share': 0.98,
              'kinds': {'convolution (cuDNN)': 20.0, 'elementwise': 5.0, 'GEMM': 3.0,
                        'copy': 2.0},
              'phases': {'backward': 18.0, 'forward': 9.0, 'update': 2.0, 'convert': 1.0}}
    write('breakdown', {'baseline': {'step_ms': 500.0}}, 1000)
    write('breakdown-quick', {'baseline': {'step_ms': 100.0, 'device': device},
                              'torch': {'step_ms': 40.0, 'device': {'work': 0, 'steps': 5}},
                              'fp16': {'error': 'Traceback ...\nRuntimeError: no plan\n'}},
          2000)
    found = gpu_check.breakdown_figures(str(tmp_path))
    assert found == {
        'baseline': {'step_ms': 100.0, 'busy_ms': 30.0, 'idle_share': 0.7,
                     'located_share': 0.98,
                     'kinds': {'convolution (cuDNN)': 20.0, 'elementwise': 5.0, 'GEMM': 3.0},
                     'phases': {'backward': 18.0, 'forward': 9.0, 'update': 2.0}},
        'torch': {'step_ms': 40.0, 'device': 'the profiler recorded no device work'},
        'fp16': {'error': 'RuntimeError: no plan'}}
    os.utime(tmp_path / 'breakdown.json', (3000, 3000))     # a full run after the quick one
    assert gpu_check.breakdown_figures(str(tmp_path)) == {'baseline': {'step_ms': 500.0}}


def test_gpu_test_files_run_in_the_order_that_says_most_first():
    gpu_check = load_script()
    files = [os.path.relpath(f, gpu_check.ROOT) for f in gpu_check.gpu_test_files()]
    assert files[0].startswith('tests/cudnn/') and \
        files[-1] == 'tests/distributed/test_learners.py'
    precision = [i for i, f in enumerate(files) if f.startswith('tests/precision/')]
    assert precision and max(precision) < files.index('tests/recipes/test_resnet50.py')
    # every file with a GPU test, once
    assert len(files) == len(set(files)) and 'tests/data/test_prefetch.py' in files


def test_a_run_packs_and_unpacks_only_the_files_it_wrote(tmp_path):
    """A checkout's results folder holds earlier runs' committed files; an
    archive that carried them put them back over a newer run's on unpack."""
    gpu_check = load_script()
    now = time.time()

    def archive(name, started, files):
        d = tmp_path / name
        (d / 'logs').mkdir(parents=True)
        (d / 'gpu_check.json').write_text(json.dumps(
            {'started_epoch': started, 'steps': {name: {'status': 'ok'}}}))
        for rel, (text, mtime) in files.items():
            (d / rel).write_text(text)
            os.utime(str(d / rel), (mtime, mtime))
        path = str(tmp_path / (name + '.tgz'))
        gpu_check.pack(str(d), path, since=started)
        return path

    old = now - 86400                               # the committed copy's time
    first = archive('ladder', now - 100, {'ladder-quick.md': ('new ladder', now - 50),
                                          'logs/x.log': ('committed', old)})
    second = archive('nccl', now - 40, {'ladder-quick.md': ('old ladder', old),
                                        'logs/nccl.log': ('nccl', now - 30)})
    with tarfile.open(second) as tar:
        assert 'gpu/ladder-quick.md' not in tar.getnames()
        assert 'gpu/logs/nccl.log' in tar.getnames()
    out = tmp_path / 'out'
    gpu_check.unpack([first, second], str(out))
    assert (out / 'ladder-quick.md').read_text() == 'new ladder'
    assert (out / 'logs' / 'nccl.log').read_text() == 'nccl'
    assert not (out / 'logs' / 'x.log').exists()


def test_unpacking_an_archive_of_the_older_pack_leaves_out_what_predates_its_run(tmp_path,
                                                                                monkeypatch):
    gpu_check = load_script()
    d = tmp_path / 'gpu'
    d.mkdir()
    started = time.time() - 60
    (d / 'gpu_check.json').write_text(json.dumps(        # the node's clock: UTC
        {'started': time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(started)),
         'steps': {'nccl': {'status': 'ok'}}}))
    for name, mtime in (('stale.md', started - 3600), ('fresh.md', started + 10)):
        (d / name).write_text(name)
        os.utime(str(d / name), (mtime, mtime))
    path = str(tmp_path / 'a.tgz')
    with tarfile.open(path, 'w:gz') as tar:        # everything, as pack() once did
        tar.add(str(d), arcname='gpu')
    for zone in ('UTC0', 'EST5', 'JST-9'):          # wherever it is unpacked
        monkeypatch.setenv('TZ', zone)
        time.tzset()
        out = tmp_path / ('out-' + zone)
        gpu_check.unpack([path], str(out))
        assert sorted(os.listdir(out)) == ['fresh.md', 'gpu_check.json'], zone
    monkeypatch.undo()
    time.tzset()
