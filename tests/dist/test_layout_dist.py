"""local_shard_pieces on real DTensors (gloo ranks): the pieces must say where ``to_local()`` came from.

Each global tensor is an arange, so a local value names its global position. Every rank returns its
pieces and local tensor; the test checks each rank's local tensor against the global one gathered at
its pieces, and that the ranks of one replica together tile the global tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

from hp_dcp_hf.errors import LayoutError
from hp_dcp_hf.geometry.box import disjoint_cover
from hp_dcp_hf.geometry.shards import ShardPiece, local_shard_pieces
from hp_dcp_hf.tools.launch import run_ranks

SS = _StridedShard

# (global shape, mesh shape, placements) built with distribute_tensor and with from_local. With no
# source rank, distribute_tensor splits by _StridedShard._split_tensor; where the split factors
# encode a shard order, that is torch's layout only where it agrees with the order (as in all these).
CASES_2 = [
    ((8, 3), (2,), (SS(0, split_factor=2),)),  # rank 0 holds rows 0,1,4,5: DCP loads it wrong
    ((7, 2), (2,), (SS(0, split_factor=3),)),
    ((5, 4), (2,), (Shard(0),)),
    ((3, 7), (2,), (Shard(1),)),
    ((1, 3), (2,), (Shard(0),)),  # rank 1 empty
    ((4, 4), (2,), (Replicate(),)),
]
CASES_4 = [
    ((8, 3), (2, 2), (SS(0, split_factor=2), Shard(0))),  # FSDP2 over TP
    ((7, 3), (2, 2), (SS(0, split_factor=2), Shard(0))),
    ((6, 9), (2, 2), (Shard(0), Shard(1))),
    ((7, 5), (2, 2), (Shard(0), Shard(0))),
    ((5, 6), (2, 2), (Replicate(), SS(1, split_factor=3))),
    ((3, 10), (2, 2), (Shard(1), SS(1, split_factor=2))),
    ((10,), (4,), (SS(0, split_factor=3),)),
    ((3, 2), (4,), (Shard(0),)),  # rank 3 empty
]

# (how built, global shape, placements, mesh coordinate, pieces, local tensor as _plain gives it)
Result = tuple[str, tuple[int, ...], tuple[Placement, ...], tuple[int, ...], tuple[ShardPiece, ...], tuple]


def _arange(shape: Sequence[int]) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(tuple(shape))


def _plain(tensor: torch.Tensor) -> tuple[tuple[int, ...], list[float]]:
    """A local tensor as plain data: tensors sent from a rank that then exits cannot be received."""
    return tuple(tensor.shape), tensor.detach().flatten().tolist()


def _layout_cases(rank: int, world_size: int, cases: list) -> list[Result]:
    """Per case: this rank's pieces and local tensor, from distribute_tensor and from from_local."""
    out: list[Result] = []
    meshes: dict[tuple[int, ...], DeviceMesh] = {}  # each new mesh costs collectives: build it once
    for shape, mesh_shape, placements in cases:
        if mesh_shape not in meshes:
            meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape)
        mesh = meshes[mesh_shape]
        coordinate = tuple(mesh.get_coordinate())
        # torch 2.13's scatter asserts on uneven _StridedShard; its local split (no source rank) does not.
        src = None if any(isinstance(p, SS) for p in placements) else 0
        dt = distribute_tensor(_arange(shape), mesh, placements, src_data_rank=src)
        out.append(("distribute_tensor", shape, placements, coordinate, local_shard_pieces(dt), _plain(dt.to_local())))
        # from_local with the very local tensor torch made, but told only the placements: the
        # layout must come from them, and full_tensor() confirms torch reads them the same way.
        fl = DTensor.from_local(dt.to_local().clone(), mesh, placements, shape=dt.shape, stride=dt.stride())
        assert torch.equal(fl.full_tensor(), _arange(shape)), (shape, placements)
        out.append(("from_local", shape, placements, coordinate, local_shard_pieces(fl), _plain(fl.to_local())))
    return out


def _fsdp_over_tp(rank: int, world_size: int, dp: int, sizes: Sequence[tuple[int, int]]) -> list[Result]:
    """fully_shard over TP-sharded Linears (out, in features) on a (dp, world_size // dp) mesh."""
    mesh = init_device_mesh("cpu", (dp, world_size // dp), mesh_dim_names=("dp", "tp"))
    coordinate = tuple(mesh.get_coordinate())
    out: list[Result] = []
    for style in (ColwiseParallel(), RowwiseParallel()):
        for out_features, in_features in sizes:
            lin = nn.Linear(in_features, out_features)
            with torch.no_grad():
                lin.weight.copy_(_arange(lin.weight.shape))
                lin.bias.copy_(_arange(lin.bias.shape))
            parallelize_module(lin, mesh["tp"], style)
            fully_shard(lin, mesh=mesh["dp"])
            for param in (lin.weight, lin.bias):
                # FSDP2's own all-gather path must agree that this is the parameter.
                assert torch.equal(param.full_tensor(), _arange(param.shape)), (style, param.shape)
                out.append((
                    f"fully_shard+{type(style).__name__}", tuple(param.shape), tuple(param.placements),
                    coordinate, local_shard_pieces(param), _plain(param.to_local()),
                ))
    return out


def _shard_order(rank: int, world_size: int) -> list[Result]:
    """A spec that carries its shard order (mesh dim 1 splits rows first, then mesh dim 0)."""
    mesh = init_device_mesh("cpu", (2, 2))
    c0, c1 = mesh.get_coordinate()
    spec = DTensorSpec(
        mesh, (Shard(0), Shard(0)), tensor_meta=TensorMeta(torch.Size((8, 3)), (3, 1), torch.float32),
        shard_order=(ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),),
    )
    dt = DTensor(_arange((8, 3))[4 * c1 + 2 * c0:][:2].clone(), spec, requires_grad=False)
    assert torch.equal(dt.full_tensor(), _arange((8, 3)))  # torch agrees this is the layout
    return [("shard_order", (8, 3), dt.placements, (c0, c1), local_shard_pieces(dt), _plain(dt.to_local()))]


def _refusals(rank: int, world_size: int) -> list[str]:
    """The DTensors whose layout cannot be loaded into raise LayoutError naming the key."""
    mesh = init_device_mesh("cpu", (2, 2))
    caught = []
    partial = distribute_tensor(_arange((4, 4)), mesh, (Shard(0), Partial()))
    wrong_shape = DTensor.from_local(torch.zeros(1, 4), mesh, (Shard(0), Shard(0)), shape=(8, 4), stride=(4, 1))
    for name, dt in (("partial", partial), ("wrong_shape", wrong_shape)):
        try:
            local_shard_pieces(dt, key=name)
        except LayoutError as e:
            if e.key == name:
                caught.append(name)
    return caught


def _outside_mesh(rank: int, world_size: int) -> tuple[tuple[ShardPiece, ...], tuple]:
    """A rank outside the DTensor's mesh holds nothing."""
    mesh = DeviceMesh("cpu", [0, 1])
    dt = distribute_tensor(_arange((4, 2)), mesh, (Shard(0),))
    return local_shard_pieces(dt), _plain(dt.to_local())


def _check(results_per_rank: list[list[Result]]) -> int:
    """Each rank's local tensor is the global one at its pieces; each replica's ranks tile it."""
    checked = 0
    for case in zip(*results_per_rank, strict=True):
        how, shape, placements = case[0][:3]
        where = f"{how} {shape} {placements}"
        global_tensor = _arange(shape)
        tiles = []
        for _, _, _, coordinate, pieces, (local_shape, values) in case:
            local = torch.tensor(values, dtype=torch.float32).reshape(local_shape)
            rebuilt = torch.full(local.shape, -1.0)
            for piece in pieces:
                rebuilt[piece.local_box().slices()] = global_tensor[piece.global_box.slices()]
            assert torch.equal(rebuilt, local), f"{where} at {coordinate}: {pieces}"
            assert sum(p.global_box.numel for p in pieces) == local.numel(), where
            if all(c == 0 for c, p in zip(coordinate, placements, strict=True) if isinstance(p, Replicate)):
                tiles.extend(p.global_box for p in pieces)
            checked += 1
        assert disjoint_cover(tiles, shape), where
    return checked


FSDP_SIZES = ((8, 4), (7, 6), (5, 3), (3, 5), (1, 2))


def _four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    """Everything that needs 4 ranks, in one spawn: starting ranks costs more than the checks."""
    return {
        "layouts": _layout_cases(rank, world_size, CASES_4),
        "fsdp": _fsdp_over_tp(rank, world_size, 2, FSDP_SIZES),
        "shard_order": _shard_order(rank, world_size),
        "refusals": _refusals(rank, world_size),
        "outside": _outside_mesh(rank, world_size),
    }


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(4, _four_ranks)


def test_two_ranks() -> None:
    assert _check(run_ranks(2, _layout_cases, CASES_2)) == 2 * 2 * len(CASES_2)


def test_four_ranks(four_ranks: list[dict[str, Any]]) -> None:
    assert _check([r["layouts"] for r in four_ranks]) == 4 * 2 * len(CASES_4)


def test_fsdp_over_tp(four_ranks: list[dict[str, Any]]) -> None:
    results = [r["fsdp"] for r in four_ranks]
    assert any(SS(0, split_factor=2) in r[2] for r in results[0])
    assert _check(results) == 4 * 2 * 2 * len(FSDP_SIZES)


def test_fsdp_over_tp_uneven_on_three_dp_ranks() -> None:
    """dp = 3 is where FSDP2's layout and _StridedShard._split_tensor part for uneven sizes."""
    sizes = ((7, 2), (13, 3), (5, 4))
    assert _check(run_ranks(6, _fsdp_over_tp, 3, sizes, timeout=300)) == 6 * 2 * 2 * len(sizes)


def test_explicit_shard_order(four_ranks: list[dict[str, Any]]) -> None:
    assert _check([r["shard_order"] for r in four_ranks]) == 4


def test_unloadable_dtensors_raise(four_ranks: list[dict[str, Any]]) -> None:
    assert [r["refusals"] for r in four_ranks] == [["partial", "wrong_shape"]] * 4


def test_rank_outside_mesh_holds_nothing(four_ranks: list[dict[str, Any]]) -> None:
    results = [r["outside"] for r in four_ranks]
    assert [len(pieces) for pieces, _ in results] == [1, 1, 0, 0]
    assert all(math.prod(local_shape) == 0 for _, (local_shape, _) in results[2:])
