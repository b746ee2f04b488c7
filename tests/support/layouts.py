"""Parallel layouts applied to a materialized model: each parameter becomes a DTensor.

Each recipe maps a parameter (name, shape) to a mesh and placements; tied parameters stay tied.
Every rank builds the same model (same seed), so shards are split locally (``src_data_rank=None``,
which also avoids torch 2.13's scatter assertion on uneven ``_StridedShard``). After distribution every local shard is filled with NaN, so an element a load forgets is caught.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard


def _meshes(world: int) -> dict[str, DeviceMesh]:
    flat = init_device_mesh("cpu", (world,))
    meshes = {"1d": flat}
    if world % 2 == 0 and world >= 4:
        meshes["2d"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("outer", "inner"))
    return meshes


def _placements(layout: str, name: str, shape: torch.Size, meshes: dict[str, DeviceMesh], index: int):
    ndim = len(shape)
    if layout == "replicate" or ndim == 0:
        return meshes["1d"], [Replicate()]
    if layout == "shard0":
        return meshes["1d"], [Shard(0)]
    if layout == "shard_last":
        return meshes["1d"], [Shard(ndim - 1)]
    if layout == "strided":  # non-contiguous: rank r holds chunks r and r + world of 2 * world
        return meshes["1d"], [_StridedShard(0, split_factor=2)]
    mesh = meshes["2d"]
    inner = mesh.shape[1]
    if layout == "fsdp_tp":  # FSDP2 (outer) over TP (inner): colwise and rowwise params alternate
        if ndim == 1:
            return mesh, [Shard(0), Replicate()]
        if index % 2 == 0:
            return mesh, [_StridedShard(0, split_factor=inner), Shard(0)]
        return mesh, [Shard(0), Shard(1)]
    if layout == "ep_tp":  # experts over the outer dim, TP inside
        if ndim == 3:
            return mesh, [Shard(0), Shard(1 + index % 2)]
        return mesh, [Replicate(), Shard(0)] if ndim == 2 else [Replicate(), Replicate()]
    raise ValueError(f"unknown layout {layout!r}")


LAYOUTS_1D = ("shard0", "shard_last", "strided", "replicate")
LAYOUTS_2D = ("fsdp_tp", "ep_tp")


def apply_layout(model: nn.Module, layout: str, world: int) -> None:
    """Turn every parameter of ``model`` into a DTensor of ``layout``, keep ties, fill with NaN."""
    meshes = _meshes(world)
    replaced: dict[int, nn.Parameter] = {}
    index = 0
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in replaced:
                mesh, placements = _placements(layout, f"{module_name}.{name}", param.shape, meshes, index)
                index += 1
                dt = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
                replaced[id(param)] = nn.Parameter(dt, requires_grad=False)
            module.register_parameter(name, replaced[id(param)])
    with torch.no_grad():
        for param in replaced.values():
            local = param.to_local() if isinstance(param, DTensor) else param
            local.fill_(float("nan"))
