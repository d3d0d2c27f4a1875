"""Data-parallel fastchain under real MPI (2 ranks, each on its half of every
batch) against plain Chainer in one process on the whole batch.

The ranks must agree bit for bit; with the single process they agree within
DP_ATOL of the largest weight (averaging two half-batch gradients rounds
differently from one whole-batch mean). Models here have no
BatchNormalization (each rank normalises over its own half) and no dropout
(each rank draws its own mask); the optimizers are SGD and MomentumSGD:
Adam divides each step by the gradient's own magnitude, so the rounding of
a small gradient becomes a difference of the step's size (1.25e-5 of the
largest weight after 2 steps of Adam(0.01) on six convolutions, found by a
run of 600 examples, over DP_ATOL; the ranks still agree bit for bit).
"""

import json
import os
import subprocess
import sys

import numpy
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fastchain.backends import mpi
from tests.differential import harness
from tests.differential.models import HOOKS, SGD_FAMILY, model_specs

pytestmark = pytest.mark.mpi
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, 'tests', 'differential', 'dp_cases.py')
EXAMPLES = max(1, int(os.environ.get('FASTCHAIN_DIFFERENTIAL_EXAMPLES', 30)) // 30)
DP_ATOL = 1e-5

CASE = st.fixed_dictionaries({
    'model': model_specs(max_layers=3, allow_bn=False, allow_dropout=False,
                         allow_branch=False, allow_lazy=False, min_batch=2),  # (halves)
    'optimizer': SGD_FAMILY, 'hooks': HOOKS, 'steps': st.integers(1, 3),
    'options': st.fixed_dictionaries({}, optional={
        'static_graph': st.booleans(), 'cpu_conv': st.booleans(),
        'fused_update': st.booleans(), 'nvtx': st.booleans()}),
})


def single_process(case):
    spec = dict(case['model'])
    spec['input'] = (2 * spec['input'][0],) + tuple(spec['input'][1:])
    trace = harness.run(spec, case['optimizer'], case['hooks'], case['steps'])
    return {k[1:]: v for k, v in trace[-1].items() if k.startswith('W')}


@settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases=st.lists(CASE, min_size=1, max_size=12))
def test_two_ranks_agree_with_each_other_and_with_one_process(cases, tmp_path_factory):
    folder = tmp_path_factory.mktemp('dp')
    (folder / 'cases.json').write_text(json.dumps(cases))
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, SCRIPT,
                        str(folder / 'cases.json'), str(folder)], capture_output=True,
                       text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS='1',
                                OPENBLAS_NUM_THREADS='1'))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    ranks = [numpy.load(folder / 'rank{}.npz'.format(k)) for k in (0, 1)]
    assert sorted(ranks[0].files) == sorted(ranks[1].files)
    for key in ranks[0].files:
        numpy.testing.assert_array_equal(ranks[1][key], ranks[0][key], err_msg=key)
    for i, case in enumerate(cases):
        expected = single_process(case)
        scale = max(float(numpy.abs(v).max()) for v in expected.values())
        for name, value in expected.items():
            numpy.testing.assert_allclose(ranks[0]['case{}{}'.format(i, name)], value,
                                          rtol=0, atol=DP_ATOL * scale,
                                          err_msg='case {} {}'.format(i, name))
