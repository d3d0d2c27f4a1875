"""Choosing a communicator: the only module that knows every strategy.

===========  ================================  ===================================
name         arrays                            use it for
===========  ================================  ===================================
``mpi``      NumPy (MPI through mpi4py)        CPU training, the tests, debugging
``nccl``     CuPy (NCCL through CuPy; the      GPUs: one process per GPU, within a
             unique id broadcast over MPI)     node and across nodes
``auto``     ``nccl`` when a GPU is usable,
             else ``mpi``
===========  ================================  ===================================

Processes are started by MPI (``mpiexec -n N python train.py``, or
``fastchain-run -n N train.py``). The set-up and every collective wait at
most ``timeout`` seconds (``FASTCHAIN_COLLECTIVE_TIMEOUT``, default 300; see ``_base``):
past that, the process says which rank and which operation did not
complete, and aborts the whole job rather than hang; a rank that ends its
process (``sys.exit()``) while the others wait for it ends the job within
seconds (see ``_departures``). With more than one process on a node, each
gets its share of the node's cores for BLAS/OpenMP threads (see
``_threads``).
"""

from fastchain import _node
from fastchain.distributed import _allocator, _base, _faults, _setup, _threads

NAMES = ('auto', 'mpi', 'nccl')


def create_communicator(name='auto', mpi_comm=None, timeout=None):
    """Make a communicator over ``mpi_comm`` (default: MPI.COMM_WORLD).

    With more than one process, the communicator holds the job's
    process-wide hooks (an uncaught error aborts the job; Ctrl-C ends every
    rank quietly with status 130) until ``comm.finalize()`` or the end of a
    ``with create_communicator() as comm:`` block.

    Args:
        name (str): ``'auto'``, ``'mpi'`` or ``'nccl'`` (see the table above).
        mpi_comm: an mpi4py communicator.
        timeout (float): seconds the set-up or a collective may take before
            the job is aborted (default: ``FASTCHAIN_COLLECTIVE_TIMEOUT`` or
            300; ``inf``: no deadline).
    """
    if name not in NAMES:
        raise ValueError('communicator name must be one of {}, got {!r}'.format(
            ', '.join(repr(n) for n in NAMES), name))
    timeout = _base.check_timeout(timeout)
    import os
    _threads.check(os.environ)      # (before MPI starts)
    from fastchain.backends import mpi as mpi_backend
    with _setup.setup_deadline(timeout) as setup:
        # Importing mpi4py.MPI initialises MPI, which waits for every rank.
        status = mpi_backend.mpi_status()
        if not status.available:
            raise RuntimeError('fastchain.distributed needs MPI: {}. Fix: {}'.format(
                status.why, status.fix))
        from mpi4py import MPI
        _allocator.settle()         # after MPI's initialisation (see _allocator)
        if mpi_comm is None:
            mpi_comm = MPI.COMM_WORLD
            _one_of_many(mpi_comm)
        setup['initialised'](mpi_comm)
        if name == 'auto':
            name = _agreed(mpi_comm)
        if name == 'mpi':
            from fastchain.distributed._mpi import MpiCommunicator
            comm = MpiCommunicator(mpi_comm, timeout)
        else:
            from fastchain.distributed._nccl import NcclCommunicator
            comm = NcclCommunicator(mpi_comm, timeout)
    _faults.hold(comm)
    if comm.size > 1:
        _threads.apply(comm.rank, _node.own_cores(), comm.node_cores)
    else:       # one process keeps its threads; a wrong setting is still named
        import os
        _threads.plan(_node.own_cores(), [_node.own_cores()], os.environ)
    return comm


def _one_of_many(world):
    """MPI sees a job of one process where the launcher started several (its
    variables say so; SLURM's are left out: an allocation's tasks are not a
    job's): another MPI's launcher than mpi4py's. Each process trained alone,
    all writing to one output folder, and exited 0 (a review)."""
    import os
    from fastchain.backends.mpi import _RANK_VARIABLES
    if world.size != 1:
        return
    for rank, size in _RANK_VARIABLES:
        if rank.startswith('SLURM_'):
            continue
        try:
            launched = int(os.environ[size])
        except (KeyError, ValueError):
            continue
        if launched > 1:
            from mpi4py import MPI
            raise RuntimeError(
                'fastchain: this process was started as rank {} of {} ({}={}), but MPI sees a '
                'job of one process: the launcher belongs to another MPI than the one mpi4py '
                'uses ({}). Each process would train alone. Fix: start the job with '
                'fastchain-run -n {} or the mpiexec of the environment mpi4py is installed in'
                .format(os.environ.get(rank, '?'), launched, size, launched,
                        ' '.join(MPI.Get_library_version().split('\n')[0].split()), launched))


def _agreed(mpi_comm):
    """'auto': 'nccl' where this rank has a usable GPU, else 'mpi', agreed by
    every rank (one allgather). Decided on each rank alone, a node without
    a GPU took 'mpi' where the others set up NCCL, and that rank failed in
    MPI with no word of why (a review)."""
    from fastchain.backends import cuda
    mine = 'nccl' if cuda.available() else 'mpi'
    if mpi_comm.size == 1:
        return mine
    seen = mpi_comm.allgather((mine, cuda.cupy_status().why))
    if len({kind for kind, _ in seen}) == 1:
        return mine
    raise RuntimeError(
        "fastchain: create_communicator('auto') found a usable GPU on some ranks and none on "
        "{}, so the ranks cannot agree on NCCL. Fix: give each rank a GPU (`fastchain doctor` "
        "on that node says why it has none), or pass 'mpi' to train every rank on its "
        'CPU'.format(', '.join('rank {} ({})'.format(r, why or 'no GPU')
                               for r, (kind, why) in enumerate(seen) if kind == 'mpi')))
