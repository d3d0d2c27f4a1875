"""The NVTX group of ``fastchain.enable``."""

import atexit
import functools
import os
import sys

from fastchain.backends import nvtx as nvtx_backend
from fastchain.config import _patches
from fastchain.config._options import Group, Option, State, unwritable

TIMELINE = 'fastchain timeline (annotator().timeline)'
LINK_HOOKS = 'chainer link and function hooks (nvtx links)'


def _timeline_path(value):
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise ValueError('expected the path of the trace JSON to write (str or os.PathLike), '
                         'got {!r}'.format(value))
    if os.path.isdir(value):
        raise ValueError('{!r} is a folder; give a file path, e.g. {!r}'.format(
            value, os.path.join(value, 'trace.json')))
    if os.path.splitext(value)[1].lower() in ('.png', '.txt'):
        raise ValueError('the chart and the summary are written beside the trace, as '
                         '{}.png and .txt: give the trace its own name, e.g. {!r}'.format(
                             os.path.splitext(value)[0],
                             os.path.splitext(value)[0] + '.json'))
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        raise ValueError('the folder {!r} does not exist (the trace is written there '
                         'on disable(): create it first)'.format(folder))
    why = unwritable(value)
    if why is not None:
        raise ValueError('{!r} cannot be written ({}): choose another path'
                         .format(value, why))
    return value


# The timelines of handles not disabled yet: what an aborted data-parallel
# job writes before MPI_Abort, which runs no exit handler.
_unwritten = {}
opened = []     # every timeline path given to enable() in this process, in order


def write_unwritten(when, limit=10.0):
    """Write every timeline whose handle is still enabled (``when``: as the
    message says it, 'before the job was aborted'), without waiting for the
    device, in a thread given ``limit`` seconds (the abort goes on after)."""
    import threading

    def write():
        for at_exit in list(_unwritten.values()):
            atexit.unregister(at_exit)
            at_exit(when, wait_device=False)
    thread = threading.Thread(target=write, daemon=True, name='fastchain-timeline-at-abort')
    thread.start()
    thread.join(limit)


def rank_path(path):
    """Where this process writes the timeline ``path``: a data-parallel rank
    other than 0 writes beside rank 0's (``trace.json`` -> ``trace.rank1.json``;
    the ranks of a job would otherwise all write the same files, and the last
    one's would be all that is left)."""
    from fastchain.backends.mpi import launch_rank
    rank, size = launch_rank()
    if rank is None or size < 2 or rank == 0:
        return path
    base, ext = os.path.splitext(path)
    return '{}.rank{}{}'.format(base, rank, ext)


class NvtxGroup(Group):
    name = 'nvtx'
    options = (
        Option('nvtx', "NVTX ranges for every phase of a step: True, False, 'links' "
               '(also one range per link), or default: on when a profiler is attached',
               choices=(True, False, 'links')),
        Option('timeline', "record fastchain's ranges in-process and write a Chrome "
               'trace (+ .png chart, .txt summary) to this path on disable',
               check=_timeline_path),
    )

    def probe(self):
        status = nvtx_backend.nvtx_status()
        return [State('nvtx', status.available, False, why=status.why, fix=status.fix)]

    def check(self, values, explicit):
        if values['timeline'] is not None and values['nvtx'] is False:
            raise ValueError('fastchain.enable(timeline=...) records the NVTX ranges: '
                             'it cannot go with nvtx=False')
        if 'timeline' in explicit and values['timeline'] is not None:
            # Two handles' timelines on one path: the last written (the outer
            # handle's, which records nothing while the inner one is in force)
            # replaced the other's trace and summary (a new-user trial).
            from fastchain.config._enable import active_handles
            mine = os.path.abspath(values['timeline'])
            for handle in active_handles():
                timeline = handle.resources.get('timeline')
                if timeline is not None and os.path.abspath(timeline.given) == mine:
                    raise ValueError(
                        'timeline={!r} is the timeline of a handle still enabled: each '
                        'handle writes its own trace, so give this one another path (the '
                        'handle enabled last records the ranges while it is in force)'
                        .format(values['timeline']))

    def unused(self, values, own):
        if 'nvtx' in own and values['nvtx'] is False and values['timeline'] is not None:
            return ['nvtx=False keeps the timeline {!r} of an earlier handle from recording '
                    'anything while it is in force'.format(values['timeline'])]
        return []

    def open(self, handle, values):
        if values['timeline'] is not None:
            from fastchain.nvtx._timeline import Timeline
            timeline = handle.resources['timeline'] = Timeline()
            timeline.given = values['timeline']
            opened.append(values['timeline'])
            # from the current folder now, not at disable() or exit
            path = rank_path(os.path.abspath(values['timeline']))

            def at_exit(when='at exit', wait_device=True):  # a handle never disabled
                _unwritten.pop(id(timeline), None)
                timeline.wait_device = wait_device
                if timeline.ranges:
                    try:
                        timeline.save(path)
                        print('fastchain: the timeline was written {} to {} (disable() its '
                              'handle to write it earlier)'.format(when, path), file=sys.stderr)
                    except Exception as e:
                        print('fastchain: the timeline {} could not be written {}: '
                              '{}: {}'.format(path, when, type(e).__name__, e), file=sys.stderr)
            atexit.register(at_exit)
            _unwritten[id(timeline)] = at_exit

            def forget():       # the enable() failed: nothing written for it
                atexit.unregister(at_exit)
                _unwritten.pop(id(timeline), None)
            handle.on_failure(forget)

            def save():
                atexit.unregister(at_exit)
                _unwritten.pop(id(timeline), None)
                timeline.save(path)
            handle.on_disable(save, 'fastchain timeline -> ' + path)
        if values['nvtx'] == 'links':
            from fastchain.nvtx._hooks import LinkPaths
            handle.resources['link_paths'] = LinkPaths()

    def plan(self, values, explicit, plan):
        from fastchain.nvtx import _hooks
        mode, path = values['nvtx'], values['timeline']
        if not (_on(mode, path) and nvtx_backend.nvtx_status().available):
            return
        from chainer.dataset import convert
        from chainer.optimizer import GradientMethod
        from chainer.training import trainer as trainer_module
        from chainer.training.updaters import StandardUpdater
        changes = plan.changes('nvtx', 'nvtx')
        paths = plan.handle('nvtx').resources.get('link_paths') if mode == 'links' else None
        plan.wrap(convert, '_call_converter', 'nvtx', _hooks.converter_layer)
        plan.wrap(StandardUpdater, '__init__', 'nvtx', functools.partial(
            _hooks.updater_layer, (changes, _hooks.capture_window())))
        plan.wrap(GradientMethod, 'setup', 'nvtx',
                  functools.partial(_hooks.setup_layer, (changes, paths)))
        plan.wrap(trainer_module.Trainer, 'run', 'nvtx', _hooks.trainer_run_layer)
        if paths is not None:
            plan.value(LINK_HOOKS, _hooks.installed_link_hooks, _hooks.install_link_hooks,
                       _hooks.link_hooks(paths))
        if path is not None:
            from fastchain.nvtx._annotator import annotator
            ann = annotator()
            plan.value(TIMELINE, lambda: ann.timeline,
                       lambda v: setattr(ann, 'timeline', None if v is _patches.MISSING
                                         else v),
                       plan.handle('timeline').resources['timeline'])

    def states(self, values, explicit):
        from chainer.optimizer import GradientMethod
        status = nvtx_backend.nvtx_status()
        mode, path = values['nvtx'], values['timeline']
        on = _patches.in_force(GradientMethod, 'setup', 'nvtx') is not None
        state = State('nvtx', status.available, on, why=status.why, fix=status.fix,
                      requested='nvtx' in explicit and bool(mode), setting=mode)
        if path is not None:
            state.setting = {'nvtx': mode, 'timeline': path}
        if status.available and not _on(mode, path):
            state.why = ('nvtx=False' if mode is False else
                         'no profiler attached (set nvtx=True to emit anyway)')
        if on and mode is not None and path is None and not nvtx_backend.profiler_attached():
            state.note = ('no NVTX tool is attached, so the ranges go nowhere: run '
                          'under `nsys profile` or pass timeline="trace.json"')
        return [state]


def _on(mode, path):
    if mode is not None:
        return bool(mode)
    return nvtx_backend.profiler_attached() or path is not None


GROUP = NvtxGroup()
