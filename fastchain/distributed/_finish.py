"""The end of a block learner's training: every rank holds the global model.

Between block ends a block learner's ranks train models of their own, and
at a block end with Nesterov's look-ahead they hold ``W + momentum * D``,
not the global model ``W`` (see ``_blocks``). A training that stops there
would leave each rank its own model, and rank 0's (the one a script saves)
would not be BMUF's result. :meth:`Learner.finish` ends the block (one
exchange of what the ranks trained since the last) and writes ``W`` on
every rank. (CNTK's block-momentum learner also exchanges once more at the
end of its data, and leaves the look-ahead in the model.)

A ``Trainer`` run that ends normally does it for every optimizer of its
updater: ``Trainer.run`` gets a layer while a block learner lives. Every
rank's run ends at the same iteration (the same stop trigger), so the
exchange pairs up; a run that ends in an error does not exchange (the job
is ending). A custom loop calls ``distributed.learner_of(opt).finish()`` on
every rank after its last update.
"""

from fastchain.config import _patches
from fastchain.distributed._held import HeldLayer


def acquire(learner):
    """The Trainer layer, in force as long as ``learner`` lives."""
    _layer.acquire(learner)


def _run_then_finish(next_, trainer, *args, **kwargs):
    result = next_(trainer, *args, **kwargs)
    from fastchain.distributed._optimizer import LEARNER
    for _, optimizer in sorted(trainer.updater.get_all_optimizers().items()):
        learner = _patches.attached(optimizer, LEARNER)
        if learner is not None:
            learner.finish()
    return result


_layer = HeldLayer('run', _run_then_finish)
