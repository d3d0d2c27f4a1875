"""What the parts of :mod:`fastchain.config._patches` share."""

import os
import threading
import weakref

MISSING = object()      # an attribute or value that was not there
lock = threading.RLock()
object_points = weakref.WeakKeyDictionary()     # obj -> {name: Point} (_points)
left_out = weakref.WeakKeyDictionary()          # obj -> attribute names its copies leave out
carried = weakref.WeakKeyDictionary()           # obj -> {name: value} its copies carry


def user_stacklevel():
    """The ``stacklevel`` for a warning raised here that names the first
    frame outside fastchain and Chainer (the user's call)."""
    import sys
    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in _skipped_modules())
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def _skipped_modules():
    import chainer
    import fastchain
    return (fastchain, chainer)
