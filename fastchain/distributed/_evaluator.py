"""An Evaluator whose results are the mean over ranks, weighted by the
examples each rank evaluated."""

import warnings

from fastchain.config import _patches


def create_multi_node_evaluator(evaluator, comm):
    """Make ``evaluator`` (a Chainer Evaluator, run on every rank over that
    rank's shard) report each metric's mean over all ranks, each rank's
    result weighted by the number of examples it evaluated.

    Each rank's own result is Chainer's: the mean over its batches. So the
    result is the mean over the whole validation set when every batch has
    the same size; when a rank's batches differ (a batch size that does not
    divide the shard, examples skipped), a smaller batch's examples weigh
    more, as in Chainer's Evaluator in one process, and rank 0 says so
    once. ChainerMN's evaluator took the plain mean of the ranks' results,
    which is off too when shards differ in size (examples skipped as
    unreadable on one rank). A metric that is not a number is refused.
    """
    warned = []

    def evaluate_everywhere(next_):
        iterators = getattr(evaluator, '_iterators', {})
        main = iterators.get('main')
        counting = _Counting(main) if main is not None else None
        if counting is not None:
            iterators['main'] = counting
        try:
            local = {k: _number(k, v) for k, v in next_().items()}
        finally:
            if counting is not None:
                iterators['main'] = main
        sizes = counting.sizes if counting is not None else []
        keys = sorted(local)
        everyone = comm.allgather_obj((local, sizes), what='evaluation (allgather of metrics)')
        if any(sorted(r) != keys for r, _ in everyone):
            raise ValueError('ranks reported different metrics: {}'.format(
                [sorted(r) for r, _ in everyone]))
        weighed = all(s and None not in s for _, s in everyone)
        # without sizes (an evaluate() of the script's own): the plain mean
        weights = [sum(s) for _, s in everyone] if weighed else [1] * comm.size
        uneven = [(r, max(s), min(s)) for r, (_, s) in enumerate(everyone)
                  if weighed and len(set(s)) > 1]
        if uneven and comm.rank == 0 and not warned:
            warned.append(True)
            from fastchain.config._warning import FastchainWarning
            r, most, least = uneven[0]
            warnings.warn(
                "multi-node evaluator: rank {} evaluated {} examples in batches of {} down to "
                "{}: Chainer's Evaluator averages over batches, so a smaller batch's examples "
                "weigh more than the others'. For the mean over the validation set, use a "
                'batch size that divides the shard (examples skipped as unreadable make '
                'batches smaller too)'.format(r, weights[r], most, least), FastchainWarning,
                stacklevel=_patches.user_stacklevel())
        total = float(sum(weights))
        return {k: sum(res[k] * w for (res, _), w in zip(everyone, weights)) / total
                for k in keys}

    _patches.wrap(evaluator, 'evaluate', 'distributed', evaluate_everywhere)
    _patches.attach(evaluator, 'communicator', comm)
    return evaluator


def _number(key, value):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            'multi-node evaluator: the metric {!r} is {} of shape {}, not one number: the ranks\' '
            'results are averaged metric by metric. Report a scalar (e.g. F.mean of it), or '
            'evaluate it on one rank'.format(key, type(value).__name__,
                                            getattr(value, 'shape', '?'))) from None


class _Counting:
    """The evaluator's iterator, counting the examples of each batch; it
    answers ``isinstance`` and every attribute as the iterator it wraps."""

    def __init__(self, iterator, sizes=None):
        self._iterator = iterator
        self.sizes = [] if sizes is None else sizes

    @property
    def __class__(self):
        return type(self._iterator)

    def __iter__(self):
        return self

    def __next__(self):
        batch = self._iterator.__next__()
        # a batch of the script's own making (a dict of arrays): not weighed
        self.sizes.append(len(batch) if isinstance(batch, (list, tuple)) else None)
        return batch

    next = __next__

    def __copy__(self):
        # (an Evaluator of older style copies its iterator rather than reset it)
        import copy
        return _Counting(copy.copy(self._iterator), self.sizes)

    def __getattr__(self, name):
        if name.startswith('__') or name == '_iterator':
            raise AttributeError(name)
        return getattr(self._iterator, name)

    def __setattr__(self, name, value):
        # (an evaluator that rewinds by assignment, it.current_position = 0)
        if name in ('_iterator', 'sizes'):
            object.__setattr__(self, name, value)
        else:
            setattr(self._iterator, name, value)

    def __reduce_ex__(self, protocol):
        return self._iterator.__reduce_ex__(protocol)     # pickled: the iterator itself
