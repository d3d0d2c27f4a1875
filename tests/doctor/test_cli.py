"""``fastchain doctor`` describes this machine truthfully."""

import json
import os
import subprocess
import sys

import numpy

FASTCHAIN = os.path.join(os.path.dirname(sys.executable), 'fastchain')


def doctor(*args):
    out = subprocess.run([FASTCHAIN, 'doctor', *args], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_json_describes_this_machine():
    rep = json.loads(doctor('--json'))
    assert rep['machine']['numpy'] == numpy.__version__
    assert rep['machine']['chainer'] == '7.8.1'
    assert rep['machine']['cores'] >= 1
    assert rep['compat_hook_installed'] is True
    shims = {s['name'] for s in rep['shims']}
    if not hasattr(numpy, 'sctypes'):
        assert 'numpy.sctypes' in shims
    if not hasattr(numpy, 'float'):
        assert 'numpy.float' in shims
    from fastchain.backends import cuda
    if not cuda.available():
        assert rep['machine']['gpus'] == []
        assert rep['dependencies']['cupy']['available'] is False
        assert rep['dependencies']['cudnn']['available'] is False
        assert rep['dependencies']['cudnn']['why']
        for name in ('cudnn', 'autotune', 'tensor_cores'):
            acc = rep['accelerators'][name]
            assert acc['available'] is False and acc['active'] is False
            assert acc['why'] and acc['fix']
    assert rep['dependencies']['nvtx']['available'] is True
    mpi = rep['dependencies']['mpi']
    assert mpi['available'] == bool(mpi['detail'].get('mpiexec'))


def test_human_output_names_each_section():
    text = doctor()
    for heading in ('GPUs:', 'dependencies:', 'Chainer shims applied', 'accelerators:'):
        assert heading in text
    assert 'numpy ' + numpy.__version__ in text


def test_report_function_matches_enable_state():
    import warnings
    import fastchain
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with fastchain.enable(autotune=True):
            rep = fastchain.report()
            assert rep['enabled_handles'] == 1
            assert rep['accelerators']['autotune']['requested'] is True
    assert fastchain.report()['enabled_handles'] == 0
