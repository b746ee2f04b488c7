"""layout.shard_pieces against torch's own sharding, simulated per mesh coordinate in one process.

The oracle is torch's code run on an arange tensor, where every value names its global position:
placements whose _StridedShard split factors encode a shard order are decoded by torch's
``DTensorSpec._maybe_convert_StridedShard_to_shard_order`` and applied as ``Shard._split_tensor``
in that order (what redistribution assumes and FSDP2 lays out); any other placements apply their
own ``_split_tensor`` left to right (what ``distribute_tensor`` runs). The pieces must rebuild the
local tensor exactly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

from hp_dcp_hf.errors import LayoutError
from hp_dcp_hf.geometry.box import Box, disjoint_cover
from hp_dcp_hf.geometry.shards import ShardPiece, local_shape, local_shard_pieces, shard_pieces


class MeshSizes:
    """The one DeviceMesh method torch's shard order codecs call."""

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape = tuple(shape)

    def size(self, mesh_dim: int) -> int:
        return self.shape[mesh_dim]


def torch_steps(mesh_shape: Sequence[int], placements: Sequence[Placement]) -> list[tuple[int, Placement]]:
    """(mesh dim, placement to split with), in the order torch applies them."""
    order = None
    if any(isinstance(p, _StridedShard) for p in placements):
        order = DTensorSpec._maybe_convert_StridedShard_to_shard_order(tuple(placements), MeshSizes(mesh_shape))
    if order is None:
        return [(m, p) for m, p in enumerate(placements) if isinstance(p, Shard | _StridedShard)]
    return [(m, Shard(entry.tensor_dim)) for entry in order for m in entry.mesh_dims]


def torch_local(
    global_tensor: torch.Tensor, mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Placement]
) -> torch.Tensor:
    local = global_tensor
    for mesh_dim, placement in torch_steps(mesh_shape, placements):
        local = placement._split_tensor(local, mesh_shape[mesh_dim], with_padding=False)[0][coordinate[mesh_dim]]
    return local


def rebuild(global_tensor: torch.Tensor, pieces: Sequence[ShardPiece], local_shape: Sequence[int]) -> torch.Tensor:
    out = torch.full(tuple(local_shape), -1, dtype=global_tensor.dtype)
    for piece in pieces:
        out[piece.local_box().slices()] = global_tensor[piece.global_box.slices()]
    return out


def check_layout(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]) -> None:
    """Every coordinate's pieces rebuild torch's local tensor; the non-replicated coordinates tile it."""
    global_tensor = torch.arange(math.prod(global_shape)).reshape(tuple(global_shape))
    tiles: list[Box] = []
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        pieces = shard_pieces(global_shape, mesh_shape, coordinate, placements)
        expected = torch_local(global_tensor, mesh_shape, coordinate, placements)
        where = f"{global_shape} {mesh_shape} {placements} at {coordinate}"
        assert torch.equal(rebuild(global_tensor, pieces, expected.shape), expected), where
        assert local_shape(global_shape, mesh_shape, coordinate, placements) == tuple(expected.shape), where
        assert disjoint_cover([p.local_box() for p in pieces], expected.shape) or expected.numel() == 0, where
        assert all(not p.global_box.is_empty() for p in pieces), where
        assert [p.local_offsets for p in pieces] == sorted(p.local_offsets for p in pieces), where
        assert_no_mergeable_pair(pieces, where)
        if all(c == 0 for c, p in zip(coordinate, placements, strict=True) if isinstance(p, Replicate)):
            tiles.extend(p.global_box for p in pieces)
    assert disjoint_cover(tiles, global_shape), f"{global_shape} {mesh_shape} {placements}"


def assert_no_mergeable_pair(pieces: Sequence[ShardPiece], where: str) -> None:
    """Two pieces equal but in one dim, where they touch globally and locally, should have been one."""
    for a, b in itertools.permutations(pieces, 2):
        differ = [
            d for d in range(a.global_box.ndim)
            if (a.global_box.offsets[d], a.global_box.sizes[d], a.local_offsets[d])
            != (b.global_box.offsets[d], b.global_box.sizes[d], b.local_offsets[d])
        ]
        if len(differ) == 1:
            (d,) = differ
            touches = a.global_box.ends[d] == b.global_box.offsets[d] and a.local_box().ends[d] == b.local_offsets[d]
            assert not touches, f"{where}: {a} and {b} could be one piece"


Layout = tuple[tuple[int, ...], tuple[int, ...], tuple[Placement, ...]]


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    """Any placements, _StridedShard with any split factor: mostly laid out by _split_tensor."""
    ndim = draw(st.integers(1, 3))
    global_shape = tuple(draw(st.lists(st.integers(0, 13), min_size=ndim, max_size=ndim)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placement = st.one_of(
        st.just(Replicate()),
        st.builds(Shard, st.integers(0, ndim - 1)),
        st.builds(
            lambda d, sf: _StridedShard(d, split_factor=sf), st.integers(0, ndim - 1), st.integers(1, 5)
        ),
    )
    placements = tuple(draw(st.lists(placement, min_size=len(mesh_shape), max_size=len(mesh_shape))))
    return global_shape, mesh_shape, placements


@st.composite
def ordered_layouts(draw: st.DrawFn) -> tuple[Layout, tuple[Placement, ...], tuple[ShardOrderEntry, ...]]:
    """Dim 0 sharded right to left (FSDP2 over TP is one): torch's encoding, plain placements, order."""
    ndim = draw(st.integers(1, 2))
    global_shape = tuple(draw(st.lists(st.integers(0, 23), min_size=ndim, max_size=ndim)))
    mesh_shape = tuple(draw(st.lists(st.integers(2, 5), min_size=2, max_size=3)))
    third = st.sampled_from([Shard(0), Shard(ndim - 1), Replicate()])
    plain = (Shard(0), Shard(0), *(draw(third) for _ in mesh_shape[2:]))
    order = []
    for d in range(ndim):
        mesh_dims = draw(st.permutations([m for m, p in enumerate(plain) if p == Shard(d)]))
        if d == 0 and mesh_dims[0] == 0:  # mesh dim 0 not first: a _StridedShard
            mesh_dims = mesh_dims[1:] + mesh_dims[:1]
        if mesh_dims:
            order.append(ShardOrderEntry(d, tuple(mesh_dims)))
    encoded = DTensorSpec._convert_shard_order_to_StridedShard(tuple(order), plain, MeshSizes(mesh_shape))
    return (global_shape, mesh_shape, encoded), plain, tuple(order)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_random_layouts_match_torch(layout: Layout) -> None:
    check_layout(*layout)


@settings(max_examples=300, deadline=None)
@given(ordered_layouts())
def test_random_shard_orders_match_torch(
    case: tuple[Layout, tuple[Placement, ...], tuple[ShardOrderEntry, ...]],
) -> None:
    """The order encoded in _StridedShard and the same order given explicitly are one layout."""
    (global_shape, mesh_shape, encoded), plain, order = case
    check_layout(global_shape, mesh_shape, encoded)
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        assert shard_pieces(global_shape, mesh_shape, coordinate, plain, shard_order=order) == shard_pieces(
            global_shape, mesh_shape, coordinate, encoded
        )


def test_explicit_shard_order() -> None:
    """Mesh dim 1 splits the rows first, then mesh dim 0: (c0, c1) holds rows 4 * c1 + 2 * c0 + [0, 2)."""
    order = (ShardOrderEntry(0, (1, 0)),)
    for c0, c1 in itertools.product(range(2), range(2)):
        pieces = shard_pieces((8, 3), (2, 2), (c0, c1), (Shard(0), Shard(0)), shard_order=order)
        assert pieces == (ShardPiece(Box((4 * c1 + 2 * c0, 0), (2, 3)), (0, 0)),)


@pytest.mark.parametrize(
    "order",
    [
        (ShardOrderEntry(0, (1,)),),  # mesh dim 0 left out
        (ShardOrderEntry(0, (1, 0)), ShardOrderEntry(1, (0,))),  # mesh dim 0 twice
        (ShardOrderEntry(1, (1, 0)),),  # the wrong tensor dim
        (ShardOrderEntry(0, (1, 0, 2)),),  # mesh dim 2 replicates
    ],
)
def test_shard_order_must_match_placements(order: tuple[ShardOrderEntry, ...]) -> None:
    with pytest.raises(LayoutError):
        shard_pieces((8, 3), (2, 2, 2), (0, 0, 0), (Shard(0), Shard(0), Replicate()), shard_order=order, key="w")


SS = _StridedShard


@pytest.mark.parametrize(
    ("global_shape", "mesh_shape", "placements"),
    [
        ((8,), (2,), (SS(0, split_factor=2),)),  # DCP describes rank 0 as rows 0-3: wrong
        ((8, 4), (2, 2), (SS(0, split_factor=2), Shard(0))),  # FSDP2 over TP
        ((7, 5), (2, 2), (SS(0, split_factor=2), Shard(0))),  # same, uneven
        ((7, 2), (3, 2), (SS(0, split_factor=2), Shard(0))),  # uneven on 3 dp ranks: not _split_tensor
        ((9, 6), (2, 3), (SS(1, split_factor=3), Shard(1))),  # FSDP2 on dim 1 over TP on dim 1
        ((5, 3), (4,), (Shard(0),)),  # torch.chunk sizes 2, 2, 1, 0: an empty trailing shard
        ((6, 3), (4,), (Shard(0),)),  # sizes 2, 2, 2, 0: the last rank empty though 6 >= 4
        ((12, 10), (2, 2, 2), (Shard(0), Replicate(), Shard(1))),
        ((12, 10), (2, 3, 2), (Shard(1), Shard(0), Shard(1))),  # two mesh dims on one tensor dim
        ((16,), (2, 2, 2), (SS(0, split_factor=4), SS(0, split_factor=2), Shard(0))),  # decodes to order (2, 1, 0)
        ((11,), (2, 3), (Shard(0), SS(0, split_factor=2))),  # encodes no order: _split_tensor
        ((3, 4), (2,), (Shard(-1),)),  # negative dim
        ((0, 4), (2,), (Shard(0),)),  # empty tensor
    ],
)
def test_named_layouts_match_torch(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> None:
    check_layout(global_shape, mesh_shape, placements)


def test_non_contiguous_strided_shard_is_two_pieces() -> None:
    ss = (_StridedShard(0, split_factor=2),)
    assert shard_pieces((8, 3), (2,), (0,), ss) == (
        ShardPiece(Box((0, 0), (2, 3)), (0, 0)),
        ShardPiece(Box((4, 0), (2, 3)), (2, 0)),
    )
    assert shard_pieces((8, 3), (2,), (1,), ss) == (
        ShardPiece(Box((2, 0), (2, 3)), (0, 0)),
        ShardPiece(Box((6, 0), (2, 3)), (2, 0)),
    )


@pytest.mark.parametrize("rows", [7, 13, 27])
@pytest.mark.parametrize(("dp", "tp"), [(3, 2), (3, 4), (4, 3)])
def test_fsdp_over_tp_matches_fsdp_chunking(rows: int, dp: int, tp: int) -> None:
    """FSDP2 chunks each TP shard over dp: one contiguous run, though _split_tensor says otherwise here."""
    placements = (_StridedShard(0, split_factor=tp), Shard(0))
    for t, tp_shard in enumerate(chunks(torch.arange(rows), tp)):
        for d, fsdp_shard in enumerate(chunks(tp_shard, dp)):
            expected = (ShardPiece(Box((int(fsdp_shard[0]),), (len(fsdp_shard),)), (0,)),) if len(fsdp_shard) else ()
            assert shard_pieces((rows,), (dp, tp), (d, t), placements) == expected, (d, t)


def test_fsdp_over_tp_uneven_differs_from_split_tensor() -> None:
    """Why the shard order is decoded: left to right, _split_tensor gives rank (2, 0) row 6; FSDP2 gives it none."""
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    left_to_right = placements[0]._split_tensor(torch.arange(7), 3, with_padding=False)[0][2].chunk(2)[0]
    assert left_to_right.tolist() == [6]
    assert shard_pieces((7,), (3, 2), (2, 0), placements) == ()
    assert shard_pieces((7,), (3, 2), (2, 1), placements) == (ShardPiece(Box((6,), (1,)), (0,)),)


def chunks(tensor: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``torch.chunk`` padded with empty chunks to ``n``, as FSDP2's ``_chunk_with_empty``."""
    out = list(torch.chunk(tensor, n)) if len(tensor) else []
    return out + [tensor[:0]] * (n - len(out))


def test_fsdp_over_tp_even_is_one_piece() -> None:
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    assert shard_pieces((8, 4), (2, 2), (1, 0), placements) == (ShardPiece(Box((2, 0), (2, 4)), (0, 0)),)
    assert shard_pieces((8, 4), (2, 2), (0, 1), placements) == (ShardPiece(Box((4, 0), (2, 4)), (0, 0)),)


def test_runs_that_continue_each_other_are_merged() -> None:
    assert shard_pieces((8,), (1,), (0,), (_StridedShard(0, split_factor=4),)) == (
        ShardPiece(Box((0,), (8,)), (0,)),
    )


def test_empty_shard_has_no_pieces() -> None:
    assert shard_pieces((5, 3), (4,), (3,), (Shard(0),)) == ()
    assert shard_pieces((6, 3), (4,), (3,), (Shard(0),)) == ()
    assert shard_pieces((0, 3), (1,), (0,), (Replicate(),)) == ()


def test_replicate_and_scalar_hold_everything() -> None:
    assert shard_pieces((4, 2), (3,), (2,), (Replicate(),)) == (ShardPiece(Box((0, 0), (4, 2)), (0, 0)),)
    assert shard_pieces((), (), (), ()) == (ShardPiece(Box((), ()), ()),)


def test_plain_tensor_is_one_full_piece() -> None:
    assert local_shard_pieces(torch.zeros(3, 5)) == (ShardPiece(Box((0, 0), (3, 5)), (0, 0)),)
    assert local_shard_pieces(torch.zeros(0, 5)) == ()


class _Unknown(Placement):
    pass


@pytest.mark.parametrize("placement", [Partial(), Partial("max"), _Unknown()])
def test_unloadable_placements_raise_naming_the_key(placement: Placement) -> None:
    with pytest.raises(LayoutError) as info:
        shard_pieces((4,), (2, 2), (0, 1), (Shard(0), placement), key="model.layers.0.mlp.weight")
    assert info.value.key == "model.layers.0.mlp.weight"
    assert "model.layers.0.mlp.weight" in str(info.value)


@pytest.mark.parametrize(
    ("global_shape", "mesh_shape", "coordinate", "placements"),
    [
        ((4,), (2,), (2,), (Shard(0),)),  # coordinate outside the mesh
        ((4,), (2,), (0,), (Shard(1),)),  # no dim 1
        ((), (2,), (0,), (Shard(0),)),  # a scalar has no dim to shard
        ((4,), (2, 2), (0,), (Shard(0), Shard(0))),  # coordinate of the wrong length
        ((4,), (2,), (0,), (Shard(0), Replicate())),  # placements of the wrong length
    ],
)
def test_inconsistent_layouts_raise(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> None:
    with pytest.raises(LayoutError):
        shard_pieces(global_shape, mesh_shape, coordinate, placements, key="w")
