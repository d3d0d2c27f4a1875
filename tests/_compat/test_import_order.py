"""``import chainer`` works in a fresh interpreter whatever the import order."""

import pytest

TRAIN = '''
import {first}, {second}
import numpy as np
import chainer, chainer.links as L, chainer.functions as F
from chainer import training
rng = np.random.RandomState(0)
x = rng.randn(256, 4).astype(np.float32)
t = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
model = L.Classifier(L.Linear(4, 2))
opt = chainer.optimizers.SGD(lr=0.5).setup(model)
it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), 32)
trainer = training.Trainer(training.StandardUpdater(it, opt), (5, 'epoch'),
                           out='{out}')
log = training.extensions.LogReport(trigger=(1, 'epoch'))
trainer.extend(log)
trainer.run()
print(log.log[0]['main/accuracy'], log.log[-1]['main/accuracy'])
'''


@pytest.mark.parametrize('first,second', [('chainer', 'fastchain'),
                                          ('fastchain', 'chainer')])
def test_training_loop_in_either_import_order(python, tmp_path, first, second):
    out = python(TRAIN.format(first=first, second=second, out=tmp_path))
    before, after = map(float, out.stdout.split())
    assert after > 0.9 and after > before


def test_importing_fastchain_is_enough_without_the_pth_file(python):
    # `python -S` skips site-packages' .pth files (so do `pip install
    # --target` on PYTHONPATH and zipapps): importing fastchain before Chainer
    # must then be enough (it was not: Chainer failed on NumPy 2 with
    # NumPy's own error).
    import sysconfig
    code = '''
import sys
sys.path.append({!r})
assert not any(type(f).__name__ == '_ChainerShimFinder' for f in sys.meta_path)
import fastchain
import fastchain._compat as c
assert c.installed()
import chainer.functions.array.as_strided
print(sorted({{a["name"] for a in c.applied()}}))
'''.format(sysconfig.get_paths()['purelib'])
    import subprocess
    import sys
    out = subprocess.run([sys.executable, '-S', '-c', code], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import numpy
    if not hasattr(numpy, 'sctypes'):
        assert 'numpy.sctypes' in out.stdout


def test_the_hook_costs_little_at_interpreter_start(python):
    # The .pth imports the finder at every start; it must not pull in heavy
    # modules (importlib.abc, threading, numpy, chainer).
    out = python('import sys; print(" ".join(sorted(sys.modules)))')
    loaded = set(out.stdout.split())
    for heavy in ('numpy', 'chainer', 'importlib.abc', 'threading'):
        assert heavy not in loaded, heavy
    # the finder is in place, and the fastchain imported to put it there let
    # go of (see the next test)
    out = python('import sys; print([type(f).__name__ for f in sys.meta_path][0], '
                 'sorted(m for m in sys.modules if m.startswith("fastchain")))')
    assert out.stdout.split() == ['_ChainerShimFinder', '[]'], out.stdout


def test_a_checkout_in_the_current_folder_comes_before_the_installed_copy(tmp_path):
    # The .pth file imported the installed fastchain at start, so `python
    # script.py` or `python -m pytest` in another checkout silently ran the
    # installed one. The shims still apply to Chainer imported there.
    import os
    import shutil
    import subprocess
    import sys
    import fastchain
    shutil.copytree(os.path.dirname(fastchain.__file__), tmp_path / 'fastchain',
                    ignore=shutil.ignore_patterns('__pycache__'))
    with open(tmp_path / 'fastchain' / '__init__.py', 'a') as f:
        f.write('HERE = True\n')
    (tmp_path / 'script.py').write_text(
        'import fastchain\nprint(getattr(fastchain, "HERE", False))\n'
        'import sys, numpy, chainer.functions\n'
        'print(any(type(f).__name__ == "_ChainerShimFinder" for f in sys.meta_path))\n')
    out = subprocess.run([sys.executable, 'script.py'], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ['True', 'True']
