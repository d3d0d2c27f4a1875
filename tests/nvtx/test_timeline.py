"""The built-in timeline and the step summary, on CPU."""

import json
import warnings

import numpy
import pytest

import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions

import fastchain
from fastchain.nvtx import _summary
from fastchain.nvtx._annotator import annotator
from fastchain.nvtx._summary import Range


def train(tmp_path, iterations=5, **options):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        handle = fastchain.enable(loader_workers=0, **options)
    x = numpy.random.RandomState(0).randn(32, 4).astype(numpy.float32)
    t = (x[:, 0] > 0).astype(numpy.int32)
    model = L.Classifier(L.Linear(4, 2))
    opt = chainer.optimizers.SGD(0.1).setup(model)
    it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), 8)
    trainer = training.Trainer(training.StandardUpdater(it, opt),
                               (iterations, 'iteration'), out=str(tmp_path / 'out'))
    trainer.extend(extensions.LogReport(trigger=(1, 'iteration')))
    trainer.run()
    handle.disable()
    return handle


def test_timeline_records_every_phase_and_writes_trace_chart_summary(tmp_path):
    path = str(tmp_path / 'trace.json')
    train(tmp_path, timeline=path)
    trace = json.load(open(path))
    spans = [e for e in trace['traceEvents'] if e['ph'] == 'X']
    assert {e['cat'] for e in spans} == {'step', 'data', 'convert', 'forward', 'backward',
                                          'update', 'extension'}
    assert sum(e['name'] == 'step' for e in spans) == 5
    assert all(e['dur'] >= 0 for e in spans)
    marks = [e['name'] for e in trace['traceEvents'] if e['ph'] == 'i']
    assert marks == ['epoch 1']         # 32 examples / batch 8 = 4 steps per epoch
    summary = open(str(tmp_path / 'trace.txt')).read()
    assert 'fastchain step breakdown (4 steps, 1 warm-up left out)' in summary
    assert 'diagnosis:' in summary
    png = tmp_path / 'trace.png'
    assert png.exists() and png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert annotator().timeline is None         # detached on disable


def test_timeline_with_nvtx_false_is_refused():
    with pytest.raises(ValueError, match='timeline'):
        fastchain.enable(nvtx=False, timeline='x.json')


def test_no_profiler_means_no_annotation_installed():
    from chainer.training.updaters import StandardUpdater
    before = StandardUpdater.__dict__['__init__']
    with fastchain.enable(loader_workers=0) as h:
        assert StandardUpdater.__dict__['__init__'] is before
        assert not h.states['nvtx'].active and 'no profiler' in h.states['nvtx'].why


def test_nvtx_true_without_a_tool_says_the_ranges_go_nowhere():
    with pytest.warns(UserWarning, match='go nowhere'):
        h = fastchain.enable(nvtx=True, loader_workers=0)
    assert h.states['nvtx'].active
    h.disable()


def step(t, phases, thread=1, extension=0, gap=0):
    """A step range starting at t with the given (category, ns) children and
    ``gap`` ns of unannotated time at its end."""
    out, cursor = [], t
    for category, ns in phases:
        out.append(Range(category, category, thread, cursor, cursor + ns, 1))
        cursor += ns
    cursor += gap
    out.insert(0, Range('step', 'step', thread, t, cursor, 0))
    if extension:
        out.append(Range('extension log', 'extension', thread, cursor, cursor + extension, 0))
    return out, cursor + extension


def steps(n, phases, extension=0, gap=0):
    ranges, t = [], 0
    for _ in range(n):
        rs, t = step(t, phases, extension=extension, gap=gap)
        ranges += rs
    return ranges


def test_summary_shares_and_input_bound_diagnosis():
    ms = 1_000_000
    ranges = steps(5, [('data', 4 * ms), ('convert', 1 * ms), ('forward', 2 * ms),
                       ('backward', 2 * ms), ('update', 1 * ms)], extension=0)
    result = _summary.summarize(ranges, skip=1)
    assert result['steps'] == 4
    assert result['mean_ms']['data'] == pytest.approx(4.0)
    assert result['share']['data'] == pytest.approx(0.4)
    assert result['diagnosis'] == 'input-bound: 40% of each step is waiting for data'


def test_summary_other_time_extensions_and_compute_bound():
    ms = 1_000_000
    ranges = steps(3, [('forward', 5 * ms), ('backward', 4 * ms)], extension=1 * ms,
                   gap=1 * ms)
    result = _summary.summarize(ranges, skip=0)
    assert result['mean_ms']['other'] == pytest.approx(1.0)
    assert result['mean_ms']['extension'] == pytest.approx(1.0)
    assert result['diagnosis'].startswith('compute-bound: forward, backward and update')


def test_device_idle_from_kernels():
    ms = 1_000_000
    ranges = steps(2, [('forward', 5 * ms), ('backward', 5 * ms)])
    kernels = [(0, 2 * ms), (1 * ms, 3 * ms), (10 * ms, 12 * ms)]   # overlap merged
    result = _summary.summarize(ranges, kernels=kernels, skip=0)
    assert result['device_idle'] == pytest.approx((0.7 + 0.8) / 2)
    assert result['diagnosis'].startswith('host-bound: the device is idle 75%')
