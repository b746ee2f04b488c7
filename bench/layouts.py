"""The parallel layout every contender loads into: FSDP2-over-TP placements, EP for experts.

One rule per parameter role, the placements FSDP2 (``fully_shard`` on ``dp``) over tensor
parallelism (``parallelize_module`` on ``tp``) leave on a decoder, and expert parallelism over all
ranks for stacked experts:

==============================  ========================================  ==========================
role (name suffix)              ``(dp, tp)`` mesh                          ``tp`` only
==============================  ========================================  ==========================
colwise: q/k/v/gate/up, fused   ``(_StridedShard(0, sf=tp), Shard(0))``    ``Shard(0)``
qkv/gate_up, embed, lm_head
rowwise: o_proj, down_proj      ``(Shard(0), Shard(1))``                   ``Shard(1)``
3-D stacked experts             ``Shard(0)`` over all ranks (1-D mesh)     same
anything else (norms, router)   ``(Shard(0), Replicate())``                ``Replicate()``
==============================  ========================================  ==========================

The placements are applied with ``distribute_tensor`` on the meta device (no hooks, no forward:
these models are only loaded), then ``to_empty`` allocates the local shards. Fused projections get
the colwise rule too: a layout for loading and FSDP (their local rows are not whole heads), which
keeps the rewrite row's bytes per rank comparable with the others. The same rules, as pure
``(mesh shape, placements)`` pairs, drive the cluster-scale simulation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

COLWISE = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight", "q_b_proj.weight",
           "kv_b_proj.weight",
           "qkv_proj.weight", "gate_up_proj.weight", "embed_tokens.weight", "lm_head.weight")
ROWWISE = ("o_proj.weight", "down_proj.weight")


def parse_mesh(spec: str) -> dict[str, int]:
    """``"dp=2,tp=2"`` -> ``{"dp": 2, "tp": 2}`` (dims ``dp`` and ``tp``, outermost first); ``""`` -> ``{}``."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        if name not in ("dp", "tp") or not value.isdigit() or int(value) < 1:
            raise ValueError(f"mesh {spec!r}: expected dp=N,tp=M")
        sizes[name] = int(value)
    return {name: sizes[name] for name in ("dp", "tp") if name in sizes}


def default_mesh(world: int) -> dict[str, int]:
    """1 rank: none; 2: ``tp=2`` (1-D); 4 and more (even): ``dp=world/2, tp=2`` (2-D)."""
    if world == 1:
        return {}
    if world == 2 or world % 2:
        return {"tp": world}
    return {"dp": world // 2, "tp": 2}


def mesh_label(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items()) or "single"


def role(name: str, ndim: int) -> str:
    """``experts`` | ``colwise`` | ``rowwise`` | ``other`` for the parameter ``name`` of ``ndim`` dims."""
    if ndim == 3:
        return "experts"
    if ndim == 2 and name.endswith(COLWISE):
        return "colwise"
    if ndim == 2 and name.endswith(ROWWISE):
        return "rowwise"
    return "other"


def placements(name: str, ndim: int, mesh: Mapping[str, int]) -> tuple[str, tuple[Placement, ...]]:
    """``(mesh kind, placements)``: mesh kind ``"dense"`` is the ``mesh`` dims, ``"experts"`` the
    flattened 1-D mesh of all ranks."""
    kind = role(name, ndim)
    if kind == "experts":
        return "experts", (Shard(0),)
    dp, tp = mesh.get("dp"), mesh.get("tp")
    tp_place = {"colwise": Shard(0), "rowwise": Shard(1)}.get(kind, Replicate())
    if ndim == 0:
        return "dense", tuple(Replicate() for _ in mesh)
    out: list[Placement] = []
    if dp:
        out.append(_StridedShard(0, split_factor=tp) if tp and kind == "colwise" else Shard(0))
    if tp:
        out.append(tp_place)
    return "dense", tuple(out)


def mesh_shapes(mesh: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """Mesh kind -> shape: ``dense`` is ``mesh``'s dims, ``experts`` all ranks in one dim."""
    return {"dense": tuple(mesh.values()), "experts": (math.prod(mesh.values()),)}


def device_meshes(mesh: Mapping[str, int]):
    """The two DeviceMeshes of ``mesh`` over the default process group (same ranks, two shapes)."""
    from torch.distributed.device_mesh import init_device_mesh

    dense = init_device_mesh("cpu", tuple(mesh.values()), mesh_dim_names=tuple(mesh))
    experts = init_device_mesh("cpu", (math.prod(mesh.values()),), mesh_dim_names=("ep",))
    return {"dense": dense, "experts": experts}


def apply_layout(model: nn.Module, mesh: Mapping[str, int]) -> nn.Module:
    """Make every parameter of the (meta) ``model`` a DTensor of its role's placements; keep ties."""
    if not mesh:
        return model
    meshes = device_meshes(mesh)
    replaced: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in replaced:
                full = f"{module_name}.{name}" if module_name else name
                kind, places = placements(full, param.ndim, mesh)
                dt = distribute_tensor(param.detach(), meshes[kind], places, src_data_rank=None)
                replaced[id(param)] = nn.Parameter(dt, requires_grad=False)
            module.register_parameter(name, replaced[id(param)])
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def materialize(model: nn.Module) -> nn.Module:
    """Allocate every local shard on CPU and fill it with NaN: the pages are touched before the load
    (so RSS growth during a load is the load's own), and an element no load writes stays NaN."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in unique_tensors(model):
            if tensor.is_floating_point():
                local(tensor).fill_(float("nan"))
    return model


def unique_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers, each shared tensor once."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def local_bytes(model: nn.Module) -> int:
    """Bytes of this rank's local shards of every parameter (each shared tensor once)."""
    return sum(local(p).numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
