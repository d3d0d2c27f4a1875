"""Measure and choose (``enable(autotune=...)``).

Where fastchain has more than one way to compute the same thing, bit for bit
(Chainer's convolution kernel or fastchain's, per call and in a bound
schedule; Chainer's optimizer update or the fused one; a verified static
schedule or define-by-run; how many of the default loader workers load),
the autotuner times the alternatives on the first
calls of each key and keeps the fastest, as cuDNN's autotune does for its
algorithms; the per-call picks are then checked together over whole steps
against fastchain's side (``_steps``). :func:`choices` lists what was picked
and the times measured.
"""

from fastchain.tune._tuner import choices, describe, forget, summary

__all__ = ['choices', 'describe', 'forget', 'summary']
