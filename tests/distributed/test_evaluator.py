"""The multi-node evaluator's checks on one rank (no MPI; the averaging over
ranks runs under mpiexec in dp_script.py's evaluator scenario)."""

import numpy
import pytest

import chainer
import chainer.links as L
from chainer.training import extensions

from fastchain import distributed
from fastchain.config import FastchainWarning
from tests.helpers import OneRank


class _Vector(extensions.Evaluator):
    def evaluate(self):
        return {'main/loss': numpy.float32(0.5), 'main/per_class': numpy.ones(3)}


def test_a_metric_that_is_not_one_number_is_named():
    # float() raised "only length-1 arrays can be converted to Python scalars"
    it = chainer.iterators.SerialIterator([0], 1, repeat=False)
    ev = distributed.create_multi_node_evaluator(_Vector(it, L.Linear(2, 2)), OneRank())
    with pytest.raises(TypeError, match=r"metric 'main/per_class' is ndarray of shape \(3,\), "
                                        r'not one number.*Report a scalar'):
        ev.evaluate()


def test_the_iterator_is_the_evaluators_own_again_after_the_call():
    x = numpy.random.RandomState(0).randn(10, 3).astype(numpy.float32)
    t = numpy.zeros(10, numpy.int32)
    it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), 5,
                                          repeat=False, shuffle=False)
    model = L.Classifier(L.Linear(3, 2))
    ev = distributed.create_multi_node_evaluator(extensions.Evaluator(it, model), OneRank())
    plain = extensions.Evaluator(chainer.iterators.SerialIterator(
        chainer.datasets.TupleDataset(x, t), 5, repeat=False, shuffle=False), model)
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    with reporter.scope({}):
        got, expected = ev.evaluate(), plain.evaluate()
    assert ev.get_iterator('main') is it
    assert got.keys() == expected.keys()
    for key in got:
        assert got[key] == pytest.approx(float(expected[key]), rel=1e-6)


class _OldStyle(extensions.Evaluator):
    """Copies its iterator instead of resetting it, and checks its type, as
    evaluators of scripts written for older Chainer do."""

    def evaluate(self):
        import copy
        assert isinstance(self.get_iterator('main'), chainer.iterators.SerialIterator)
        return {'main/n': float(sum(len(b) for b in copy.copy(self.get_iterator('main'))))}


def test_an_evaluator_that_copies_or_checks_its_iterator_works_as_in_chainer():
    # The counting wrapper recursed without end under copy.copy.
    it = chainer.iterators.SerialIterator(list(range(7)), 3, repeat=False, shuffle=False)
    ev = distributed.create_multi_node_evaluator(_OldStyle(it, L.Linear(2, 2)), OneRank())
    with pytest.warns(FastchainWarning, match='rank 0 evaluated 7 examples in batches of 3 '
                                              'down to 1'):
        assert ev.evaluate() == {'main/n': 7.0}
    assert ev.evaluate() == {'main/n': 7.0}     # the copy left the iterator where it was


class _Assigning(extensions.Evaluator):
    """Sets an attribute of its iterator and pickles it, as scripts may."""

    def evaluate(self):
        import pickle
        it = self.get_iterator('main')
        it.batch_size = 2
        it.reset()
        copied = pickle.loads(pickle.dumps(it))
        assert type(copied) is chainer.iterators.SerialIterator
        return {'main/batches': float(sum(1 for _ in it))}


def test_an_evaluator_that_sets_or_pickles_its_iterator_works():
    # the assignment stayed on the counting wrapper, and pickling it failed
    it = chainer.iterators.SerialIterator(list(range(6)), 3, repeat=False, shuffle=False)
    ev = distributed.create_multi_node_evaluator(_Assigning(it, L.Linear(2, 2)), OneRank())
    assert ev.evaluate() == {'main/batches': 3.0}
    assert it.batch_size == 2
