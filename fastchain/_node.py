"""This process's share of its node's cores.

``None`` until ``fastchain.distributed`` makes a communicator of more than one
process, which sets it to the cores of the node divided by the job's
processes on it (or the cores the process is bound to): the BLAS/OpenMP
threads and the loader's default worker count both use it, so N processes
on a node do not each take every core.
"""

cores_per_process = None


def share_of_cores(available):
    """The cores this process should use, of ``available`` it can see."""
    return available if cores_per_process is None else min(available, cores_per_process)
