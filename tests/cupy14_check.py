"""Run by `make cupy14-check` (not collected by pytest): Chainer 7.8.1 and
fastchain with CuPy 14 (``cupy-cuda13x[ctk]``, CUDA 13's libraries from
NVIDIA's wheels) installed, on a machine with or without a GPU.

It imports every module of Chainer (and ChainerMN's, which need mpi4py) and
of fastchain, with fastchain's import hook active, and records for each one
that fails the exception, and every warning raised while importing; then
what Chainer concludes about CUDA and cuDNN, what fastchain's probes say, and
(without a GPU) what ``enable()`` does. Writes JSON to the path given (and
prints a summary). Without a GPU this is as far as CuPy 14 can be exercised:
CuPy needs a device for its first kernel.
"""

import importlib
import json
import pkgutil
import sys
import traceback
import warnings


def walk(package_name, first_errors):
    """Every module of a package. A subpackage that fails to import is not
    walked into; its first error goes to ``first_errors`` (a second import
    can fail differently, after the first left a half-made module)."""
    package = importlib.import_module(package_name)
    names = [package_name]

    def failed(name):
        e = sys.exc_info()[1]
        first_errors.setdefault(name, _describe(e))
    for info in pkgutil.walk_packages(package.__path__, package_name + '.', onerror=failed):
        names.append(info.name)
    return names


def _describe(e):
    return '{}: {}'.format(type(e).__name__, str(e).splitlines()[0] if str(e) else '')


def import_all(names, first_errors):
    failed, warned = dict(first_errors), {}
    for name in names:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            try:
                importlib.import_module(name)
            except BaseException as e:      # noqa: B902 - a SystemExit is a failure too
                failed.setdefault(name, _describe(e))
        messages = sorted({'{}: {}'.format(w.category.__name__, str(w.message).splitlines()[0])
                           for w in caught})
        if messages:
            warned[name] = messages
    return failed, warned


def main(path):
    result = {'python': sys.version.split()[0]}
    import numpy
    result['numpy'] = numpy.__version__
    try:
        import cupy
        result['cupy'] = cupy.__version__
        try:
            result['cupy.is_available()'] = bool(cupy.is_available())
        except Exception as e:
            result['cupy.is_available()'] = 'raises {}: {}'.format(type(e).__name__, e)
    except Exception as e:
        result['cupy'] = 'not importable: {}: {}'.format(type(e).__name__, e)
    errors = {}
    chainer_names = walk('chainer', errors)
    failed, warned = import_all(chainer_names, errors)
    result['chainer_modules'] = len(chainer_names)
    result['chainer_failed'] = failed
    result['chainer_warnings'] = warned
    import chainer
    import chainer.backends.cuda as cuda
    result['chainer.backends.cuda.available'] = bool(cuda.available)
    result['chainer.backends.cuda.cudnn_enabled'] = bool(cuda.cudnn_enabled)
    result['chainer.backends.cuda.cudnn'] = repr(getattr(cuda, 'cudnn', 'unbound'))
    try:
        result['chainer.should_use_cudnn_tensor_core(float16)'] = bool(
            cuda.should_use_cudnn_tensor_core(numpy.float16))
    except Exception as e:
        result['chainer.should_use_cudnn_tensor_core(float16)'] = 'raises {}: {}'.format(
            type(e).__name__, e)
    try:
        errors = {}
        chainermn = walk('chainermn', errors)
        result['chainermn_modules'] = len(chainermn)
        result['chainermn_failed'], result['chainermn_warnings'] = import_all(chainermn,
                                                                              errors)
    except Exception as e:
        result['chainermn'] = 'not walked: {}: {}'.format(type(e).__name__, e)
    errors = {}
    fastchain_names = walk('fastchain', errors)
    result['fastchain_modules'] = len(fastchain_names)
    result['fastchain_failed'], result['fastchain_warnings'] = import_all(fastchain_names,
                                                                          errors)
    from fastchain._compat import _finder
    result['shims_applied'] = sorted('{} ({})'.format(s['name'], s['module'])
                                     for s in _finder.applied())
    from fastchain.backends import cuda as probes
    for name in ('cupy_status', 'cudnn_status', 'nccl_status'):
        s = getattr(probes, name)()
        result['fastchain ' + name] = {'available': s.available, 'why': s.why, 'fix': s.fix}
    import fastchain
    import chainer.links as L
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            with fastchain.enable() as handle:
                model = L.Classifier(L.Linear(4, 3))
                opt = chainer.optimizers.MomentumSGD(0.1).setup(model)
                x = numpy.random.RandomState(0).rand(8, 4).astype(numpy.float32)
                opt.update(model, x, numpy.zeros(8, numpy.int32))
                report = handle.report()
        result['enable() on the CPU'] = {
            'active': sorted(k for k, v in report.items() if v.get('active')),
            'unavailable': {k: v.get('why') for k, v in report.items()
                            if not v.get('available')},
            'warnings': sorted({str(w.message).splitlines()[0] for w in caught})}
    except Exception:
        result['enable() on the CPU'] = 'raises: ' + traceback.format_exc()
    with open(path, 'w') as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print('cupy14-check: Python {}, NumPy {}, CuPy {} (is_available: {}); Chainer: {} modules, '
          '{} failed to import; fastchain: {} modules, {} failed; cuda.available {}, '
          'cudnn_enabled {}; written to {}'.format(
              result['python'], result['numpy'], result.get('cupy'),
              result.get('cupy.is_available()'), result['chainer_modules'], len(failed),
              result['fastchain_modules'], len(result['fastchain_failed']),
              result['chainer.backends.cuda.available'],
              result['chainer.backends.cuda.cudnn_enabled'], path))
    for name, error in sorted(failed.items()):
        print('  {}: {}'.format(name, error))


if __name__ == '__main__':
    main(sys.argv[1] if len(sys.argv) > 1 else 'cupy14_check.json')
