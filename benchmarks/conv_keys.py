"""Per convolution call of one ResNet-50 training step on the CPU: Chainer's
kernel against fastchain's planned kernel (``cpu_conv``), checked bitwise
equal and timed alternately, call by call.

It answers what a per-key choice between the two would gain (issue #21):
the sum of Chainer's times, of fastchain's, and of the faster of the two per
call. Not one of the ``make bench`` set: a diagnostic, in one process.

    python benchmarks/conv_keys.py --batch 16 --crop 32
"""

import argparse
import statistics
import time

import numpy


def main(argv=None):
    p = argparse.ArgumentParser(prog='benchmarks/conv_keys.py', description=__doc__)
    p.add_argument('--batch', type=int, default=16)
    p.add_argument('--crop', type=int, default=32)
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--width', type=int, default=64, help='first stage channels')
    args = p.parse_args(argv)
    import chainer
    import chainer.links as L
    from fastchain.kernels import _bind
    from fastchain.models import ResNet

    calls, originals = [], {}
    for cls in _bind.planners():
        originals[cls] = cls._forward_cpu_core

        def capture(self, *arrays, _orig=originals[cls], _cls=cls):
            calls.append((_cls, self, tuple(None if a is None else a.copy() for a in arrays)))
            return _orig(self, *arrays)
        cls._forward_cpu_core = capture
    try:
        numpy.random.seed(0)
        model = L.Classifier(ResNet(50, 1000, width=args.width))
        opt = chainer.optimizers.MomentumSGD(0.01).setup(model)
        x = numpy.random.randn(args.batch, 3, args.crop, args.crop).astype(numpy.float32)
        t = numpy.random.randint(0, 1000, args.batch).astype(numpy.int32)
        opt.update(model, x, t)
    finally:
        for cls, orig in originals.items():
            cls._forward_cpu_core = orig

    planners = _bind.planners()
    rows = []
    for cls, node, arrays in calls:
        inputs = tuple(a for a in arrays if a is not None)
        plan = planners[cls](node, inputs, {}) \
            if _bind._plain_node(node) and _bind._plain(inputs) else None
        if plan is None:
            continue
        chainer_s, fastchain_s = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            a = originals[cls](node, *arrays)
            chainer_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            b = plan(inputs)
            fastchain_s.append(time.perf_counter() - start)
        for u, v in zip(_tuple(a), _tuple(b)):
            if not numpy.array_equal(u, v):
                raise SystemExit('{}: the kernels differ (they must be bitwise equal)'.format(
                    cls.__name__))
        key = (cls.__name__, inputs[0].shape[1:], inputs[1].shape[2:],
               getattr(node, 'sy', None))
        rows.append((key, statistics.median(chainer_s), statistics.median(fastchain_s)))
    total_c = sum(r[1] for r in rows)
    total_f = sum(r[2] for r in rows)
    best = sum(min(r[1], r[2]) for r in rows)
    print('{} calls, batch {}, {} px: Chainer {:.1f} ms, fastchain {:.1f} ms, the faster per '
          'call {:.1f} ms'.format(len(rows), args.batch, args.crop, total_c * 1e3,
                                  total_f * 1e3, best * 1e3))
    by_key = {}
    for key, c, f in rows:
        entry = by_key.setdefault(key, [0.0, 0.0, 0])
        entry[0] += c
        entry[1] += f
        entry[2] += 1
    print('| function | input (C, H, W) | kernel | stride | calls | Chainer ms | fastchain ms |')
    print('| --- | --- | --- | --- | --- | --- | --- |')
    for key, (c, f, n) in sorted(by_key.items(), key=lambda kv: -max(kv[1][:2])):
        print('| {} | {} | {} | {} | {} | {:.2f} | {:.2f} |'.format(
            key[0], key[1], key[2], key[3], n, c * 1e3, f * 1e3))
    return total_c, total_f, best


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


if __name__ == '__main__':
    main()
