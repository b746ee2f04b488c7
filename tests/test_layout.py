"""layout.shard_pieces against torch's own sharding, simulated per mesh coordinate in one process.

The oracle is what ``distribute_tensor`` runs on each rank: for every mesh dim, left to right, the
placement's ``_split_tensor`` on the current local tensor, keeping this rank's chunk. On an arange
tensor every value names its global position, so the pieces must rebuild the local tensor exactly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

from hp_dcp_hf.box import Box, disjoint_cover
from hp_dcp_hf.errors import LayoutError
from hp_dcp_hf.layout import ShardPiece, local_shard_pieces, shard_pieces


def torch_local(
    global_tensor: torch.Tensor, mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Placement]
) -> torch.Tensor:
    local = global_tensor
    for n, c, placement in zip(mesh_shape, coordinate, placements, strict=True):
        if isinstance(placement, Shard | _StridedShard):
            local = placement._split_tensor(local, n, with_padding=False)[0][c]
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
        assert disjoint_cover([p.local_box() for p in pieces], expected.shape) or expected.numel() == 0, where
        assert all(not p.global_box.is_empty() for p in pieces), where
        assert [p.local_offsets for p in pieces] == sorted(p.local_offsets for p in pieces), where
        assert_no_mergeable_pair(pieces, where)
        torch_shape, torch_offset = _compute_local_shape_and_global_offset(
            global_shape, mesh_shape, list(coordinate), placements
        )
        assert tuple(torch_shape) == tuple(expected.shape), where
        if pieces:
            assert pieces[0].global_box.offsets == tuple(torch_offset), where
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


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Placement, ...]]:
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


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_random_layouts_match_torch(layout: tuple[tuple[int, ...], tuple[int, ...], tuple[Placement, ...]]) -> None:
    check_layout(*layout)


SS = _StridedShard


@pytest.mark.parametrize(
    ("global_shape", "mesh_shape", "placements"),
    [
        ((8,), (2,), (SS(0, split_factor=2),)),  # DCP describes rank 0 as rows 0-3: wrong
        ((8, 4), (2, 2), (SS(0, split_factor=2), Shard(0))),  # FSDP2 over TP
        ((7, 5), (2, 2), (SS(0, split_factor=2), Shard(0))),  # same, uneven
        ((9, 6), (2, 3), (SS(1, split_factor=3), Shard(1))),  # FSDP2 on dim 1 over TP on dim 1
        ((5, 3), (4,), (Shard(0),)),  # torch.chunk sizes 2, 2, 1, 0: an empty trailing shard
        ((6, 3), (4,), (Shard(0),)),  # sizes 2, 2, 2, 0: the last rank empty though 6 >= 4
        ((12, 10), (2, 2, 2), (Shard(0), Replicate(), Shard(1))),
        ((12, 10), (2, 3, 2), (Shard(1), Shard(0), Shard(1))),  # two mesh dims on one tensor dim
        ((16,), (2, 2, 2), (SS(0, split_factor=4), SS(0, split_factor=2), Shard(0))),  # three-level FSDP
        ((11,), (2, 3), (Shard(0), SS(0, split_factor=2))),  # _StridedShard after a Shard
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
