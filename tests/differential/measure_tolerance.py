"""How far the runs the suite holds to a tolerance end from plain Chainer's:
the measurements ``harness.TIED_TOLERANCE`` and ``harness.ONEDNN_TOLERANCE``
are set from.

    python -m tests.differential.measure_tolerance [--fp16 | --onednn]
        [--examples 600] [--seed 0] [--out deviations.jsonl]

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
import sys

from hypothesis import HealthCheck, assume, given, seed, settings, strategies as st

from tests.differential import harness
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
    """The factors over the most the ``twins`` moved each value that the
    values of ``got`` need (``harness.twin_allowance`` with a factor of 1): the largest over
    the run, and the largest where a value comes within a tenth of the fixed
    ``tolerance`` (where the twins can decide), with its difference in the
    fixed tolerance's units."""
    steps = harness.comparable_steps(expected, got)
    factor = harness.TWIN_FACTOR
    allowance = harness.twin_allowance(expected, twins)
    first, later = tolerance
    worst, near = 0.0, None
    for step in range(steps):
        largest = harness._largest(expected[step])
        for key, moved in allowance[step].items():
            difference = harness._difference(expected[step][key], got[step][key])
            if not difference:
                continue
            need = difference * factor / moved if moved else float('inf')
            worst = max(worst, need)
            scale = largest.get(harness._kind(key), 0.0) * (first if step == 0 else later)
            ratio = difference / scale if scale else float('inf')
            if ratio > 0.1 and (near is None or need > near[0]):
                near = (need, ratio, 'step {} {}'.format(step, key))
    return {'twin_factor': worst, 'twin_factor_near': near}


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


def measure(fp16, examples, seed_, out):
    """The tied runs of ``examples`` draws that the cache said are not
    bitwise (float32 or fp16)."""
    records = []

    def draw(data):
        spec = data.draw(model_specs(allow_calls=True), 'model')
        assume(spec['tied'])
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
    parser.add_argument('--examples', type=int, default=600)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--out', help='append a JSON line per measured run to this file')
    args = parser.parse_args(argv)
    if args.onednn:
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
    """The factors over the twins' largest move that the runs needed: anywhere, and
    where a value came within a tenth of the fixed tolerance (where the
    twins can decide)."""
    every = sorted(r['twin_factor'] for r in records)
    near = sorted(tuple(r['twin_factor_near']) for r in records if r['twin_factor_near'])
    print('twins ({} each): the factor a run needs over their largest move: p50 {:.3g}, '
          'p90 {:.3g}, '
          'max {:.3g} (harness.TWIN_FACTOR {})'.format(
              harness.TWINS, every[len(every) // 2], every[int(0.9 * (len(every) - 1))],
              every[-1], harness.TWIN_FACTOR))
    print('  {} runs came within a tenth of the fixed tolerance {}; the factors they needed '
          'there (their difference in its units, where):'.format(len(near), tolerance))
    for need, ratio, where in near[-10:]:
        print('    {:.3g} ({:.3g}, {})'.format(need, ratio, where))


if __name__ == '__main__':
    sys.exit(main())
