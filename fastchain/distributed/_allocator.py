"""glibc's allocator after MPI is initialised.

In a process without MPI, glibc adapts its thresholds to the program: once
a large array is freed, arrays of that size come from the heap, and freed
heap is kept for the next step. Measured here (MPICH 5.0.2 from the
``mpich`` wheel), initialising MPI after the model exists leaves them at
their fixed initial values: every gradient-sized array is mapped and
unmapped again at each step. On the MNIST recipe's MLP (4 MB weights),
3,874 page faults a step, 19.9 ms a step against 11.9 ms; with the
thresholds set as below, 0 faults and 11.9 ms (one process, one BLAS
thread, OpenBLAS 0.3.31, AMD EPYC).

So when a communicator is made, fastchain sets them to what glibc's own
adaptation reaches at most: arrays up to 32 MiB from the heap, up to 64 MiB
of free heap kept (``mallopt(M_MMAP_THRESHOLD)``, ``mallopt(M_TRIM_THRESHOLD)``).
Not where the environment sets either (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``), or ``FASTCHAIN_KEEP_MALLOC=1``, and only with
glibc. Results do not change; only where the memory comes from.
"""

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1       # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2 ** 20      # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc's adaptation pairs with it
USER_VARIABLES = ('MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_', 'FASTCHAIN_KEEP_MALLOC')

_done = []


def keep_malloc(environ):
    """``FASTCHAIN_KEEP_MALLOC``: True to leave glibc's thresholds alone."""
    keep = environ.get('FASTCHAIN_KEEP_MALLOC', '').strip().lower()
    if keep not in ('', '0', '1', 'false', 'true', 'no', 'yes'):
        raise ValueError('FASTCHAIN_KEEP_MALLOC={!r}: set it to 1 to leave glibc\'s malloc '
                         'thresholds alone, 0 (or unset) to let fastchain set them'
                         .format(environ['FASTCHAIN_KEEP_MALLOC']))
    return keep in ('1', 'true', 'yes')


def settle(environ=None):
    """Set the thresholds (once per process); True if they were set."""
    environ = os.environ if environ is None else environ
    if _done:
        return _done[0]
    ok = False
    mine = any(environ.get(v) for v in USER_VARIABLES[:2]) or keep_malloc(environ)
    if platform.libc_ver()[0] == 'glibc' and not mine:
        libc = ctypes.CDLL(None)
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
            bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    _done.append(ok)
    return ok
