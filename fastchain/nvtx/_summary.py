"""Per-phase breakdown of a training step, from fastchain's ranges.

Shared by the built-in timeline and by ``profiling/summarize.py`` (which
reads the same ranges from an Nsight Systems SQLite export). A step is one
'step' range (the updater's update) plus the extensions that ran after it;
its phases are the 'step' range's direct children, and 'other' is the rest
(gradient allreduce, also shown apart, lies within backward, update or other).

The per-step figures are medians over the measured steps, so that a typical
step, not an average polluted by rare long events, drives the diagnosis.

One-off events. Each step is split into *events*: its phases by category
('data', 'forward', ..., 'other') and each extension by name ('extension
snapshot'), with the time each took in that step (0 where it did not run).
An event's time in a step is a **one-off** when it is more than
``ONE_OFF_FACTOR`` (3) times the event's median time over the measured
steps, *and* longer than that median by more than ``ONE_OFF_MIN_SHARE``
(25%) of the median step. So an extension that runs in fewer than half of
the steps (its median is 0: a snapshot, an evaluation every epoch) is a
one-off wherever it takes over a quarter of a typical step; an event that
runs every step is one only where it takes over 3x its usual time (an
epoch-end reshuffle in 'data', a first-call warm-up when ``skip=0``). One-offs
are listed by name, step and duration; in the per-step figures each counts
for its median time only. With fewer than 3 measured steps no time can be
more than 3x a median, so nothing is a one-off.
"""

import bisect
import collections
import statistics

Range = collections.namedtuple('Range', 'name category thread start end depth')

# Work timed on a device (a NCCL allreduce on its stream, from CUDA events or
# from an Nsight Systems kernel record): where it ran, on the host clock, and
# when the host launched it. A step counts the device work it launched.
DeviceRange = collections.namedtuple('DeviceRange', 'name category track start end launched')

PHASES = ('data', 'convert', 'forward', 'backward', 'loss_scale', 'update', 'other',
          'extension')

# The names fastchain gives its ranges (fastchain/nvtx/_hooks.py), for a
# record that lost the categories' names: (exact name or prefix, category).
_NAMED = (('step', 'step'), ('capture', 'step'), ('data', 'data'), ('convert', 'convert'),
          ('forward', 'forward'), ('backward', 'backward'), ('update', 'update'))
_PREFIXED = (('extension ', 'extension'), ('allreduce bucket ', 'allreduce'),
             ('loss_scale ', 'loss_scale'), ('epoch ', 'mark'), ('skipped step', 'mark'))


def category_from_name(name):
    """The category fastchain gives a range of this name: every range it
    opens is named after its category ('forward'), or starts with it
    ('extension snapshot', 'allreduce bucket 0'), or is a link's path
    ('link')."""
    for exact, category in _NAMED:
        if name == exact:
            return category
    for prefix, category in _PREFIXED:
        if name.startswith(prefix):
            return category
    return 'link'


ONE_OFF_FACTOR = 3.0
ONE_OFF_MIN_SHARE = 0.25
ONE_OFF_RULE = ("a phase's or an extension's time in a step that is more than {:g}x its "
                'median per step and exceeds that median by over {:.0f}% of the median '
                'step'.format(ONE_OFF_FACTOR, 100 * ONE_OFF_MIN_SHARE))


def summarize(ranges, kernels=None, skip=1, device=None):
    """Median time per phase of a step, shares, one-offs, device idle, diagnosis.

    Args:
        ranges: iterable of :class:`Range` (times in ns, one clock).
        kernels: optional list of (start, end) of device kernels, same clock.
        skip (int): leading steps left out (warm-up: autotune, first calls).
        device: optional list of :class:`DeviceRange`; those of category
            'allreduce' give each step ``allreduce_device``, the time its
            allreduces ran on the device (the host's 'allreduce' ranges only
            cover their launch when the wait is a stream dependency).

    Returns a dict: ``median_ms`` (per phase, one-offs at their median time),
    ``share`` (of the sum of those medians, ``total_ms``), ``mean_ms`` (plain
    mean per phase, one-offs included), ``mean_step_ms``, ``one_offs`` (dicts
    with name, phase, step, ms, typical_ms; longest first), ``warmup`` ((step,
    ms) of the steps left out), ``device_idle`` (median share of a step),
    ``diagnosis`` and ``per_step``; with ``device``, ``median_ms`` and
    ``share`` have ``allreduce_device``.
    """
    ranges = list(ranges)
    launched = sorted((d.launched, d.end - d.start) for d in (device or ())
                      if d.category == 'allreduce')
    by_thread = collections.defaultdict(list)
    for r in ranges:
        by_thread[r.thread].append(r)
    starts = {}
    for thread, rs in by_thread.items():
        rs.sort(key=lambda r: (r.start, -r.end))
        starts[thread] = [r.start for r in rs]
    steps = sorted((r for r in ranges if r.category == 'step' and r.name == 'step'),
                   key=lambda r: r.start)
    skip = skip if len(steps) > skip else 0
    # A step's extensions run up to the next step of its own thread (another
    # thread's steps, or another process's in an export of several, do not
    # end it).
    following, next_start = [None] * len(steps), {}
    for i in range(len(steps) - 1, -1, -1):
        following[i] = next_start.get(steps[i].thread)
        next_start[steps[i].thread] = steps[i].start
    at = [a for a, _ in launched]
    upto = [0]
    for _, t in launched:
        upto.append(upto[-1] + t)
    per_step, warmup = [], []
    for i, step in enumerate(steps):
        phases = _phases(step, by_thread[step.thread], starts[step.thread],
                         following[i])
        if device is not None:
            lo, hi = phases['window']
            phases['allreduce_device'] = \
                upto[bisect.bisect_right(at, hi)] - upto[bisect.bisect_left(at, lo)]
        phases['index'] = i + 1
        if i < skip:
            warmup.append((i + 1, sum(phases[p] for p in PHASES) / 1e6))
        else:
            per_step.append(phases)
    seen = {r.category for r in ranges}
    result = {'steps': len(per_step), 'skipped_steps': skip, 'per_step': per_step,
              'warmup': warmup, 'one_offs': [],
              # phases no range was recorded for (loss_scale without fp16): not 0.00 ms
              'unrecorded': [p for p in PHASES if p != 'other' and p not in seen]}
    if not per_step:
        result.update(median_ms={}, mean_ms={}, share={}, total_ms=0.0, mean_step_ms=0.0,
                      device_idle=None, diagnosis='no training step was recorded')
        return result
    one_offs = _one_offs(per_step)
    names = PHASES + ('allreduce',) + (('allreduce_device',) if device is not None else ())
    for s in per_step:
        if device is not None:
            s['adjusted']['allreduce_device'] = s['allreduce_device']
    median = {p: statistics.median(s['adjusted'][p] for s in per_step) / 1e6 for p in names}
    mean = {p: sum(s[p] for s in per_step) / len(per_step) / 1e6 for p in names}
    total = sum(median[p] for p in PHASES)
    share = {p: (median[p] / total if total else 0.0) for p in names}
    idle = _device_idle(per_step, kernels) if kernels else None
    result.update(median_ms=median, mean_ms=mean, share=share, total_ms=total,
                  mean_step_ms=sum(mean[p] for p in PHASES), one_offs=one_offs,
                  device_idle=idle, diagnosis=diagnose(share, idle))
    return result


def _phases(step, thread_ranges, starts, following):
    """The step's phases and events: its thread's ranges that start in it
    and the extensions after it, up to the next step (``starts``: the
    ranges' start times, sorted as they are, so each step looks only at its
    own: the whole list for every step made saving a long run's timeline
    take minutes)."""
    lo = bisect.bisect_left(starts, step.start)
    hi = len(starts) if following is None else \
        bisect.bisect_right(starts, max(step.end, following))
    return _step_figures(step, thread_ranges[lo:hi], following)


def _step_figures(step, candidates, following):
    """The step's phases and events from ``candidates``, its thread's ranges
    (those outside the step and its extensions are passed over)."""
    out = dict.fromkeys(PHASES, 0)
    out['allreduce'] = 0
    events = collections.Counter()      # (phase, name) -> ns in this step
    children = 0
    end = step.end
    for r in candidates:
        if r.start >= step.start and r.end <= step.end and r is not step:
            if r.depth == step.depth + 1 and r.category in PHASES:
                out[r.category] += r.end - r.start
                events[(r.category, r.category)] += r.end - r.start
                children += r.end - r.start
            if r.category == 'allreduce':
                out['allreduce'] += r.end - r.start
        elif r.category == 'extension' and r.depth <= step.depth and \
                r.start >= step.end and (following is None or r.end <= following):
            out['extension'] += r.end - r.start
            events[('extension', r.name)] += r.end - r.start
            end = max(end, r.end)
    out['other'] = max(0, (step.end - step.start) - children)
    if out['other']:
        events[('other', 'other')] = out['other']
    out['events'] = dict(events)
    out['window'] = (step.start, end)
    return out


def _one_offs(per_step):
    """Finds the one-off events (see the module docstring); gives each step
    ``adjusted`` phases, where a one-off counts for its median time only."""
    keys = set()
    for s in per_step:
        keys.update(s['events'])
    typical = {k: statistics.median(s['events'].get(k, 0) for s in per_step) for k in keys}
    floor = ONE_OFF_MIN_SHARE * statistics.median(sum(s[p] for p in PHASES)
                                                  for s in per_step)
    found = []
    for s in per_step:
        s['adjusted'] = {p: s[p] for p in PHASES + ('allreduce',)}
        s['one_offs'] = []
        for key, t in sorted(s['events'].items()):
            excess = t - typical[key]
            if t > ONE_OFF_FACTOR * typical[key] and excess > floor:
                phase, name = key
                s['adjusted'][phase] -= excess
                s['one_offs'].append((name, t / 1e6))
                found.append({'name': name, 'phase': phase, 'step': s['index'],
                              'ms': t / 1e6, 'typical_ms': typical[key] / 1e6})
    return sorted(found, key=lambda e: -e['ms'])


def _device_idle(per_step, kernels):
    """The median share of a step's window during which no kernel ran: the
    kernels' union (streams overlap), found per step by bisection in it."""
    union = []
    for k0, k1 in sorted(kernels):
        if union and k0 <= union[-1][1]:
            if k1 > union[-1][1]:
                union[-1][1] = k1
        else:
            union.append([k0, k1])
    ends = [b for _, b in union]
    idle = []
    for s in per_step:
        lo, hi = s['window']
        busy = 0
        for a, b in union[bisect.bisect_right(ends, lo):]:
            if a >= hi:
                break
            busy += min(b, hi) - max(a, lo)
        idle.append(1 - busy / max(1, hi - lo))
    return statistics.median(idle)


HOST_TIME_NOTE = (
    'note: these phases are host time. On a GPU the kernels run asynchronously: a phase '
    "that waits for the device (fp16's loss-scale check, reading a loss) absorbs the device "
    'time of the phases launched before it. For device time, profile with nsys '
    '(profiling/README.md); the allreduce line "(on device)" is device time.')


def diagnose(share, device_idle=None):
    """One line naming what bounds the (median) step."""
    def pct(x):
        return '{:.0f}%'.format(100 * x)
    if share.get('data', 0) >= 0.2:
        return 'input-bound: {} of each step is waiting for data'.format(pct(share['data']))
    if share.get('convert', 0) >= 0.2:
        return 'transfer-bound: {} of each step converts and copies the batch'.format(
            pct(share['convert']))
    if share.get('allreduce', 0) >= 0.25:
        return 'communication-bound: gradient allreduce takes {} of each step'.format(
            pct(share['allreduce']))
    if share.get('extension', 0) >= 0.2:
        return 'extension-bound: trainer extensions take {} of each step'.format(
            pct(share['extension']))
    if device_idle is not None and device_idle >= 0.3:
        return ('host-bound: the device is idle {} of each step (Python overhead: '
                'try static_graph)'.format(pct(device_idle)))
    compute = share.get('forward', 0) + share.get('backward', 0) + share.get('update', 0)
    return 'compute-bound: forward, backward and update take {} of each step'.format(
        pct(compute))


def skip_note(asked, result):
    """The line saying an explicit ``--skip`` left nothing out (it asks for
    as many steps as were recorded, or more), or None."""
    if result['steps'] and asked > result['skipped_steps']:
        return ('warm-up: --skip {} asks for more steps than the {} recorded: none left '
                'out'.format(asked, result['steps']))
    return None


def one_off_lines(result):
    """The one-off events grouped by name, longest in all first: one line each."""
    groups = collections.OrderedDict()
    for e in sorted(result['one_offs'], key=lambda e: e['step']):
        groups.setdefault(e['name'], []).append(e)
    lines = []
    for name, events in sorted(groups.items(), key=lambda g: -sum(e['ms'] for e in g[1])):
        if len(events) == 1:
            lines.append('{}: {:.1f} ms in step {} (median {:.1f} ms)'.format(
                name, events[0]['ms'], events[0]['step'], events[0]['typical_ms']))
            continue
        shown = events[:6]
        lines.append('{}: {} times, {:.1f} ms in all (steps {}: {} ms{})'.format(
            name, len(events), sum(e['ms'] for e in events),
            ', '.join(str(e['step']) for e in shown),
            ', '.join('{:.1f}'.format(e['ms']) for e in shown),
            ', ...' if len(events) > len(shown) else ''))
    return lines


def format_summary(result):
    lines = ['fastchain step breakdown ({} steps, {} warm-up left out)'.format(
        result['steps'], result['skipped_steps'])]
    if result['warmup']:
        lines.append('warm-up left out: ' + ', '.join(
            'step {} ({:.1f} ms)'.format(i, ms) for i, ms in result['warmup']))
    if not result['median_ms']:
        lines.append(result['diagnosis'])
        lines += _unclosed(result)
        return '\n'.join(lines)
    lines.append('{:12s} {:>10s} {:>7s}'.format('phase', 'median ms', 'share'))
    for p in PHASES + ('allreduce', 'allreduce_device'):
        if p in ('allreduce', 'allreduce_device') and not result['median_ms'].get(p):
            continue
        label = {'allreduce': '(allreduce)', 'allreduce_device': '(on device)'}.get(p, p)
        if p in result.get('unrecorded', ()):
            lines.append('{:12s} {:>10s} {:>7s}  none recorded'.format(label, '-', '-'))
            continue
        lines.append('{:12s} {:10.2f} {:6.1f}%'.format(
            label, result['median_ms'][p], 100 * result['share'][p]))
    lines.append('{:12s} {:10.2f}'.format('total', result['total_ms']))
    one_offs = result['one_offs']
    all_ms = sum(e['ms'] for e in one_offs)
    measured = result['mean_step_ms'] * result['steps']
    lines.append('one-off events ({}): {}'.format(ONE_OFF_RULE, 'none' if not one_offs else
                 "{:.1f} ms in all, {:.0f}% of the measured steps' time; each counts in the "
                 'figures above for its median time only'.format(
                     all_ms, 100 * all_ms / measured if measured else 0)))
    lines += ['  ' + line for line in one_off_lines(result)]
    lines.append('mean step, one-offs included: {:.2f} ms'.format(result['mean_step_ms']))
    if result['device_idle'] is not None:
        lines.append('device idle: {:.1f}% of each step (median)'.format(
            100 * result['device_idle']))
    else:
        lines.append('device idle: n/a (no device kernels in this record)')
    if result.get('host_time_on_gpu'):
        lines.append(HOST_TIME_NOTE)
        lines.append('diagnosis (host time): ' + result['diagnosis'])
    else:
        lines.append('diagnosis: ' + result['diagnosis'])
    lines += _unclosed(result)
    return '\n'.join(lines)


def _unclosed(result):
    if not result.get('unclosed'):
        return []
    return ['warning: {} range(s) never closed ({}): pushed without a pop, so they are '
            'missing and the nesting recorded after them is off'.format(
                len(result['unclosed']), ', '.join(n for n, _ in result['unclosed']))]
