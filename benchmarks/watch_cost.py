"""What the static cache's look at a model's containers costs a step.

While a chain is cached, every call looks at what its links hold that the
training loop could change in place without setting an attribute: lists,
sets, dicts, deques and configs (``model.cfg['beta'] = 0.5``), entry by entry
up to 1024 entries in all, a bigger one by its identity and size
(``fastchain/static/_configs.py``). This prices that look: the same small
MLP training step (three ``L.Linear``, batch 8; a step of about a
millisecond, where a per-call cost shows most), cached, with nothing held,
with a 100-entry and a 1000-entry dict of floats held (not read by the
forward), and with a 100,000-entry vocabulary held; define-by-run alongside.
Autotune is off, so every cached step replays. All variants live in one
process and take turns of ``STEPS_PER_WINDOW`` steps, the order reversed each
round. ``config_1000/cached`` is the cost of the look at a full budget; the
note turns the gap into microseconds per entry.
"""

import os
import sys
import time
import warnings

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

STEPS_PER_WINDOW = 50
# variant: (cached, entries of the dict the model holds, 0: none)
VARIANTS = {'define_by_run': (False, 0), 'cached': (True, 0), 'config_100': (True, 100),
            'config_1000': (True, 1000), 'vocab_100k': (True, 100000)}


def make(cached, entries, batch=8):
    import chainer
    import chainer.functions as F
    import chainer.links as L
    from fastchain.static import cache_static_graph

    class MLP(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.l1 = L.Linear(64, 128)
                self.l2 = L.Linear(128, 128)
                self.l3 = L.Linear(128, 10)

        def forward(self, x):
            return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))

    numpy.random.seed(0)
    model = L.Classifier(MLP())
    if entries:
        # held by the cached chain, as a config or a vocabulary would be
        model.predictor.table = {'w{}'.format(i): float(i) for i in range(entries)}
    if cached:
        cache_static_graph(model.predictor)
    optimizer = chainer.optimizers.MomentumSGD(0.01).setup(model)
    rng = numpy.random.RandomState(1)
    x = rng.randn(batch, 64).astype(numpy.float32)
    t = rng.randint(0, 10, batch).astype(numpy.int32)

    def step():
        optimizer.update(model, x, t)
    return step


def main(argv=None):
    p = _common.parser('watch_cost', __doc__)
    args = p.parse_args(argv)
    import fastchain
    windows = args.windows or (9 if args.quick else 25)
    rows = _common.Rows('iterations/s')
    # autotune off: every cached step replays (no turns of define-by-run)
    with fastchain.enable(loader_workers=0, autotune=False), warnings.catch_warnings():
        warnings.simplefilter('error')      # a fallback would void the comparison
        steps = {name: make(*spec) for name, spec in VARIANTS.items()}
        for step in steps.values():         # record, verify 2 replays, and more
            for _ in range(20):
                step()
        names = list(steps)
        for w in range(windows):
            for name in (names if w % 2 == 0 else names[::-1]):
                step = steps[name]
                start = time.perf_counter()
                for _ in range(STEPS_PER_WINDOW):
                    step()
                rows.add(name, STEPS_PER_WINDOW / (time.perf_counter() - start))
            print('window {}/{}: '.format(w + 1, windows) + ', '.join(
                '{} {:.0f}'.format(n, v[-1]) for n, v in rows.windows.items()), flush=True)
    ratios = {'{}/cached'.format(n): rows.ratio(n, 'cached')
              for n in names if n != 'cached'}
    us = {n: 1e6 / rows.median(n) for n in names}
    per_entry = {n: (us[n] - us['cached']) / VARIANTS[n][1]
                 for n in ('config_100', 'config_1000')}
    config = {'model': 'L.Classifier(MLP 64-128-128-10), MomentumSGD, batch 8',
              'windows': windows, 'steps_per_window': STEPS_PER_WINDOW,
              'warm_up_steps': 20, 'autotune': False,
              'microseconds_per_step': {n: round(v, 1) for n, v in us.items()},
              'microseconds_per_entry': {n: round(v, 3) for n, v in per_entry.items()}}
    notes = ['A step: cached {:.0f} us, define-by-run {:.0f} us; holding a 1000-entry dict '
             'adds {:.0f} us ({:.2f} us an entry; 100 entries: {:.2f} us an entry); a '
             '100,000-entry vocabulary, counted by its size, adds {:.0f} us.'.format(
                 us['cached'], us['define_by_run'], us['config_1000'] - us['cached'],
                 per_entry['config_1000'], per_entry['config_100'],
                 us['vocab_100k'] - us['cached'])]
    _common.write('watch_cost', args, config, rows, ratios, notes)


if __name__ == '__main__':
    main()
