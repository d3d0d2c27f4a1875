"""Units of fastchain.static._fixes that need no model: how the last
function's retained arrays are marked for the replay."""

import types

import numpy

from fastchain.static import _fixes


class _Info:
    def __init__(self):
        self.retain = False

    def was_deleted(self):
        return False


def _schedule(*arrays):
    node = types.SimpleNamespace(
        get_retained_inputs=lambda: tuple(types.SimpleNamespace(data=a) for a in arrays),
        get_retained_outputs=lambda: None)
    infos = [_Info() for _ in arrays]
    return types.SimpleNamespace(
        schedule_info_list=[types.SimpleNamespace(function_node=node)],
        array_id_to_unique_index={id(a): i for i, a in enumerate(arrays)},
        unique_array_infos=infos), infos


class CupyLike:
    """CuPy 14's flags: c_contiguous, f_contiguous, owndata; no writeable."""

    def __init__(self, owndata):
        self.flags = types.SimpleNamespace(c_contiguous=True, f_contiguous=False,
                                           owndata=owndata)


def test_the_last_functions_own_arrays_are_retained_cupys_too():
    readonly = numpy.zeros(3)
    readonly.flags.writeable = False
    base = numpy.zeros(4)
    arrays = (numpy.zeros(3), readonly, base[1:], CupyLike(True), CupyLike(False))
    schedule, infos = _schedule(*arrays)
    _fixes._retain_last(schedule)
    assert [i.retain for i in infos] == [True, False, False, True, False]
