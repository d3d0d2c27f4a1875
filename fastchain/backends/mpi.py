"""The MPI edge: mpi4py and an ``mpiexec`` to start processes with."""

import functools
import os
import shutil
import sys

from fastchain.backends._status import Status

MPI_EXTRA = 'pip install "fastchain[mpi]" (mpi4py and the mpich wheel)'


def mpiexec_path():
    """The ``mpiexec`` next to this interpreter (the mpich wheel's), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if os.access(here, os.X_OK):
        return here
    return shutil.which('mpiexec')


@functools.lru_cache(maxsize=None)
def mpi_status():
    """mpi4py and its MPI library usable, and an ``mpiexec`` present.

    .. note:: Importing ``mpi4py.MPI`` initialises MPI in this process (as a
       singleton when not started by mpiexec), so call this only where MPI
       may be used: ``fastchain doctor`` does.
    """
    try:
        import mpi4py
    except ImportError:
        return Status(False, why='mpi4py is not installed', fix=MPI_EXTRA)
    detail = {'mpiexec': mpiexec_path()}
    try:
        from mpi4py import MPI
        detail['library'] = MPI.Get_library_version().strip().splitlines()[0]
    except Exception as e:
        return Status(False, version=mpi4py.__version__,
                      why='the MPI library did not load: {}'.format(e),
                      fix=MPI_EXTRA, detail=detail)
    if detail['mpiexec'] is None:
        return Status(False, version=mpi4py.__version__,
                      why='no mpiexec found', fix=MPI_EXTRA, detail=detail)
    return Status(True, version=mpi4py.__version__, detail=detail)


# Where launchers put a process's rank and the job's size: MPICH's and Intel
# MPI's hydra (PMI_*), Open MPI (OMPI_COMM_WORLD_*), PMIx launchers, Slurm.
_RANK_VARIABLES = (('PMI_RANK', 'PMI_SIZE'),
                   ('OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE'),
                   ('PMIX_RANK', 'PMIX_SIZE'),
                   ('SLURM_PROCID', 'SLURM_NTASKS'))


def launch_rank():
    """(rank, size) of this process as its launcher set them in the
    environment, readable before (and without) initialising MPI; (None,
    None) when not started by a launcher fastchain knows."""
    for rank, size in _RANK_VARIABLES:
        try:
            return int(os.environ[rank]), int(os.environ[size])
        except (KeyError, ValueError):
            continue
    return None, None
