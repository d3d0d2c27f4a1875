"""``fastchain doctor`` describes this machine truthfully."""

import json
import os
import subprocess
import sys

import numpy
import pytest

FASTCHAIN = os.path.join(os.path.dirname(sys.executable), 'fastchain')


def fastchain_cli(*args):
    out = subprocess.run([FASTCHAIN, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def doctor(*args):
    return fastchain_cli('doctor', *args)


def accelerator_lines(text, name):
    """The lines of ``name`` in the human report: its own and those under it."""
    lines = text[text.index('\naccelerators:'):].split('\n')
    start = next(i for i, line in enumerate(lines) if line.startswith('  {} '.format(name)))
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith(' ' * 23):
            break
        block.append(line)
    return block


def enable_states(**options):
    """{accelerator: State} of the real ``fastchain.enable(**options)`` here."""
    import warnings
    import fastchain
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with fastchain.enable(**options) as handle:
            return handle.states


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
        for name in ('cudnn', 'tensor_cores'):
            acc = rep['accelerators'][name]
            assert acc['available'] is False and acc['active'] is False
            assert acc['why'] and acc['fix']
        # fastchain's own choices are tuned without a GPU; nothing is enabled.
        acc = rep['accelerators']['autotune']
        assert acc['available'] is True and acc['active'] is False
    assert rep['dependencies']['nvtx']['available'] is True
    mpi = rep['dependencies']['mpi']
    assert mpi['available'] == bool(mpi['detail'].get('mpiexec'))


def test_human_output_names_each_section():
    text = doctor()
    for heading in ('GPUs:', 'dependencies:', 'Chainer shims applied', 'accelerators:'):
        assert heading in text
    assert 'numpy ' + numpy.__version__ in text


def test_the_environment_variables_set_are_read_as_fastchain_reads_them(monkeypatch):
    from fastchain.doctor._environment import READERS, variables
    for name in list(os.environ):
        if name.startswith('FASTCHAIN_'):
            monkeypatch.delenv(name)
    assert variables() == []
    monkeypatch.setenv('FASTCHAIN_COLLECTIVE_TIMEOUT', '900')
    monkeypatch.setenv('FASTCHAIN_CAPTURE', '120:100')
    monkeypatch.setenv('FASTCHAIN_COLECTIVE_TIMEOUT', '5')     # a typo
    monkeypatch.setenv('FASTCHAIN_CUDNN_BN', 'yes')            # 1, stats or 0
    monkeypatch.setenv('FASTCHAIN_KEEP_MALLOC', 'maybe')
    monkeypatch.setenv('FASTCHAIN_THREADS_PER_PROCESS', '2')
    found = {v['name']: v for v in variables()}
    assert found['FASTCHAIN_COLLECTIVE_TIMEOUT']['meaning'] == '900 s a collective'
    assert "expected FIRST:LAST" in found['FASTCHAIN_CAPTURE']['error']
    assert 'not a variable fastchain reads' in found['FASTCHAIN_COLECTIVE_TIMEOUT']['error']
    assert "1 (cuDNN graphs), stats (two-level reductions) or 0" in \
        found['FASTCHAIN_CUDNN_BN']['error']
    assert 'set it to 1' in found['FASTCHAIN_KEEP_MALLOC']['error']
    assert found['FASTCHAIN_THREADS_PER_PROCESS']['meaning'].startswith('2 BLAS/OpenMP')
    cores = len(os.sched_getaffinity(0))
    assert 'more than' not in found['FASTCHAIN_THREADS_PER_PROCESS']['meaning'] or cores < 2
    monkeypatch.setenv('FASTCHAIN_THREADS_PER_PROCESS', str(cores + 1))    # too many: said
    said = {v['name']: v for v in variables()}['FASTCHAIN_THREADS_PER_PROCESS']['meaning']
    assert 'more than the {} cores here'.format(cores) in said, said
    monkeypatch.setenv('FASTCHAIN_THREADS_PER_PROCESS', '2')
    assert [n for n, v in found.items() if v['ok']] == ['FASTCHAIN_COLLECTIVE_TIMEOUT',
                                                        'FASTCHAIN_THREADS_PER_PROCESS']
    # every variable the package, its tools and tests read has a reader
    import re
    top = os.path.join(os.path.dirname(__file__), '..', '..')
    read = set()
    for part in ('fastchain', 'profiling', 'benchmarks', 'tests', 'recipes'):
        for folder, _, files in os.walk(os.path.join(top, part)):
            for name in files:
                if name.endswith(('.py', '.c')) and name not in ('_environment.py',
                                                                  'test_cli.py'):
                    text = open(os.path.join(folder, name), errors='replace').read()
                    read |= set(re.findall(r'''["'](FASTCHAIN_[A-Z_]+)["'=]''', text))
    assert 'FASTCHAIN_NVTX_LOG' in read             # the scan sees C and the tools
    assert read <= set(READERS), read - set(READERS)
    text = doctor()     # the CLI prints them (its environment is this one)
    assert "\n  FASTCHAIN_CUDNN_BN=yes  WRONG: FASTCHAIN_CUDNN_BN='yes': 1 (cuDNN" in text
    assert '\n  FASTCHAIN_COLLECTIVE_TIMEOUT=900  900 s a collective' in text


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


def test_doctor_says_what_enable_would_do_here_not_active_no():
    rep = json.loads(doctor('--json'))
    assert rep['enabled_handles'] == 0 and rep['patch_points'] == {} and not rep['settings']
    real = enable_states()
    assert set(rep['accelerators']) == set(real)
    for name, state in real.items():
        acc = rep['accelerators'][name]
        assert acc['active'] is False       # in force in the doctor's process: never
        here = acc['enable_here']
        assert (here['active'], here['why'], here['fix']) == (state.active, state.why,
                                                              state.fix)
        if state.available:
            assert acc['on_by_default'] is state.active
            if state.active:
                assert acc['requested_here'] == {}
        else:
            assert acc['on_by_default'] is (acc['default'] is None)
    # An option that is off by default and available: asking for it is tried.
    assert rep['accelerators']['static_graph']['on_by_default'] is False
    tried = rep['accelerators']['static_graph']['requested_here']['static_graph=True']
    assert tried['active'] is enable_states(static_graph=True)['static_graph'].active
    text = doctor()
    assert 'active: no' not in text
    assert 'what fastchain.enable() with no arguments does on this machine' in text
    for name, state in real.items():
        line = accelerator_lines(text, name)[0]
        if state.available:
            assert 'enable(): {}'.format('on' if state.active else 'off') in line
        else:
            assert 'enable(): off here' in line and state.why in line
    assert 'enable(static_graph=True): on' in '\n'.join(
        accelerator_lines(text, 'static_graph'))


def test_fp16_on_a_cpu_says_it_is_slower_and_auto_leaves_it_off():
    from fastchain.backends import cuda
    if cuda.cudnn_status().available:
        pytest.skip('a GPU with cuDNN is here: fp16 runs there')
    rep = json.loads(doctor('--json'))
    fp16 = rep['accelerators']['fp16']
    assert fp16['on_by_default'] is False and fp16['enable_here']['active'] is False
    forced, auto = fp16['requested_here']['fp16=True'], fp16['requested_here']["fp16='auto'"]
    assert forced['active'] is True and 'slower than fp32' in forced['note']
    assert any(forced['note'] in w for w in forced['warnings'])
    # 'auto' leaves fp16 off here, as the real enable() does.
    assert auto['active'] is enable_states(fp16='auto')['fp16'].active is False
    assert 'TensorCores' in auto['why']
    block = accelerator_lines(doctor(), 'fp16')
    assert 'enable(): off' in block[0]
    forced_line = next(line for line in block if 'enable(fp16=True)' in line)
    assert 'on' in forced_line and 'warning' in forced_line
    assert 'slower than fp32' in forced_line and 'TensorCores' in forced_line
    auto_line = next(line for line in block if "enable(fp16='auto'): off" in line)
    assert 'no GPU with TensorCores' in auto_line


def test_the_preview_leaves_nothing_in_force_and_refuses_under_a_handle():
    import chainer
    import fastchain
    from fastchain.doctor._report import report
    dtype = chainer.global_config.dtype
    rep = report(preview=True)
    assert all('enable_here' in acc for acc in rep['accelerators'].values())
    after = fastchain.report()
    assert after['enabled_handles'] == 0
    assert after['patch_points'] == {} and after['settings'] == []
    assert chainer.global_config.dtype is dtype
    with fastchain.enable(cpu_conv=False):
        with pytest.raises(RuntimeError, match='no handle is enabled'):
            report(preview=True)


@pytest.mark.parametrize('args', [('--version',), ('doctor', '--version')])
def test_version(args):
    import importlib.metadata
    import fastchain
    text = fastchain_cli(*args)
    assert 'fastchain {}'.format(fastchain.__version__) in text
    assert 'Chainer {}'.format(importlib.metadata.version('chainer')) in text
    assert text.count('\n') == 1


def test_the_machine_record_names_the_nvidia_driver_apart_from_cuda(tmp_path):
    """Benchmarks record the driver (BENCHMARKS.md): the GPU results had
    only the CUDA version the driver offers, which README called the driver
    (a review)."""
    from fastchain.doctor._report import machine, nvidia_driver
    proc = tmp_path / 'version'
    proc.write_text(
        'NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  '
        '(dvs-builder@U22-I3-AE18-23-3)  Tue Jul 15 03:40:38 UTC 2025\n'
        'GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n')
    assert nvidia_driver(str(proc)) == '580.65.06'
    assert nvidia_driver(str(tmp_path / 'absent')) is None
    m = machine()
    for key in ('nvidia_driver', 'cuda_runtime', 'cuda_driver', 'torch'):
        assert key in m
