"""The autotune group of ``fastchain.enable``: ``autotune``.

One option, three tuners: cuDNN's algorithm search (Chainer's ``autotune``
configuration) where CuPy's own cuDNN works; on CuPy 14, the plans of
fastchain's cuDNN graphs, each timed with CUDA events on a key's first call
(:mod:`fastchain.cudnn._graphs`); and everywhere fastchain's own
measure-and-choose (:mod:`fastchain.tune._tuner`) between bitwise-equal
alternatives of its CPU convolution kernels, its fused update, its static
cache and its loader workers.
"""

import atexit
import functools
import os

from fastchain.backends import cuda
from fastchain.config._options import Group, Option, State, boolean, unwritable

FLAG = 'fastchain.tune._tuner.enabled'
_saved_at_exit = {}         # cache file -> what writes it again when the process ends


def _path(value):
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError('expected the path of a JSON file (str or os.PathLike)')
    path = os.fspath(value)
    if os.path.isdir(path):
        raise ValueError('{} is a folder; give a file path, e.g. {}'.format(
            path, os.path.join(path, 'autotune.json')))
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError('the folder {!r} does not exist{} (the file is written there at '
                         'disable() and at exit): create it first or choose another path'
                         .format(folder, '' if not os.path.exists(folder) else
                                 ' as a folder (it is a file)'))
    why = unwritable(path)
    if why is not None:
        raise ValueError('{!r} cannot be written ({}): it is rewritten at disable() and '
                         'at exit; choose another path (a read-only cache: copy it to a '
                         'writable one)'.format(path, why))
    return path


class AutotuneGroup(Group):
    name = 'autotune'
    options = (
        boolean('autotune', "measure and choose on the first calls of each key: cuDNN's "
                "fastest convolution algorithm where cuDNN works, and everywhere the "
                "fastest of fastchain's bitwise-equal alternatives (CPU convolution "
                "kernels, fused update, static cache, how many default loader workers "
                "load); default: on"),
        Option('tune_cache', "a JSON file that keeps autotune's choices for this machine "
               'and versions: read at enable(), written at disable() and at exit; keys '
               'found there are not measured again (default: none)', check=_path),
    )

    def probe(self):
        return [State('autotune', True, False, note=self._cudnn_note())]

    @staticmethod
    def _cudnn_note():
        if not cuda.available():
            return None         # a CPU: the CPU choices are all there is to tune
        status = cuda.cudnn_status()
        if status.available:
            return None
        from fastchain.cudnn._group import graph_status
        graphs = graph_status()
        if graphs.available:
            return None         # the graphs' plans are timed by fastchain's tuner
        return ("cuDNN's algorithm search is not available here ({}, and {}; fix: {}); "
                "only fastchain's CPU choices are tuned".format(status.why, graphs.why,
                                                                graphs.fix))

    def unused(self, values, own):
        if 'tune_cache' in own and values['autotune'] is False:
            return ['tune_cache={!r} has no effect while autotune=False: the choices it '
                    'keeps are neither used nor measured (leave autotune on, or leave '
                    'tune_cache out)'.format(values['tune_cache'])]
        return []

    def open(self, handle, values):
        if values['tune_cache'] is None or values['autotune'] is False:
            return      # (said in unused(): neither read nor written)
        # the file read now is the one written: a relative path is taken
        # from the current folder now, not at disable() or exit
        path = os.path.abspath(values['tune_cache'])
        from fastchain.tune import _cache
        handle.resources['tune_cache'] = {'path': path, 'read': _cache.load(path)}
        handle.on_disable(lambda: _cache.save(path), 'autotune cache -> ' + path)
        if path not in _saved_at_exit:
            saver = _saved_at_exit[path] = functools.partial(_save_quietly, path)
            atexit.register(saver)

            def forget():       # the enable() failed: nothing saved at exit for it
                atexit.unregister(saver)
                _saved_at_exit.pop(path, None)
            handle.on_failure(forget)

    def plan(self, values, explicit, plan):
        from fastchain.tune import _tuner
        autotune = values['autotune']
        if autotune is None and cuda.cudnn_status().available:
            autotune = True                       # default: on where it works
        if autotune is not None:
            plan.config('autotune', autotune)
        plan.value(FLAG, lambda: _tuner.enabled, _tuner.set_enabled,
                   values['autotune'] is not False)
        if values['autotune'] is not False:
            from chainer.optimizer import GradientMethod
            from chainer.training.extensions import Evaluator
            plan.wrap(GradientMethod, 'update', 'autotune', _step_clock)
            plan.wrap(Evaluator, 'evaluate', 'autotune', _evaluation)

    def states(self, values, explicit):
        import chainer
        from fastchain.tune import _tuner
        state = self.probe()[0]
        state.setting = values['autotune']
        state.requested = 'autotune' in explicit and values['autotune'] is True
        # What is in force now, whoever set it.
        cudnn_search = bool(chainer.global_config.autotune) and \
            cuda.cudnn_status().available
        state.active = _tuner.enabled or cudnn_search
        if state.active:
            state.choices = _tuner.summary()
        elif values['autotune'] is False:
            state.why = 'autotune=False'
        return [state]


def _step_clock(next_, optimizer, *args, **kwargs):
    """Each step starts at its optimizer's update: the per-call picks'
    check over whole steps (:mod:`fastchain.tune._steps`) is timed there."""
    from fastchain.tune import _steps
    _steps.tick(optimizer)
    return next_(optimizer, *args, **kwargs)


def _evaluation(next_, evaluator, *args, **kwargs):
    """An evaluation between two steps: the check over whole steps does not
    time the period that holds it."""
    from fastchain.tune import _tuner
    _tuner.evaluated()
    return next_(evaluator, *args, **kwargs)


def _save_quietly(path):
    """At exit: a cache that cannot be written says so, without a traceback."""
    from fastchain.tune import _cache
    try:
        _cache.save(path)
    except OSError as e:
        import sys
        print('fastchain: the autotune cache {} could not be written: {}'.format(path, e),
              file=sys.stderr)


GROUP = AutotuneGroup()
