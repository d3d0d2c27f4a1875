"""benchmarks/conv_keys.py at a toy width: every planned call is compared
bitwise with Chainer's, and the three totals are consistent."""

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def test_conv_keys_compares_every_planned_call(capsys):
    spec = importlib.util.spec_from_file_location(
        'conv_keys', os.path.join(HERE, '..', '..', 'benchmarks', 'conv_keys.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    chainer_s, fastchain_s, best = module.main(['--batch', '2', '--crop', '32', '--width',
                                                '4', '--repeats', '1'])
    assert 0 < best <= min(chainer_s, fastchain_s)
    out = capsys.readouterr().out
    assert 'Convolution2DGradW' in out and 'Deconvolution2DFunction' in out
