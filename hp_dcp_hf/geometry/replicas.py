"""Which ranks hold the same local values of a tensor: its replicas.

A DTensor is replicated along its ``Replicate`` mesh dims, and also across every rank that holds
the same coordinate on a mesh of the same kind (FSDP's ``dp`` submesh is one of ``tp`` parallel
copies: those ranks are replicas its placements do not show). Ranks tell each other their
coordinate on each kind of mesh once (one ``all_gather_object`` of a few small tuples); a plain
tensor in a process group is held by every rank. A save writes each tensor from one replica.

Replicas also hold the same part of the model: pipeline stages lay their layers out on meshes of
the same kind (each stage's ``dp`` submesh), yet rank 0 of one stage holds none of another stage's
tensors. Ranks tell each other a digest of the names they hold (:func:`model_part`), and only ranks
of one part are replicas of each other.

Which replica writes: by default they take turns (a save spreads its writing); with ``lowest`` the
lowest rank of each group writes all of it, so that the pieces a rank writes are exactly those no
lower rank holds (a weight source that assembles on rank 0 then moves only what rank 0 lacks).

Plain local shards (torch's ``CheckpointableTensor`` protocol, :mod:`hp_dcp_hf.geometry.shards`) carry no
mesh: ranks tell each other their shards' geometry instead (each distinct geometry once, then one
small index per tensor, in name order). A rank whose geometry of a tensor equals this one's is a
replica of all of it; a shard whose global box several ranks list is written by one of them,
whatever else each holds.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp_dcp_hf.errors import LayoutError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.geometry.shards import ShardPiece, is_checkpointable, local_shard_pieces

MeshKind = tuple[tuple[str, ...] | None, tuple[int, ...]]
# A protocol tensor's geometry on one rank: (local shape, ((global box, local offsets) per piece)).
Geometry = tuple[tuple[int, ...], tuple[tuple[Box, tuple[int, ...]], ...]]


@dataclass(frozen=True)
class ShardGeometry:
    """What a rank tells the others about its protocol tensors: ``names`` (a digest of their sorted
    names), each distinct geometry once, and per name (in sorted order) the index of its geometry."""

    names: str
    geometries: tuple[Geometry, ...]
    index: tuple[int, ...]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> ShardGeometry:
        names = sorted(name for name, tensor in tensors.items() if is_checkpointable(tensor))
        distinct: dict[Geometry, int] = {}
        index = tuple(distinct.setdefault(_geometry(tensors[name], name), len(distinct)) for name in names)
        return cls(model_part(names), tuple(distinct), index)


def _geometry(tensor: torch.Tensor, key: str) -> Geometry:
    return tuple(tensor.shape), tuple((p.global_box, p.local_offsets) for p in local_shard_pieces(tensor, key=key))


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
    for all); this rank is ``rank``; ``lowest``: the lowest replica writes (see the module
    docstring). :meth:`gather` builds it."""

    def __init__(self, rank: int, world: int, every: Sequence[Mapping[MeshKind, tuple[int, ...] | None]],
                 parts: Sequence[str] | None = None, shards: Sequence[ShardGeometry | None] | None = None, *,
                 lowest: bool = False) -> None:
        self.rank, self.world = rank, world
        self.lowest = lowest
        parts = parts if parts is not None else [""] * world
        self.same_part = tuple(r for r in range(world) if parts[r] == parts[rank])
        # Protocol tensors: the ranks of this part that hold the same ones, with their geometries.
        # Without this rank's geometry (built by hand), each of its shards is its own alone.
        mine = shards[rank] if shards is not None else None
        self._shards: dict[int, ShardGeometry] = {}
        self._positions: dict[str, int] = {}
        if mine is not None and shards is not None:
            self._shards = {r: g for r in self.same_part if (g := shards[r]) is not None and g.names == mine.names}
        # kind -> coordinate -> the ranks of this rank's part holding it, in rank order
        self.holders: dict[MeshKind, dict[tuple[int, ...], list[int]]] = {}
        for other in self.same_part:
            for kind, coordinate in every[other].items():
                if coordinate is not None:
                    self.holders.setdefault(kind, {}).setdefault(tuple(coordinate), []).append(other)

    @classmethod
    def gather(cls, tensors: Mapping[str, torch.Tensor], *, lowest: bool = False) -> ReplicaGroups:
        """Every rank's coordinates and part (``tensors``: the ones it holds, by name), collectively
        (one ``all_gather_object``; none outside a process group)."""
        mine = (mesh_coordinates(list(tensors.values())), model_part(tensors), ShardGeometry.of(tensors))
        names = sorted(name for name, tensor in tensors.items() if is_checkpointable(tensor))
        if not (dist.is_available() and dist.is_initialized()):
            groups = cls(0, 1, [mine[0]], shards=[mine[2]], lowest=lowest)
        else:
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            groups = cls(dist.get_rank(), dist.get_world_size(), [e[0] for e in every], [e[1] for e in every],
                         [e[2] for e in every], lowest=lowest)
        groups.name_positions(names)
        return groups

    def name_positions(self, names: Sequence[str]) -> None:
        """The protocol tensors' names, sorted as :class:`ShardGeometry` lists them (the ranks'
        geometries are told by position)."""
        self._positions = {name: i for i, name in enumerate(names)}

    def _geometries(self, key: str | None) -> dict[int, Geometry]:
        """Each rank's geometry of protocol tensor ``key`` (of the ranks holding the same ones)."""
        position = self._positions.get(key) if key is not None else None
        if position is None or self.rank not in self._shards:
            return {}
        return {r: g.geometries[g.index[position]] for r, g in self._shards.items()}

    def group(self, tensor: torch.Tensor, key: str | None = None) -> tuple[int, ...]:
        """The ranks holding this rank's local values of ``tensor``, this one included, in rank
        order; empty when this rank holds none of it. A protocol tensor's (named ``key``) are the
        ranks whose geometry of it is this one's, local layout and padding alike."""
        if is_checkpointable(tensor):
            geometries = self._geometries(key)
            if not geometries:
                return (self.rank,) if local_shard_pieces(tensor, key=key) else ()
            mine = geometries[self.rank]
            if not mine[1]:
                return ()
            return tuple(r for r in sorted(geometries) if geometries[r] == mine)
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
        replica of each, replicas taking turns (the lowest, with ``lowest``)."""
        if isinstance(tensor, DTensor) and any(p.is_partial() for p in tensor.placements):
            raise LayoutError(f"Partial placements {tensor.placements} hold no savable value", key=key)
        group = self.group(tensor, key)
        return bool(group) and group.index(self.rank) == (0 if self.lowest else ordinal % len(group))

    def written_pieces(self, tensor: torch.Tensor, ordinal: int, key: str) -> tuple[ShardPiece, ...]:
        """The pieces of ``tensor`` (the ``ordinal``-th tensor saved) this rank writes. A DTensor's
        or plain tensor's: all of them on one replica (:meth:`writes`). A protocol tensor's: each
        shard by one of the ranks listing its global box, the ranks taking turns by shard and
        tensor; an element two ranks hold in shards of different boxes is written by both, and the
        save's coordinator refuses that (every element exactly once)."""
        pieces = local_shard_pieces(tensor, key=key)
        if not is_checkpointable(tensor):
            return pieces if self.writes(tensor, ordinal, key) else ()
        holders: dict[Box, list[int]] = {}
        for r, (_, shards) in sorted(self._geometries(key).items()):
            for box, _ in shards:
                holders.setdefault(box, []).append(r)
        mine = []
        for piece in pieces:
            ranks = holders.get(piece.global_box, [self.rank])
            turn = 0 if self.lowest else (ordinal + sum(piece.global_box.offsets)) % len(ranks)
            if ranks[turn] == self.rank:
                mine.append(piece)
        return tuple(mine)
