"""Which ranks hold the same local values of a tensor: its replicas.

A DTensor is replicated along its ``Replicate`` mesh dims, and also across every rank that holds
the same coordinate on a mesh of the same kind (FSDP's ``dp`` submesh is one of ``tp`` parallel
copies: those ranks are replicas its placements do not show). Ranks tell each other their
coordinate on each kind of mesh once (one ``all_gather_object`` of a few small tuples); a plain
tensor in a process group is held by every rank. A save writes each tensor from one replica; a
cooperative load reads each replicated byte once.

Replicas also hold the same part of the model: pipeline stages lay their layers out on meshes of
the same kind (each stage's ``dp`` submesh), yet rank 0 of one stage holds none of another stage's
tensors. Ranks tell each other a digest of the names they hold (:func:`model_part`), and only ranks
of one part are replicas of each other.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp_dcp_hf.errors import LayoutError

MeshKind = tuple[tuple[str, ...] | None, tuple[int, ...]]


def _mesh_kind(tensor: DTensor) -> MeshKind:
    mesh = tensor.device_mesh
    return mesh.mesh_dim_names, tuple(mesh.shape)


def mesh_coordinates(tensors: Sequence[torch.Tensor]) -> dict[MeshKind, tuple[int, ...] | None]:
    """This rank's coordinate on each kind of mesh its DTensors live on (what ranks exchange)."""
    return {_mesh_kind(t): _coordinate(t) for t in tensors if isinstance(t, DTensor)}


def model_part(names: Collection[str]) -> str:
    """A digest of the tensor names a rank holds: ranks of one pipeline stage agree, others differ."""
    return hashlib.sha1("\n".join(sorted(names)).encode()).hexdigest()


def _coordinate(tensor: DTensor) -> tuple[int, ...] | None:
    coordinate = tensor.device_mesh.get_coordinate()
    return tuple(coordinate) if coordinate is not None else None


class ReplicaGroups:
    """The replicas of the tensors of ``world`` ranks (see the module docstring), from every rank's
    :func:`mesh_coordinates` (``every[r]``) and :func:`model_part` (``parts[r]``; default: one part
    for all); this rank is ``rank``. :meth:`gather` builds it."""

    def __init__(self, rank: int, world: int, every: Sequence[Mapping[MeshKind, tuple[int, ...] | None]],
                 parts: Sequence[str] | None = None) -> None:
        self.rank, self.world = rank, world
        parts = parts if parts is not None else [""] * world
        self.same_part = tuple(r for r in range(world) if parts[r] == parts[rank])
        # kind -> coordinate -> the ranks of this rank's part holding it, in rank order
        self.holders: dict[MeshKind, dict[tuple[int, ...], list[int]]] = {}
        for other in self.same_part:
            for kind, coordinate in every[other].items():
                if coordinate is not None:
                    self.holders.setdefault(kind, {}).setdefault(tuple(coordinate), []).append(other)

    @classmethod
    def gather(cls, tensors: Mapping[str, torch.Tensor]) -> ReplicaGroups:
        """Every rank's coordinates and part (``tensors``: the ones it holds, by name), collectively
        (one ``all_gather_object``; none outside a process group)."""
        mine = (mesh_coordinates(list(tensors.values())), model_part(tensors))
        if not (dist.is_available() and dist.is_initialized()):
            return cls(0, 1, [mine[0]])
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return cls(dist.get_rank(), dist.get_world_size(), [e[0] for e in every], [e[1] for e in every])

    def group(self, tensor: torch.Tensor) -> tuple[int, ...]:
        """The ranks holding this rank's local values of ``tensor``, this one included, in rank
        order; empty when this rank holds none of it."""
        if not isinstance(tensor, DTensor):
            return self.same_part
        mesh, coordinate = tensor.device_mesh, tensor.device_mesh.get_coordinate()
        if coordinate is None:
            return ()
        if any(p.is_partial() for p in tensor.placements):
            return (self.rank,)  # partial sums: no two ranks hold the same values
        holders = self.holders.get(_mesh_kind(tensor), {})
        replicated = [d for d, p in enumerate(tensor.placements) if p.is_replicate()]
        ranks: set[int] = set()
        for values in itertools.product(*(range(mesh.shape[d]) for d in replicated)):
            other = list(coordinate)
            for d, value in zip(replicated, values):
                other[d] = value
            ranks.update(holders.get(tuple(other), ()))
        return tuple(sorted(ranks | {self.rank}))

    def writes(self, tensor: torch.Tensor, ordinal: int, key: str) -> bool:
        """Whether this rank writes its pieces of ``tensor``, the ``ordinal``-th tensor saved: one
        replica of each, replicas taking turns."""
        if isinstance(tensor, DTensor) and any(p.is_partial() for p in tensor.placements):
            raise LayoutError(f"Partial placements {tensor.placements} hold no savable value", key=key)
        group = self.group(tensor)
        return bool(group) and group.index(self.rank) == ordinal % len(group)
