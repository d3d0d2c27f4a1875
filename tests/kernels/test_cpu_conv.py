"""cpu_conv: define-by-run convolutions through fastchain's kernels, bitwise
equal to Chainer's, and its enable()/disable()."""

import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import fastchain
from fastchain.config import FastchainWarning, _patches
from fastchain.kernels import _bind, _conv

from tests.helpers import ConvZoo


class DeconvNet(chainer.Chain):
    def __init__(self, dtype):
        super().__init__()
        init = chainer.initializers.Normal(0.1, dtype=dtype)
        with self.init_scope():
            self.up = L.Deconvolution2D(4, 3, 4, stride=2, pad=1, initialW=init,
                                        initial_bias=init)
            self.up1 = L.Deconvolution2D(3, 2, 1, nobias=True, initialW=init)

    def forward(self, x):
        return F.sum(self.up1(F.relu(self.up(x))), axis=(2, 3))


def grads(make, x, **options):
    numpy.random.seed(0)
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FastchainWarning)
        with fastchain.enable(loader_workers=0, **options):
            # x needs a gradient: Chainer 7.8.1's deconvolution backward fails
            # when only its weight gradient is asked for (_set_cover_all is
            # given variables instead of shapes).
            y = model(chainer.Variable(x))
            model.cleargrads()
            F.sum(y * y).backward()
    return y.array, {name: p.grad for name, p in model.namedparams()}


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32, numpy.float64])
@pytest.mark.parametrize('make,shape', [(ConvZoo, (3, 3, 19, 17)),
                                        (DeconvNet, (2, 4, 5, 6))])
def test_define_by_run_is_bitwise_chainers(make, shape, dtype):
    x = numpy.random.RandomState(1).randn(*shape).astype(dtype)
    calls = []
    real = _bind._convolution, _bind._convolution_grad_w, _bind._deconvolution

    def counting(i):
        def plan(node, inputs, buffers):
            calls.append(type(node).__name__)
            return real[i](node, inputs, buffers)
        return plan
    y0, g0 = grads(lambda: make(dtype), x, cpu_conv=False)
    assert not calls
    _bind._convolution, _bind._convolution_grad_w, _bind._deconvolution = (
        counting(0), counting(1), counting(2))
    try:
        y1, g1 = grads(lambda: make(dtype), x)
    finally:
        _bind._convolution, _bind._convolution_grad_w, _bind._deconvolution = real
    assert set(calls) == {'Convolution2DFunction', 'Convolution2DGradW',
                          'Deconvolution2DFunction'}
    numpy.testing.assert_array_equal(y1, y0)
    assert g1.keys() == g0.keys()
    for name in g0:
        numpy.testing.assert_array_equal(g1[name], g0[name], err_msg=name)


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32, numpy.float64])
def test_a_batch_of_one_is_bitwise_chainers(dtype):
    """For a batch of 1 NumPy's tensordot multiplies Chainer's im2col matrix
    as a transposed view, not a copy, and BLAS rounds differently on it: the
    kernels multiply the same layout (before, 116 of 384 such convolutions
    gave other bits, forward, weight and input gradients; a trial)."""
    rng = numpy.random.RandomState(4)
    cases = [(1, 5, 1, 3, 1, 0), (3, 5, 1, 3, 1, 1), (16, 8, 8, 3, 2, 1), (3, 8, 8, 1, 1, 0),
             (1, 7, 4, 3, 2, 1), (16, 8, 8, 3, 1, 0)]
    for c, hw, o, k, s, p in cases:
        x = rng.randn(1, c, hw, hw).astype(dtype)
        W = rng.randn(o, c, k, k).astype(dtype)
        _assert_bitwise_both_ways(x, W, lambda y: F.sum(y * y), (c, hw, o, k), stride=s, pad=p)


def _assert_bitwise_both_ways(x, W, loss, where, **conv):
    """y, gW and gx of one convolution, cpu_conv off and on: the same bits."""
    results = []
    for on in (False, True):
        xv, Wv = chainer.Variable(x.copy()), chainer.Variable(W.copy())
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', FastchainWarning)
            with fastchain.enable(loader_workers=0, autotune=False, cpu_conv=on):
                y = F.convolution_2d(xv, Wv, **conv)
                loss(y).backward()
        results.append((y.array, Wv.grad, xv.grad))
    for name, a, b in zip(('y', 'gW', 'gx'), *results):
        numpy.testing.assert_array_equal(b, a, err_msg='{} {}'.format(name, where))


@pytest.mark.parametrize('n', [1, 2])
@pytest.mark.parametrize('reduce', [F.sum, F.mean])
def test_a_broadcast_output_gradient_is_multiplied_as_chainer_does(n, reduce):
    """F.sum(y) hands the convolution a broadcast (zero-strided) gradient;
    numpy.matmul runs its own loop on it where Chainer's numpy.dot copies it
    for BLAS (a 1-channel 1x1 convolution's gradients were not bitwise: a
    review)."""
    rng = numpy.random.RandomState(n)
    x = rng.randn(n, 1, 12, 13).astype('f')
    W = rng.randn(69, 1, 1, 1).astype('f')
    _assert_bitwise_both_ways(x, W, reduce, (n, reduce.__name__))


def test_what_blas_takes_in_place():
    a = numpy.zeros((4, 6), 'f')
    assert _bind._blasable(a) and _bind._blasable(a.T) and _bind._blasable(a[:, :3])
    assert not _bind._blasable(numpy.broadcast_to(numpy.float32(1), (4, 6)))
    assert not _bind._blasable(a[:, ::2])


@pytest.mark.parametrize('options', [dict(autotune=False), dict(autotune=True),
                                     dict(onednn=True)])
def test_a_kernel_larger_than_the_padded_input_raises_chainers_error(options):
    """Chainer refuses an output without rows; the kernels had made an empty
    (2, 4, 0, 0) output, which a sum-pooled head then trained on silently."""
    if options.get('onednn'):
        pytest.importorskip('torch', reason="the onednn option needs PyTorch's CPU build")
    x, W = numpy.ones((2, 3, 4, 4), 'f'), numpy.ones((4, 3, 5, 5), 'f')
    with pytest.raises(AssertionError) as plain:
        F.convolution_2d(x, W)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FastchainWarning)
        with fastchain.enable(loader_workers=0, **options):
            for pad, extra in ((0, 0), (1, 0), (1, 4)):     # 4 + 2 < 7; and < 11
                k = 5 + 2 * pad + extra
                with pytest.raises(AssertionError) as got:
                    F.convolution_2d(x, numpy.ones((4, 3, k, k), 'f'), pad=pad)
                assert str(got.value) == str(plain.value)


def cores():
    return [cls._forward_cpu_core for cls, _ in _conv.functions()]


def layers():
    return [_patches.layers(cls, '_forward_cpu_core') for cls, _ in _conv.functions()]


def test_enable_installs_once_and_cpu_conv_false_restores_chainers_inside_its_scope():
    chainers = cores()
    with fastchain.enable(loader_workers=0) as outer:
        assert outer.states['cpu_conv'].active
        installed = cores()
        assert layers() == [['cpu_conv']] * 3
        assert [c.__wrapped__ for c in installed] == chainers
        with fastchain.enable(loader_workers=0):
            assert cores() == installed             # not wrapped twice
        with fastchain.enable(loader_workers=0, cpu_conv=False) as inner:
            assert not inner.states['cpu_conv'].active
            assert cores() == chainers and _bind.enabled is False
        assert layers() == [['cpu_conv']] * 3 and _bind.enabled is True
        assert [c.__wrapped__ for c in cores()] == chainers
    assert cores() == chainers and _bind.enabled is True


def test_schedules_built_under_cpu_conv_false_replay_chainers_code():
    from fastchain.static import _fixes
    from tests.helpers import bound_entries
    _fixes.uninstall()
    try:
        for option, bound in ((False, False), (True, True)):
            numpy.random.seed(0)
            model = ConvZoo()
            x = numpy.random.RandomState(2).randn(2, 3, 19, 17).astype(numpy.float32)
            with fastchain.enable(loader_workers=0, cpu_conv=option):
                fastchain.static_graph(model)
                for _ in range(2):
                    model.cleargrads()
                    F.sum(model(x)).backward()
            assert bool(bound_entries(model)) is bound
    finally:
        _fixes.uninstall()


def test_resnet50_at_full_width_is_bitwise_chainers():
    # Every convolution shape of the real model (the overhead benchmark's
    # setting), so BLAS sees the operand shapes it sees in training.
    from fastchain.models import ResNet
    x = numpy.random.RandomState(3).randn(2, 3, 32, 32).astype(numpy.float32)
    y0, g0 = grads(lambda: ResNet(50, 10), x, cpu_conv=False)
    y1, g1 = grads(lambda: ResNet(50, 10), x)
    numpy.testing.assert_array_equal(y1, y0)
    for name in g0:
        numpy.testing.assert_array_equal(g1[name], g0[name], err_msg=name)


def test_an_overflowed_gradient_warns_exactly_when_chainers_kernels_warn():
    # NumPy 1.x's dot reports no floating-point errors, matmul does; 2.x's
    # dot does too. Whatever this NumPy does, cpu_conv matches Chainer.
    x = numpy.ones((2, 3, 5, 5), numpy.float32)
    W = numpy.ones((4, 3, 3, 3), numpy.float32)
    gy = numpy.zeros((2, 4, 5, 5), numpy.float32)
    gy[0, 0, 0, 0] = numpy.inf          # inf * 0: an invalid value in the products

    def warned(**options):
        with warnings.catch_warnings(record=True) as caught, \
                fastchain.enable(loader_workers=0, **options):
            warnings.simplefilter('always')
            xv, Wv = chainer.Variable(x), chainer.Variable(W)
            y = F.convolution_2d(xv, Wv, pad=1)
            y.grad = gy
            y.backward()
        return [str(w.message) for w in caught if w.category is RuntimeWarning], xv.grad
    chainers, gx0 = warned(cpu_conv=False)
    ours, gx1 = warned()
    assert bool(ours) == bool(chainers)
    numpy.testing.assert_array_equal(gx1, gx0)
