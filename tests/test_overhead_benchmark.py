"""benchmarks/overhead.py's variants at a toy size: the untuned ones (autotune
off) train the same bits as the tuned ones, and the cached one replays its
schedule from the first timed step on, so a ratio between them measures
autotune's machinery and nothing else."""

import os
import sys

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'benchmarks'))
import overhead  # noqa: E402


def _weights(model):
    return {name: p.array.copy() for name, p in sorted(model.namedparams())}


def test_untuned_variants_train_the_same_bits_and_replay():
    from fastchain.backends import cuda
    from fastchain.static._cache import cache_state
    device = cuda.get_device('@numpy')
    made = {name: overhead.make(*spec, 2, 32, 2, device, autotune=name not in overhead.UNTUNED)
            for name, spec in (('static', overhead.VARIANTS['static']),
                               ('static_untuned', overhead.UNTUNED['static_untuned']),
                               ('dynamic_untuned', overhead.UNTUNED['dynamic_untuned']))}
    state = cache_state(made['static_untuned'][0].model.predictor)
    verified = dict(state['verified'])
    assert state['fallback'] is None and verified and min(verified.values()) >= 2
    # the variants may have warmed up for different step counts (until
    # autotune decided): all go on to the same count
    steps = {name: step.optimizer.t for name, (step, _) in made.items()}
    for name, (step, kernels) in made.items():
        with kernels():
            while step.optimizer.t < max(steps.values()) + 2:
                step()
    # the untuned cache replayed (no step went back to verification or define-by-run)
    assert state['verified'] == verified and state['fallback'] is None
    # the same steps from the same seeds: the same bits with autotune on or off
    w = {name: _weights(step.model) for name, (step, _) in made.items()}
    assert w['static'].keys() == w['static_untuned'].keys() == w['dynamic_untuned'].keys()
    for key in w['static']:
        numpy.testing.assert_array_equal(w['static'][key], w['static_untuned'][key], key)
        numpy.testing.assert_array_equal(w['static'][key], w['dynamic_untuned'][key], key)


def test_own_time_is_grouped_by_the_package_it_is_spent_in():
    join = os.path.join
    repo = join(os.sep, 'home', 'me', 'fastchain')         # a checkout named fastchain
    site = join(repo, '.venv', 'lib', 'python3.12', 'site-packages')
    mine = join(repo, 'fastchain')

    def of(*path):
        return overhead.package_of(join(*path), fastchain_dir=mine)
    assert of(site, 'cudnn', '_pygraph.py') == 'cuDNN frontend'
    assert of(mine, 'cudnn', '_graphs.py') == 'fastchain'
    assert of(site, 'fastchain', 'cudnn', '_graphs.py') == 'fastchain'   # a wheel install
    assert of(site, 'chainer', 'function_node.py') == 'chainer'
    assert of(site, 'cupy', '_core', 'x.py') == 'cupy'
    assert of(repo, 'benchmarks', 'overhead.py') == 'other'
    assert of(os.sep, 'usr', 'lib', 'python3.12', 'abc.py') == 'other'
    assert overhead.package_of('~') == 'C functions and methods'
