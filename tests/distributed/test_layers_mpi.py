"""A handle's disable leaves a data-parallel optimizer's averaging in place
(issue #16: it used to delete the optimizer's own update wrapper, so two
ranks with gradients -2 and -4 ended with weights 2 and 4 instead of 3)."""

import os
import subprocess
import sys

import pytest

from fastchain.backends import mpi

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'layers_script.py')
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize('scenario', ['disable_first', 'step_then_disable'])
def test_disabling_nvtx_keeps_the_averaging(scenario, tmp_path):
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, SCRIPT, scenario,
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ['ok.0', 'ok.1'], r.stderr[-4000:]
