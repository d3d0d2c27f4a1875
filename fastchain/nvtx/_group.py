"""The NVTX group of ``fastchain.enable``."""

from fastchain.backends import nvtx as nvtx_backend
from fastchain.config._options import Group, Option, State


def _timeline_path(value):
    if not isinstance(value, str) or not value:
        raise ValueError('expected the path of the trace JSON to write')
    return value


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

    def apply(self, values, explicit, recorder):
        status = nvtx_backend.nvtx_status()
        mode, timeline_path = values['nvtx'], values['timeline']
        attached = nvtx_backend.profiler_attached()
        on = mode if mode is not None else (attached or timeline_path is not None)
        if timeline_path is not None and mode is False:
            raise ValueError('fastchain.enable(timeline=...) records the NVTX ranges: '
                             'it cannot go with nvtx=False')
        state = State('nvtx', status.available, bool(on) and status.available,
                      requested='nvtx' in explicit and bool(on), setting=mode)
        if not on or not status.available:
            if not on:
                state.why = 'no profiler attached (set nvtx=True to emit anyway)'
            return [state]
        if mode is not None and not attached and timeline_path is None:
            state.note = ('no NVTX tool is attached, so the ranges go nowhere: run '
                          'under `nsys profile` or pass timeline="trace.json"')
        from fastchain.nvtx import _hooks
        from fastchain.nvtx._annotator import annotator
        paths = _hooks.LinkPaths() if mode == 'links' else None
        _hooks.wrap_converter(recorder)
        _hooks.wrap_updater_init(recorder)
        _hooks.wrap_optimizer_setup(recorder, paths)
        _hooks.wrap_trainer_run(recorder)
        if paths is not None:
            _hooks.install_link_hooks(recorder, paths)
        if timeline_path is not None:
            from fastchain.nvtx._timeline import Timeline
            ann = annotator()
            timeline = Timeline()
            previous = ann.timeline

            def stop_and_save():
                ann.timeline = previous
                timeline.save(timeline_path)
            recorder.call('fastchain timeline -> ' + timeline_path,
                          lambda: setattr(ann, 'timeline', timeline), stop_and_save)
            state.setting = {'nvtx': mode, 'timeline': timeline_path}
        return [state]


GROUP = NvtxGroup()
