"""Plain local shards (torch's ``CheckpointableTensor`` protocol) in one process: the geometry a
tensor states becomes its pieces, bad geometry is a typed error, replicas are found from the ranks'
geometries, and a load and a save through them are exact.

The protocol's own class is used where the installed packages have it (torch 2.14's
``torch.distributed.checkpoint.protocol``, torch_checkpointing's); the tensors themselves are
duck-typed, as the protocol is.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from hp_dcp_hf.errors import LayoutError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.geometry.replicas import ReplicaGroups, ShardGeometry
from hp_dcp_hf.geometry.shards import (
    ShardPiece,
    checkpointable_pieces,
    global_shape,
    held_views,
    is_checkpointable,
    keep_shard_geometry,
    local_shard_pieces,
    local_tensor,
    mark_checkpointable,
)
from tests.support.models import replace_parameters

PROTOCOL_MODULES = ("torch.distributed.checkpoint.protocol", "torch_checkpointing.checkpointable")


def _protocols() -> list[type]:
    found = []
    for name in PROTOCOL_MODULES:
        try:
            found.append(importlib.import_module(name).CheckpointableTensor)
        except ImportError:
            continue
    return found


def _two_shards_padded() -> torch.Tensor:
    """Rows 0-2 and 7-9 of a (10, 4) tensor, at local rows 0 and 4 of a (7, 4) buffer: row 3 and
    row 6 are padding."""
    buffer = torch.zeros(7, 4)
    return mark_checkpointable(buffer, (10, 4), [(0, 0), (7, 0)], [(0, 0), (4, 0)], [(3, 4), (2, 4)])


def test_the_protocol_classes_recognise_the_duck_typed_tensor():
    tensor = _two_shards_padded()
    protocols = _protocols()
    assert protocols, "torch_checkpointing is installed: its protocol must be found"
    for protocol in protocols:
        assert isinstance(tensor, protocol)
        assert not isinstance(torch.zeros(2), protocol)
    assert is_checkpointable(tensor) and not is_checkpointable(torch.zeros(2))
    partly = torch.zeros(2)
    partly.global_shape, partly.global_offsets = (4,), ((0,),)
    assert not is_checkpointable(partly)  # all four attributes, or it is a plain tensor


def test_pieces_of_several_shards_with_padding():
    tensor = _two_shards_padded()
    assert global_shape(tensor) == (10, 4)
    assert local_shard_pieces(tensor) == (ShardPiece(Box((0, 0), (3, 4)), (0, 0)),
                                          ShardPiece(Box((7, 0), (2, 4)), (4, 0)))
    assert [tuple(v.shape) for v in held_views(tensor)] == [(3, 4), (2, 4)]


def test_pieces_are_sorted_by_local_offset_and_empty_shards_dropped():
    pieces = checkpointable_pieces((6, 6), ((0, 3), (2, 0), (5, 5)), ((0, 4), (0, 0), (3, 3)),
                                   ((2, 3), (2, 4), (0, 1)), (3, 7))
    assert pieces == (ShardPiece(Box((2, 0), (2, 4)), (0, 0)), ShardPiece(Box((0, 3), (2, 3)), (0, 4)))


@pytest.mark.parametrize(("fields", "words"), [
    (((4,), ((0,), (1,)), ((0,), (2,)), ((2,), (2,)), (4,)), "overlap in the global tensor"),
    (((4,), ((0,), (2,)), ((0,), (1,)), ((2,), (2,)), (4,)), "overlap in the local tensor"),
    (((4,), ((3,),), ((0,),), ((2,),), (4,)), "exceeds global_shape"),
    (((4,), ((0,),), ((3,),), ((2,),), (4,)), "exceeds the local tensor"),
    (((4,), ((0,), (2,)), ((0,),), ((2,), (2,)), (4,)), "one each per shard"),
    (((4, 4), ((0,),), ((0,),), ((2,),), (4, 4)), "must each have 2 entries"),
    (((4, 4), ((0, 0),), ((0, 0),), ((2, 2),), (4,)), "differ in rank"),
])
def test_bad_geometry_is_a_layout_error(fields, words):
    with pytest.raises(LayoutError, match=words) as info:
        checkpointable_pieces(*fields, key="w")
    assert info.value.key == "w"


def test_mark_checkpointable_checks_against_the_local_tensor():
    with pytest.raises(LayoutError, match="exceeds the local tensor"):
        mark_checkpointable(torch.zeros(3, 4), (10, 4), [(0, 0)], [(0, 0)], [(4, 4)])


def test_local_tensor_of_a_parameter_is_writable_in_place():
    param = torch.nn.Parameter(torch.zeros(4))
    mark_checkpointable(param, (8,), [(4,)], [(0,)], [(4,)])
    local = local_tensor(param)
    local[1:3].copy_(torch.ones(2))  # a leaf that requires grad refuses this, its detached view does not
    assert param.data.tolist() == [0, 1, 1, 0]


def test_keep_shard_geometry_copies_the_attributes_into_state_dict():
    model = torch.nn.Linear(4, 3, bias=False)
    model.weight = torch.nn.Parameter(torch.zeros(2, 4))
    mark_checkpointable(model.weight, (3, 4), [(1, 0)], [(0, 0)], [(2, 4)])
    assert not is_checkpointable(model.state_dict()["weight"])
    keep_shard_geometry(keep_shard_geometry(model))
    entry = model.state_dict()["weight"]
    assert is_checkpointable(entry) and entry.global_offsets == ((1, 0),)
    assert entry.data_ptr() == model.weight.data_ptr()


def _rank_tensors(boxes_per_rank: list[list[tuple[int, int]]], rows: int = 12) -> list[torch.Tensor]:
    """1-d tensors of ``rows`` elements; rank ``r`` holds the (offset, size) shards listed, packed
    with one padding element after each."""
    tensors = []
    for boxes in boxes_per_rank:
        local_offsets, at = [], 0
        for _, size in boxes:
            local_offsets.append((at,))
            at += size + 1
        tensors.append(mark_checkpointable(torch.zeros(at), (rows,), [(o,) for o, _ in boxes], local_offsets,
                                           [(s,) for _, s in boxes]))
    return tensors


def _groups(tensors: list[torch.Tensor], name: str = "w") -> list[ReplicaGroups]:
    shards = [ShardGeometry.of({name: t, "plain": torch.zeros(1)}) for t in tensors]
    groups = [ReplicaGroups(r, len(tensors), [{}] * len(tensors), shards=shards) for r in range(len(tensors))]
    for g in groups:
        g.name_positions([name])
    return groups


def test_replicas_are_the_ranks_of_the_same_geometry():
    tensors = _rank_tensors([[(0, 3), (6, 3)], [(3, 3), (9, 3)], [(0, 3), (6, 3)], [(3, 3), (9, 3)]])
    groups = _groups(tensors)
    assert [g.group(t, "w") for g, t in zip(groups, tensors)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert groups[0].group(torch.zeros(1), "plain") == (0, 1, 2, 3)


def test_a_shard_several_ranks_list_is_written_once():
    # rank 1 holds (0, 3) like rank 0 but also (3, 2); rank 2 holds (5, 7) alone: partial replicas
    tensors = _rank_tensors([[(0, 3)], [(0, 3), (3, 2)], [(5, 7)]])
    groups = _groups(tensors)
    for ordinal in range(3):
        written = [p.global_box for g, t in zip(groups, tensors) for p in g.written_pieces(t, ordinal, "w")]
        assert sorted(written, key=lambda b: b.offsets) == [Box((0,), (3,)), Box((3,), (2,)), Box((5,), (7,))]
    # the shared shard goes to each of its holders for some tensor ordinal: replicas share the writing
    writers = {ordinal: [r for r, (g, t) in enumerate(zip(groups, tensors))
                         if Box((0,), (3,)) in [p.global_box for p in g.written_pieces(t, ordinal, "w")]]
               for ordinal in range(2)}
    assert sorted(w for ws in writers.values() for w in ws) == [0, 1]
    # ranks that differ but are not identical share no reads
    assert [g.group(t, "w") for g, t in zip(groups, tensors)] == [(0,), (1,), (2,)]


def test_without_the_ranks_geometry_a_rank_writes_all_its_shards():
    (tensor,) = _rank_tensors([[(0, 3), (5, 2)]])
    groups = ReplicaGroups(0, 2, [{}, {}])
    assert groups.group(tensor, "w") == (0,)
    assert len(groups.written_pieces(tensor, 0, "w")) == 2


# -- one process holding every shard: load and save exact ----------------------------------------------


def _shard_rows(model: torch.nn.Module, pad: int = 1) -> None:
    """Every parameter becomes a protocol tensor of two shards (its rows cut unevenly, the second
    first in the buffer), ``pad`` padding rows after each; tied parameters stay one."""

    def make(param: torch.nn.Parameter) -> torch.nn.Parameter:
        rows = param.shape[0]
        cut = max(1, rows // 3)
        rest = tuple(param.shape[1:])
        zero = (0,) * len(rest)
        buffer = torch.full((rows + 2 * pad, *rest), float("nan"), dtype=param.dtype)
        new = torch.nn.Parameter(buffer, requires_grad=param.requires_grad)
        mark_checkpointable(new, tuple(param.shape), [(cut, *zero), (0, *zero)],
                            [(0, *zero), (rows - cut + pad, *zero)], [(rows - cut, *rest), (cut, *rest)])
        return new

    replace_parameters(model, make)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    out = torch.empty(global_shape(tensor), dtype=tensor.dtype)
    for piece in local_shard_pieces(tensor):
        out[piece.global_box.slices()] = local_tensor(tensor)[piece.local_box().slices()]
    return out


def _tensor_data_bytes(file) -> int:
    """A safetensors file's size less its 8-byte length and header."""
    with open(file, "rb") as handle:
        return os.path.getsize(file) - 8 - int.from_bytes(handle.read(8), "little")


def test_one_process_loads_and_saves_protocol_shards_exactly(tmp_path):
    from hp_dcp_hf import HFStorageReader, load_hf_checkpoint, save_hf_checkpoint
    from tests.support.checkpoints import assert_same_checkpoint
    from tests.support.models import make_checkpoint, model_class, tiny_config

    path = make_checkpoint("llama", tmp_path / "ckpt", dtype=torch.float32)
    model = model_class("llama")(tiny_config("llama"))
    _shard_rows(model)
    reader = HFStorageReader(str(path), coalesce_gap=0)
    report = load_hf_checkpoint(model, str(path), reader=reader, check_written=True)
    assert not report.missing_keys
    from tests.support.models import load_reference

    reference = load_reference(path, "llama", torch.float32)
    bad = [k for k, v in model.state_dict().items() if not torch.equal(_full(v), reference[k])]
    assert not bad
    padding = model.model.embed_tokens.weight.data[-1]
    assert torch.isnan(padding).all()  # padding is no load's to write
    assert reader.stats.total().bytes_read == sum(_tensor_data_bytes(f) for f in path.glob("*.safetensors"))
    save_hf_checkpoint(model, str(tmp_path / "out"))
    assert_same_checkpoint(tmp_path / "out", path)
