"""Every accelerator at once on a plain Chainer Trainer script, then disabled."""

import json
import warnings

import numpy

import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions

import fastchain
from fastchain import data
from fastchain.models import ResNet
from fastchain.precision import scaler_of


def test_plain_script_with_everything_enabled(tmp_path):
    from chainer.dataset import convert
    from chainer.optimizer import GradientMethod
    from chainer.training.updaters import StandardUpdater
    before = (dict(vars(GradientMethod)), dict(vars(convert)), dict(vars(StandardUpdater)),
              dict(chainer.global_config.__dict__))
    rng = numpy.random.RandomState(0)
    x = rng.randn(40, 3, 16, 16).astype(numpy.float32)
    t = rng.randint(0, 4, 40).astype(numpy.int32)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')     # fp16 on a CPU is slower: it says so
        # A modest first scale: a legitimate overflow skip is not what this
        # test looks for (the fault it guards against skipped 9 steps of 10).
        handle = fastchain.enable(fp16=True, loader_workers=2, static_graph=True,
                                  loss_scale={'init_scale': 1024.0},
                                  timeline=str(tmp_path / 'trace.json'))
    # The plain script: nothing fastchain-specific below.
    model = L.Classifier(ResNet(18, 4, width=4))
    optimizer = chainer.optimizers.MomentumSGD(0.05).setup(model)
    it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), 8)
    updater = training.StandardUpdater(it, optimizer)
    trainer = training.Trainer(updater, (10, 'iteration'), out=str(tmp_path / 'out'))
    trainer.extend(extensions.LogReport(trigger=(5, 'iteration')))
    used = []
    trainer.extend(lambda trainer: used.append(updater.get_iterator('main')))
    try:
        trainer.run()
        assert scaler_of(optimizer).steps == 10, scaler_of(optimizer)
        assert 'forward' in vars(model.predictor)        # cached while enabled
    finally:
        handle.disable()

    assert isinstance(used[0], data.DevicePrefetcher)
    assert updater.get_iterator('main') is it       # handed back by the finalized loader
    assert model.predictor.conv1.W.dtype == numpy.float16
    log = json.load(open(tmp_path / 'out' / 'log'))
    assert [e['iteration'] for e in log] == [5, 10]
    assert all(numpy.isfinite(e['main/loss']) for e in log)
    assert 'main/loss_scale' in log[-1]
    assert (tmp_path / 'trace.txt').read_text().startswith(
        'fastchain step breakdown (9 steps, 1 warm-up left out)')
    after = (dict(vars(GradientMethod)), dict(vars(convert)), dict(vars(StandardUpdater)),
             dict(chainer.global_config.__dict__))
    assert after == before
    assert 'forward' not in vars(model.predictor)
