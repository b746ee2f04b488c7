"""A caller's ``DeviceMesh`` read as transformers' ``device_mesh=`` reads one, in one process:
the dims it names (:func:`~hp_dcp_hf.parallel.caller_mesh_dims`) and whether it carries a
``distributed_config``'s sizes (:func:`~hp_dcp_hf.parallel.check_caller_mesh`); each wrong mesh is
a ``MeshSpecError`` that names what is wrong."""

from __future__ import annotations

import pytest

from hp_dcp_hf.errors import MeshSpecError
from hp_dcp_hf.parallel import caller_mesh_dims, check_caller_mesh


@pytest.mark.parametrize(("names", "shape", "dims"), [
    (None, (4,), {"tp": (None, 4)}),  # transformers: a 1-D mesh is the tensor parallel mesh
    (("tp",), (2,), {"tp": ("tp", 2)}),
    (("dp",), (2,), {"dp": ("dp", 2)}),
    (("dp", "tp"), (1, 2), {"dp": ("dp", 1), "tp": ("tp", 2)}),
    (("fsdp", "tp"), (2, 2), {"dp": ("fsdp", 2), "tp": ("tp", 2)}),  # transformers' name of FSDP's dim
    (("dp_replicate", "dp", "tp"), (2, 1, 2), {"dp_replicate": ("dp_replicate", 2), "dp": ("dp", 1), "tp": ("tp", 2)}),
])
def test_dims_of_a_mesh(names, shape, dims):
    assert caller_mesh_dims(names, shape) == dims


@pytest.mark.parametrize(("names", "shape", "message"), [
    (None, (1, 2), "has no mesh_dim_names"),
    (("dp", "tq"), (1, 2), "unknown dim 'tq' (did you mean tp?)"),
    (("dp_shard", "tp"), (1, 2), "unknown dim 'dp_shard' (did you mean dp?)"),
    (("dp", "fsdp"), (1, 2), "name dp twice"),
    (("tp", "dp"), (2, 1), "out of order: outermost first, ('dp', 'tp')"),
])
def test_a_wrong_mesh_is_named(names, shape, message):
    with pytest.raises(MeshSpecError, match=r"device_mesh") as raised:
        caller_mesh_dims(names, shape)
    assert message in str(raised.value)


def test_a_mesh_carries_the_sizes_of_its_config():
    dims = caller_mesh_dims(("dp", "tp"), (2, 2))
    check_caller_mesh(dims, {"dp": 2, "tp": 2})
    check_caller_mesh(caller_mesh_dims(("dp_replicate", "dp"), (2, 1)), {"dp_replicate": 2})
    with pytest.raises(MeshSpecError, match=r"device_mesh has dp=2 where distributed_config asks dp=4"):
        check_caller_mesh(dims, {"dp": 4, "tp": 2})
    with pytest.raises(MeshSpecError, match=r"has dp=4, tp=1 where distributed_config asks dp=1, tp=4"):
        check_caller_mesh(caller_mesh_dims(("dp",), (4,)), {"tp": 4})
    with pytest.raises(MeshSpecError, match=r"ep=2 with device_mesh="):
        check_caller_mesh(dims, {"dp": 2, "tp": 2, "ep": 2})
    with pytest.raises(MeshSpecError, match=r"dp_replicate needs a dp \(or fsdp\) dim"):
        check_caller_mesh(caller_mesh_dims(("dp_replicate", "tp"), (2, 2)), {"dp_replicate": 2, "tp": 2})
