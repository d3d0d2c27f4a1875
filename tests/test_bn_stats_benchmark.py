"""benchmarks/bn_stats.py on the CPU: the layers it times are ResNet-50's
BatchNormalization layers, its Chainer rows run (forward and backward) and
are checked against float64, and the GPU rows say why they did not run."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'benchmarks'))
import bn_stats  # noqa: E402


def test_the_layers_are_resnet50s_and_the_cpu_rows_say_what_did_not_run(tmp_path):
    from fastchain.backends import cuda
    shapes = bn_stats.layer_shapes(cuda.get_device('@numpy'), 2, 32)
    assert len(shapes) == 53 and shapes[0] == (2, 64, 16, 16)
    assert {s[1] for s in shapes} == {64, 128, 256, 512, 1024, 2048}
    bn_stats.main(['--quick', '--windows', '2', '--results', str(tmp_path)])
    result = json.loads((tmp_path / 'bn_stats-quick.json').read_text())
    rows = {r['name']: r for r in result['rows']}
    assert set(rows) == {'chainer_float32', 'chainer_float32_channels_last', 'chainer_float16'}
    assert all(r['windows'] == 2 and r['value'] > 0 for r in rows.values())
    skipped = {u['name']: u['why'] for u in result['unavailable']}
    assert skipped['graph_float16'] == 'no cuDNN graphs here: not a GPU'
    assert skipped['statistics_float32'].startswith('a GPU rung')
    errors = result['config']['worst_error_vs_float64']
    assert set(errors) == set(rows) and max(errors.values()) < 1e-5
    # the backward's: float32 data to float32's rounding (Chainer's own: 2.8e-5
    # at a 1 x 1 layer of batch 2, two values a channel), float16 to float16's
    grads = result['config']['worst_gradient_error_vs_float64']
    assert set(grads) == set(rows)
    assert max(grads['chainer_float32'], grads['chainer_float32_channels_last']) < 1e-4
    assert 1e-6 < grads['chainer_float16'] < 2e-3
