"""A cached call that raises: an error define-by-run raises as well is the
call's own (a malformed batch), raised as plain Chainer raises it, and the
cache stays; Ctrl-C ends the call and the cache stays. Either way the key's
half-made schedule is forgotten and recorded anew on its next call, and the
training goes on bit for bit as plain Chainer's."""

import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from fastchain.static import StaticGraphFallback, cache_state, cache_static_graph

from tests.helpers import assert_same, copies

pytestmark = pytest.mark.usefixtures('fresh_fixes')


class Checked(chainer.Chain):
    """Raises ValueError on a batch of 5 (the script's own check: every call
    of it raises), and ``interrupt`` once when it is set (Ctrl-C arriving
    during that call)."""

    interrupt = None

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 5)
            self.l2 = L.Linear(5, 3)

    def forward(self, x):
        h = F.relu(self.l1(x))
        if x.shape[0] == 5:
            raise ValueError('a batch of 5')
        if Checked.interrupt is not None:
            exception, Checked.interrupt = Checked.interrupt, None
            raise exception
        return self.l2(h)


def good(n, seed):
    rng = numpy.random.RandomState(seed)
    return rng.randn(n, 6).astype(numpy.float32), rng.randint(0, 3, n).astype(numpy.int32)


def bad(kind, n):
    if kind == 'malformed':
        x, t = good(n, 99)
        return x[:, :5].copy(), t           # 5 features: Chainer's type check raises
    return good(5, 99)


@pytest.mark.parametrize('kind', ['malformed', 'rejected', 'interrupt'])
@pytest.mark.parametrize('at', [0, 1, 3], ids=['recording', 'verifying', 'a new key'])
def test_a_call_that_raises_leaves_the_cache_and_the_training_as_plain_chainers(kind, at):
    """``at``: the raising call is the first of the training (it records), the
    second (a verification), or a new batch size's first after the first
    key is verified."""
    ordinary, cached = copies(lambda: L.Classifier(Checked()))
    cache_static_graph(cached.predictor)
    optimizers = [chainer.optimizers.MomentumSGD(0.05).setup(m) for m in (ordinary, cached)]
    n = 3 if at == 3 else 4         # (a new key: another batch size, first met raising)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphFallback)
        for step in range(9):
            raised = []
            for model, optimizer in zip((ordinary, cached), optimizers):
                if step == at:
                    if kind == 'interrupt':
                        Checked.interrupt = KeyboardInterrupt()
                        batch = good(n, step)
                    else:
                        batch = bad(kind, n)
                    with pytest.raises(BaseException) as caught:
                        optimizer.update(model, *batch)
                    raised.append((type(caught.value), str(caught.value)))
                else:       # after a new key raised: the two keys in turn
                    optimizer.update(model, *good(n if step > at and step % 2 == 0 else 4,
                                                  step))
            if raised:
                assert raised[1] == raised[0]       # plain Chainer's own error
            assert_same(ordinary, cached, 'step {}'.format(step))
    state = cache_state(cached.predictor)
    assert state['fallback'] is None
    assert state['verified'] == {key: 2 for key in state['sequences']}
    assert len(state['sequences']) == (1 if n == 4 else 2)
