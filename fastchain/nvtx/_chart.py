"""The chart of a step breakdown (:func:`fastchain.nvtx._summary.summarize`'s
result): the median time per phase, and each step's phases with its one-off
events hatched and named."""

from fastchain.nvtx._summary import PHASES

BARS_UP_TO = 200    # steps drawn as bars; more as one area a phase
LABELS = 10         # one-off steps named in the chart (the largest)


def plot(result, path):
    """A PNG: the median time per phase of a step, and each step's phases,
    one-off events hatched and named. Returns ``path``, or None where
    matplotlib is missing or no step was recorded."""
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
        width = result['median_ms'][p]
        top.barh([0], [width], left=left, color=colours[p], label=p)
        left += width
    top.set_yticks([])
    top.set_xlabel('ms per step (median; one-off events at their median time)')
    top.set_title(result['diagnosis'], fontsize=10)
    top.legend(ncol=len(PHASES), fontsize=7, loc='upper center', bbox_to_anchor=(0.5, -0.6))
    per_step = result['per_step']
    steps = [s['index'] for s in per_step]
    acc = [0.0] * len(per_step)
    layers = []
    for p in PHASES:
        values = [s['adjusted'][p] / 1e6 for s in per_step]
        layers.append(values)
        if len(per_step) <= BARS_UP_TO:
            bottom.bar(steps, values, bottom=acc, color=colours[p], width=0.9)
        acc = [a + v for a, v in zip(acc, values)]
    if len(per_step) > BARS_UP_TO:
        # one polygon a phase, not a bar a step and phase (a long run's
        # tens of thousands of bars took minutes to draw)
        bottom.stackplot(steps, layers, colors=[colours[p] for p in PHASES], step='mid')
    extra = [sum(s[p] for p in PHASES) / 1e6 - a for s, a in zip(per_step, acc)]
    odd = [i for i, s in enumerate(per_step) if s['one_offs']]
    if odd:
        # One-offs can dwarf a step: draw them hatched, clipped, and name
        # the largest (all of them are in the summary).
        ceiling = 2.5 * max(acc)
        bottom.bar([steps[i] for i in odd], [min(extra[i], ceiling - acc[i]) for i in odd],
                   bottom=[acc[i] for i in odd], color='white', edgecolor='#d62728',
                   hatch='//', width=0.9 if len(per_step) <= BARS_UP_TO else 1.0,
                   label='one-off events (clipped at 2.5x the tallest step)')
        named = sorted(odd, key=lambda i: -extra[i])[:LABELS]
        for i in named:
            bottom.text(steps[i], acc[i], '\n'.join('{} {:.0f} ms'.format(n, ms)
                                                    for n, ms in per_step[i]['one_offs']),
                        rotation=90, va='bottom', ha='center', fontsize=7,
                        bbox={'facecolor': 'white', 'edgecolor': 'none', 'alpha': 0.8})
        bottom.set_ylim(0, ceiling * 1.05)
        bottom.legend(fontsize=7, loc='upper left', title=None if len(named) == len(odd) else
                      'the {} largest of {} named'.format(len(named), len(odd)),
                      title_fontsize=7)
    from matplotlib.ticker import MaxNLocator
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlabel('step')
    bottom.set_ylabel('ms')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
