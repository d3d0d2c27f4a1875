"""The ``FASTCHAIN_*`` environment variables set in this process, each read
as fastchain reads it (``fastchain doctor``): a wrong value is named here,
before a job fails on it (some are read only by data-parallel jobs, or only
on a GPU), and a name fastchain does not read (a typo) too."""

import os


def _flag(name):
    def read(value):
        if value not in ('0', '1'):
            raise ValueError('{}={!r}: only 1 turns it on (0 or unset: off)'.format(
                name, value))
        return 'on' if value == '1' else 'off'
    return read


def _bn_mode(value):
    modes = {'0': "off: Chainer's BatchNormalization", '1': "cuDNN's BatchNormalization graphs",
             'stats': "Chainer's BatchNormalization with two-level CuPy reductions"}
    if value not in modes:
        raise ValueError("FASTCHAIN_CUDNN_BN={!r}: 1 (cuDNN graphs), stats (two-level "
                         'reductions) or 0 (off, as unset)'.format(value))
    return modes[value]


def _timeout(value):
    from fastchain.distributed._base import default_timeout
    return '{:g} s a collective'.format(default_timeout())


def _capture(value):
    from fastchain.nvtx._hooks import capture_window
    return "a 'capture' range over iterations {}-{}".format(*capture_window())


def _threads(value):
    from fastchain import _node
    from fastchain.distributed import _threads as threads
    own = _node.own_cores()
    n, _ = threads.plan(own, [own], os.environ)
    # (how many processes will share the node is the job's to say: a rank
    # prints its plan when its communicator is made)
    return '{} BLAS/OpenMP thread(s) a process, in a data-parallel job{}'.format(
        n, '' if n <= len(own) else ': more than the {} cores here, before any other '
        'process shares them (the threads wait for cores; N processes on this node fit '
        '{} // N each)'.format(len(own), len(own)))


def _keep_malloc(value):
    from fastchain.distributed._allocator import keep_malloc
    return "glibc's malloc thresholds left alone" if keep_malloc(os.environ) else \
        'fastchain sets the malloc thresholds once MPI is up'


def _tool(meaning):
    """A variable the repository's tests and tools read, not the package."""
    return lambda value: meaning + ' (read by the repository\'s tests and tools, not by the ' \
        'package)'


READERS = {
    'FASTCHAIN_COLLECTIVE_TIMEOUT': _timeout,
    'FASTCHAIN_CAPTURE': _capture,
    'FASTCHAIN_THREADS_PER_PROCESS': _threads,
    'FASTCHAIN_KEEP_MALLOC': _keep_malloc,
    'FASTCHAIN_CUDNN_BN': _bn_mode,
    'FASTCHAIN_NO_COMPAT': _flag('FASTCHAIN_NO_COMPAT'),
    'FASTCHAIN_NVTX_LOG': _tool('the file the NVTX injection recorder writes the ranges to'),
    'FASTCHAIN_DIFFERENTIAL_EXAMPLES': _tool("the differential suite's examples"),
    'FASTCHAIN_GPU_CASES': _tool('the share of the generated GPU test cases that runs'),
    'FASTCHAIN_MUTATION': _tool('the defect make mutation-check plants'),
}


def variables():
    """[{'name', 'value', 'ok', 'meaning' or 'error'}] for every FASTCHAIN_*
    variable set in this process's environment."""
    environ = os.environ
    out = []
    for name in sorted(n for n in environ if n.startswith('FASTCHAIN_')):
        entry = {'name': name, 'value': environ[name]}
        read = READERS.get(name)
        if read is None:
            entry.update(ok=False, error='not a variable fastchain reads (a typo?); it reads '
                         + ', '.join(sorted(READERS)))
        else:
            try:
                entry.update(ok=True, meaning=read(environ[name]))
            except ValueError as e:
                entry.update(ok=False, error=str(e))
        out.append(entry)
    return out
