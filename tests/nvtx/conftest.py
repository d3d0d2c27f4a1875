"""Builds the NVTX recording tool (tests/nvtx/nvtx_recorder.c) once."""

import glob
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', '..', 'profiling'))
from summarize import recorder_events  # noqa: E402  (the recorder's log, parsed once)


def nvtx_include_dir():
    """A directory holding nvtx3/nvToolsExt.h: the CUDA toolkit's, or the
    nvidia-nvtx wheel's."""
    candidates = [os.environ.get('CUDA_HOME', ''), '/usr/local/cuda']
    candidates += sorted(glob.glob('/usr/local/cuda-*'), reverse=True)
    for base in candidates:
        if base and os.path.exists(os.path.join(base, 'include', 'nvtx3', 'nvToolsExt.h')):
            return os.path.join(base, 'include')
    try:
        import nvidia.nvtx
        base = os.path.dirname(nvidia.nvtx.__file__)
        if os.path.exists(os.path.join(base, 'include', 'nvtx3', 'nvToolsExt.h')):
            return os.path.join(base, 'include')
    except ImportError:
        pass
    return None


def build_recorder(out):
    """Builds nvtx_recorder.c into ``out``: ``(out, None)``, or ``(None, why)``
    (also used by benchmarks/gpu_check.py on a GPU node)."""
    cc = shutil.which('cc') or shutil.which('gcc')
    if cc is None:
        return None, 'no C compiler to build the NVTX recording tool'
    include = nvtx_include_dir()
    if include is None:
        return None, ('no NVTX headers (CUDA toolkit include/nvtx3, or pip install '
                      'nvidia-nvtx-cu12)')
    r = subprocess.run([cc, '-shared', '-fPIC', '-O2', '-I', include, '-o', out,
                        os.path.join(HERE, 'nvtx_recorder.c'), '-lpthread'],
                       capture_output=True, text=True, timeout=120)
    return (out, None) if r.returncode == 0 else (None, r.stderr.strip()[-500:])


@pytest.fixture(scope='session')
def nvtx_tool(tmp_path_factory):
    out, why = build_recorder(str(tmp_path_factory.mktemp('nvtxtool') /
                                  'libnvtx_recorder.so'))
    if out is None:
        pytest.skip(why)
    return out


def read_log(path):
    """[(kind, thread, time_ns, domain, category, extra, message)]."""
    return recorder_events(path)


def nest(events, domain='fastchain'):
    """Ranges as (message, depth, children) trees per thread, plus marks in order."""
    roots, stacks, marks = [], {}, []
    for kind, tid, t, dom, category, extra, message in events:
        if dom != domain:
            continue
        stack = stacks.setdefault(tid, [])
        if kind == 'push':
            node = {'name': message, 'children': [], 'thread': tid, 'start': t}
            (stack[-1]['children'] if stack else roots).append(node)
            stack.append(node)
        elif kind == 'pop':
            stack.pop()['end'] = t
        elif kind == 'mark':
            marks.append(message)
            (stack[-1]['children'] if stack else roots).append({'name': '!' + message,
                                                                'children': []})
    assert all(not s for s in stacks.values()), 'unbalanced push/pop'
    return roots, marks
