"""Each process's share of its node's cores for BLAS and OpenMP threads.

OpenBLAS, MKL and OpenMP size their thread pools by the cores a process
sees, so N processes of a data-parallel job on one node start N times as
many threads as there are cores, and the threads of one process spin while
another's compute: on the project's 2-core machine, the MNIST recipe on 2
ranks took 5.7-6.1 s, and 2.4-3.1 s with one thread per rank set by hand
(issue #22's runs: 10.6-15.4 s and 2.3-2.4 s).

When a communicator of more than one process is made, each process gets
``cores of the node // processes on the node`` threads (at least 1), or the
cores it is bound to where the launcher binds each process to its own cores
(``mpiexec -bind-to core``). The limit is applied at once (through
threadpoolctl: BLAS and OpenMP libraries already loaded) and, for processes
this one starts later (loader workers), through ``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS``. Choosing:

- ``FASTCHAIN_THREADS_PER_PROCESS=N`` sets N threads per process;
- a thread count set by you (``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``,
  ``MKL_NUM_THREADS`` or ``BLIS_NUM_THREADS`` in the environment) is kept
  as it is.

Rank 0 says which in one line on stderr.
"""

import os
import sys

VARIABLE = 'FASTCHAIN_THREADS_PER_PROCESS'
USER_VARIABLES = ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS',
                  'BLIS_NUM_THREADS')
SET_FOR_CHILDREN = ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS')


def check(environ):
    """``FASTCHAIN_THREADS_PER_PROCESS`` as a number, or None where unset;
    refused, naming the fix, where it is not a positive whole number (read
    before MPI starts: every rank printed the same traceback after)."""
    if VARIABLE not in environ:
        return None
    text = environ[VARIABLE]
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError('{}={!r} is not a positive number of threads. Fix: set it to '
                         'the BLAS/OpenMP threads each process should use, e.g. '
                         '{}=1'.format(VARIABLE, text, VARIABLE))
    return n


def plan(own, node, environ):
    """``(threads, what)``: the threads this process should use (None: leave
    them as the environment set them) and a phrase saying why.

    Args:
        own: this process's CPUs.
        node: the CPU sets of every process of the job on this node.
        environ: the environment.
    """
    if VARIABLE in environ:
        n = check(environ)
        cores = len(frozenset().union(*map(frozenset, node))) if node else len(own)
        share = max(1, cores // max(1, len(node)))
        if n > share:
            # 64 threads a process on 2 cores x 2 processes: an epoch 140x slower
            return n, ('from {} (more than this process\'s share of the node, {} of its {} '
                       'cores for {} process(es): the threads wait for cores, and a step can '
                       'take many times longer; {}={} fits)'.format(
                           VARIABLE, share, cores, len(node), VARIABLE, share))
        return n, 'from {}'.format(VARIABLE)
    for name in USER_VARIABLES:
        if environ.get(name):
            return None, 'as {}={} sets them'.format(name, environ[name])
    node = [frozenset(s) for s in node]
    if len(node) == 1:
        return max(1, len(own)), 'one process on this node, with its {} cores'.format(
            len(own))
    disjoint = sum(len(s) for s in node) == len(frozenset().union(*node))
    if disjoint:        # bound by the launcher: each process owns its CPUs
        return max(1, len(own)), '{} process(es) on this node, each bound to its own ' \
            'cores'.format(len(node))
    cores = len(frozenset().union(*node))
    return max(1, cores // len(node)), '{} processes on this node share its {} ' \
        'cores'.format(len(node), cores)


_applied = []      # the first communicator of the process decides, once


def apply(rank, own, node, environ=None):
    """Limit this process's BLAS/OpenMP threads as :func:`plan` says; rank
    0 reports it. Returns the thread count set, or None. Once per process."""
    if _applied:
        return _applied[0]
    environ = os.environ if environ is None else environ
    threads, what = plan(own, node, environ)
    from fastchain import _node
    _node.cores_per_process = plan(own, node, {})[0]    # the share, whatever the threads
    if threads is not None:
        import threadpoolctl
        threadpoolctl.threadpool_limits(threads)
        for name in SET_FOR_CHILDREN:
            environ[name] = str(threads)
    if rank == 0:
        if threads is None:
            line = 'BLAS/OpenMP threads per process left {}'.format(what)
        else:
            line = '{}: {} BLAS/OpenMP thread(s) per process (set {}=N to ' \
                'choose)'.format(what, threads, VARIABLE)
        print('fastchain: ' + line, file=sys.stderr, flush=True)
    _applied.append(threads)
    return threads
