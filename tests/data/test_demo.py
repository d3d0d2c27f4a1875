"""The demo dataset: made once per setting, never left half made."""

import json
import os

import pytest

from fastchain.data import _demo
from fastchain.data import make_demo_dataset


def files(root):
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, 'rb') as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def test_a_set_is_made_once_and_an_interrupted_remaking_is_made_again(tmp_path, monkeypatch):
    """Stopped while making a set of another size, the old stamp stayed: the
    next run at the old size trained on a mix of both sets."""
    small = dict(n_train=3, n_val=1, size=(20, 30), classes=2)
    root = str(tmp_path / 'demo')
    make_demo_dataset(root, **small)
    made = files(root)
    assert json.loads(made['dataset.json'])['size'] == [20, 30]
    assert not [name for name in made if name.endswith('.part')]
    stamp = os.path.join(root, 'dataset.json')
    before = os.path.getmtime(stamp)
    make_demo_dataset(root, **small)            # same setting: left as it is
    assert os.path.getmtime(stamp) == before and files(root) == made

    calls = []
    real = _demo.make_image

    def stopped(*args):
        calls.append(args)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(_demo, 'make_image', stopped)
    with pytest.raises(KeyboardInterrupt):
        make_demo_dataset(root, **dict(small, size=(40, 60)))
    monkeypatch.setattr(_demo, 'make_image', real)
    assert not os.path.exists(stamp)            # no stamp: not taken for either set
    make_demo_dataset(root, **small)
    assert files(root) == made
