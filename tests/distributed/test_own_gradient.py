"""Each parameter's gradient made an array of its own before it is written
in place (the in-place allreduce, the quantized learner's average): the
memory test against NumPy's own, over generated views of shared buffers."""

import numpy
from hypothesis import given, settings, strategies as st

import chainer

from fastchain.distributed._sync import own_gradient


def views(draw_from, base):
    """A view of ``base`` (flat, 120 values): a slice, a reshape, a
    transpose, a reversed or strided slice, a broadcast, the base itself."""
    kind, a, b = draw_from
    a, b = sorted((a, b))
    if kind == 'slice':
        return base[a:b + 1]
    if kind == 'reshape':
        return base[:120].reshape(8, 15) if a % 2 else base.reshape(2, 60)[:, a % 60:]
    if kind == 'transpose':
        return base.reshape(10, 12).T
    if kind == 'reversed':
        return base[b:a:-1] if b > a else base[::-1]
    if kind == 'strided':
        return base[a::3]
    if kind == 'broadcast':
        return numpy.broadcast_to(base[a:a + 1], (4, 3))
    return base


view_spec = st.tuples(st.sampled_from(['slice', 'reshape', 'transpose', 'reversed', 'strided',
                                       'broadcast', 'base']),
                      st.integers(0, 119), st.integers(0, 119))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), view_spec), min_size=1, max_size=6),
       st.booleans())
def test_every_gradient_ends_its_own_writable_contiguous_array_with_its_values(specs,
                                                                               readonly):
    bases = [numpy.arange(120, dtype=numpy.float32) + 1000 * i for i in range(3)]
    if readonly:
        bases[0].flags.writeable = False
    params = []
    for which, spec in specs:
        g = views(spec, bases[which])
        p = chainer.Parameter(numpy.zeros(g.shape, numpy.float32))
        p.grad = g
        params.append((p, g.copy()))
    claimed = []
    for p, _ in params:
        assert own_gradient(p, claimed) is p.grad
    for i, (p, values) in enumerate(params):
        g = p.grad
        numpy.testing.assert_array_equal(g, values)
        assert g.flags.c_contiguous and g.flags.writeable
        assert all(s != 0 or n <= 1 for s, n in zip(g.strides, g.shape))
        for q, _ in params[:i]:
            assert not numpy.shares_memory(g, q.grad), (specs, i)
    # an own array is kept as it is (no copy where none is needed)
    first, _ = params[0]
    spec = specs[0][1]
    base_view = views(spec, bases[specs[0][0]])
    if base_view.flags.c_contiguous and base_view.size and not (
            readonly and specs[0][0] == 0) and spec[0] != 'broadcast':
        assert numpy.shares_memory(first.grad, bases[specs[0][0]])


def test_a_missing_gradient_is_zero_filled():
    p = chainer.Parameter(numpy.ones((2, 3), numpy.float32))
    g = own_gradient(p, [])
    assert g is p.grad and g.shape == (2, 3) and not g.any()
