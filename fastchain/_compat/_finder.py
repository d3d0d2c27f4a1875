"""The meta-path finder that applies the Chainer shims on first import.

Kept free of imports that are not already loaded at interpreter start (not
even ``importlib.abc``, which costs ~25 ms): it is imported at every start by
``fastchain-compat.pth``. The shim table is imported only when a module it
may concern is being imported.
"""

import os
import sys
import _thread  # not `threading`: that costs ~4 ms at every interpreter start

# Top-level packages whose modules may be shimmed. Anything else is passed
# through at the cost of one string comparison.
_ROOTS = ('chainer', 'chainermn')
_TARGET_VERSION = '7.8.1'

_lock = _thread.RLock()
_applied = []           # [(shim name, module, why)] in the order applied
_version_cache = {}     # chainer package dir -> version string or None


def applied():
    """Shims applied in this process, as a list of dicts (name, module, why)."""
    finder = _installed_finder()
    lock, record = (finder.lock, finder.applied) if finder is not None else (_lock, _applied)
    with lock:
        return [dict(name=n, module=m, why=w) for n, m, w in record]


def installed():
    """Whether the finder is on ``sys.meta_path``."""
    return _installed_finder() is not None


def _installed_finder():
    # By name, not class: the finder installed at start belongs to the copy
    # of this module the .pth file imported, which at_start() let go of.
    return next((f for f in sys.meta_path if type(f).__name__ == '_ChainerShimFinder'), None)


def at_start():
    """Run by ``fastchain-compat.pth`` at interpreter start: install the
    finder, then forget the fastchain modules imported to get here, so that
    a later ``import fastchain`` resolves on the ``sys.path`` of that moment,
    as for any package: a checkout in the script's folder or the current one
    comes before the installed copy (it was silently shadowed by it)."""
    install()
    ours = ('fastchain', 'fastchain._compat', 'fastchain._compat._finder')
    if {m for m in sys.modules if m == 'fastchain' or m.startswith('fastchain.')} == \
            set(ours):      # nothing else of fastchain imported yet (site.addsitedir later)
        for name in ours:
            del sys.modules[name]


def install():
    """Put the finder first on ``sys.meta_path`` (idempotent).

    If Chainer was imported before the finder existed (e.g. under
    ``python -S``), the shims that can still be applied after the fact are
    applied at once.

    ``FASTCHAIN_NO_COMPAT=1`` in the environment turns the hook off (to
    compare with plain Chainer, or to rule fastchain out of a problem).
    """
    if os.environ.get('FASTCHAIN_NO_COMPAT') == '1':
        return
    with _lock:
        if installed():
            return
        sys.meta_path.insert(0, _ChainerShimFinder())
    for name in list(sys.modules):
        if name.split('.', 1)[0] in _ROOTS:
            module = sys.modules.get(name)
            if module is not None:
                _after_exec(name, module, late=True)


def _chainer_version(chainer_dir):
    """The ``__version__`` in ``chainer/_version.py``, read without importing."""
    if chainer_dir not in _version_cache:
        version = None
        try:
            with open(os.path.join(chainer_dir, '_version.py')) as f:
                for line in f:
                    if line.startswith('__version__'):
                        version = line.split('=', 1)[1].strip().strip('\'"')
                        break
        except OSError:
            pass
        _version_cache[chainer_dir] = version
    return _version_cache[chainer_dir]


def _is_target_chainer():
    """True when the ``chainer`` importable here is release 7.8.1."""
    chainer = sys.modules.get('chainer')
    if chainer is not None and getattr(chainer, '__file__', None):
        return _chainer_version(os.path.dirname(chainer.__file__)) == \
            _TARGET_VERSION
    for finder in sys.meta_path:
        if isinstance(finder, _ChainerShimFinder):
            continue
        find = getattr(finder, 'find_spec', None)
        spec = find('chainer', None) if find else None
        if spec is not None and spec.submodule_search_locations:
            return _chainer_version(
                list(spec.submodule_search_locations)[0]) == _TARGET_VERSION
    return False


def _shims_for(fullname):
    if fullname.split('.', 1)[0] not in _ROOTS:
        return []
    from fastchain._compat import _shims
    return [s for s in _shims.SHIMS if s.module == fullname and s.needed()]


def _after_exec(fullname, module, late=False):
    """Run the shims' ``after`` steps and record them as applied.

    ``late``: the module ran before the finder was installed, so only shims
    that work after the fact (no source rewrite) can still apply.
    """
    for shim in _shims_for(fullname):
        if late and (shim.rewrites or shim.inject):
            continue
        if not _is_target_chainer():
            return
        with _lock:
            seen = any(n == shim.name and m == fullname for n, m, _ in _applied)
            if late and seen:
                continue
            # Every run of the module's code gets its fix (importlib.reload
            # runs it again, and lost the fix when it was kept to the first).
            shim.after(module)
            if not seen:
                _applied.append((shim.name, fullname, shim.why))


class _ShimLoader:
    """Wraps the real loader: compiles the rewritten source, then runs ``after``."""

    def __init__(self, loader, shims):
        self._loader = loader
        self._shims = shims

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        rewriting = [s for s in self._shims if s.rewrites or s.inject]
        if not rewriting:
            self._loader.exec_module(module)
        else:
            # Compile the rewritten source under the real file name, so that
            # tracebacks and debuggers still point at Chainer's own lines.
            source = self._loader.get_source(module.__name__)
            for shim in rewriting:
                source = shim.rewrite(source)
                module.__dict__.update(shim.inject)
            filename = module.__spec__.origin
            exec(compile(source, filename, 'exec', dont_inherit=True),
                 module.__dict__)
        _after_exec(module.__name__, module)

    def __getattr__(self, name):
        # get_source, get_code, is_package, ... go to the real loader.
        return getattr(self._loader, name)


class _ChainerShimFinder:
    """Finds nothing itself; wraps the loader of shimmed Chainer modules."""

    _active = _thread._local()
    lock, applied = _lock, _applied     # what applied() reads from any copy of this module

    def find_spec(self, fullname, path, target=None):
        if fullname.split('.', 1)[0] not in _ROOTS:
            return None
        if getattr(self._active, 'busy', False):
            return None
        self._active.busy = True
        try:
            shims = _shims_for(fullname)
            if not shims or not _is_target_chainer():
                return None
            spec = None
            for finder in sys.meta_path:
                if finder is self:
                    continue
                find = getattr(finder, 'find_spec', None)
                if find is not None:
                    spec = find(fullname, path, target)
                    if spec is not None:
                        break
            if spec is None or spec.loader is None:
                return None
            spec.loader = _ShimLoader(spec.loader, shims)
            return spec
        finally:
            self._active.busy = False
