"""This process's share of its node's cores.

``None`` until ``fastchain.distributed`` makes a communicator of more than one
process, which sets it to the cores of the node divided by the job's
processes on it (or the cores the process is bound to): the BLAS/OpenMP
threads and the loader's default worker count both use it, so N processes
on a node do not each take every core.
"""

import os

cores_per_process = None


def own_cores():
    """The CPUs this process may run on."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:         # not Linux
        return frozenset(range(os.cpu_count() or 1))


def share_of_cores(available):
    """The cores this process should use, of ``available`` it can see."""
    return available if cores_per_process is None else min(available, cores_per_process)
