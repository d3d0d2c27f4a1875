"""Function points: one dispatcher per attribute, the layers on it, in order."""

import functools
import weakref

from fastchain.config._patches._common import MISSING as _MISSING, lock as _lock, object_points
from fastchain.config._patches._copies import _guard, _unguard

ORDER = ('nvtx', 'autotune', 'distributed', 'static_graph', 'fused_update', 'cpu_conv', 'onednn',
         'cudnn', 'fp16', 'loader')
_RANK = {name: i for i, name in enumerate(ORDER)}
_class_points = {}                              # (owner, name) -> Point
_object_points = object_points                  # obj -> {name: Point}
_orphans = weakref.WeakSet()    # points replaced in their registry, maybe still called


def _is_object(owner):
    import types
    return not isinstance(owner, (type, types.ModuleType))


def _label(owner, name):
    base = getattr(owner, '__qualname__', None) or getattr(owner, '__name__', None) \
        or type(owner).__name__
    return '{}.{}'.format(base, name)


class Point:
    """One function attribute (or a class's property: its getter) fastchain
    dispatches through."""

    __slots__ = ('_owner', 'name', 'label', 'is_object', 'had_own', 'own', 'original',
                 'layers', 'composed', 'dispatch', 'value', 'successor', '__weakref__')

    def __init__(self, owner, name):
        self.is_object = _is_object(owner)
        self._owner = weakref.ref(owner) if self.is_object else owner
        self.name = name
        self.label = _label(owner if not self.is_object else type(owner), name)
        own = vars(owner).get(name, _MISSING)
        self.had_own = own is not _MISSING
        self.own = own
        prop = None
        if not self.is_object:
            found = own if self.had_own else getattr(owner, name, None)
            prop = found if isinstance(found, property) else None
        if prop is not None:
            self.original = prop.fget               # the layers wrap the getter
        elif self.had_own:
            self.original = own
        elif self.is_object:
            # Looked up on the class at call time, bound to the object.
            ref = self._owner

            def through_class(*args, **kwargs):
                obj = ref()
                return getattr(type(obj), name)(obj, *args, **kwargs)
            self.original = through_class
        elif hasattr(owner, name):
            self.original = getattr(owner, name)    # inherited: resolved now
        else:
            import builtins                         # a module's builtin (print)
            self.original = getattr(builtins, name)
        self.layers = {}
        self.composed = self.original
        self.successor = None       # the point that took over, if replaced
        point = self

        def dispatch(*args, **kwargs):
            return point.composed(*args, **kwargs)
        target = self.original if self.had_own or not self.is_object else \
            getattr(type(owner), name, None)
        if callable(target):
            functools.update_wrapper(dispatch, target)
        dispatch.__wrapped__ = self.original
        self.dispatch = dispatch
        self.value = dispatch if prop is None else \
            property(dispatch, prop.fset, prop.fdel, prop.__doc__)

    @property
    def owner(self):
        return self._owner() if self.is_object else self._owner

    def current(self):
        owner = self.owner
        return _MISSING if owner is None else vars(owner).get(self.name, _MISSING)

    def installed(self):
        """The attribute holds this point's dispatcher."""
        return self.current() is self.value

    def reachable(self):
        """A call of the attribute reaches the dispatcher: it is the
        dispatcher, or a patch that leads to it (see :func:`_leads_to`)."""
        current = self.current()
        if isinstance(current, property):
            current = current.fget
        return _leads_to(current, self.dispatch)

    def order(self):
        """The layer names on this point, outermost first."""
        return sorted(self.layers, key=_RANK.__getitem__)

    def _compose(self):
        call = self.original
        for name in reversed(self.order()):
            call = functools.partial(self.layers[name], call)
        self.composed = call

    def _install(self):
        setattr(self.owner, self.name, self.value)
        if self.is_object:
            _guard(self.owner)

    def _restore(self):
        owner = self.owner
        if owner is None:
            return
        if self.had_own:
            setattr(owner, self.name, self.own)
        else:
            delattr(owner, self.name)
        if self.is_object:
            _unguard(owner)

    def __repr__(self):
        return '<fastchain point {} [{}]>'.format(self.label, ', '.join(self.order()))


def _leads_to(fn, target, depth=4):
    """Whether calling ``fn`` may call ``target``: it is ``target``, or refers
    to it through ``__wrapped__`` (functools.wraps), a bound method, a
    partial, a closure, a default argument or a global it names, up to
    ``depth`` patches deep. A patch that hides it otherwise is taken as a
    replacement of fastchain's dispatcher."""
    if fn is target:
        return True
    if depth == 0 or not isinstance(fn, _FUNCTIONS):
        return False
    found = []
    for attr in ('__wrapped__', '__func__'):
        found.append(getattr(fn, attr, None))
    if isinstance(fn, functools.partial):
        found += [fn.func, *fn.args, *fn.keywords.values()]
    for cell in getattr(fn, '__closure__', None) or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:      # an empty cell
            pass
    found += list(getattr(fn, '__defaults__', None) or ())
    found += list((getattr(fn, '__kwdefaults__', None) or {}).values())
    code, names = getattr(fn, '__code__', None), getattr(fn, '__globals__', {})
    if code is not None:
        found += [names[n] for n in code.co_names if n in names]
    return any(_leads_to(f, target, depth - 1) for f in found if f is not None)


def _function_types():
    import types
    return (types.FunctionType, types.MethodType, functools.partial)


_FUNCTIONS = _function_types()


def _registry(owner, create):
    if _is_object(owner):
        points = _object_points.get(owner)
        if points is None and create:
            points = _object_points[owner] = {}
        return points
    return _ClassPoints(owner)


class _ClassPoints:
    """The class/module points of one owner, as a mapping by name."""

    def __init__(self, owner):
        self.owner = owner

    def get(self, name):
        return _class_points.get((self.owner, name))

    def __setitem__(self, name, point):
        _class_points[(self.owner, name)] = point

    def pop(self, name, default=None):
        return _class_points.pop((self.owner, name), default)


def _point(owner, name, create):
    points = _registry(owner, create)
    point = None if points is None else points.get(name)
    if point is not None and not point.layers and not point.reachable() \
            and point.current() is not point.own:
        # A dormant dispatcher that nothing calls any more (its attribute was
        # replaced by something that does not wrap it): start afresh. One
        # whose attribute is back to what it wrapped is used again, so a
        # layer removed and added again leaves the very same function there.
        points.pop(name, None)
        _orphans.add(point)
        point = None
    if point is not None and create and point.layers and not point.reachable():
        # Replaced while it had layers (someone set the attribute to what
        # does not lead to the dispatcher): the layers go on top of what is
        # there now; the old dispatcher passes through wherever it is called.
        new = Point(owner, name)
        new.layers, point.layers = point.layers, {}
        point._compose()
        new._compose()
        new._install()
        point.successor = new
        _orphans.add(point)
        points[name] = point = new
    if point is None and create:
        point = Point(owner, name)
        points[name] = point
    return point


def _check_layer(layer):
    if layer not in _RANK:
        raise ValueError('unknown layer {!r}; layers are {}'.format(layer, ', '.join(ORDER)))


def wrap(owner, name, layer, fn):
    """Put ``fn`` on ``owner.name`` as layer ``layer`` (replacing that layer's
    previous function there, if any); returns the point."""
    _check_layer(layer)
    with _lock:
        point = _point(owner, name, create=True)
        point.layers[layer] = fn
        point._compose()
        if not point.reachable():
            point._install()
        return point


def unwrap(owner, name, layer, point=None):
    """Take layer ``layer`` off ``owner.name`` (no-op if it is not there).

    ``point``: the point the layer was put on (a newer point may have been
    made on the same attribute since). Returns True if a layer was removed.
    """
    with _lock:
        point = point or _point(owner, name, create=False)
        while point is not None and point.successor is not None:
            point = point.successor
        if point is None or point.layers.pop(layer, None) is None:
            return False
        point._compose()
        if not point.layers:
            _retire(point)
        return True


def _retire(point):
    if point.installed():
        point._restore()    # kept in the registry, to be used again
    # else: someone's patch wraps the dispatcher; it stays as a pass-through


def layers(owner, name):
    """The layer names on ``owner.name`` now, outermost first."""
    with _lock:
        point = _point(owner, name, create=False)
        return [] if point is None else point.order()


def in_force(owner, name, layer):
    """The function of layer ``layer`` on ``owner.name`` if a call of the
    attribute reaches it now, else None (for reports: the truth)."""
    with _lock:
        point = _point(owner, name, create=False)
        if point is None or layer not in point.layers or not point.reachable():
            return None
        return point.layers[layer]


def sweep():
    """Restore the attributes whose dispatcher has no layer and is back in
    place (each restore may put back an older dispatcher: repeat)."""
    with _lock:
        changed = True
        while changed:
            changed = False
            candidates = list(_class_points.values()) + list(_orphans)
            for points in list(_object_points.values()):
                candidates += list(points.values())
            for point in candidates:
                if not point.layers and point.installed():
                    _retire(point)
                    changed = True


def points():
    """Every point with a layer, as ``{label: [layers]}`` (for doctor and tests)."""
    with _lock:
        found = {}
        for point in _class_points.values():
            if point.layers:
                found[point.label] = point.order()
        return found
