"""Mesh specs: ``"dp_replicate=2,dp=2,tp=2,ep=2"`` -> sizes, a transformers ``DistributedConfig``, a mesh.

The dims follow transformers' ``DistributedConfig`` and torchtitan:

* ``dp_replicate``: HSDP replicas (``dp_replicate_size``): whole copies of the FSDP-sharded model.
* ``dp``: FSDP2 shards inside a replica (``fsdp_size``).
* ``tp``: tensor parallel ranks (``tp_size``), adjacent in rank order.
* ``ep``: expert parallel ranks (``ep_size``). EP does not add ranks: it overlays ``dp x tp`` (experts
  are split over ``ep`` ranks and FSDP-sharded over the remaining ``dp * tp / ep``), so ``ep`` must
  be a multiple of ``tp`` and divide ``dp * tp``. A spec with ``ep`` but no ``dp`` takes
  ``dp = ep / tp``: ``"ep=4"`` is 4 ranks, dense weights FSDP-sharded over 4, experts split over 4.

The world size is ``dp_replicate * dp * tp``. Parsing imports nothing heavy (the CLI's ``--help``
stays fast); :func:`distributed_config` and :func:`init_mesh` import transformers / torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hp_dcp_hf.errors import MeshSpecError

MESH_DIMS = ("dp_replicate", "dp", "tp", "ep")
"""Known mesh dims, outermost first (tensor parallel ranks adjacent)."""

DENSE_DIMS = ("dp_replicate", "dp", "tp")
"""The dims whose product is the world size (``ep`` overlays ``dp x tp``)."""

_CONFIG_FIELDS = {"dp_replicate": "dp_replicate_size", "dp": "fsdp_size", "tp": "tp_size", "ep": "ep_size"}

_OTHER_NAMES = {
    **{field: dim for dim, field in _CONFIG_FIELDS.items()},  # transformers' DistributedConfig fields
    "fsdp": "dp", "dp_shard": "dp", "hsdp": "dp_replicate", "replicate": "dp_replicate", "ddp": "dp_replicate",
    # torchtitan's ParallelismConfig degrees
    "data_parallel_shard_degree": "dp", "data_parallel_replicate_degree": "dp_replicate",
    "tensor_parallel_degree": "tp", "expert_parallel_degree": "ep",
}
"""What other tools call the mesh dims (FSDP's ``fsdp``, torchtitan's ``dp_shard``): the dim to suggest."""


def _did_you_mean(name: str) -> str:
    """`` (did you mean dp?)`` for another tool's name of a dim, or a near miss of one known dim
    (``tq``: tp; not ``pp``, as near to dp, tp and ep), else ``""``."""
    import difflib

    known = _OTHER_NAMES.get(name.lower())
    if known is None:
        scores = {dim: difflib.SequenceMatcher(None, name.lower(), dim).ratio() for dim in MESH_DIMS}
        best = max(scores.values())
        nearest = [dim for dim, score in scores.items() if score == best]
        known = nearest[0] if best >= 0.5 and len(nearest) == 1 else None
    return f" (did you mean {known}?)" if known else ""


class MeshSizeError(MeshSpecError):
    """A mesh whose size does not match the process group it is built on."""


def parse_mesh(spec: str | Mapping[str, int]) -> dict[str, int]:
    """``"tp=2,dp=2"`` (or a mapping) -> ``{"dp": 2, "tp": 2}`` in :data:`MESH_DIMS` order.

    ``ep`` without ``dp`` fills ``dp = ep / tp``. Sizes are checked for form here; whether ``ep``
    fits ``dp x tp`` is checked by :func:`distributed_config` (transformers' own validation).
    """
    if isinstance(spec, Mapping):
        sizes = {str(k): v for k, v in spec.items()}
    else:
        sizes = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or not value.strip().isdigit():
                raise MeshSpecError(f"mesh spec {spec!r}: expected name=size[,name=size], e.g. dp=2,tp=2")
            if name in sizes:
                raise MeshSpecError(f"mesh spec {spec!r} names {name!r} twice")
            sizes[name] = int(value)
    unknown = sorted(set(sizes) - set(MESH_DIMS))
    if unknown:
        named = ", ".join(f"{name!r}{_did_you_mean(name)}" for name in unknown)
        raise MeshSpecError(f"mesh spec {spec!r}: unknown dim{'s' if len(unknown) > 1 else ''} {named}; known: "
                            f"{', '.join(MESH_DIMS)} (dp is FSDP's sharding, dp_replicate HSDP's replicas)")
    if not sizes or any(not isinstance(size, int) or size < 1 for size in sizes.values()):
        raise MeshSpecError(f"mesh spec {spec!r}: need at least one dim, every size an integer >= 1")
    if "ep" in sizes and "dp" not in sizes:
        tp = sizes.get("tp", 1)
        if sizes["ep"] % tp:
            raise MeshSpecError(f"mesh spec {spec!r}: ep={sizes['ep']} must be a multiple of tp={tp}")
        sizes["dp"] = sizes["ep"] // tp
    return {name: sizes[name] for name in MESH_DIMS if name in sizes}


def mesh_world_size(spec: str | Mapping[str, int]) -> int:
    """The number of ranks a mesh spec needs: ``dp_replicate * dp * tp``."""
    sizes = parse_mesh(spec)
    return math.prod(sizes.get(dim, 1) for dim in DENSE_DIMS)


def format_mesh(spec: str | Mapping[str, int]) -> str:
    """``{"dp": 2, "tp": 2}`` -> ``"dp=2,tp=2"``."""
    return ",".join(f"{k}={v}" for k, v in parse_mesh(spec).items())


def check_world_size(spec: str | Mapping[str, int], world: int) -> None:
    """Raise :class:`MeshSizeError`, with the torchrun line that fits, when ``spec`` needs other
    than ``world`` ranks."""
    need = mesh_world_size(spec)
    if need != world:
        raise MeshSizeError(
            f"mesh {format_mesh(spec)} has {need} ranks but the process group has {world}: "
            f"launch with `torchrun --nproc-per-node {need} ...`"
        )


def distributed_config(spec: str | Mapping[str, int], **options: Any):
    """transformers' ``DistributedConfig`` of a mesh spec (``options``: its other fields, e.g.
    ``tp_plan``, ``ep_plan``, ``fsdp_plan``, ``ep_implementation``)."""
    from transformers import DistributedConfig

    sizes = parse_mesh(spec)
    return DistributedConfig(**{_CONFIG_FIELDS[dim]: size for dim, size in sizes.items()}, **options)


def mesh_spec(config: Any) -> dict[str, int]:
    """The mesh spec of a ``DistributedConfig`` (sizes > 1 only; ``{"dp": 1}`` when all are 1)."""
    sizes = {dim: int(getattr(config, field) or 1) for dim, field in _CONFIG_FIELDS.items()}
    return {dim: size for dim, size in sizes.items() if size > 1} or {"dp": 1}


_CALLER_NAMES = {"dp_replicate": "dp_replicate", "dp": "dp", "fsdp": "dp", "tp": "tp"}
"""The names a caller's ``DeviceMesh`` may give its dims (ours, and transformers' ``fsdp``) -> our dim."""


def caller_mesh_dims(names: tuple[str, ...] | None, shape: tuple[int, ...]) -> dict[str, tuple[str | None, int]]:
    """Our dims of a caller's ``DeviceMesh`` (its ``mesh_dim_names`` and ``shape``): ``{dim: (the
    caller's name, size)}`` in :data:`MESH_DIMS` order, as transformers' ``device_mesh=`` reads one:
    a 1-D mesh without names is the tensor parallel mesh, an N-D one names every dim
    (``dp_replicate``, ``dp`` or transformers' ``fsdp``, ``tp``), outermost first.

    Raises :class:`~hp_dcp_hf.errors.MeshSpecError` naming what is wrong: dims without names, an
    unknown name, a dim named twice, dims out of order."""
    if not names:
        if len(shape) != 1:
            raise MeshSpecError(f"device_mesh of shape {tuple(shape)} has no mesh_dim_names: name its dims "
                                "(init_device_mesh(..., mesh_dim_names=(\"dp\", \"tp\")))")
        return {"tp": (None, shape[0])}
    unknown = [name for name in names if name not in _CALLER_NAMES]
    if unknown:
        named = ", ".join(f"{name!r}{_did_you_mean(name)}" for name in unknown)
        raise MeshSpecError(f"device_mesh dims {tuple(names)}: unknown dim {named}; known: "
                            f"{', '.join(_CALLER_NAMES)} (dp and fsdp are FSDP's sharding, dp_replicate HSDP's replicas)")
    dims = [_CALLER_NAMES[name] for name in names]
    twice = sorted({dim for dim in dims if dims.count(dim) > 1})
    if twice:
        raise MeshSpecError(f"device_mesh dims {tuple(names)} name {', '.join(twice)} twice")
    order = [dim for dim in MESH_DIMS if dim in dims]
    if dims != order:
        expected = tuple(names[dims.index(dim)] for dim in order)
        raise MeshSpecError(f"device_mesh dims {tuple(names)} are out of order: outermost first, {expected}")
    return {dim: (name, size) for dim, name, size in zip(dims, names, shape, strict=True)}


def check_caller_mesh(dims: Mapping[str, tuple[str | None, int]], spec: Mapping[str, int]) -> None:
    """Raise :class:`~hp_dcp_hf.errors.MeshSpecError` when a caller's mesh (:func:`caller_mesh_dims`)
    does not carry the mesh spec ``spec`` (a ``distributed_config``'s): every dense dim of the same
    size, no ``ep`` (transformers' expert mesh groups ranks its own way, which the caller's mesh
    has no groups for), and under HSDP a ``dp`` dim beside ``dp_replicate`` (FSDP2 replicates over
    the first dim of a 2-D mesh and shards over the second)."""
    if spec.get("ep", 1) > 1:
        raise MeshSpecError(f"ep={spec['ep']} with device_mesh=: expert parallelism needs transformers' expert "
                            "mesh; pass distributed_config= alone")
    sizes = {dim: size for dim, (_, size) in dims.items()}
    differ = [dim for dim in DENSE_DIMS if sizes.get(dim, 1) != spec.get(dim, 1)]
    if differ:
        got = ", ".join(f"{dim}={sizes.get(dim, 1)}" for dim in differ)
        want = ", ".join(f"{dim}={spec.get(dim, 1)}" for dim in differ)
        raise MeshSpecError(f"device_mesh has {got} where distributed_config asks {want}")
    if spec.get("dp_replicate", 1) > 1 and "dp" not in dims:
        raise MeshSpecError("device_mesh with dp_replicate needs a dp (or fsdp) dim beside it, of size 1 if need "
                            "be: FSDP2 shards HSDP replicas over a 2-D (dp_replicate, dp) mesh")


def init_mesh(spec: str | Mapping[str, int], device_type: str = "cpu"):
    """The ``DeviceMesh`` of ``spec``'s dense dims over the default process group, for recipes of
    one's own (``parallelize=``); the size must match the process group. ``ep`` is not a mesh dim
    of its own: pass ``distributed_config=`` to :func:`hp_dcp_hf.from_pretrained` for EP. A later
    call with the same spec and device type returns the same mesh (its groups are made once)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hp_dcp_hf.util.groups import reused

    sizes = parse_mesh(spec)
    if "ep" in sizes:
        raise MeshSpecError(f"mesh spec {format_mesh(sizes)}: ep overlays dp x tp; use distributed_config(spec) "
                         "with from_pretrained for expert parallelism")
    check_world_size(sizes, dist.get_world_size() if dist.is_initialized() else 1)
    return reused(("mesh", device_type, *sizes.items()),
                  lambda: init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes)))
