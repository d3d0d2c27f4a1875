"""The layout of fastchain.distributed: no import cycle between its modules
(counting imports inside functions too; tests/test_layout.py checks the whole
package and the modules' length), the factory the only module that knows every
strategy, each importable on its own."""

import ast
import pathlib
import subprocess
import sys

import pytest

from tests.test_layout import find_cycle

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / 'fastchain' / 'distributed'
MODULES = sorted(p.stem for p in PACKAGE.glob('*.py') if p.name != '__init__.py')


def imports_within_the_package(module):
    """The package's modules that ``module`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse((PACKAGE / (module + '.py')).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == 'fastchain.distributed':
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.startswith('fastchain.distributed.'):
            found.add(node.module.split('.')[2])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split('.')[2] for alias in node.names
                      if alias.name.startswith('fastchain.distributed.')}
    return found & set(MODULES)


def test_no_import_cycle_between_the_modules():
    graph = {m: imports_within_the_package(m) for m in MODULES}
    assert find_cycle(graph) is None, ' -> '.join(find_cycle(graph))
    # The factory is the only module that knows every strategy.
    assert {m for m in MODULES if {'_mpi', '_nccl'} <= graph[m]} == {'_factory'}


@pytest.mark.parametrize('module', MODULES)
def test_each_module_imports_in_a_fresh_interpreter(module):
    r = subprocess.run([sys.executable, '-c', 'import fastchain.distributed.' + module],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
