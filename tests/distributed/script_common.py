"""What the MPI scenario scripts (dp_script.py, learners_script.py) share;
they run as scripts, with this folder on sys.path."""

import chainer


class Poison(chainer.FunctionNode):
    """Identity whose backward yields NaN on the rank told to (``bad``)."""

    def __init__(self, bad):
        self.bad = bad

    def forward(self, inputs):
        return inputs[0].copy(),

    def backward(self, indexes, grads):
        return grads[0] * (grads[0].dtype.type('nan') if self.bad else 1),
