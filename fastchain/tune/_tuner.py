"""The autotuner: per key, the fastest of bitwise-equal alternatives.

A *choice* is made once per (kind, key): the alternatives run in turn on the
first calls of the key (each once untimed, to warm it up, then ``TRIALS``
timed calls each, interleaved so that a slow moment of the machine hits all
of them alike), and the one with the lowest median time is used from then
on. Only alternatives that give bitwise-equal results are offered, so the
choice changes speed and nothing else; while it is being made the results
are the same whichever runs (kernels that are not bitwise equal, the
``onednn`` option's, are never an alternative: the user turns them on).
One exception, by what it is: the plans of a cuDNN graph (kind
``'cudnn_graph'``, :mod:`fastchain.cudnn._graphs`) are timed with CUDA
events and recorded here for the reports and the cache file; like cuDNN's
algorithms under Chainer's own autotune they round differently, and they
run only where ``cudnn`` allows cuDNN at all.

The cost is bounded: ``(TRIALS + 1)`` calls of each alternative per key.
Each data-parallel process chooses for itself (they may pick differently:
the results are the same).

``enabled`` is set by ``enable(autotune=...)`` (on unless ``False``);
``forced`` (``{kind: alternative}``) makes every key of a kind take one
alternative, without measuring, for tests and benchmarks that compare them.
"""

import statistics
import threading
import time

TRIALS = 3
enabled = False
forced = {}
forced_calls = {}   # kind -> calls that took the forced alternative

_lock = threading.Lock()
_choices = {}       # (kind, key) -> Choice
# Bumped by forget(): a call site that keeps a decided pick (to skip call()'s
# work on every call) keeps it with the generation it was read in.
generation = 0
_known = {}         # (kind, repr(key)) -> a choice read from a cache file (_cache.py)
forgotten = 0       # bumped by forget() alone (generation also by _steps' verdicts)
# Calls and turns that measured an undecided choice, so far: a step that adds
# none ran decided choices only (the per-call picks' check waits for one).
measuring = 0
collecting = None   # a set while _steps collects the choices one step calls
checking = set()    # choices _steps is checking: their picks flip, the cache keeps them
evaluations = 0     # Chainer Evaluator runs so far (a step period holding one is not timed)


class Choice:
    """One key's alternatives, their times so far, and the pick."""

    __slots__ = ('kind', 'key', 'names', 'times', 'calls', 'picked', 'measured', 'label',
                 'cached', 'trials', 'paired')

    def __init__(self, kind, key, names, label, trials=None, paired=False):
        self.kind, self.key, self.names, self.label = kind, key, tuple(names), label
        self.times = {n: [] for n in self.names}
        self.calls = 0
        self.picked = None      # what runs
        self.measured = None    # what its own timings picked (_steps may overrule it)
        self.cached = False     # picked from a cache file, not measured in this process
        self.trials = trials    # timed runs of each alternative (default TRIALS)
        # two alternatives timed in alternation: decided by the median of the
        # ratios of their i-th times (a drift of the machine cancels)
        self.paired = paired

    def next(self):
        """(alternative to run now, whether to time it)."""
        n = len(self.names)
        name = self.names[self.calls % n]
        timed = self.calls >= n
        self.calls += 1
        return name, timed

    def record(self, name, seconds):
        self.times[name].append(seconds)
        trials = self.trials or TRIALS
        if self.picked is None and all(len(t) >= trials for t in self.times.values()):
            # The first named (the default) wins a tie.
            if self.paired:
                first, second = self.names
                ratio = statistics.median(a / b for a, b in zip(self.times[second],
                                                                 self.times[first]))
                self.picked = self.measured = second if ratio < 1 else first
            else:
                self.picked = self.measured = min(self.names, key=lambda a: (
                    statistics.median(self.times[a]), self.names.index(a)))

    def as_dict(self):
        return {'kind': self.kind, 'key': self.label, 'picked': self.picked,
                'measured': self.measured,
                'median_ms': {n: round(statistics.median(t) * 1e3, 4) if t else None
                              for n, t in self.times.items()},
                'trials': {n: len(t) for n, t in self.times.items()},
                'from_cache': self.cached}


def choice(kind, key, names, label=None, trials=None, paired=False):
    """The Choice for (kind, key), made on first use (``label``: how the key
    reads in reports; a callable is called then)."""
    c = _choices.get((kind, key))
    if c is None:
        with _lock:
            c = _choices.get((kind, key))
            if c is None:
                c = Choice(kind, key, names, label() if callable(label) else
                           (label if label is not None else repr(key)), trials, paired)
                known = _known.get((kind, repr(key)))
                if known is not None and tuple(known['names']) == c.names:
                    c.picked = c.measured = known['picked']
                    c.cached = True
                    c.times = {n: [known['median_ms'][n] / 1e3] if known.get(
                        'median_ms', {}).get(n) is not None else [] for n in c.names}
                _choices[(kind, key)] = c
    return c


def know(entries):
    """Choices read from a cache file (:mod:`fastchain.tune._cache`):
    ``{(kind, repr(key)): {'names', 'picked', 'median_ms', ...}}``; a key
    met later with the same alternatives takes the stored pick unmeasured."""
    with _lock:
        _known.update(entries)


def pick(kind, key):
    """The alternative decided for (kind, key), or None while undecided (or
    never met). A call site may keep it, with :data:`generation`, and run it
    directly while ``enabled``, ``forced`` is empty and the generation holds."""
    c = _choices.get((kind, key))
    return None if c is None else c.picked


def decided():
    """The decided choices, as a cache file keeps them:
    ``{(kind, repr(key)): {'names', 'picked', 'median_ms', 'label'}}`` (what
    runs; a choice whose check over whole steps is still open: its pick)."""
    with _lock:
        return {(c.kind, repr(c.key)): {
            'names': list(c.names), 'label': c.label,
            'picked': c.measured if c in checking else c.picked,
            'median_ms': {n: round(statistics.median(t) * 1e3, 4) if t else None
                          for n, t in c.times.items()}}
            for c in _choices.values() if c.picked is not None}


def call(kind, key, alternatives, label=None):
    """Run the chosen one of ``alternatives`` (``((name, fn), ...)``, each
    ``fn()`` giving the same result; the first is the default) for (kind,
    key) and return its result; while undecided, run them in turn and time
    them. Without autotuning, the first one runs."""
    if not enabled:
        return alternatives[0][1]()
    force = forced_name(kind, [a[0] for a in alternatives])
    if force is not None:
        return _named(alternatives, force)()
    c = choice(kind, key, [a[0] for a in alternatives], label)
    if c.picked is not None:
        if collecting is not None:
            collecting.add(c)
        return _named(alternatives, c.picked)()
    global measuring
    measuring += 1
    name, timed = c.next()
    fn = _named(alternatives, name)
    if not timed:
        return fn()
    start = time.perf_counter()
    out = fn()
    c.record(name, time.perf_counter() - start)
    return out


class Turns:
    """Alternatives that take turns over whole steps, for choices timed by
    the period between steps (the static cache, the loader's workers) rather
    than by one call.

    Each turn runs one alternative for ``settle`` untimed steps (what the
    previous one left in flight drains), then ``timed`` steps timed together.
    A turn :meth:`void`-ed on the way (an evaluation between two steps) is
    run again with the same alternative, up to ``void_limit`` times in all;
    then the default (the first name) is kept.
    """

    def __init__(self, settle=0, timed=1, void_limit=None):
        self.settle, self.timed, self.void_limit = settle, timed, void_limit
        self.voided = 0
        self.turn = None    # [choice, alternative, timed, steps, start, voided]

    def void(self):
        if self.turn is not None:
            self.turn[5] = True

    def reset(self):
        self.turn = None

    def step(self, kind, key, names, label=None, trials=None, paired=False):
        """The alternative for the step that starts now (call at the start of
        each step)."""
        force = forced_name(kind, names)
        if force is not None:
            return force
        c = choice(kind, key, names, label, trials, paired)
        if c.picked is None and kind != 'per_call_picks':
            global measuring
            measuring += 1
        now = time.perf_counter()
        turn, retry = self.turn, False
        if turn is not None and turn[0] is c and c.picked is None:
            turn[3] += 1
            if turn[3] == self.settle:
                turn[4] = now
            if turn[3] < self.settle + self.timed:
                return turn[1]
            if turn[2] and turn[5]:
                retry = True
            elif turn[2]:
                c.record(turn[1], (now - turn[4]) / self.timed)
        self.turn = None
        if c.picked is not None:
            return c.picked
        if retry:
            self.voided += 1
            if self.void_limit is not None and self.voided > self.void_limit:
                # its steps never come in a row: keep the default
                c.picked = c.measured = c.names[0]
                return c.picked
            name, timed = turn[1], True
        else:
            name, timed = c.next()
        self.turn = [c, name, timed, 0, now if self.settle == 0 else None, False]
        return name


def forced_name(kind, names):
    """The alternative ``forced`` names for ``kind`` (counted in
    ``forced_calls``), or None; a name not among ``names`` raises KeyError."""
    force = forced.get(kind)
    if force is None:
        return None
    if force not in names:
        raise KeyError('autotune forced {!r} for {}, which has no such alternative '
                       '(it has {})'.format(force, kind, ', '.join(names)))
    forced_calls[kind] = forced_calls.get(kind, 0) + 1
    return force


def _named(alternatives, name):
    for a, fn in alternatives:
        if a == name:
            return fn
    raise KeyError('no alternative {!r} among {}'.format(
        name, ', '.join(a for a, _ in alternatives)))


def choices(kind=None):
    """What the autotuner measured and picked: a list of dicts ``{'kind',
    'key', 'picked' (None while measuring), 'median_ms' {alternative: ms},
    'trials' {alternative: timed calls}}``, in the order the keys came."""
    with _lock:
        return [c.as_dict() for c in _choices.values() if kind is None or c.kind == kind]


def summary():
    """{kind: {'keys', 'decided', 'from_cache' (decided keys read from a cache
    file), 'picked' {alternative: keys}, 'ms' {alternative: sum of medians over
    the decided keys, for the alternatives timed}, and 'overruled' (keys whose pick the check over whole
    steps set back to the default) where there are; over the 'compared'
    keys whose pick and default (the first alternative) were both timed,
    'picked_ms' and 'default_ms', the sums of their medians}}: one line's
    worth per kind."""
    out = {}
    with _lock:
        for c in _choices.values():
            s = out.setdefault(c.kind, {'keys': 0, 'decided': 0, 'from_cache': 0,
                                        'picked': {}, 'ms': {}})
            s['keys'] += 1
            if c.picked is None:
                continue
            s['decided'] += 1
            s['from_cache'] += c.cached
            if c.measured is not None and c.measured != c.picked:
                s['overruled'] = s.get('overruled', 0) + 1
            s['picked'][c.picked] = s['picked'].get(c.picked, 0) + 1
            for n, t in c.times.items():
                if t:       # an alternative that could not run has no time
                    s['ms'][n] = round(s['ms'].get(n, 0.0) + statistics.median(t) * 1e3, 3)
            default, picked = c.times[c.names[0]], c.times.get(c.picked)
            if default and picked:
                s['compared'] = s.get('compared', 0) + 1
                for field, t in (('picked_ms', picked), ('default_ms', default)):
                    s[field] = round(s.get(field, 0.0) + statistics.median(t) * 1e3, 3)
    return out


LISTED = 8      # alternatives of a kind listed by name; more (per-key plans) are summed


def describe(summary):
    """``summary()`` (or a report's ``choices``) as lines of text. A kind
    whose keys have alternatives of their own (cuDNN's plans: hundreds of
    names) gets its most picked and the sums of the picks' and the
    defaults' medians instead of every name."""
    lines = []
    for kind, s in summary.items():
        ranked = sorted(s['picked'].items(), key=lambda item: -item[1])
        line = '{}: {} of {} keys decided'.format(kind, s['decided'], s['keys'])
        if s.get('from_cache'):
            line += ' ({} from the autotune cache file)'.format(s['from_cache'])
        if s.get('overruled'):
            line += (' ({} picks overruled by the check over whole steps: the defaults '
                     'ran faster there)'.format(s['overruled']))
        if s['decided'] and len(set(s['ms']) | set(s['picked'])) <= LISTED:
            line += ': {}; sum of medians: {}'.format(
                ', '.join('{} {}'.format(n, k) for n, k in ranked),
                ', '.join('{} {:.1f} ms'.format(n, ms) for n, ms in s['ms'].items())
                or 'none timed (the default kept)')
        elif s['decided']:
            shown = ranked[:5]
            line += ': {} different picks, the most: {}{}'.format(
                len(ranked), ', '.join('{} {}'.format(n, k) for n, k in shown),
                ', ...' if len(ranked) > len(shown) else '')
            if s.get('compared'):
                line += ('; sum of medians over the {} keys where both ran: the picks '
                         '{:.1f} ms, the defaults (each key\'s first) {:.1f} ms'.format(
                             s['compared'], s['picked_ms'], s['default_ms']))
        lines.append(line)
    return lines


def decide_now(kinds=None):
    """Ends the measuring of the undecided choices (of ``kinds``): each
    takes the alternative with the lowest median of the times it has (the
    default, the first named, where none was timed). For a benchmark that
    must time a steady state before a choice timed over whole steps could
    finish its turns; the results are the same whichever is picked. Returns
    ``[{'kind', 'key', 'picked', 'trials'}]`` of the choices it decided."""
    decided_now = []
    with _lock:
        for c in _choices.values():
            if c.picked is not None or (kinds is not None and c.kind not in kinds):
                continue
            timed = [n for n in c.names if c.times[n]]
            if c.paired and len(timed) == 2:
                first, second = c.names
                c.picked = c.measured = second if statistics.median(
                    a / b for a, b in zip(c.times[second], c.times[first])) < 1 else first
            elif c.paired:
                c.picked = c.measured = c.names[0]     # no pair timed: the default
            else:
                c.picked = c.measured = min(timed, key=lambda a: (
                    statistics.median(c.times[a]), c.names.index(a))) if timed else c.names[0]
            decided_now.append({'kind': c.kind, 'key': c.label, 'picked': c.picked,
                                'trials': {n: len(c.times[n]) for n in c.names}})
    return decided_now


def set_enabled(value):
    """``enable(autotune=...)``'s switch; a step period across a switch is
    not a quiet one (``measuring`` moves)."""
    global enabled, measuring
    if bool(value) != bool(enabled):
        measuring += 1
    enabled = value


def evaluated():
    """An Evaluator ran (a step period holding it is not timed)."""
    global evaluations
    evaluations += 1


def bump():
    """Call sites that keep a decided pick read it again (a pick changed)."""
    global generation
    with _lock:
        generation += 1


def forget(kind=None):
    """Drop the choices made (of one kind), and those read from a cache
    file, so they are measured again."""
    global generation, forgotten, collecting
    with _lock:
        generation += 1
        forgotten += 1
        collecting = None
        checking.clear()
        for k in [k for k in _choices if kind is None or k[0] == kind]:
            del _choices[k]
        for k in [k for k in _known if kind is None or k[0] == kind]:
            del _known[k]
        for k in [k for k in forced_calls if kind is None or k == kind]:
            del forced_calls[k]
