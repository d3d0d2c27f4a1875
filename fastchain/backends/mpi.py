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
