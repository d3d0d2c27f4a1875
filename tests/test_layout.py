"""The package's layout: no module over 400 lines, no import cycle between
modules (imports inside functions count too: a cycle hidden in a function is
still two modules that need each other)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / 'fastchain'


def modules():
    """{dotted name: path} of every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob('*.py')):
        parts = path.relative_to(ROOT).with_suffix('').parts
        if parts[-1] == '__init__':
            parts = parts[:-1]
        found['.'.join(parts)] = path
    return found


def imports(path, known):
    """The package's modules that the module at ``path`` names in an import."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + ['{}.{}'.format(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name in known:
                found.add(name)
    return found


def find_cycle(graph):
    state = {}

    def visit(module, path):
        state[module] = 'open'
        for dep in sorted(graph[module]):
            if state.get(dep) == 'open':
                return path[path.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep, path + [dep])
                if cycle:
                    return cycle
        state[module] = 'done'
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return None


def graph():
    known = modules()
    edges = {}
    for name, path in known.items():
        deps = imports(path, known)
        # A package's __init__ re-exporting its own modules is how packages
        # work, not a cycle between modules: leave package -> own child out.
        edges[name] = {d for d in deps if d != name and not d.startswith(name + '.')}
    return edges


def test_no_module_is_over_400_lines():
    long = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {n: k for n, k in long.items() if k > 400} == {}


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, ' -> '.join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
    assert find_cycle({'a': {'b'}, 'b': set()}) is None
