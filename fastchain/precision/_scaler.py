"""Dynamic loss scaling that never lets inf/NaN reach the weights."""

import math
import numbers
import warnings

from fastchain.config import _patches
from fastchain.config._warning import FastchainWarning


# Largest power of two an fp16 loss can carry: Chainer seeds backward with
# `ones_like(loss) * loss_scale` in the loss's dtype, and fp16 tops out at 65504.
FP16_SAFE_SCALE = 2.0 ** 15


class DynamicLossScaler:
    """Scales the loss up so fp16 gradients do not underflow, and backs off
    when they overflow.

    Each step: the gradients are checked once for inf/NaN (one device-to-host
    synchronisation for all of them). On overflow the step is skipped and the
    scale is multiplied by ``backoff_factor``; after ``growth_interval``
    consecutive good steps it is multiplied by ``growth_factor``. The scale
    stays within ``[min_scale, max_scale]``.

    Unlike Chainer's own dynamic scaling (which starts at 1, doubles on every
    step until the first overflow and is capped at 65504 so that a halved
    scale keeps overflowing), it starts at ``init_scale`` and grows at most
    once per ``growth_interval`` steps.

    Usable on its own in a custom loop::

        scaler = DynamicLossScaler()
        loss = model(x, t)
        model.cleargrads()
        loss.backward(loss_scale=scaler.scale)
        if scaler.step(grads):          # False: overflow, skip this update
            for p in model.params():
                p.grad /= scaler.scale  # (Chainer's update rules do this)
            ...
        scaler.update()

    With ``fastchain.enable(fp16=True)`` it is attached to each optimizer set
    up while enabled, and nothing above has to be written.

    Args:
        init_scale (float): the first scale. Default 2**15, the largest power
            of two an fp16 loss can be multiplied by.
        growth_factor (float): > 1.
        backoff_factor (float): in (0, 1).
        growth_interval (int): good steps between two growths.
        min_scale (float): the scale never goes below it (> 0).
        max_scale (float): nor above it.
    """

    def __init__(self, init_scale=FP16_SAFE_SCALE, growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=1000, min_scale=1.0,
                 max_scale=2.0 ** 24):
        init_scale = _positive('init_scale', init_scale)
        min_scale = _positive('min_scale', min_scale)
        max_scale = _positive('max_scale', max_scale)
        growth_factor = _real('growth_factor', growth_factor, lambda v: v > 1, '> 1')
        backoff_factor = _real('backoff_factor', backoff_factor, lambda v: 0 < v < 1,
                               'in (0, 1)')
        if isinstance(growth_interval, bool) or \
                not isinstance(growth_interval, numbers.Integral) or growth_interval < 1:
            raise ValueError('growth_interval must be an int >= 1, got {!r}'.format(
                growth_interval))
        growth_interval = int(growth_interval)
        if not min_scale <= init_scale <= max_scale:
            raise ValueError('need min_scale <= init_scale <= max_scale, got '
                             '{} <= {} <= {}'.format(min_scale, init_scale, max_scale))
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        # Set each step by fastchain's fp16 (not saved): FP16_SAFE_SCALE when
        # the loss is float16, whose backward seed a larger scale makes inf
        # (every growth past it was a skipped step: a new-user trial).
        self.cap = None
        self.scale = float(init_scale)
        self.good_steps = 0         # consecutive steps without overflow
        self.steps = 0              # updates applied
        self.skipped_steps = 0      # updates skipped on overflow
        self.stepped = None         # last step: True applied, False skipped
        self._found_inf = None
        self._reduce = None
        self._stuck = 0             # steps skipped in a row at min_scale
        self._stuck_said = False

    def set_found_inf_reducer(self, reduce):
        """Make every process reach the same skip decision.

        Args:
            reduce (callable): ``(found_inf: bool) -> bool`` returning True if
                any process found inf/NaN (an allreduce with MAX/LOR). The
                data-parallel updater installs one; ``None`` removes it.
        """
        self._reduce = reduce

    def step(self, grads, reduce=None):
        """Check ``grads`` (an iterable of arrays, ``None`` skipped) once.

        Returns True when the update may be applied. Costs one device-to-host
        synchronisation for all gradients together. ``reduce``: a reducer for
        this step (default: the one set with :meth:`set_found_inf_reducer`).
        """
        found_inf = _any_nonfinite(grads)
        reduce = reduce or self._reduce
        if reduce is not None:
            found_inf = bool(reduce(found_inf))
        self._found_inf = found_inf
        self.stepped = not found_inf
        return self.stepped

    def update(self):
        """Adjust the scale after :meth:`step`; returns the new scale."""
        if self._found_inf is None:
            raise RuntimeError('DynamicLossScaler.update() called without a '
                               'step() since the last update()')
        if self._found_inf:
            self.skipped_steps += 1
            self.good_steps = 0
            at_min = self.scale <= self.min_scale
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self._stuck = self._stuck + 1 if at_min else 0
            if self._stuck >= STUCK_STEPS and not self._stuck_said:
                # (every step skipped, NaN losses, and only NumPy's
                # RuntimeWarnings said anything: a new-user trial)
                self._stuck_said = True
                warnings.warn(STUCK.format(self._stuck, self.min_scale), FastchainWarning,
                              stacklevel=3)
        else:
            self._stuck = 0
            self.steps += 1
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.good_steps = 0
                top = self.max_scale if self.cap is None else min(self.max_scale, self.cap)
                self.scale = max(self.scale, min(top, self.scale * self.growth_factor))
        self._found_inf = None
        return self.scale

    def serialize(self, serializer):
        """Save or load the state (Chainer's serializer protocol)."""
        for name in ('scale', 'good_steps', 'steps', 'skipped_steps'):
            value = serializer(name, getattr(self, name))
            # Loading returns numpy scalars; keep plain Python numbers.
            setattr(self, name, type(getattr(self, name))(value))
        import chainer
        if isinstance(serializer, chainer.serializer.Deserializer):
            self._within_range()

    def _within_range(self):
        """A loaded scale outside this run's ``[min_scale, max_scale]`` (the
        snapshot's run had other settings) is brought into it, and said: it
        stayed outside, and growth kept it there (a review)."""
        if self.min_scale <= self.scale <= self.max_scale:
            return
        loaded = self.scale
        self.scale = min(max(self.scale, self.min_scale), self.max_scale)
        warnings.warn(
            'fastchain: the loss scale the snapshot holds ({:g}) is outside this run\'s '
            'range [min_scale={:g}, max_scale={:g}]; going on from {:g}'.format(
                loaded, self.min_scale, self.max_scale, self.scale),
            FastchainWarning, stacklevel=_patches.user_stacklevel())

    def state_dict(self):
        return {'scale': self.scale, 'good_steps': self.good_steps,
                'steps': self.steps, 'skipped_steps': self.skipped_steps}

    def load_state_dict(self, state):
        self.scale = float(state['scale'])
        for name in ('good_steps', 'steps', 'skipped_steps'):
            setattr(self, name, int(state[name]))
        self._within_range()

    def __repr__(self):
        return ('DynamicLossScaler(scale={:g}, steps={}, skipped_steps={}, '
                'good_steps={}/{})'.format(self.scale, self.steps, self.skipped_steps,
                                           self.good_steps, self.growth_interval))


STUCK_STEPS = 5
STUCK = ('fastchain fp16: {} steps in a row were skipped at the smallest loss scale ({:g}): '
         'the gradients are inf or NaN in float16 whatever the scale, so nothing is '
         'learning. The loss or the activations overflow float16 (inputs far from unit '
         'scale, a learning rate that diverged); scale the inputs, lower the learning rate, '
         'or train in fp32 (fp16=False)')


def _real(name, value, check, what):
    """``value`` as a float (a NumPy scalar too), checked; otherwise a
    ValueError naming the option and what it takes."""
    try:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError
        number = float(value)
    except (TypeError, OverflowError):
        number = None
    if number is None or not math.isfinite(number) or not check(number):
        raise ValueError('{} must be a finite number {}, got {!r}'.format(name, what, value))
    return number


def _positive(name, value):
    return _real(name, value, lambda v: v > 0, '> 0')


def _any_nonfinite(grads):
    """True if any gradient holds inf or NaN: one host synchronisation for
    all of them (:mod:`fastchain.precision._nonfinite`)."""
    from fastchain.precision._nonfinite import any_nonfinite
    return any_nonfinite(grads)
