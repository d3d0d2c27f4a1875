"""autotune: the per-call picks checked over whole steps.

A per-call choice (a CPU convolution kernel, the fused update) is the faster
of two timings of one call in isolation. Those timings do not see what a
kernel costs the calls after it (its temporaries, what it leaves in the
caches): on ResNet-50 on a CPU the picks, each faster alone, made a whole
step 2-3% slower than fastchain's kernels everywhere (DEVELOPERS.md, what
limits the cache on a CPU). So once a step calls only decided choices, the
picks that differ from their defaults are checked together over whole
steps: steps with the picks and steps with the defaults take turns, timed
from one ``optimizer.update()`` to the next (the forward, backward, update
and loading of a step), and the picks are kept only where the median of
the ratios of neighbouring steps says they are faster (kind
``per_call_picks``; a tie keeps the defaults, fastchain's side, which runs
where autotune is off). Every alternative is bitwise equal, so the check
changes speed, never results.

The clock is the first optimizer to update while a check is open (in a GAN,
one optimizer's period covers the whole iteration). A step that measures
anything (a new key, another choice's turns) voids the turn it falls in.
"""

import hashlib
import weakref

from fastchain.tune import _tuner

KIND = 'per_call_picks'
NAMES = ('defaults', 'picks')      # the defaults win a tie: the picks must show a gain
KINDS = ('cpu_conv', 'cpu_conv_bound', 'fused_update')     # the per-call choices checked
TRIALS = 15         # timed steps of each side: the gains are a few percent of a step
VOID_LIMIT = 32     # voided turns of one check before it keeps the defaults
IDLE_LIMIT = 16     # other optimizers' updates without one of the clock's: given up


class _Check:
    def __init__(self):
        self.forgotten = _tuner.forgotten
        self.owner = None       # weakref to the optimizer whose updates are the clock
        self.phase = None       # None, 'collect' (one step's choices), 'turns'
        self.seen = None        # (measuring, evaluations) at the owner's last update
        self.idle = 0           # other optimizers' updates since the owner's last
        self.choices = ()       # the per-call choices checked together
        self.key = None
        self.label = None
        self.turns = None
        self.done = set()       # per-call choices checked (or being checked)
        self.scanned = None     # _tuner.measuring when the choices were last scanned


_check = _Check()
updates = 0     # optimizer updates seen while autotune is on: the steps' count


def tick(optimizer):
    """At the start of each ``optimizer.update()`` while autotune is on."""
    global _check, updates
    updates += 1
    check = _check
    if check.forgotten != _tuner.forgotten:
        check = _check = _Check()               # forget(): measure everything again
    if not _tuner.enabled or _tuner.forced:
        check.seen = None                       # the next period is not a quiet one
        return
    owner = None if check.owner is None else check.owner()
    if check.phase is not None and owner is None:
        _end(check, abandon=True)               # its optimizer is gone
    elif owner is not None and owner is not optimizer:
        check.idle += 1
        if check.idle <= IDLE_LIMIT:
            return
        _end(check, abandon=True)               # its optimizer stopped updating
    check.idle = 0
    now = _tuner.measuring, _tuner.evaluations
    quiet, check.seen = check.seen == now, now
    if check.phase == 'turns':
        if not quiet:
            check.turns.void()      # something measured, or an evaluation ran
        _apply(check.choices, check.turns.step(KIND, check.key, NAMES, check.label,
                                               trials=TRIALS, paired=True))
        if _tuner.pick(KIND, check.key) is not None:
            _end(check)
        return
    if check.phase == 'collect':
        called, _tuner.collecting = _tuner.collecting, None
        if not quiet:
            _end(check)
            return
        _open(check, optimizer, called)
        return
    if quiet and check.scanned != _tuner.measuring and _unchecked(check, scan=True):
        # The next step's calls go through the tuner once (generation bumped)
        # and name the choices this model's step calls.
        check.phase, check.owner = 'collect', weakref.ref(optimizer)
        _tuner.collecting = set()
        _tuner.bump()


def pending():
    """Whether a check is open, or due (picks decided since the last look):
    a benchmark steps until neither, as it does until every choice is
    decided."""
    check = _check if _check.forgotten == _tuner.forgotten else _Check()
    return check.phase is not None or (check.scanned != _tuner.measuring
                                       and _unchecked(check))


def _unchecked(check, scan=False):
    if scan:
        check.scanned = _tuner.measuring    # nothing is decided without measuring
    return any(c.kind in KINDS and c.measured is not None and c.measured != c.names[0]
               and c not in check.done for c in list(_tuner._choices.values()))


def _open(check, optimizer, called):
    # The picks this step calls that no check has taken yet (one shared with
    # a model checked before keeps that check's verdict); a decided choice
    # the step does not call (an evaluation's key) waits for a step that does.
    picks = sorted((c for c in called if c.kind in KINDS and c.measured is not None
                    and c.measured != c.names[0] and c not in check.done),
                   key=lambda c: (c.kind, repr(c.key)))
    if not picks:
        _end(check)
        return
    check.done.update(picks)
    digest = hashlib.sha1(repr([(c.kind, repr(c.key), c.measured) for c in picks])
                          .encode()).hexdigest()[:16]
    check.choices, check.key = tuple(picks), ('step', digest, len(picks))
    check.label = '{} per-call picks against their defaults, over whole steps of {}'.format(
        len(picks), type(optimizer.target).__name__)
    check.phase = 'turns'
    check.turns = _tuner.Turns(void_limit=VOID_LIMIT)
    _tuner.checking.update(picks)       # a cache file saved meanwhile keeps their picks
    _apply(check.choices, check.turns.step(KIND, check.key, NAMES, check.label,
                                           trials=TRIALS, paired=True))
    if _tuner.pick(KIND, check.key) is not None:        # known from a cache file
        _end(check)


def _end(check, abandon=False):
    """Close the check; ``abandon``: without a verdict (its clock stopped):
    its choices run their picks again and wait for another check."""
    if check.phase == 'collect':
        _tuner.collecting = None
    if abandon and check.phase == 'turns':
        _apply(check.choices, 'picks')
        check.done.difference_update(check.choices)
        check.scanned = None        # looked for again at the next quiet step
        with _tuner._lock:      # undecided, it would hold a benchmark's tuning open
            _tuner._choices.pop((KIND, check.key), None)
    _tuner.checking.difference_update(check.choices)
    check.phase = check.owner = check.key = check.turns = None
    check.choices, check.seen, check.idle = (), None, 0


def _apply(choices, name):
    """Run the measured picks (``'picks'``) or the defaults from now on."""
    changed = False
    for c in choices:
        run = c.measured if name == 'picks' else c.names[0]
        if c.picked != run:
            c.picked, changed = run, True
    if changed:
        _tuner.bump()       # call sites that keep a pick read it again
