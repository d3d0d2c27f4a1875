"""BatchNormalization's training forward and backward, every layer of ResNet-50 once.

The breakdown of a ResNet-50 step on an H200 (2026-11-28) found Chainer's
batch statistics (``x.mean`` and ``x.var`` over N, H and W) the largest
device cost of every step. This times the three ways fastchain has of
computing BatchNormalization's training forward and backward, on the input
shapes of every BatchNormalization layer of ResNet-50 at the given batch and
size (recorded from one forward of the model), in float32 and float16 data
with float32 statistics (Chainer's ``mixed16``):

- ``chainer``: Chainer's general implementation (what runs on CuPy 14).
- ``statistics``: the same with the batch statistics and the backward's two
  sums reduced in two levels (``fastchain/cudnn/_bn_stats.py``; where cuDNN
  refuses a key, and every call with ``FASTCHAIN_CUDNN_BN=stats``).
- ``graph``: cuDNN's BatchNormalization graphs (``fastchain/cudnn/_bn_graphs.py``;
  a GPU with the cuDNN frontend only; ``FASTCHAIN_CUDNN_BN=1``).

Each row is passes per second, a pass being every layer's forward (outputs,
batch statistics, running statistics) and backward (the input gradient and
gamma's and beta's) once; ``_channels_last`` rows take the NCHW views of
channels-last memory that Chainer's im2col convolution outputs (the plain
baseline's case). Each variant's largest errors against float64 (the
statistics; the gradients) are in the notes.
"""

import os
import sys
import time

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

EPS, DECAY = 2e-5, 0.9
AXIS, EXPANDER = (0, 2, 3), (None, Ellipsis, None, None)


def layer_shapes(device, batch, size):
    """The input shape of every BatchNormalization layer of ResNet-50, in
    call order, from one forward of the model."""
    import chainer
    from chainer.functions.normalization import batch_normalization as _bn
    from fastchain.models import ResNet
    shapes = []
    original = _bn.GeneralBatchNormalizationImpl.get_mean_and_var

    def record(self, axis, gamma, x, xp, interm_dtype):
        shapes.append(tuple(x.shape))
        return original(self, axis, gamma, x, xp, interm_dtype)
    model = ResNet(50, 10)
    model.to_device(device)
    x = device.xp.zeros((batch, 3, size, size), numpy.float32)
    _bn.GeneralBatchNormalizationImpl.get_mean_and_var = record
    try:
        with chainer.using_config('enable_backprop', False):
            model(x)
    finally:
        _bn.GeneralBatchNormalizationImpl.get_mean_and_var = original
    return shapes


class Layers:
    """The layers' inputs and parameters on the device, in one layout."""

    def __init__(self, xp, shapes, dtype, channels_last, seed=0):
        rng = numpy.random.RandomState(seed)
        self.xp, self.items, self.references = xp, [], None
        for shape in shapes:
            n, c = shape[:2]
            host = rng.normal(0.5, 2, (n,) + shape[2:] + (c,)).astype(dtype)
            x = xp.asarray(host).transpose(0, 3, 1, 2) if channels_last else \
                xp.asarray(host.transpose(0, 3, 1, 2).copy())
            gamma = xp.asarray(rng.uniform(0.5, 1.5, c).astype(numpy.float32))
            beta = xp.asarray(rng.uniform(-1, 1, c).astype(numpy.float32))
            gy = xp.asarray(rng.standard_normal(shape).astype(dtype))    # C-contiguous
            self.items.append((x, gamma, beta, xp.zeros(c, numpy.float32),
                               xp.ones(c, numpy.float32), gy))


def chainer_pass(impl):
    def run(layers):
        out = []
        for x, gamma, beta, mean, var, gy in layers.items:
            r = impl.forward(AXIS, gamma, x, None, layers.xp, EXPANDER, beta, EPS, DECAY, mean,
                             var)
            g = impl.backward(AXIS, gamma, gy, x, None, layers.xp, EXPANDER, r[4], r[6], EPS,
                              r[5], r[7])
            # batch mean, 1/sqrt(var + eps); gx, ggamma, gbeta
            out.append((r[4], r[6], g[0], g[2], g[3]))
        return out
    return run


def graph_pass(device_id):
    from fastchain.cudnn import _bn_graphs, _keys

    def run(layers):
        out = []
        for x, gamma, beta, mean, var, gy in layers.items:
            key = _keys.bn_key('batchnorm forward', x, gamma, EPS, True, device_id)
            _, batch_mean, inv_std = _bn_graphs.bn_forward(key, x, gamma, beta, mean, var,
                                                          EPS, DECAY)
            key = _keys.bn_key('batchnorm backward', x, gamma, EPS, False, device_id)
            gx, ggamma, gbeta = _bn_graphs.bn_backward(key, x, gamma, gy, batch_mean, inv_std)
            out.append((batch_mean, inv_std, gx, ggamma, gbeta))
        return out
    return run


def references(layers, to_cpu):
    """Per layer, float64 (wants, scales) of (the batch mean, 1/sqrt(var +
    eps), the input gradient, gamma's and beta's gradients): each variant of
    one layout compares against the same, computed once."""
    if layers.references is None:
        layers.references = []
        for x, gamma, _, _, _, gy in layers.items:
            x64, gy64 = (to_cpu(a).astype(numpy.float64) for a in (x, gy))
            g64 = to_cpu(gamma).astype(numpy.float64)[EXPANDER]
            mean = x64.mean(axis=AXIS, keepdims=True)
            inv_std = 1 / numpy.sqrt(x64.var(axis=AXIS, keepdims=True) + EPS)
            x_hat = (x64 - mean) * inv_std
            gbeta = gy64.sum(axis=AXIS, keepdims=True)
            ggamma = (gy64 * x_hat).sum(axis=AXIS, keepdims=True)
            terms = numpy.abs(g64 * inv_std * gy64)
            gx = g64 * inv_std * (gy64 - (x_hat * ggamma + gbeta) / (x64.size // x64.shape[1]))
            # the gradients' against the magnitude of what they add up (a layer of
            # 1 x 1 at batch 2 has a zero input gradient in exact arithmetic)
            scales = (float(numpy.abs(mean).max()), float(inv_std.max()), float(terms.max()),
                      float(numpy.abs(gy64 * x_hat).sum(axis=AXIS).max()),
                      float(numpy.abs(gy64).sum(axis=AXIS).max()))
            layers.references.append(((mean, inv_std, gx, ggamma, gbeta), scales))
    return layers.references


def worst_errors(layers, out, to_cpu):
    """The largest errors against float64 of (the batch mean and 1/sqrt(var
    + eps), each relative to its largest float64 value; the input gradient
    and gamma's and beta's, relative to the largest magnitude of the terms
    each adds up)."""
    stats = grads = 0.0
    for (wants, scales), got in zip(references(layers, to_cpu), out):
        errors = [float(numpy.abs(to_cpu(g).astype(numpy.float64).ravel() - w.ravel()).max())
                  / v for g, w, v in zip(got, wants, scales)]
        stats, grads = max([stats] + errors[:2]), max([grads] + errors[2:])
    return stats, grads


def main(argv=None):
    p = _common.parser('bn_stats', __doc__)
    p.add_argument('--device', default=None, help="default: GPU 0 if usable, else '@numpy'")
    p.add_argument('--batch', type=int, default=None, help='default: 32 on a GPU, 2 on a CPU')
    p.add_argument('--size', type=int, default=None, help='default: 224 on a GPU, 32 on a CPU')
    args = p.parse_args(argv)
    import chainer
    from chainer.functions.normalization import batch_normalization as _bn
    from fastchain.cudnn import _group, _layers
    device = _common.device(args.device)
    xp = device.xp
    gpu = xp is not numpy
    batch, size = args.batch or (32 if gpu else 2), args.size or (224 if gpu else 32)
    windows = args.windows or (5 if args.quick else 11)
    shapes = layer_shapes(device, batch, size)
    to_cpu = chainer.backends.cuda.to_cpu

    def sync():
        if gpu:
            device.device.synchronize()

    variants, rows, errors = {}, _common.Rows('passes/s'), {}
    graphs = _group.graph_status() if gpu else None
    for dtype in ('float32', 'float16'):
        layouts = (False, True) if dtype == 'float32' else (False,)
        for channels_last in layouts:
            layers = Layers(xp, shapes, dtype, channels_last)
            tail = '_' + dtype + ('_channels_last' if channels_last else '')
            variants['chainer' + tail] = (layers, chainer_pass(
                _bn.GeneralBatchNormalizationImpl()))
            if gpu:
                variants['statistics' + tail] = (layers, chainer_pass(_layers.StatsImpl()))
            else:
                rows.skip('statistics' + tail, 'a GPU rung: on a CPU Chainer\'s code runs')
            if channels_last:
                continue
            if graphs is not None and graphs.available:
                variants['graph' + tail] = (layers, graph_pass(device.device.id))
            else:
                rows.skip('graph' + tail, 'no cuDNN graphs here: {}'.format(
                    graphs.why if graphs is not None else 'not a GPU'))
    for name, (layers, run) in list(variants.items()):    # warm-up; first builds
        try:
            out = run(layers)
            sync()
        except Exception as e:          # a key cuDNN refuses: named, the rest runs
            rows.skip(name, '{}: {}'.format(type(e).__name__, e))
            del variants[name]
            continue
        errors[name] = worst_errors(layers, out, to_cpu)
    for w in range(windows):
        for name, (layers, run) in variants.items():
            sync()
            start = time.perf_counter()
            run(layers)
            sync()
            rows.add(name, 1.0 / (time.perf_counter() - start))
        print('window {}/{}: '.format(w + 1, windows) + ', '.join(
            '{} {:.1f}'.format(n, v[-1]) for n, v in rows.windows.items()), flush=True)
    ratios = {}
    for name in variants:
        if not name.startswith('chainer'):
            base = 'chainer' + name[name.index('_'):]
            ratios['{}/{}'.format(name, base)] = rows.ratio(name, base)
    config = {'model': 'ResNet-50', 'batch': batch, 'size': size, 'device': str(device),
              'layers': len(shapes), 'shapes': sorted(set(shapes)), 'windows': windows,
              'eps': EPS, 'decay': DECAY,
              'worst_error_vs_float64': {n: float('{:.3g}'.format(e[0]))
                                         for n, e in errors.items()},
              'worst_gradient_error_vs_float64': {n: float('{:.3g}'.format(e[1]))
                                                  for n, e in errors.items()}}
    notes = ['A pass: the training forward and backward of all {} BatchNormalization layers '
             'of ResNet-50 at batch {} and {} px, once each; ms per pass (median): {}.'.format(
                 len(shapes), batch, size, ', '.join(
                     '{} {:.2f}'.format(n, 1e3 / rows.median(n)) for n in rows.windows)),
             'Largest error against float64 of the batch mean and 1/sqrt(var + eps), relative '
             'to the largest value of each: {}; of the input gradient and gamma\'s and beta\'s, '
             'relative to the largest magnitude of the terms each adds up (in the data\'s '
             'dtype: float16 rows to float16\'s rounding): {}.'.format(
                 ', '.join('{} {:.2e}'.format(n, e[0]) for n, e in errors.items()),
                 ', '.join('{} {:.2e}'.format(n, e[1]) for n, e in errors.items()))]
    _common.write('bn_stats', args, config, rows, ratios, notes)


if __name__ == '__main__':
    main()
