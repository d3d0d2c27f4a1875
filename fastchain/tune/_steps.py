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
VOID_LIMIT = 32     # voided turns before the picks are kept unchecked


class _Check:
    def __init__(self):
        self.forgotten = _tuner.forgotten
        self.owner = None       # weakref to the optimizer whose updates are the clock
        self.phase = None       # None, 'collect' (one step's choices), 'turns'
        self.seen = None        # _tuner.measuring at the owner's last update
        self.choices = ()       # the per-call choices checked together
        self.key = None
        self.label = None
        self.turns = _tuner.Turns(void_limit=VOID_LIMIT)
        self.done = set()       # per-call choices checked, or not called by a step
        self.scanned = None     # _tuner.measuring when the choices were last scanned


_check = _Check()


def tick(optimizer):
    """At the start of each ``optimizer.update()`` while autotune is on."""
    global _check
    if not _tuner.enabled or _tuner.forced:
        return
    check = _check
    if check.forgotten != _tuner.forgotten:
        check = _check = _Check()               # forget(): measure everything again
    owner = None if check.owner is None else check.owner()
    if owner is None and check.phase is not None:
        check.phase, check.seen = None, None     # its optimizer is gone
        _tuner.collecting = None
        _apply(check.choices, 'picks')
    if owner is not None and owner is not optimizer:
        return
    quiet = check.seen == _tuner.measuring
    check.seen = _tuner.measuring
    if check.phase == 'turns':
        if not quiet:
            check.turns.void()
        _apply(check.choices, check.turns.step(KIND, check.key, NAMES, check.label,
                                               trials=TRIALS, paired=True))
        if _tuner.pick(KIND, check.key) is not None:
            check.phase, check.owner = None, None
        return
    if check.phase == 'collect':
        called, _tuner.collecting = _tuner.collecting, None
        if not quiet:
            check.phase, check.owner = None, None
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
    """Whether a check is open, or picks wait for one (a benchmark steps
    until neither, as it does until every choice is decided)."""
    check = _check if _check.forgotten == _tuner.forgotten else _Check()
    return check.phase is not None or _unchecked(check)


def _unchecked(check, scan=False):
    if scan:
        check.scanned = _tuner.measuring    # nothing is decided without measuring
    return any(c.kind in KINDS and c.measured is not None and c.measured != c.names[0]
               and c not in check.done for c in list(_tuner._choices.values()))


def _open(check, optimizer, called):
    decided = [c for c in list(_tuner._choices.values())
               if c.kind in KINDS and c.measured is not None]
    check.done.update(decided)          # checked now, or not part of a step
    picks = sorted((c for c in called if c.kind in KINDS and c.measured is not None
                    and c.measured != c.names[0]), key=lambda c: (c.kind, repr(c.key)))
    if not picks:
        check.phase, check.owner = None, None
        return
    digest = hashlib.sha1(repr([(c.kind, repr(c.key), c.measured) for c in picks])
                          .encode()).hexdigest()[:16]
    check.choices, check.key = tuple(picks), ('step', digest, len(picks))
    check.label = '{} per-call picks against their defaults, over whole steps of {}'.format(
        len(picks), type(optimizer.target).__name__)
    check.phase = 'turns'
    _apply(check.choices, check.turns.step(KIND, check.key, NAMES, check.label,
                                           trials=TRIALS, paired=True))
    if _tuner.pick(KIND, check.key) is not None:        # known from a cache file
        check.phase, check.owner = None, None


def _apply(choices, name):
    """Run the measured picks (``'picks'``) or the defaults from now on."""
    changed = False
    for c in choices:
        run = c.measured if name == 'picks' else c.names[0]
        if c.picked != run:
            c.picked, changed = run, True
    if changed:
        _tuner.bump()       # call sites that keep a pick read it again
