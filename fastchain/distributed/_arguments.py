"""The arguments of ``create_multi_node_optimizer`` and of the learners:
each refused by name, with what it must be (a wrong type or value would
otherwise surface as a raw error far from the call, or be taken silently:
``error_feedback='no'`` is true)."""

import math

import numpy


def flag(name, value):
    """A bool (NumPy's too): a string such as 'False' is not taken as true."""
    if not isinstance(value, (bool, numpy.bool_)):
        raise TypeError('{} must be True or False, got {!r}'.format(name, value))
    return bool(value)


def number(name, value, what):
    """A finite real number (not a bool); ``what`` says its range."""
    if isinstance(value, (bool, numpy.bool_)) or \
            not isinstance(value, (int, float, numpy.integer, numpy.floating)):
        raise TypeError('{} must be {}, got {!r}'.format(name, what, value))
    if not math.isfinite(value):
        raise ValueError('{} must be {}, got {!r}'.format(name, what, value))
    return float(value)


def count(name, value, what, low):
    """A whole number >= ``low`` (an int, not a bool or a float)."""
    if isinstance(value, (bool, numpy.bool_)) or \
            not isinstance(value, (int, numpy.integer)) or value < low:
        raise ValueError('{} must be {} (an int >= {}), got {!r}'.format(
            name, what, low, value))
    return int(value)


def check_optimizer(optimizer, comm, bucket_cap_mb, fp16_allreduce, overlap,
                    distributed_after, zero_fill, double_buffering):
    from chainer.optimizer import GradientMethod
    from fastchain.distributed._base import CommunicatorBase
    if isinstance(optimizer, type):
        # the class given for an instance would be patched for the whole process
        raise TypeError('create_multi_node_optimizer takes an optimizer, not its class: '
                        'give {0}(...) (e.g. chainer.optimizers.{0}(lr=0.01)), not {0}'
                        .format(optimizer.__name__))
    if not isinstance(optimizer, GradientMethod):
        raise TypeError('create_multi_node_optimizer takes a Chainer GradientMethod (SGD, '
                        'MomentumSGD, Adam, ...), got {}'.format(type(optimizer).__name__))
    if not isinstance(comm, CommunicatorBase):
        raise TypeError('comm must be a communicator from '
                        'fastchain.distributed.create_communicator(), got {!r}'.format(comm))
    if number('bucket_cap_mb', bucket_cap_mb, 'a number of MiB > 0') <= 0:
        raise ValueError('bucket_cap_mb must be a number of MiB > 0, got {!r}'.format(
            bucket_cap_mb))
    flag('fp16_allreduce', fp16_allreduce)
    if overlap is not None:
        flag('overlap', overlap)
    count('distributed_after', distributed_after, 'a number of samples', 0)
    # ChainerMN's arguments, so that its scripts port: what fastchain does is
    # their default; the other choice is refused, saying why.
    if flag('zero_fill', zero_fill) is False:
        raise ValueError(
            'zero_fill=False is not offered: fastchain averages a zero gradient for a '
            'parameter that got none on a rank (ChainerMN\'s default, zero_fill=True), so '
            'every rank applies the same update; drop the argument')
    if flag('double_buffering', double_buffering):
        raise ValueError(
            'double_buffering=True (ChainerMN: each step applies the previous step\'s '
            'averaged gradients) is not offered: it changes the training. fastchain '
            'overlaps the exact allreduce with the backward instead (overlap=True, the '
            'default on NCCL); drop the argument')
