"""Puts known defects back, one at a time (three from the issues, two found
in review), and shows the differential suite fails on each
(``make mutation-check``).

Each mutation is applied in the test process by tests/differential/conftest.py
when ``FASTCHAIN_MUTATION`` names it. The suite runs with a fixed seed, first
unmutated (it must pass), then once per mutation (it must fail).
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def hooks_see_scaled_gradients():
    """Issue #17 case 5: the rules unscale, after the optimizer's hooks saw
    loss-scaled fp16 gradients (GradientClipping then zeroes every update)."""
    from fastchain.precision import _attach

    def unscale_late(params, scales):
        for param, scale in zip(params, scales):
            param._loss_scale = scale
        return []
    _attach._unscale = unscale_late


def unconditional_undo():
    """Issue #16: an undo that restores what it replaced whether or not the
    attribute still holds its own change (it removes others' patches)."""
    from fastchain.config._patches import _objects, _points
    undo_one = _objects._undo_one

    def undo_anyway(kind, ref, name, value, extra):
        obj = ref() if ref is not None else None
        if kind == 'wrap' and obj is not None:
            if name in vars(obj):
                delattr(obj, name)
            return
        undo_one(kind, ref, name, value, extra)
    _objects._undo_one = undo_anyway

    def retire_anyway(point):
        point._restore()
    _points._retire = retire_anyway


def padding_blind_buffers():
    """Issue #17 case 1: the bound convolutions' padded-input buffers keyed by
    shape and dtype only (the zero border depends on the padding too)."""
    import numpy
    from fastchain.kernels import _bind

    def buffer(buffers, shape, dtype, interior):
        key = (shape, numpy.dtype(dtype))
        if key not in buffers:
            buffers[key] = numpy.zeros(shape, dtype)
        return buffers[key]
    _bind._buffer = buffer


def unscale_by_the_optimizers_scale():
    """Found by review: gradients divided by the optimizer's loss scale
    whether or not the backward was scaled (a script's own loss.backward()
    trained 2**15 times too slowly, silently)."""
    from fastchain.precision import _attach

    def optimizers_scale(optimizer, params, step):
        _attach._local.scale = _attach._patches.MISSING
        return [optimizer._loss_scale] * len(params)
    _attach._backward_scales = optimizers_scale


def hooks_see_the_fp16_weight():
    """Found by review (2026-12-03): a per-parameter hook (WeightDecay) given
    the fp16 parameter beside its fp32 gradient: rate * weight in float16,
    subnormal for a typical rate (and a type error on a GPU)."""
    from fastchain.precision import _attach

    def as_given(self, rule, param):
        return self.hook(rule, param)
    _attach._OnMasters.__call__ = as_given


MUTATIONS = {
    'hooks-see-scaled-gradients': hooks_see_scaled_gradients,
    'unconditional-undo': unconditional_undo,
    'padding-blind-buffers': padding_blind_buffers,
    'unscale-by-the-optimizers-scale': unscale_by_the_optimizers_scale,
    'hooks-see-the-fp16-weight': hooks_see_the_fp16_weight,
}


def run(mutation, seed, examples):
    env = dict(os.environ, FASTCHAIN_DIFFERENTIAL_EXAMPLES=str(examples))
    if mutation:
        env['FASTCHAIN_MUTATION'] = mutation
    cmd = [sys.executable, '-m', 'pytest', '-q', '-x', '-p', 'no:cacheprovider',
           '-o', 'timeout=0', '--hypothesis-seed={}'.format(seed),
           os.path.join(ROOT, 'tests', 'differential', 'test_differential.py')]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)


def main(seed=20261123, examples=300):
    baseline = run(None, seed, examples)
    print('unmutated: {}'.format('passes' if baseline.returncode == 0 else 'FAILS'))
    if baseline.returncode != 0:
        print(baseline.stdout[-3000:])
        return 1
    survived = []
    for name in MUTATIONS:
        r = run(name, seed, examples)
        caught = r.returncode != 0
        last = [line for line in r.stdout.splitlines() if line.strip()][-1:]
        print('{:32s} {}  ({})'.format(name, 'caught' if caught else 'SURVIVED',
                                        last[0] if last else ''))
        if not caught:
            survived.append(name)
    return 1 if survived else 0


if __name__ == '__main__':
    sys.exit(main())
