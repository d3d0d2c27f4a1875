"""NVTX annotations of every phase of a training step, and a built-in timeline.

``fastchain.enable(nvtx=True)`` (on by default when a profiler is attached)
puts each phase of a Chainer training step in a range of the ``fastchain``
NVTX domain, so ``nsys profile`` shows where a step's time goes:

========== ==========================================================
category   range
========== ==========================================================
step       one ``updater.update()`` (the phases below are inside it)
data       waiting for the next batch
convert    conversion and host-to-device copy
forward    the loss function
backward   ``loss.backward()``
loss_scale the overflow check and the scale update
update     the optimizer update (with its hooks)
allreduce  one gradient bucket (data-parallel training)
extension  one trainer extension (after the step)
link       per-link forward/backward, with ``nvtx='links'``
mark       epoch boundaries and skipped steps
========== ==========================================================

``enable(timeline='trace.json')`` records the same ranges in-process and
writes a Chrome trace, a PNG chart and a summary when disabled.
"""

from fastchain.nvtx._annotator import CATEGORIES, DOMAIN, annotator
from fastchain.nvtx._summary import diagnose, format_summary, summarize
from fastchain.nvtx._timeline import Timeline

__all__ = ['CATEGORIES', 'DOMAIN', 'Timeline', 'annotator', 'diagnose',
           'format_summary', 'summarize']
