"""benchmarks/gpu_check.py, the one command for a GPU node, tried on the CPU:
each step runs in its own process, its status and figures land in
gpu_check.json, and the GPU-only steps say why they were skipped."""

import json
import os
import subprocess
import sys
import tarfile

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
    # The GPU tests' files collect (without hypothesis, which the node lacks)
    # and skip here with their reason.
    assert steps['gpu_tests']['status'] == 'ok', steps['gpu_tests']
    assert 'needs a CUDA GPU' in (out / 'logs' / 'gpu_tests.log').read_text()
    nvtx = steps['nvtx']
    if nvtx['status'].startswith('skipped'):
        assert 'recorder not built' in nvtx['status']
    else:
        assert nvtx['status'] == 'ok', nvtx
        assert nvtx['figures']['nvtx_pushes'] == nvtx['figures']['nvtx_pops'] > 0
        assert nvtx['figures']['images_per_s'] > 0
    with tarfile.open(tmp_path / 'gpu.tar.gz') as tar:
        names = tar.getnames()
    assert 'gpu/gpu_check.json' in names and not any(n.endswith('.so') for n in names)


def test_an_unknown_step_is_refused():
    r = subprocess.run([sys.executable, SCRIPT, '--steps', 'doctr'], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and 'unknown step(s) doctr; choose from doctor' in r.stderr
