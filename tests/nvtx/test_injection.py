"""The ranges of a real training loop, as an NVTX tool receives them.

A tool library built from nvtx_recorder.c is injected through
NVTX_INJECTION64_PATH (what Nsight Systems does) and records every call; the
tests assert the exact ranges, their nesting and their order per step.
"""

import os
import subprocess
import sys
import textwrap

import pytest


from .conftest import nest, read_log

TRAIN = textwrap.dedent('''
    import warnings
    import numpy as np, chainer, chainer.links as L, chainer.functions as F
    from chainer import training
    from chainer.training import extensions
    import fastchain
    warnings.simplefilter('ignore')
    handle = fastchain.enable(fp16=True, loader_workers=0, nvtx={mode!r},
                              loss_scale={{'growth_interval': 1000}})

    class Poison(chainer.FunctionNode):
        """Identity; its backward returns NaN on the steps listed."""
        steps = {poison}
        count = [0]
        def forward(self, inputs):
            return inputs[0].copy(),
        def backward(self, indexes, grads):
            self.count[0] += 1
            bad = self.count[0] in self.steps
            return grads[0] * (np.float16('nan') if bad else 1),

    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.conv1 = L.Convolution2D(3, 4, 3)
                self.fc = L.Linear(None, 2)
        def forward(self, x):
            h, = Poison().apply((self.conv1(x),))
            return self.fc(F.relu(h))

    x = np.random.RandomState(0).randn(16, 3, 6, 6).astype('f')
    t = np.arange(16, dtype='i') % 2
    model = L.Classifier(Net())
    opt = chainer.optimizers.SGD(0.01).setup(model)
    it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), 8)
    trainer = training.Trainer(training.StandardUpdater(it, opt), (4, 'iteration'),
                               out={out!r})
    trainer.extend(extensions.LogReport(trigger=(2, 'iteration')))
    trainer.run()
    handle.disable()
''')


def run(tool, tmp_path, mode=True, poison=(3,)):
    log = str(tmp_path / 'nvtx.log')
    env = dict(os.environ, NVTX_INJECTION64_PATH=tool, FASTCHAIN_NVTX_LOG=log)
    code = TRAIN.format(mode=mode, poison=set(poison), out=str(tmp_path / 'out'))
    r = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_log(log) if os.path.exists(log) else []


def names(node):
    return [c['name'] for c in node['children']]


STEP = ['data', 'convert', 'forward', 'backward', 'loss_scale check', 'update',
        'loss_scale update']


def test_every_phase_of_every_step_in_order(nvtx_tool, tmp_path):
    events = run(nvtx_tool, tmp_path)
    roots, marks = nest(events)
    top = [r['name'] for r in roots]
    # 4 steps; LogReport after steps 2 and 4; an epoch mark after step 2 (16
    # examples, batch 8) and 4; a skipped-step mark on the poisoned step 3.
    steps = [r for r in roots if r['name'] == 'step']
    assert len(steps) == 4
    for i, step in enumerate(steps, 1):
        expected = list(STEP)
        if i == 3:
            expected.insert(5, '!skipped step (loss scale 32768)')
        assert names(step) == expected, (i, names(step))
        for child in step['children']:
            if not child['name'].startswith('!'):
                assert step['start'] <= child['start'] <= child['end'] <= step['end']
    # LogReport is called after every step (it collects each observation).
    assert top == ['step', 'extension LogReport', 'step', '!epoch 1',
                   'extension LogReport', 'step', 'extension LogReport', 'step',
                   '!epoch 2', 'extension LogReport']
    assert marks == ['epoch 1', 'skipped step (loss scale 32768)', 'epoch 2']
    # The categories nsys shows come with their names.
    categories = {e[6] for e in events if e[0] == 'category'}
    assert {'step', 'data', 'convert', 'forward', 'backward', 'loss_scale', 'update',
            'extension', 'mark'} <= categories


def test_per_link_mode_names_ranges_by_path(nvtx_tool, tmp_path):
    roots, _ = nest(run(nvtx_tool, tmp_path, mode='links', poison=()))
    step = next(r for r in roots if r['name'] == 'step')
    forward = next(c for c in step['children'] if c['name'] == 'forward')
    backward = next(c for c in step['children'] if c['name'] == 'backward')
    assert names(forward) == ['conv1', 'fc']
    assert 'conv1 backward' in names(backward) and 'fc backward' in names(backward)
    # Backward runs the layers in reverse.
    order = names(backward)
    assert order.index('fc backward') < order.index('conv1 backward')


def test_default_is_on_when_a_tool_is_attached(nvtx_tool, tmp_path):
    roots, _ = nest(run(nvtx_tool, tmp_path, mode=None, poison=()))
    assert sum(r['name'] == 'step' for r in roots) == 4


def test_nvtx_false_emits_nothing(nvtx_tool, tmp_path):
    events = run(nvtx_tool, tmp_path, mode=False, poison=())
    # Not one NVTX call: the tool was never even initialised.
    assert events == []


@pytest.mark.mpi
def test_each_allreduce_bucket_is_a_range(nvtx_tool, tmp_path):
    from fastchain.backends import mpi
    script = os.path.join(os.path.dirname(__file__), '..', 'distributed', 'dp_script.py')
    log = str(tmp_path / 'nvtx.log')
    out = tmp_path / 'out'
    out.mkdir()
    env = dict(os.environ, NVTX_INJECTION64_PATH=nvtx_tool, FASTCHAIN_NVTX_LOG=log)
    r = subprocess.run([mpi.mpiexec_path(), '-n', '2', sys.executable, script,
                        'equivalence', str(out), 'in_place'],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    events = read_log(log)
    buckets = [e[6] for e in events if e[0] == 'push' and e[6].startswith('allreduce bucket')]
    # 2 ranks x 6 steps x every bucket, each pushed and popped.
    assert buckets and len(buckets) % 12 == 0
    assert sorted(set(buckets))[0] == 'allreduce bucket 0'
    nest(events)        # balanced on every thread
    categories = {e[6] for e in events if e[0] == 'category'}
    assert 'allreduce' in categories


RAISES = textwrap.dedent('''
    import warnings
    import numpy as np, chainer, chainer.links as L, chainer.functions as F
    from chainer import training
    import fastchain
    warnings.simplefilter('ignore')
    handle = fastchain.enable(loader_workers=0, nvtx='links')
    fail = {{'step': 0}}

    class Boom(Exception):
        pass

    class Fails(chainer.FunctionNode):
        """Identity; its backward raises on the step 'backward' names."""
        def forward(self, inputs):
            return inputs[0].copy(),
        def backward(self, indexes, grads):
            if fail['step'] == {backward}:
                raise Boom('backward')
            return grads[0],

    class Block(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.conv = L.Convolution2D(3, 4, 3)
        def forward(self, x):
            h = self.conv(x)
            if fail['step'] == {forward}:
                raise Boom('forward')
            return Fails().apply((h,))[0]

    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.block = Block()
                self.fc = L.Linear(None, 2)
        def forward(self, x):
            return self.fc(F.relu(self.block(x)))

    def hook(optimizer):
        if fail['step'] == {update}:
            raise Boom('update')

    x = np.random.RandomState(0).randn(16, 3, 6, 6).astype('f')
    t = np.arange(16, dtype='i') % 2
    model = L.Classifier(Net())
    opt = chainer.optimizers.SGD(0.01).setup(model)
    opt.add_hook(hook, name='fails')
    it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), 8)
    updater = training.StandardUpdater(it, opt)
    for step in range(1, 6):
        fail['step'] = step
        for attempt in range({attempts}):
            try:
                updater.update()
                break
            except Boom as e:
                print('caught', e)
                fail['step'] = 0            # the retry goes through
    handle.disable()
''')


def test_a_step_that_raises_leaves_no_range_open_for_the_steps_after(nvtx_tool, tmp_path):
    # A script that catches an exception from a step (an out-of-memory retry)
    # goes on with ranges that nest as before: the ranges the exception left
    # open (a link's, the backward range, the update range) close with the
    # step's. Before, each was left open and every later range nested in it.
    log = str(tmp_path / 'nvtx.log')
    env = dict(os.environ, NVTX_INJECTION64_PATH=nvtx_tool, FASTCHAIN_NVTX_LOG=log)
    code = RAISES.format(forward=2, backward=3, update=4, attempts=1)
    r = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split('\n')[:3] == ['caught forward', 'caught backward', 'caught update']
    roots, _ = nest(read_log(log))          # balanced, or it asserts
    roots = [r for r in roots if not r['name'].startswith('!')]     # epoch marks

    def shape(node):
        return (node['name'], [shape(c) for c in node['children']])

    assert [r['name'] for r in roots] == ['step'] * 5
    first, last = roots[0], roots[4]
    assert shape(last) == shape(first)
    forward = next(c for c in last['children'] if c['name'] == 'forward')
    assert [shape(c) for c in forward['children']] == [('block', [('block/conv', [])]),
                                                      ('fc', [])]
    for failed in roots[1:4]:
        assert names(failed)[:3] == ['data', 'convert', 'forward']


def test_a_step_run_again_after_it_raised_stays_in_the_one_capture_range(nvtx_tool, tmp_path):
    """FASTCHAIN_CAPTURE=2:3, the steps 2 and 3 each raising once and run
    again: a retry of the window's first step opened a second capture range
    (the first never closed: nsys records to the process's end), and one of
    its last step closed it at the failed try."""
    log = str(tmp_path / 'nvtx.log')
    env = dict(os.environ, NVTX_INJECTION64_PATH=nvtx_tool, FASTCHAIN_NVTX_LOG=log,
               FASTCHAIN_CAPTURE='2:3')
    code = RAISES.format(forward=2, backward=3, update=-1, attempts=2)
    r = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split('\n')[:2] == ['caught forward', 'caught backward']
    roots, _ = nest(read_log(log))
    roots = [r for r in roots if not r['name'].startswith('!')]
    assert [r['name'] for r in roots] == ['step', 'capture', 'step', 'step']
    capture = roots[1]
    inside = [c for c in capture['children'] if not c['name'].startswith('!')]
    assert [c['name'] for c in inside] == ['step'] * 4     # 2 (failed, again), 3 (the same)
    assert 'update' not in names(inside[0]) and 'update' in names(inside[1])
    assert 'update' not in names(inside[2]) and 'update' in names(inside[3])
