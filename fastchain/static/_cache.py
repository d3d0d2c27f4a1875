"""Static-subgraph caching that users can trust.

Chainer's ``static_graph`` records the forward and backward of a chain on
the first call and replays them afterwards, skipping most of Chainer's
per-function Python work. fastchain uses it with its faults fixed
(:mod:`fastchain.static._fixes`) and adds what a user needs around it:

- **verification** (:mod:`fastchain.static._verify`): the step that builds a
  schedule and the first ``verify_steps`` replays of each key also run the
  chain define-by-run on the same batch, leaving no trace (persistent values,
  gradients and NumPy's random state put back), and compare the functions
  applied, the outputs, the persistent values and, in the replay's backward,
  every parameter's and input's gradient. On a difference the step's result
  is define-by-run's (the forward is redone, or the backward's gradients are
  replaced before anything is updated) and the chain runs define-by-run from
  then on, with a warning that names the cause: a function the cache refuses,
  a model that is not static, or a defect of the cache itself;
- **refusal** of functions the replay cannot reproduce (``F.dropout``, the
  other random functions, those whose backward keeps forward state:
  :mod:`fastchain.static._functions`) and of a call that leaves a variable in
  a link (``L.LSTM``'s state);
- **one node** of Chainer's graph per call, the parameters among its inputs
  (:mod:`fastchain.static._node`): its gradients add up with the rest of the
  graph's (weight tying, several calls before a backward, accumulation), and
  a double backward through it is computed define-by-run, within rounding
  (the cache gives up);
- **keys**: one Chainer schedule manager per key (the structure, types,
  shapes, dtypes and devices of the inputs, ``chainer.config``'s
  ``train``, ``dtype``, ``use_cudnn``, ``cudnn_deterministic``, ``use_ideep``,
  ``cudnn_fast_batch_normalization`` and ``lazy_grad_sum``, every entry of
  it that is not Chainer's, and the state of the links' attributes), at most
  :data:`MAX_KEYS`;
- **autotune** (``enable(autotune=...)``, :mod:`fastchain.tune`): once a key
  is verified, its replay and define-by-run take turns for a few steps, timed
  over whole steps, and the faster is kept (a model too small for the replay
  to pay trains define-by-run; the bits are the same either way);
- define-by-run wherever the replay does not apply: evaluation, no backprop,
  another cached chain's recording, ``use_static_graph == False``, keywords.

.. note:: Checking is by sampling: a model whose control flow or Python
   constants change after the verified steps is not caught, nor are random
   numbers drawn through CuPy. Mark only models you know are static
   (ResNet-style networks are).
"""

import contextlib
import functools
import hashlib
import warnings
import weakref

import chainer

from fastchain.config import _patches
from fastchain.config._warning import FastchainWarning
from fastchain.static import (_draws, _fixes, _functions, _keys, _node, _outside, _reads,
                              _reasons, _verify, _watch)
from fastchain.tune import _steps, _tuner

STATE = 'static_cache'      # attachment key: the chain's cache
VOIDED_LIMIT = 32           # autotune: periods voided by evaluations before it gives up
# Keys (input shapes, dtypes, configurations, attribute states) of one chain
# before it gives up: each is recorded and verified (two forwards) and keeps
# its schedules; a batch shape new on every step cost 5x and 119 MiB over 300
# steps of a small MLP, silently (a new-user trial)
MAX_KEYS = 16
LIVE = weakref.WeakSet()    # every cache whose chain lives (for handle.report())


class StaticGraphFallback(FastchainWarning):
    """A chain marked static runs define-by-run instead, for the reason given."""


def cache_state(chain):
    """The cache's bookkeeping for ``chain`` (None if it is not cached):
    ``{'fallback': reason or None, 'cause': None or 'refused' (a function
    the cache refuses), 'not static' (the model), 'defect' (fastchain or
    Chainer's replay), 'unsupported' (a use the cache does not support),
    'sequences': {key: functions recorded}, 'verified': {key: replays
    verified}, 'names': {key: functions applied}}``."""
    cache = _patches.attached(chain, STATE)
    return None if cache is None else cache.state


def _uninitialized(chain):
    """The names of ``chain``'s parameters not made yet (their size comes
    from their first input)."""
    return frozenset(name for name, p in chain.namedparams() if p.array is None)


def is_cached(chain):
    return _patches.attached(chain, STATE) is not None


class _Cache:
    """The cache of one chain's define-by-run function ``forward``."""

    def __init__(self, chain, forward, verify_steps, verbosity):
        from chainer.graph_optimizations.static_graph import static_graph
        self.ref = weakref.ref(chain)
        self.name = type(chain).__name__
        self.verify_steps = verify_steps
        self.verbosity = verbosity
        self.forward = forward      # define-by-run, unbound (a double backward's)
        self.replay = static_graph(force_test_define_by_run=True, minimize_cache_size=False,
                                   verbosity_level=verbosity)(forward)
        self.token = object()       # marks the schedule managers of this cache
        self.method = False         # a decorated method's cache (else the instance's)
        self.state = {'fallback': None, 'cause': None, 'sequences': {}, 'verified': {},
                      'names': {}}
        self.turns = _tuner.Turns(void_limit=VOIDED_LIMIT)  # autotune: a step a turn
        self.structures = {}        # autotune: key -> the choice's key
        self.lazy = {}              # key -> the parameters unmade before its define-by-run step
        self.waited = []            # the verified call's other threads' draws that waited HOLD
        self.watch = _watch.Watch(chain)    # the state of the links' attributes: in the key
        self.turn_form = None       # autotune: (optimizer updates seen, the step's form)
        self.unverifiable = {}      # key -> verified calls whose outputs reached no backward
        LIVE.add(self)
        _outside.watch(self)    # gradient terms from outside the call, on the first passes

    def __call__(self, plain, args, kwargs):
        result = self._dispatch(plain, args, kwargs)
        if self in _outside.WANTED:     # a define-by-run call's functions are the call's
            _outside.called(self, args, result)
        return result

    def _dispatch(self, plain, args, kwargs):
        config = chainer.config
        if (self.state['fallback'] is not None or not config.train
                or not config.enable_backprop or config.schedule_func is not None
                or not config.use_static_graph or _verify.in_reference()
                or getattr(config, 'in_recomputing', False)):
            self.turns.void()       # an evaluation between two steps is not timed
            # (Chainer records a train-mode call without backprop as 'test',
            # outside the fixes; a call in another cached chain's belongs to it;
            # F.forget's recomputation must not update statistics, which a
            # replay would)
            if self.state['fallback'] is not None:
                return plain(*args, **kwargs)
            self.watch.outside_call()
            try:
                return plain(*args, **kwargs)
            finally:
                self.watch.after_outside_call()
        key = _keys.key(args) if not kwargs else None
        if key is not None:
            state = self.watch.state()
            if state is None:
                return self._redo(plain, args, *_reasons.attributes_reason(
                    self.watch.last_change, _watch.MAX_STATES))
            key += (state,)
        try:
            return self._call(plain, args, kwargs, key)
        finally:
            self.watch.settle()

    def _call(self, plain, args, kwargs, key):
        if key is None:
            self.fall_back('unsupported', 'the cache replays calls whose arguments are '
                           'arrays or variables (nested in lists or tuples), without keyword '
                           'arguments; this call has {}'.format(
                               'keyword arguments ({})'.format(', '.join(sorted(kwargs)))
                               if kwargs else _keys.not_an_array(args)))
            return plain(*args, **kwargs)
        chain = self.ref()
        managers = chain.__dict__.get('schedule_manager')
        if getattr(managers, 'owner', None) is not self.token:
            # Chainer's own attribute; one left by an earlier cache is not reused.
            managers = chain.__dict__['schedule_manager'] = _keys.Managers(
                self.token, self.verbosity, weakref.ref(self))
        if key not in managers.by_key and len(managers.by_key) >= MAX_KEYS:
            return self._redo(plain, args, *_reasons.keys_reason(
                len(managers.by_key), key, list(managers.by_key)))
        manager = managers.select(key)
        if not _node.claim(manager):
            return self._redo(plain, args, 'unsupported', _node.TOO_MANY)
        building = _keys.will_build(manager)
        if building:
            lazy = _uninitialized(chain)
            if lazy and lazy != self.lazy.get(key):
                # L.Linear(None, n) is made on its first call from NumPy's
                # generator: that step runs define-by-run, a later one records
                # (one that makes none: an unused layer is left out of it).
                self.lazy[key] = lazy
                self.turns.reset()
                return plain(*args)
        if not building and self.state['verified'].get(key, 0) >= self.verify_steps:
            if not _tuner.enabled:
                self.turns.reset()
            elif self._tuned(key) == 'define-by-run':
                return plain(*args)
            with _fixes.verbosity(self.verbosity > 0):
                out = self._replay(chain, key, args)
            self.watch.replayed = True      # none of the forward's Python ran
            return out
        self.turns.reset()
        with _draws.holding_numpy() as waited:     # another thread's draws wait: _draws
            self.waited = waited
            return self._verified(chain, plain, key, args, building)

    def _tuned(self, key):
        """autotune: the replay or define-by-run for this step. Once a key
        is verified the two give the same bits; which is faster is measured
        over whole steps (from a step's first forward of the key to the next
        step's: backward, update and loading included), taking turns, one
        form for all the calls of a step."""
        # Keyed by what was recorded (as a kernel's choice is by its shapes):
        # a rebuilt model of the same structure takes the first one's choice.
        structure = self.structures.get(key)
        if structure is None:
            structure = self.structures[key] = (self.name, hashlib.sha1(repr(
                self.state['sequences'].get(key)).encode()).hexdigest())
        # One form for every call of a step (from one optimizer update to the
        # next): a graph mixing replayed and define-by-run calls, one's state
        # into the next (truncated backprop), sums gradients in another order.
        if self.turn_form is not None and self.turn_form[0] == _steps.updates:
            return self.turn_form[1]
        form = self.turns.step('static_graph', structure, ('cached', 'define-by-run'),
                               label=lambda: '{} ({} functions recorded)'.format(
                                   self.name, len(self.state['sequences'].get(key, ()))))
        self.turn_form = (_steps.updates, form)
        return form

    def _verified(self, chain, plain, key, args, building):
        refused = _functions.hook_refusal(chain) if building else None
        if refused is not None:
            return self._redo(plain, args, 'refused', refused)
        before = _verify.Snapshot(chain, python=True)
        recorder = _functions.Recorder() if building else contextlib.nullcontext()
        statistics = _fixes.building_statistics(chain, _keys.array_inputs(args)) if building else \
            contextlib.nullcontext()
        watch = _reads.watching() if building else contextlib.nullcontext(_reads.Found())
        found = None
        try:
            with statistics, recorder, watch as reads, before.python.draws.watching(), \
                    _fixes.verbosity(self.verbosity > 0):
                out = self._replay(chain, key, args, building)
        except BaseException as e:  # the call's own error, or one of the cache's
            drew = before.random_moved()
            changed = before.python.changes(made=building)
            before.restore()
            self._drop(key)     # its half-made schedule: the key records anew
            if not isinstance(e, Exception):
                raise           # Ctrl-C, an exit: the call ends, the cache stays
            refused = _functions.refusal(recorder.names) if building else None
            if refused is not None:
                found = 'refused', refused
            elif changed:       # the likelier cause (a generator's draw made a constant)
                found = _reasons.python_reason(changed)
            else:
                found = _reasons.machinery_reason(
                    getattr(recorder, 'last', None) if building else False, e, drew)
        if found is not None:
            # Define-by-run decides whose error it was: one it raises as well
            # is the call's own (a malformed batch), raised as plain Chainer
            # raises it, the cache kept; else a limit of the cache (an error
            # of the script's that came once, too: its step is then taken).
            out = plain(*args)
            self.fall_back(*found)
            return out
        kept = before.kept_variables()
        if kept:
            before.restore()
            return self._redo(plain, args, *_reasons.kept_reason(kept))
        if building:
            self.watch.read_in_place |= recorder.inputs
            recorder.resolve(chain)
            refused = _functions.refusal(recorder.names)
            if refused is not None:
                before.restore()
                return self._redo(plain, args, 'refused', refused)
            if reads:
                before.restore()
                return self._redo(plain, args, 'not static', _reads.reason(reads))
            if reads.reports:
                before.restore()
                return self._redo(plain, args, 'unsupported',
                                  _reads.report_reason(reads.reports))
            self.state['names'][key] = set(recorder.names)
            recorded = self.state['sequences'].setdefault(key, recorder.calls)
            if recorder.calls != recorded:      # a second schedule for the key
                before.restore()
                return self._redo(plain, args,
                                  *_reasons.sequence_reason(recorder.calls, recorded))
        schedule = chain.static_schedule
        after = _verify.Snapshot(chain, grads=False, python=building)
        before.put_back()
        with before.python.draws.watching():
            reference = _verify.Reference(chain, plain, args)
        if self in _outside.WANTED:     # a parameter used twice: said where it meets others
            _outside.note_uses(self, chain.schedule_manager.current, reference.outputs)
        reached = _verify.Snapshot(chain, grads=False)
        after.put_back()
        # The recording's or the reference's Python changed the model (the
        # recording may make a constant the reference then leaves alone).
        changed = before.python.changes(made=building) or (
            after.python.changes() if building else [])
        if changed:
            before.restore()
            return self._redo(plain, args, *_reasons.python_reason(changed))
        found = self._compare_forward(key, building, out, after, reference, reached)
        if found is not None:
            before.restore()
            return self._redo(plain, args, *found)
        report = functools.partial(self._backward_result, key, building)
        names = {id(p): name for name, p, _ in before.grads}
        _patches.attach(schedule, _fixes.CHECK, _verify.BackwardCheck(reference, names, report))
        return out

    def _replay(self, chain, key, args, recording=False):
        schedule = _keys.next_schedule(chain.schedule_manager.current)
        if schedule is not None and not schedule.is_empty():
            _node.supersede(schedule, self.name)
        out = self.replay(chain, *args)
        schedule = chain.static_schedule
        _patches.detach(schedule, _fixes.CHECK)     # an earlier call's, its backward not run
        _node.called(schedule, self, key, args, recording)
        return out

    def _compare_forward(self, key, building, out, after, reference, reached):
        calls, recorded = reference.recorder.calls, self.state['sequences'][key]
        if calls != recorded:
            return _reasons.sequence_reason(calls, recorded)
        if not after.same_random_state(reached):
            return _reasons.random_reason(self.waited)
        pairs = [('output #{}'.format(i + 1), y, e) for i, (y, e) in
                 enumerate(zip(_verify.flatten(out), reference.outputs))]
        found = _verify.first_difference(pairs) or after.compare_persistents(reached)
        if found is None and len(_verify.flatten(out)) != len(reference.outputs):
            found = ('the outputs', 'a different number of outputs')
        return None if found is None else _reasons.value_reason(
            self.state['names'].get(key, ()), building, *found)

    def _backward_result(self, key, building, found):
        if found is not None and found[0] == _verify.UNUSED:
            # Not verified. Past verify_steps such calls and none verified (the
            # output is never used), the cache costs more than it saves.
            times = self.unverifiable[key] = self.unverifiable.get(key, 0) + 1
            if times > self.verify_steps and not self.state['verified'].get(key):
                self.fall_back(*_reasons.unused_reason(found[1], times))
            return
        if found is None:
            if not building:
                self.state['verified'][key] = self.state['verified'].get(key, 0) + 1
            return
        self.fall_back(*_reasons.value_reason(self.state['names'].get(key, ()), building,
                                              *found, backward=True))

    def fall_back(self, cause, reason):
        self.state['fallback'] = reason
        self.state['cause'] = cause
        _outside.unwatch(self)
        self.forget()
        warnings.warn('fastchain static_graph: {} runs define-by-run from now on: {}'
                      .format(self.name, reason), StaticGraphFallback,
                      stacklevel=_patches.user_stacklevel())

    def _redo(self, plain, args, cause, reason):
        self.fall_back(cause, reason)
        return plain(*args)

    def _own_managers(self):
        """(the chain, its key managers) if the managers are this cache's, else None."""
        chain = self.ref()
        managers = None if chain is None else chain.__dict__.get('schedule_manager')
        return (chain, managers) if getattr(managers, 'owner', None) is self.token else None

    def _drop(self, key):
        """Forget what the cache holds for ``key`` (a call of it raised)."""
        own = self._own_managers()
        if own is not None:
            own[1].by_key.pop(key, None)
        for table in (self.state['sequences'], self.state['verified'], self.state['names'],
                      self.structures, self.unverifiable):
            table.pop(key, None)

    def forget(self):
        """Drop the schedules: Chainer's attributes on the chain, if they are ours."""
        own = self._own_managers()
        if own is not None:
            for name in _keys.CHAINER_ATTRIBUTES:
                own[0].__dict__.pop(name, None)
