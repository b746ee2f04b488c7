"""Which ranks hold the same local values of a tensor: its replicas.

A DTensor is replicated along its ``Replicate`` mesh dims, and also across every rank that holds
the same coordinate on a mesh of the same kind (FSDP's ``dp`` submesh is one of ``tp`` parallel
copies: those ranks are replicas its placements do not show). Ranks tell each other their
coordinate on each kind of mesh once (one ``all_gather_object`` of a few small tuples); a plain
tensor in a process group is held by every rank. A save writes each tensor from one replica; a
cooperative load reads each replicated byte once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp_dcp_hf.errors import LayoutError

MeshKind = tuple[tuple[str, ...] | None, tuple[int, ...]]


def _mesh_kind(tensor: DTensor) -> MeshKind:
    mesh = tensor.device_mesh
    return mesh.mesh_dim_names, tuple(mesh.shape)


class ReplicaGroups:
    """The replicas of ``tensors`` (see the module docstring); every rank builds it, collectively."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        kinds = {_mesh_kind(t): t.device_mesh.get_coordinate() for t in tensors if isinstance(t, DTensor)}
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        every = [kinds]
        if self.distributed:
            every = [None] * self.world
            dist.all_gather_object(every, {k: tuple(c) if c is not None else None for k, c in kinds.items()})
        # kind -> coordinate -> the ranks holding it, in rank order
        self.holders: dict[MeshKind, dict[tuple[int, ...], list[int]]] = {}
        for rank, rank_kinds in enumerate(every):
            for kind, coordinate in rank_kinds.items():
                if coordinate is not None:
                    self.holders.setdefault(kind, {}).setdefault(tuple(coordinate), []).append(rank)

    def group(self, tensor: torch.Tensor) -> tuple[int, ...]:
        """The ranks holding this rank's local values of ``tensor``, this one included, in rank
        order; empty when this rank holds none of it."""
        if not isinstance(tensor, DTensor):
            return tuple(range(self.world))
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
