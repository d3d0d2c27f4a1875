"""Per-phase breakdown of a training step, from fastchain's ranges.

Shared by the built-in timeline and by ``profiling/summarize.py`` (which
reads the same ranges from an Nsight Systems SQLite export). A step is one
'step' range (the updater's update) plus the extensions that ran after it;
its phases are the 'step' range's direct children, and 'other' is the rest.
"""

import collections

Range = collections.namedtuple('Range', 'name category thread start end depth')

PHASES = ('data', 'convert', 'forward', 'backward', 'loss_scale', 'update', 'other',
          'extension')


def summarize(ranges, kernels=None, skip=1):
    """Mean time per phase of a step, shares, device idle time, diagnosis.

    Args:
        ranges: iterable of :class:`Range` (times in ns, one clock).
        kernels: optional list of (start, end) of device kernels, same clock.
        skip (int): leading steps left out (warm-up: autotune, first calls).
    """
    by_thread = collections.defaultdict(list)
    for r in ranges:
        by_thread[r.thread].append(r)
    for rs in by_thread.values():
        rs.sort(key=lambda r: (r.start, -r.end))
    steps = sorted((r for r in ranges if r.category == 'step'), key=lambda r: r.start)
    measured = steps[skip:] if len(steps) > skip else steps
    per_step = []
    for i, step in enumerate(steps):
        if step not in measured:
            continue
        following = steps[i + 1].start if i + 1 < len(steps) else None
        per_step.append(_phases(step, by_thread[step.thread], following))
    result = {'steps': len(per_step), 'skipped_steps': len(steps) - len(per_step),
              'per_step': per_step}
    if not per_step:
        result.update(mean_ms={}, share={}, total_ms=0.0, device_idle=None,
                      diagnosis='no training step was recorded')
        return result
    mean = {p: sum(s[p] for s in per_step) / len(per_step) / 1e6 for p in PHASES}
    mean['allreduce'] = sum(s['allreduce'] for s in per_step) / len(per_step) / 1e6
    total = sum(mean[p] for p in PHASES)
    share = {p: (mean[p] / total if total else 0.0) for p in PHASES}
    share['allreduce'] = mean['allreduce'] / total if total else 0.0
    idle = None
    if kernels:
        idle = _device_idle(per_step, kernels)
    result.update(mean_ms=mean, share=share, total_ms=total, device_idle=idle,
                  diagnosis=diagnose(share, idle))
    return result


def _phases(step, thread_ranges, following):
    out = dict.fromkeys(PHASES, 0)
    out['allreduce'] = 0
    children = 0
    end = step.end
    for r in thread_ranges:
        if r.start >= step.start and r.end <= step.end and r is not step:
            if r.depth == step.depth + 1 and r.category in out:
                out[r.category] += r.end - r.start
                children += r.end - r.start
            if r.category == 'allreduce':
                out['allreduce'] += r.end - r.start
        elif r.category == 'extension' and r.depth == step.depth and \
                r.start >= step.end and (following is None or r.end <= following):
            out['extension'] += r.end - r.start
            end = max(end, r.end)
    out['other'] = max(0, (step.end - step.start) - children)
    out['window'] = (step.start, end)
    return out


def _device_idle(per_step, kernels):
    kernels = sorted(kernels)
    idle = []
    for s in per_step:
        lo, hi = s['window']
        busy, cursor = 0, lo
        for k0, k1 in kernels:
            if k1 <= cursor or k0 >= hi:
                if k0 >= hi:
                    break
                continue
            a, b = max(k0, cursor), min(k1, hi)
            if b > a:
                busy += b - a
                cursor = b
        idle.append(1 - busy / max(1, hi - lo))
    return sum(idle) / len(idle)


def diagnose(share, device_idle=None):
    """One line naming what bounds the step."""
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


def format_summary(result):
    lines = ['fastchain step breakdown ({} steps, {} warm-up left out)'.format(
        result['steps'], result['skipped_steps'])]
    if not result['mean_ms']:
        return '\n'.join(lines + [result['diagnosis']])
    lines.append('{:12s} {:>10s} {:>7s}'.format('phase', 'ms/step', 'share'))
    for p in PHASES + ('allreduce',):
        if p == 'allreduce' and not result['mean_ms'][p]:
            continue
        label = p if p != 'allreduce' else '(allreduce)'
        lines.append('{:12s} {:10.2f} {:6.1f}%'.format(
            label, result['mean_ms'][p], 100 * result['share'][p]))
    lines.append('{:12s} {:10.2f}'.format('total', result['total_ms']))
    if result['device_idle'] is not None:
        lines.append('device idle: {:.1f}% of each step'.format(100 * result['device_idle']))
    else:
        lines.append('device idle: n/a (no device kernels in this record)')
    lines.append('diagnosis: ' + result['diagnosis'])
    return '\n'.join(lines)


def plot(result, path):
    """A PNG: mean time per phase of a step, and each step's phases."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from fastchain.nvtx._annotator import CATEGORIES
    if not result['per_step']:
        return None
    colours = {p: '#{:06x}'.format(CATEGORIES.get(p, 0xFF444444) & 0xFFFFFF) for p in PHASES}
    colours['other'] = '#cccccc'
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5),
                                      gridspec_kw={'height_ratios': [1, 3]})
    left = 0.0
    for p in PHASES:
        width = result['mean_ms'][p]
        top.barh([0], [width], left=left, color=colours[p], label=p)
        left += width
    top.set_yticks([])
    top.set_xlabel('ms per step (mean)')
    top.set_title(result['diagnosis'], fontsize=10)
    top.legend(ncol=len(PHASES), fontsize=7, loc='upper center', bbox_to_anchor=(0.5, -0.6))
    steps = range(len(result['per_step']))
    bottom_acc = [0.0] * len(result['per_step'])
    for p in PHASES:
        values = [s[p] / 1e6 for s in result['per_step']]
        bottom.bar(steps, values, bottom=bottom_acc, color=colours[p], width=0.9)
        bottom_acc = [a + v for a, v in zip(bottom_acc, values)]
    bottom.set_xlabel('step')
    bottom.set_ylabel('ms')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
