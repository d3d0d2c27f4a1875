"""How far the runs the suite holds to a tolerance end from plain Chainer's:
the measurements ``harness.TIED_TOLERANCE`` and ``harness.ONEDNN_TOLERANCE``
are set from.

    python -m tests.differential.measure_tolerance [--fp16 | --onednn [--twin]
        [--recurrent] | --family] [--examples 600] [--seed 0] [--out deviations.jsonl]

By default it draws what ``test_fastchain_trains_as_plain_chainer`` draws,
restricted to models whose loss also uses their parameters outside the call
(a penalty, a tied head) with ``static_graph`` on in the first handle, and
measures the runs the cache said are not bitwise (StaticGraphOrder: a
parameter's gradient terms summed in another order). ``--onednn`` draws what
``test_onednn_trains_within_its_stated_tolerance_of_plain_chainer`` draws
(needs PyTorch) and measures every run. For each run it records
``harness.deviation`` (the smallest tolerance the run passes, in
``harness.compare``'s units) with the draws, and prints the distribution and
the worst runs. Deterministic for a seed (Hypothesis' database off). Not a
test: pytest does not collect it.
"""

import argparse
import json
import random
import sys

import numpy

from hypothesis import HealthCheck, assume, given, seed, settings, strategies as st

from tests.differential import harness, models
from tests.differential.models import HOOKS, SGD_FAMILY, model_specs
from tests.differential.test_differential import (draw_loop, draw_onednn, layouts, run_onednn,
                                                  run_onednn_twin)


def record(expected, got, steps, draws, out, records, twins=None):
    """Append the deviation of ``got`` from ``expected`` (and the draws) to
    ``records`` and as a JSON line to ``out``; with ``twins`` (traces), the
    factors ``got`` needs over them (``twin_factor``)."""
    try:
        ratio, where = harness.deviation(expected, got)
        first = harness.deviation(expected[:1], got[:1])[0]
    except AssertionError as e:             # one training diverged alone
        ratio, where, first = float('inf'), str(e), float('inf')
    entry = {'deviation': ratio, 'where': where, 'steps': steps, 'first_step': first,
             'compared': harness.comparable_steps(expected, got),
             'loss': [float(s['loss']) for s in expected], 'draws': draws}
    if twins is not None:
        entry.update(twin_factor(expected, got, twins, harness.ONEDNN_TOLERANCE))
    records.append(entry)
    if out:
        with open(out, 'a') as f:
            f.write(json.dumps(entry, default=repr) + '\n')


def twin_factor(expected, got, twins, tolerance):
    """The factors over the most the ``twins`` moved each element that the
    elements of ``got`` need (``harness.twin_allowance`` with a factor of 1):
    the largest anywhere in the run, mostly where the fixed ``tolerance``
    decides; and the largest over the elements outside the fixed tolerance
    (the smallest harness.TWIN_FACTOR with which the run passes, or None),
    with that element's difference in the fixed tolerance's units; and how
    far the twins moved at the first step (``harness.deviation``'s units)."""
    allowance = harness.twin_allowance(expected, twins)
    first, later = tolerance
    worst, needed = 0.0, None
    for step in range(harness.comparable_steps(expected, got)):
        largest = harness._largest(expected[step])
        for key, width in allowance[step].items():
            moved = harness._moved(expected[step][key], got[step][key])
            if not moved.any():
                continue
            twins_moved = width / harness.TWIN_FACTOR
            with numpy.errstate(divide='ignore', invalid='ignore'):
                need = numpy.where(moved > 0, moved / twins_moved, 0.0)
            worst = max(worst, float(need.max()))
            scale = largest.get(harness._kind(key), 0.0) * (first if step == 0 else later)
            outside = moved > scale
            if outside.any():
                i = numpy.unravel_index(numpy.argmax(numpy.where(outside, need, -1.0)),
                                        need.shape)
                if needed is None or need[i] > needed[0]:
                    needed = (float(need[i]), float(moved[i] / scale) if scale else float('inf'),
                              'step {} {}'.format(step, key))
    return {'twin_factor': worst, 'twin_factor_needed': needed,
            'twin_first_step': max(harness._step_deviation(expected[0], twin[0])[0]
                                   for twin in twins)}


def _explore(body, examples, seed_):
    """Call ``body(data)`` on ``examples`` Hypothesis draws, the same for a
    seed (the database off)."""
    seed(seed_)(settings(max_examples=examples, deadline=None, database=None,
                         suppress_health_check=list(HealthCheck))(
        given(data=st.data())(body)))()


def measure_onednn(examples, seed_, out, twin=False, recurrent=False):
    """Every run of ``examples`` onednn draws (float32); with ``twin``, the
    factors each needs over harness.TWINS twin runs (``twin_factor``); with
    ``recurrent``, only models with an L.LSTM (those that magnify rounding most)."""
    records = []

    def draw(data):
        draws = draw_onednn(data)
        spec, hooks, optimizer, steps, layout, resume_at, loop = draws
        assume(spec['recurrent'] or not recurrent)
        expected, got = run_onednn(*draws)
        record(expected, got, steps,
               {'model': spec, 'layout': layout, 'hooks': hooks, 'optimizer': optimizer,
                'resume_at': resume_at, 'loop': loop}, out, records,
               [run_onednn_twin(*draws, seed=seed) for seed in range(harness.TWINS)]
               if twin else None)

    _explore(draw, examples, seed_)
    return records


def family_spec(rng):
    """A model of the family that magnifies rounding most (harness models, no
    nonlinearity): deconvolutions or not, two or three triples of
    convolutions of 3 to 9 channels, feeding an L.LSTM; with its optimizer
    and step count."""
    c = rng.choice([3, 4, 6, 9])
    layers = []
    if rng.random() < 0.5:
        layers += [('deconv', 3, 1, 2, 0, 1, 3, False), ('deconv', c, 1, 1, 1, 1, 1, True)]
    for _ in range(rng.choice([2, 3])):
        layers += [('conv', c, 3, 1, 1, 1, 1, True), ('conv', c, 3, 1, 0, 1, 1, False),
                   ('conv', c, 5, 1, 2, 1, 1, True)]
    spec = {'input': (rng.choice([2, 3, 4]), 3, rng.choice([7, 8, 9]), rng.choice([7, 9, 10])),
            'layers': tuple(layers), 'extra_input': False, 'branch': rng.random() < 0.3,
            'lazy_head': False, 'calls': 1, 'recurrent': True, 'tied': None,
            'counter': False, 'knob': False}
    optimizer = (rng.choice(['SGD', 'MomentumSGD']), rng.choice([0.01, 0.1]))
    return spec, optimizer, rng.choice([3, 4, 5, 6])


def measure_family(examples, seed_, out):
    """``examples`` models of ``family_spec`` (Python's random, seeded), each
    run plainly, with onednn, and as harness.TWINS twins."""
    records, rng = [], random.Random(seed_)
    layout = ({'onednn': True, '_tuning': 'measure'}, {}, None)
    harness._events = lambda model, optimizer: None       # (Hypothesis' events: no test here)
    for _ in range(examples):
        spec, optimizer, steps = family_spec(rng)
        expected = harness.run(spec, optimizer, [], steps)
        got = harness.run(spec, optimizer, [], steps, layout=layout)
        twins = [harness.run(spec, optimizer, [], steps, twin=seed)
                 for seed in range(harness.TWINS)]
        record(expected, got, steps, {'model': spec, 'layout': layout, 'optimizer': optimizer},
               out, records, twins)
    return records


def measure(fp16, examples, seed_, out):
    """The tied runs of ``examples`` draws that the cache said are not
    bitwise (float32 or fp16)."""
    records = []

    def draw(data):
        spec = data.draw(model_specs(allow_calls=True), 'model')
        assume(models.tied(spec))
        steps = data.draw(st.integers(2, 8), 'steps')
        first, second, disable_at = data.draw(layouts(steps), 'layout')
        first['static_graph'] = True
        second.pop('static_graph', None)
        layout = (first, second, disable_at)
        hooks = data.draw(HOOKS, 'hooks')
        optimizer = data.draw(SGD_FAMILY, 'optimizer')
        resume_at, loop, growth = draw_loop(data, steps, fp16)
        scales, said = [], []
        try:
            got = harness.run(spec, optimizer, hooks, steps, layout=layout, fp16=fp16,
                              resume_at=resume_at, loop=loop, growth_interval=growth,
                              scales=scales, said=said)
        except (harness.Skipped, KeyError):
            assume(False)
        if not said:
            return          # bitwise, which the suite asserts
        expected = harness.run(spec, optimizer, hooks, steps, fp16=fp16, loop=loop,
                               scales=scales)
        record(expected, got, steps,
               {'model': spec, 'layout': layout, 'hooks': hooks, 'optimizer': optimizer,
                'resume_at': resume_at, 'loop': loop, 'growth_interval': growth,
                'fp16': fp16},
               out, records)

    _explore(draw, examples, seed_)
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument('--fp16', action='store_true', help='fp16 tied runs (default float32)')
    kind.add_argument('--onednn', action='store_true',
                      help="onednn's runs (float32) instead of the tied ones")
    parser.add_argument('--twin', action='store_true',
                        help='with --onednn: also the twin runs (harness.compare_or_twin)')
    parser.add_argument('--recurrent', action='store_true',
                        help='with --onednn: only models with an L.LSTM')
    kind.add_argument('--family', action='store_true',
                      help='onednn on models of the family that magnifies rounding '
                           '(family_spec), with their twins')
    parser.add_argument('--examples', type=int, default=600)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--out', help='append a JSON line per measured run to this file')
    args = parser.parse_args(argv)
    if args.family:
        records = measure_family(args.examples, args.seed, args.out)
        what, tolerance = 'onednn, the magnifying family', harness.ONEDNN_TOLERANCE
        args.twin = True
    elif args.onednn:
        records = measure_onednn(args.examples, args.seed, args.out, args.twin,
                                 args.recurrent)
        what, tolerance = 'onednn, float32', harness.ONEDNN_TOLERANCE
    else:
        records = measure(args.fp16, args.examples, args.seed, args.out)
        what = 'tied, fp16' if args.fp16 else 'tied, float32'
        tolerance = harness.TIED_TOLERANCE[args.fp16]
    if not records:
        print('no run measured')
        return 0
    values = sorted(r['deviation'] for r in records)
    print('{} runs measured (of {} examples, seed {}, {}); deviation of the largest value '
          'of the same kind:'.format(len(values), args.examples, args.seed, what))
    for q in (0.5, 0.9, 0.99, 1.0):
        print('  {:>5}: {:.3g}'.format('max' if q == 1.0 else 'p{:g}'.format(100 * q),
                                       values[min(len(values) - 1, int(q * len(values)))]))
    print('  first step at most {:.3g}; tolerance now: {}{}'.format(
        max(r['first_step'] for r in records), tolerance,
        ' (the first step, the later ones)' if isinstance(tolerance, tuple) else ''))
    for r in sorted(records, key=lambda r: -r['deviation'])[:5]:
        print('  {:.3g} at {}; losses {}'.format(
            r['deviation'], r['where'], ' '.join('{:.3g}'.format(v) for v in r['loss'])))
    if args.twin:
        print_twin(records, tolerance)
    return 0


def print_twin(records, tolerance):
    """The factors over the twins' largest move of each element that the runs
    needed: anywhere (mostly where the fixed tolerance decides), and where an
    element is outside the fixed tolerance (the TWIN_FACTOR each run needs)."""
    every = sorted(r['twin_factor'] for r in records)
    needed = sorted(tuple(r['twin_factor_needed']) for r in records if r['twin_factor_needed'])
    print('twins ({} each; harness.TWIN_FACTOR {}): the factor over their largest move, '
          'anywhere in a run: p50 {:.3g}, p90 {:.3g}, max {:.3g}'.format(
              harness.TWINS, harness.TWIN_FACTOR, every[len(every) // 2],
              every[int(0.9 * (len(every) - 1))], every[-1]))
    print('  {} runs went outside the fixed tolerance {}; the factor each needed (its '
          'difference in the fixed tolerance\'s units, where):'.format(len(needed), tolerance))
    for need, ratio, where in needed[-12:]:
        print('    {:.3g} ({:.3g}, {})'.format(need, ratio, where))
    print('  the twins moved from the first step in every run: {}'.format(
        all(r['twin_first_step'] > 0 for r in records)))


if __name__ == '__main__':
    sys.exit(main())
