"""What a cached schedule is valid for, and where Chainer finds it.

Chainer keys its schedules by the shapes and dtypes of the inputs and
``chainer.config.train`` (``ScheduleManager.get_schedule``). The replay also
depends on what decided the functions and kernels while the schedule was
recorded: the array types and devices of the inputs, the configuration
that Chainer's functions read in Python when they make their nodes (cuDNN and
iDeep use, the default dtype, the gradient summation mode), and every entry
of ``chainer.config`` that is not Chainer's own (a user's, which a forward
may branch on). fastchain's key
covers all of it, and each key gets its own Chainer ``ScheduleManager`` so
that Chainer never reuses a schedule across keys.
"""

import chainer

# What Chainer's static graph keeps on a cached chain.
CHAINER_ATTRIBUTES = ('schedule_manager', 'static_schedule', '_out_vars_unflatten_inds')

OWNER = 'static_owner'      # on Chainer's ScheduleManager: the cache it belongs to (weakref)
CONFIG = ('train', 'dtype', 'use_cudnn', 'cudnn_deterministic', 'use_ideep',
          'cudnn_fast_batch_normalization', 'lazy_grad_sum')
# Chainer's own configuration (7.8.1's global_config); every other entry is
# the user's, and all of them are in the key: a forward may branch on one
# (``if chainer.config.use_aux: ...``), and the replay would keep the branch
# recorded (a new-user trial found it did, without a word).
CHAINER_CONFIG = frozenset((
    '_will_recompute', 'autotune', 'compute_mode', 'cudnn_deterministic',
    'cudnn_fast_batch_normalization', 'debug', 'dtype', 'enable_backprop', 'in_recomputing',
    'keep_graph_on_report', 'lazy_grad_sum', 'schedule_func', 'train', 'type_check',
    'use_cudnn', 'use_cudnn_tensor_core', 'use_ideep', 'use_static_graph',
    'warn_nondeterministic'))


def _array_key(x):
    if isinstance(x, (list, tuple)):
        parts = tuple(_array_key(item) for item in x)
        return None if None in parts else (type(x), parts)
    variable = isinstance(x, chainer.Variable)
    a = x.array if variable else x
    if not hasattr(a, 'shape') or not hasattr(a, 'dtype'):
        return None
    device = getattr(a, 'device', None)
    # an array's gradient is left out of the backward, a variable's that
    # requires one is not (_fixes.drop_input_gradients): not one schedule
    needs = 'variable' if variable and x.requires_grad else 'array'
    return type(a), a.shape, a.dtype, getattr(device, 'id', device), needs


def not_an_array(args):
    """'argument N, a T' for the first argument (counted from 1, past
    ``self``) that is not an array or variable, nor a list or tuple of them."""
    for i, x in enumerate(args):
        if _array_key(x) is None:
            return 'argument {}: {!r}'.format(i + 1, x) if x is None or isinstance(
                x, (bool, int, float, str)) else 'argument {}, a {}'.format(
                    i + 1, type(x).__name__)
    return 'another argument'


def array_inputs(args):
    """The positions, in Chainer's flattened order of a call's arguments, of
    those whose gradient nobody reads: arrays, and variables that require
    none (Chainer's static graph records its call on new variables that
    require one, and asks for it)."""
    flat = []

    def walk(x):
        if isinstance(x, (list, tuple)):
            for item in x:
                walk(item)
        else:
            flat.append(not (isinstance(x, chainer.Variable) and x.requires_grad))
    walk(args)
    return tuple(i for i, is_array in enumerate(flat) if is_array)


def key(args):
    """What a schedule is valid for, or None if an argument is not an array."""
    arrays = _array_key(args)
    if arrays is None:
        return None
    config = chainer.config
    return arrays, tuple(getattr(config, name, None) for name in CONFIG), user_config()


def user_config():
    """The entries of ``chainer.config`` that are not Chainer's, as they are
    in this thread: ((name, value), ...), a value that cannot be hashed by
    its type and ``repr``."""
    names = set(vars(chainer.global_config))
    local = getattr(chainer.config, '_local', None)
    if local is not None:
        names.update(vars(local))
    found = []
    for name in sorted(names - CHAINER_CONFIG):
        value = getattr(chainer.config, name, None)
        try:
            hash(value)
        except TypeError:
            # by what it holds (a dict changed in place, or a new one in the
            # place of a freed one whose id it takes: by id, both replayed stale)
            value = ('unhashable', type(value).__name__, repr(value)[:10000])
        found.append((name, value))
    return tuple(found)


class Managers:
    """What Chainer finds as ``chain.schedule_manager``: one Chainer
    ``ScheduleManager`` per cache key, the one for the current call selected.

    It lives on the chain, as Chainer's own manager does (the schedules refer
    to the chain, so the chain must own them to be collectable), and belongs
    to one cache (``owner``): a new cache on the same chain starts afresh.
    """

    def __init__(self, owner, verbosity, cache=None):
        self.owner = owner
        self.verbosity = verbosity
        self.cache = cache      # a weak reference to the cache (marks its schedules)
        self.by_key = {}
        self.current = None

    def select(self, key):
        manager = self.by_key.get(key)
        if manager is None:
            from chainer.graph_optimizations.static_graph import ScheduleManager
            from fastchain.config import _patches
            manager = self.by_key[key] = ScheduleManager(
                minimize_cache_size=False, verbosity_level=self.verbosity)
            if self.cache is not None:
                _patches.attach(manager, OWNER, self.cache)
        self.current = manager
        return manager

    def get_schedule(self, in_vars, enable_double_backprop=False):
        return self.current.get_schedule(in_vars, enable_double_backprop)

    def end_forward(self):
        for manager in self.by_key.values():
            manager.end_forward()

    @property
    def schedules(self):
        return {(i, name): schedules for i, manager in enumerate(self.by_key.values())
                for name, schedules in manager.schedules.items()}


def next_schedule(manager):
    """The schedule Chainer's next ``get_schedule`` on ``manager`` (one key
    per manager) hands out, or None if it makes a new one."""
    if not manager.schedules:
        return None
    (key, schedules), = manager.schedules.items()
    used = manager.in_use_count.get(key, 0)
    return schedules[used] if used < len(schedules) else None


def will_build(manager):
    """Whether Chainer's next ``get_schedule`` on ``manager`` makes a new
    schedule, or hands out one not recorded yet: it then records."""
    schedule = next_schedule(manager)
    return schedule is None or schedule.is_empty()
