"""What two thread pools on the same cores cost: PyTorch's (oneDNN, ATen)
and NumPy's BLAS, the reason ``enable(onednn=True)`` runs the BLAS on one
thread (fastchain/kernels/_onednn.py, DEVELOPERS.md "oneDNN kernels").

Each variant runs in a process of its own (a BLAS thread count and its
threads' spinning are process state): a 16x64x8x8 BatchNormalization and a
3x3 convolution of the same input through PyTorch, alone and right after a
NumPy matmul (256x576 by 576x64), and the matmul right after the
convolution. Rows are calls per second (median of windows, each from the
median call time), so ``after/alone`` ratios are speeds as BENCHMARKS.md
has them: below 1, what a switch costs.
Variants: the BLAS's own thread count, and one BLAS thread (what the
option sets). Needs PyTorch (the bench extra).
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

CHILD = r'''
import json, sys, time
import numpy, threadpoolctl, torch
if sys.argv[1] == 'one':
    threadpoolctl.threadpool_limits(1, user_api='blas')
calls = int(sys.argv[2])
x = numpy.random.randn(16, 64, 8, 8).astype(numpy.float32)
g, b = numpy.ones(64, numpy.float32), numpy.zeros(64, numpy.float32)
W = numpy.random.randn(64, 64, 3, 3).astype(numpy.float32)
A = numpy.random.randn(256, 576).astype(numpy.float32)
B = numpy.random.randn(576, 64).astype(numpy.float32)
def bn():
    torch.native_batch_norm(torch.from_numpy(x), torch.from_numpy(g), torch.from_numpy(b),
                            None, None, True, 0.1, 2e-5)
def conv():
    torch.conv2d(torch.from_numpy(x), torch.from_numpy(W), None, 1, 1)
def blas():
    A @ B
def timed(f, before=None):
    out = []
    for _ in range(calls):
        if before is not None:
            before()
        start = time.perf_counter()
        f()
        out.append(time.perf_counter() - start)
    return float(numpy.median(out)) * 1e6
for f in (bn, conv, blas):
    timed(f)        # warm-up
print(json.dumps({'bn alone': timed(bn), 'bn after blas': timed(bn, blas),
                  'conv alone': timed(conv), 'conv after blas': timed(conv, blas),
                  'blas alone': timed(blas), 'blas after conv': timed(blas, conv)}))
'''


LABELS = {'default': "BLAS: its own threads", 'one': 'BLAS: 1 thread'}


def main(argv=None):
    p = _common.parser('onednn_threads', __doc__)
    args = p.parse_args(argv)
    try:
        import torch    # noqa: F401
    except ImportError:
        sys.exit('benchmarks/onednn_threads.py needs PyTorch (pip install -e ".[bench]")')
    windows = args.windows or (3 if args.quick else 5)
    calls = 50 if args.quick else 200
    rows = _common.Rows('calls/s')
    for _ in range(windows):
        for variant in ('default', 'one'):
            out = subprocess.run([sys.executable, '-c', CHILD, variant, str(calls)],
                                 check=True, capture_output=True, text=True).stdout
            for name, us in json.loads(out).items():
                rows.add('{} ({})'.format(name, LABELS[variant]), round(1e6 / us, 1))
    ratios = {}
    for label in LABELS.values():
        for op, before in (('bn', 'blas'), ('conv', 'blas'), ('blas', 'conv')):
            ratios['{} after {} / alone ({})'.format(op, before, label)] = rows.ratio(
                '{} after {} ({})'.format(op, before, label), '{} alone ({})'.format(op, label))
    config = {'calls_per_window': calls, 'windows': windows,
              'torch_threads': torch.get_num_threads()}
    _common.write('onednn_threads', args, config, rows, ratios,
                  ['Each variant in a fresh process; "its own threads": the count the '
                   'BLAS chose (the cores); "1 thread": threadpoolctl limits it to 1, as '
                   'enable(onednn=True) does.'])


if __name__ == '__main__':
    main()
