"""An Evaluator whose results are the mean over ranks."""

from fastchain.config import _patches


def create_multi_node_evaluator(evaluator, comm):
    """Make ``evaluator`` (a Chainer Evaluator, run on every rank over that
    rank's shard) report the mean of each metric over all ranks.

    Shards from :func:`scatter_dataset` have equal size, so the mean of the
    ranks' means is the mean over the whole validation set.
    """
    def evaluate_everywhere(next_):
        local = {k: float(v) for k, v in next_().items()}
        keys = sorted(local)
        everyone = comm.allgather_obj(local, what='evaluation (allgather of metrics)')
        if any(sorted(r) != keys for r in everyone):
            raise ValueError('ranks reported different metrics: {}'.format(
                [sorted(r) for r in everyone]))
        return {k: sum(r[k] for r in everyone) / comm.size for k in keys}

    _patches.wrap(evaluator, 'evaluate', 'distributed', evaluate_everywhere)
    _patches.attach(evaluator, 'communicator', comm)
    return evaluator
