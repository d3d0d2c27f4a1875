"""Why a cached chain falls back to define-by-run: the messages, from what
the recording and the verification found (:mod:`fastchain.static._cache`)."""

from fastchain.static import _draws, _functions, _verify
from fastchain.static._draws import DRAWN


def sequence_reason(calls, recorded):
    """(cause, reason): the recorded functions and this call's differ."""
    k = next((i for i, (a, b) in enumerate(zip(calls, recorded)) if a != b),
             min(len(calls), len(recorded)))
    got = calls[k] if k < len(calls) else None
    had = recorded[k] if k < len(recorded) else None
    if got is not None and had is not None and got[:2] == had[:2] and got[2] != had[2]:
        new, old = dict(got[2]), dict(had[2])
        name = next(n for n in sorted(set(new) | set(old)) if new.get(n) != old.get(n))
        return ('not static', 'the model is not static: {} (function #{}) got {} = {} '
                'where the recorded graph has {}: a value computed in Python from '
                'the data, which the replay would keep from the first step'.format(
                    got[0], k + 1, name, new.get(name), old.get(name)))
    return ('not static', 'the model is not static: on a later call its forward applied '
            '{} where the recorded graph has {} (function #{}); Python control flow '
            'that depends on the data, or on the type of an input (Chainer\'s replay '
            'gives the forward a Variable where the script passes an array)?'.format(
                _call(got), _call(had), k + 1))


_RANDOM = ('NumPy\'s random state advanced {}: the model draws random numbers (in Python, '
           'e.g. numpy.random.randn noise, F.gumbel_softmax or a sampler, or in a function '
           "the cache does not know) and the replay keeps the first step's draw")
RANDOM = ('not static', _RANDOM.format('differently in the replay than in define-by-run'))


def random_reason(waited):
    """RANDOM, and the draws of other threads that waited for the check to
    end until they went on (``waited``: their functions' names)."""
    if not waited:
        return RANDOM
    return RANDOM[0], RANDOM[1] + (
        '. Another thread drew from it ({}) while the call was checked and went on after '
        'waiting {:g} s: a thread the forward waits on, whose draws are the forward\'s'.format(
            ', '.join(sorted(set(waited))), _draws.HOLD))


def machinery_reason(last, error, drew):
    """(cause, reason): Chainer's static graph raised ``error`` building
    (``last``: the last function recorded, or None) or replaying (``last``
    False); ``drew``: NumPy's random state had advanced (the likelier cause)."""
    if drew:
        # (Chainer's recording then fails on what the draw made: its error
        # would only confuse; a new-user trial found it did)
        return 'not static', _RANDOM.format('in the call')
    if isinstance(error, AttributeError) and "'dict' object" in str(error):
        return ('unsupported', "the forward returns a dict: Chainer's static graph replays "
                'a forward that returns a variable or a tuple or list of them. Return a '
                'tuple (and make the dict outside the cached chain), or leave this model '
                'uncached')
    where = 'replayed' if last is False else 'built' + (
        ' (at {})'.format(_functions.short(last)) if last else '')
    return ('defect', 'the schedule could not be {} ({}: {}): Chainer\'s static graph cannot '
            'record or replay this graph (a limit of the cache, not a verified difference; '
            'the step ran define-by-run)'.format(where, type(error).__name__, error))


def kept_reason(kept):
    """(cause, reason): the forward kept variables it made in attributes."""
    return ('not static', 'the model keeps what a call computes: its forward stores a '
            'variable in {} (state from call to call, as L.LSTM keeps h and c, or a value '
            'kept for later use). The cache verifies and replays a call from its inputs and '
            'parameters to its outputs; a variable kept past the call is outside that (a '
            "later call's gradient through it was lost, measured with L.LSTM). Links that "
            'take their state as inputs and return it (L.StatelessLSTM, L.NStepLSTM) can be '
            'cached'.format(_first_three(kept, ', ')))


def python_reason(changed):
    """(cause, reason): the forward changed state its links keep in Python
    (``changed``: ``'path/name: what'``, :mod:`fastchain.static._state`), or
    drew from a random generator outside them."""
    drawn = [c[:-len(': ' + DRAWN)] for c in changed if c.endswith(': ' + DRAWN)]
    if drawn and len(drawn) == len(changed):    # (a link's own generator: named by its path)
        return ('not static', 'the forward draws random numbers from {} (e.g. '
                'random.random() for stochastic depth, or noise from a module-level '
                "generator): the replay runs none of the forward's Python, so it would keep "
                "the first step's draws. Draw them in the training loop and pass the result "
                'as an input, or leave this model uncached'.format(' and '.join(drawn[:3])))
    return ('not static', 'the model keeps state in Python that its forward changes ({}): '
            'a counter, a list or dict it fills, an array it changes in place, a random '
            "generator of its own it draws from. The replay runs none of the forward's "
            'Python, so that state would stay as the first call left it, and what the '
            'forward computes from it would be frozen. Keep such state outside the cached '
            'chain (in the training loop or an extension), or leave this model '
            'uncached'.format(_first_three([c for c in changed if not c.endswith(DRAWN)]
                                           or changed, '; ')))


def keys_reason(count, key, keys):
    """(cause, reason): the chain met a key past the ``count`` it has (its
    inputs' shapes and dtypes, Chainer's configuration, the user's
    configuration entries, the links' attribute state: :func:`_keys.key`)."""
    keys = list(keys) + [key]
    shapes = sorted({_shapes(k[0]) for k in keys})
    entries = sorted({name for k in keys for name, _ in k[2]
                      if len({repr(dict(j[2]).get(name)) for j in keys}) > 1})
    states = len({k[3] for k in keys if len(k) > 3})
    parts, fixes = [], []
    if len(shapes) > 1:
        parts.append('{} input shapes ({}{})'.format(len(shapes), ', '.join(shapes[:3]),
                                                     ', ...' if len(shapes) > 3 else ''))
        fixes.append('bucket the inputs into a few shapes (pad them)')
    if entries:
        parts.append('values of the chainer.config entries {}'.format(', '.join(entries[:3])))
        fixes.append('keep a value that changes every step (a counter) out of chainer.config')
    if states > 1:
        parts.append("{} states of the links' attributes".format(states))
        fixes.append("keep what changes every step out of the model's links")
    if not parts:
        parts.append("states of Chainer's configuration")
    return ('not static', 'the model was called with more than {} different keys ({}): '
            'each is recorded and verified anew (two forwards) and keeps its schedule, so '
            'what changes on most steps costs more than the replay saves. {}, or leave this '
            'model uncached'.format(count, '; '.join(parts), '; '.join(fixes).capitalize()
                                    or 'Pass what changes as an input'))


def _shapes(arrays_key):
    """'32x3x224x224' for each array of a key's arrays part."""
    def walk(part):
        if isinstance(part, tuple) and len(part) == 2 and isinstance(part[1], tuple) and \
                part[0] in (list, tuple):
            return '(' + ', '.join(walk(p) for p in part[1]) + ')'
        if isinstance(part, tuple) and len(part) >= 2 and isinstance(part[1], tuple):
            return 'x'.join(str(d) for d in part[1]) or 'scalar'
        return '?'
    return walk(arrays_key)


def attributes_reason(change, states):
    """(cause, reason): the links' attributes took more than ``states``
    states between calls (``change``: the last, 'path/name: a -> b')."""
    return ('not static', 'the attributes of the model\'s links were set or changed in place '
            'between calls to more than {} different states (the last change: {}): the '
            'forward may read them (a weight, a flag, an array, a config), so each new state '
            'is recorded and verified anew, and one that changes on every step leaves nothing '
            'to replay. Keep a value that changes every step (a log, a counter) outside the '
            'model\'s links (in the training loop), or pass it to the forward as an input '
            'array'.format(states, change))


def unused_reason(outputs, times):
    """(cause, reason): on ``times`` calls the cache was to verify, the call's
    ``outputs`` (numbers from 1) reached no backward."""
    return ('unsupported', 'output{} {} of the call reached no backward on {} of the calls the '
            'cache was to verify (the loss leaves {}: {} gradient is None). Chainer\'s replay '
            'of the backward needs a gradient for every output, so such a call takes its '
            'backward define-by-run after its forward once more, slower than define-by-run '
            'alone. Return only what the loss uses'.format(
                's' if len(outputs) > 1 else '', ', '.join('#{}'.format(i) for i in outputs),
                times, 'them out' if len(outputs) > 1 else 'it out',
                'their' if len(outputs) > 1 else 'its'))


def _first_three(items, separator):
    more = ' and {} more'.format(len(items) - 3) if len(items) > 3 else ''
    return separator.join(items[:3]) + more


def value_reason(names, building, what, how, backward=False):
    """(cause, reason): a value differs between the replay and define-by-run
    (``names``: the functions the key recorded)."""
    if what == _verify.RAISED:
        return ('defect', "Chainer's replay of the backward raised {}: Chainer's static "
                'graph cannot replay this graph (a limit of the cache, not a verified '
                "difference; the step's gradients are define-by-run's)".format(how))
    if building:
        return ('defect', 'on the step that recorded it, the replay and define-by-run '
                'differ in {} ({}): a defect of the static cache (fastchain or '
                "Chainer's replay), not of the model; the step's result is define-by-run's. "
                'Please report it'.format(what, how))
    suspects = _functions.unknown(names)
    named = (': possibly ' + ', '.join(suspects) + ', which fastchain has not measured '
             'under the cache') if suspects else ''
    if backward:
        # A value the model computes in Python from the data shows in the
        # forward or among the constants; these agreed.
        return ('defect', 'on a later batch the gradients differ ({}: {}) although the '
                'forward, the functions applied and their constants agree: a function '
                "keeps forward state that Chainer's replay does not refresh{}. A defect "
                "of the static cache, not of the model; the step's gradients are "
                "define-by-run's".format(what, how, named))
    return ('not static', 'on a later batch the replay and define-by-run differ in {} ({}) '
            'although the functions applied and their constants are the same: something '
            'was kept from the batch the graph was recorded on. Most likely the model is '
            'not static (an array computed in Python from the data, e.g. from x.array); '
            "else a function keeps state that Chainer's replay does not refresh{}"
            .format(what, how, named))


def _call(call):
    if call is None:
        return 'nothing'
    params = [p for p in call[3] if p is not None]
    return '{}{}{}'.format(call[0], call[1], ' to ' + ', '.join(params) if params else '')
