"""benchmarks/learners.py end to end at a toy size: it runs every learner it
is given under real MPI, and writes the rows, ratios and plot the issue asks for."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, '..', 'benchmarks', 'learners.py')


@pytest.mark.mpi
def test_learning_curves_bytes_and_link_ratios(tmp_path):
    r = subprocess.run(
        [sys.executable, SCRIPT, '--quick', '--processes', '1,2', '--learners',
         'allreduce,1bit,avg', '--width', '4', '--size', '8', '--epochs', '0.25',
         '--eval-every', '96', '--warm-epochs', '0.1', '--results', str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / 'learners-quick.json').read_text())
    rows = {row['name']: row for row in result['rows']}
    assert set(rows) == {'allreduce@1', 'allreduce@2', '1bit@2', '1bit+warm@2', 'avg@2',
                         'avg+warm@2'}
    for row in rows.values():
        assert 0 <= row['final_accuracy'] <= 1 and 0 <= row['comm_share'] < 1
        assert row['curve'][0][0] == 0 and row['curve'][-1][0] > 0
    assert rows['allreduce@1']['bytes_per_sample'] == 0
    # 1 bit a value against 32, plus two float levels a row (filters of 4 to
    # 16 channels here: the levels are a third of the bytes at this width).
    assert rows['1bit@2']['bytes_per_sample'] < rows['allreduce@2']['bytes_per_sample'] / 12
    # Blocks of 4 steps: 11 steps (0.25 x 1437 samples / 32), run on to the
    # block's end, are 12 steps and 3 exchanges of the weights (and BN
    # statistics, a few % more): a quarter of what the allreduce sends.
    expected = rows['allreduce@2']['bytes_per_sample'] / 4
    assert expected <= rows['avg@2']['bytes_per_sample'] < 1.05 * expected
    for link in ('1 Gbit/s', '10 Gbit/s', '100 Gbit/s'):
        assert '1bit/allreduce@2 @ ' + link in result['ratios']
    assert 'computed' in result['config']['link_time']
    assert (tmp_path / 'learners-quick.png').stat().st_size > 10000
