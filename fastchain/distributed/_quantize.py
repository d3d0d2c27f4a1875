"""The quantized learner (1-bit SGD and its multi-bit and fp16 relatives)
and its compact gradient encodings.

Every array is seen as a matrix of ``shape[0]`` rows (a Linear's output
units, a convolution's filters; a vector or a scalar is one row), and each
row is encoded on its own:

- 1 bit (Seide et al., 2014): the sign of each value, and the row's two
  reconstruction levels, the mean of its values >= 0 and the mean of its
  values < 0. A value decodes to the level of its side.
- 2, 4 or 8 bits: ``2**bits`` levels evenly spaced from the row's minimum
  to its maximum, each value rounded to the nearest one.
- 16: IEEE half precision (no levels).

The codes of all arrays travel as one byte string with the bits packed
(eight 1-bit codes, four 2-bit codes, two 4-bit codes a byte), the levels
as one float32 array (two per row). :meth:`Encoding.decode` is the only
place codes become values: the sender's own residual is computed from the
same decoded values its peers receive.

Works on NumPy and CuPy arrays alike (only array-module functions).
"""

import time

import numpy

import chainer

from fastchain.distributed import _arguments
from fastchain.distributed._learners import Learner
from fastchain.distributed._sync import own_gradient
from fastchain.precision._attach import carried_scale
from fastchain.precision._scaler import _any_nonfinite

BITS = (1, 2, 4, 8, 16)


class Encoding:
    """The layout of one model's gradients in compact form.

    Args:
        shapes (list of tuple): the arrays' shapes, in exchange order.
        bits (int): 1, 2, 4, 8 or 16.
    """

    def __init__(self, shapes, bits):
        _check_bits(bits, 'quantization bits')
        self.bits = bits
        self.layout = []            # (shape, rows, cols, value offset, row offset)
        values = rows_total = 0
        for shape in shapes:
            shape = tuple(int(s) for s in shape)
            size = int(numpy.prod(shape, dtype=numpy.int64))
            rows = shape[0] if len(shape) >= 2 and size else 1
            cols = size // rows if rows else 0
            self.layout.append((shape, rows, cols, values, rows_total))
            values += size
            rows_total += rows
        self.values = values
        self.rows = rows_total

    @property
    def code_bytes(self):
        """Bytes of packed codes per rank and step."""
        if self.bits == 16:
            return 2 * self.values
        return -(-self.values * self.bits // 8)

    @property
    def level_count(self):
        return 0 if self.bits == 16 else 2 * self.rows

    @property
    def payload_bytes(self):
        """What one rank contributes to the exchange: codes and levels."""
        return self.code_bytes + 4 * self.level_count

    # -- encoding ------------------------------------------------------------

    def encode(self, arrays):
        """``arrays`` (float32, the layout's shapes) to (codes uint8, levels
        float32)."""
        xp = chainer.backend.get_array_module(*arrays)
        if self.bits == 16:
            flat = xp.concatenate([a.ravel() for a in arrays]) if arrays else \
                xp.zeros(0, xp.float32)
            with numpy.errstate(over='ignore'):     # beyond 65504: inf, checked
                half = flat.astype(xp.float16)
            return half.view(xp.uint8), xp.zeros(0, xp.float32)
        codes = xp.empty(self.values, xp.uint8)
        levels = xp.empty((self.rows, 2), xp.float32)
        for a, (shape, rows, cols, off, row) in zip(arrays, self.layout):
            m = a.reshape(rows, cols)
            out = codes[off:off + rows * cols].reshape(rows, cols)
            lv = levels[row:row + rows]
            if self.bits == 1:
                positive = m >= 0
                count = positive.sum(axis=1)
                zero = xp.float32(0)
                upper = xp.where(positive, m, zero).sum(axis=1, dtype=xp.float32)
                lower = xp.where(positive, zero, m).sum(axis=1, dtype=xp.float32)
                lv[:, 0] = upper / xp.maximum(count, 1).astype(xp.float32)
                lv[:, 1] = lower / xp.maximum(cols - count, 1).astype(xp.float32)
                out[...] = positive
            else:
                lo = m.min(axis=1) if cols else xp.zeros(rows, xp.float32)
                hi = m.max(axis=1) if cols else xp.zeros(rows, xp.float32)
                lv[:, 0] = lo
                lv[:, 1] = hi
                step = self._steps(lv)
                safe = xp.where(step > 0, step, xp.float32(1))
                top = (1 << self.bits) - 1
                q = xp.rint((m - lo[:, None]) / safe[:, None])
                out[...] = xp.clip(q, 0, top).astype(xp.uint8)
        return self._pack(codes, xp), levels.ravel()

    def _steps(self, levels):
        return (levels[:, 1] - levels[:, 0]) / numpy.float32((1 << self.bits) - 1)

    def _pack(self, codes, xp):
        if self.bits == 8:
            return codes
        if self.bits == 1:
            return xp.packbits(codes)
        per = 8 // self.bits
        padded = xp.zeros(-(-codes.size // per) * per, xp.uint8)
        padded[:codes.size] = codes
        padded = padded.reshape(-1, per)
        packed = xp.zeros(padded.shape[0], xp.uint8)
        for j in range(per):
            packed |= padded[:, j] << numpy.uint8(self.bits * j)
        return packed

    def _unpack(self, packed, xp):
        if self.bits == 8:
            return packed
        if self.bits == 1:
            return xp.unpackbits(packed)[:self.values]
        per = 8 // self.bits
        mask = numpy.uint8((1 << self.bits) - 1)
        codes = xp.empty((packed.size, per), xp.uint8)
        for j in range(per):
            codes[:, j] = (packed >> numpy.uint8(self.bits * j)) & mask
        return codes.ravel()[:self.values]

    # -- decoding ------------------------------------------------------------

    def decode(self, codes, levels, out=None):
        """One rank's (codes, levels) to float32 values, flat (into ``out``
        if given)."""
        xp = chainer.backend.get_array_module(codes)
        if out is None:
            out = xp.empty(self.values, xp.float32)
        if self.bits == 16:
            out[...] = codes.view(xp.float16)
            return out
        codes = self._unpack(codes, xp)
        levels = levels.reshape(-1, 2)
        for shape, rows, cols, off, row in self.layout:
            c = codes[off:off + rows * cols].reshape(rows, cols)
            lv = levels[row:row + rows]
            dst = out[off:off + rows * cols].reshape(rows, cols)
            if self.bits == 1:
                dst[...] = xp.where(c.astype(bool), lv[:, 0:1], lv[:, 1:2])
            else:
                step = self._steps(lv)
                dst[...] = lv[:, 0:1] + c.astype(xp.float32) * step[:, None]
        return out

    def split(self, flat):
        """Views of a flat float32 array as the layout's shapes."""
        return [flat[off:off + rows * cols].reshape(shape)
                for shape, rows, cols, off, _ in self.layout]


def _check_bits(bits, what):
    # an int: True and 1.0 equal 1 (and read "True-bit SGD")
    if isinstance(bits, (bool, numpy.bool_)) or \
            not isinstance(bits, (int, numpy.integer)) or bits not in BITS:
        raise ValueError('{} must be one of {}, got {!r}'.format(
            what, ', '.join(map(str, BITS)), bits))


class QuantizedSGD(Learner):
    """1-bit SGD (Seide et al., 2014) and its multi-bit relatives.

    Each step, each rank adds its residual to its gradient, encodes the sum
    with ``bits`` bits per value (see ``_quantize``), keeps what the
    encoding lost as the next residual (error feedback), and sends the
    packed encoding; every rank decodes all of them and averages, in rank
    order, so the ranks stay identical. Over many steps the applied updates
    add up to the true gradients' sum less the current residual.

    Args:
        bits (int): 1, 2, 4, 8, or 16 (IEEE half precision).
        error_feedback (bool): keep the residual (without it, what the
            encoding loses is lost).

    A step with a non-finite gradient on any rank (an fp16 overflow) is
    averaged exactly instead, the residuals untouched, so the loss
    scaler sees the overflow on every rank and skips the step everywhere.
    So is a step whose encoding overflows on any rank (a value beyond
    float16's 65504 at 16 bits, in an fp32 model; at any bits, a float64
    gradient beyond float32 or a row whose levels overflow float32), with a
    warning: it is counted in ``fallback_steps``.
    """

    name = 'quantized'
    per_rank_state = True

    def __init__(self, bits=1, error_feedback=True):
        super().__init__()
        _check_bits(bits, 'QuantizedSGD bits')
        self.bits = int(bits)
        self.error_feedback = _arguments.flag('error_feedback', error_feedback)
        self.residuals = None
        self.fallback_steps = 0
        self._scale = None

    def _bind(self, sync):
        super()._bind(sync)
        self.encoding = Encoding([p.shape for p in self.params], self.bits)

    def settings(self):
        return dict(super().settings(), bits=self.bits, error_feedback=self.error_feedback)

    def _summary(self):
        text = '{}-bit SGD{}'.format(self.bits, '' if self.error_feedback
                                     else ' without error feedback')
        if self.bits == 16:
            text = 'fp16 SGD' + text[len('16-bit SGD'):]
        return text

    def _residuals(self, xp):
        if self.residuals is None:
            self.residuals = [xp.zeros(p.shape, xp.float32) for p in self.params]
        return self.residuals

    def average_gradients(self):
        params = self.params
        xp = chainer.backend.get_array_module(params[0].grad) if params else numpy
        grads = [p.grad for p in params]
        start = time.perf_counter()
        residuals = self._residuals(xp)
        # The residual is in the units of the gradients: loss-scaled by the
        # scale their backward used (none for a script's own loss.backward(),
        # whatever the optimizer's scale is).
        scale = carried_scale(params) or 1.0
        ratio = None
        if self._scale is not None and scale != self._scale:
            ratio = numpy.float32(scale / self._scale)
        bad = _any_nonfinite(grads)
        overflow = False
        if not bad:
            with numpy.errstate(over='ignore', invalid='ignore'):     # checked below
                values = [g.astype(xp.float32) + (r if ratio is None else r * ratio)
                          for g, r in zip(grads, residuals)]
                codes, levels = self.encoding.encode(values)
                own = self.encoding.decode(codes, levels)   # what every peer will decode
            # Finite gradients the encoding cannot hold: fp16 codes beyond
            # 65504, a float64 gradient beyond float32, a row whose levels
            # overflow float32 (its sum, its range).
            overflow = _any_nonfinite(values + [own])
            if overflow:
                self._warn_once('overflow', _overflow_message(self.bits))
        if self.comm.any(bad or overflow, 'non-finite gradient agreement'):
            # averaged exactly, the residuals untouched: an overflowing
            # gradient makes the loss scaler skip the step on every rank
            self.fallback_steps += 1
            self.exact_average()
            return
        if ratio is not None:
            for r in residuals:
                r *= ratio
        self._scale = scale
        if self.error_feedback:       # the new residuals, kept if the step is finite
            fresh = [v - q for v, q in zip(values, self.encoding.split(own))]
        all_codes = self.comm.allgather(codes, 'quantized gradient exchange (codes)')
        all_levels = self.comm.allgather(levels, 'quantized gradient exchange (levels)') \
            if levels.size else [levels] * self.comm.size

        def decoded(rank, out=None):    # this rank's own: decoded above already
            if rank == self.comm.rank:
                return own
            return self.encoding.decode(all_codes[rank], all_levels[rank], out=out)
        total = decoded(0)
        buffer = xp.empty_like(total)
        for rank in range(1, self.comm.size):
            total += decoded(rank, out=buffer)
        total /= numpy.float32(self.comm.size)
        claimed = []        # each parameter's average into a gradient of its own
        for p, avg in zip(params, self.encoding.split(total)):
            own_gradient(p, claimed)[...] = avg
        # The average can overflow the gradient's dtype (fp16) where no input
        # did: the loss scaler then skips the step on every rank (they hold
        # the same average), and the residuals must stay as they were.
        if self.error_feedback and not _any_nonfinite([p.grad for p in params]):
            for r, f in zip(residuals, fresh):
                r[...] = f
        self._count(start, (self.comm.size - 1) * self.encoding.payload_bytes)

    def _start(self):
        self.residuals = None       # the warm start averaged exactly: nothing owed

    def local_state(self):
        if self.residuals is None:
            return {self._key(p): numpy.zeros(p.shape, numpy.float32) for p in self.params}
        return {self._key(p): chainer.backend.CpuDevice().send(r)
                for p, r in zip(self.params, self.residuals)}

    def _key(self, p):
        return 'residual' + self.names[id(p)]

    def _apply_local_state(self, state):
        xp = self._xp()
        # copies: an in-memory snapshot's arrays must not be trained in place
        self.residuals = [xp.array(state[self._key(p)], xp.float32) for p in self.params]

    def _foreign(self, state):
        return {k: numpy.zeros_like(v) for k, v in state.items()}

    def _shared_state(self, serializer):
        scale = serializer('residual_scale', self._scale or 0.0)
        self._scale = float(scale) or None
        self.fallback_steps = int(serializer('fallback_steps', self.fallback_steps))


def _overflow_message(bits):
    what, fix = (
        "beyond float16's range (65504)",
        "use QuantizedSGD(8), whose levels follow each row's range, or scale the loss down") \
        if bits == 16 else ('whose levels overflow float32 (a row\'s sum or range beyond '
                            '3.4e38)', 'scale the loss down')
    return ('fastchain: QuantizedSGD({}) met a gradient (plus residual) {}, which its '
            'encoding cannot hold: the step is averaged exactly instead (counted in '
            'fallback_steps). Fix: {}'.format(bits, what, fix))
