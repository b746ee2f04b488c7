"""Traced tensors as a structure shared by identical groups, bound to each group's checkpoint keys.

Every layer's experts are stacked by the same ops from tensors of the same shapes: the traced
pieces differ only by the checkpoint keys they name. A :class:`Structure` is such a traced tensor
whose pieces name *slots* (positions in a key list); a :class:`Bound` is a structure with the keys
of one group. Tracing, the exactness count and the blocks of a shard box are then computed once
per structure; symbolic ops never look at a piece's key, they only carry it, so binding is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hp_dcp_hf.mapping.symbolic import Piece, RegionTensor

_SLOTS: list[str] = []


def slot_key(slot: int) -> str:
    """The key a structure's pieces carry for ``slot`` (never a checkpoint key: it starts with NUL)."""
    while len(_SLOTS) <= slot:
        _SLOTS.append(f"\0{len(_SLOTS)}")
    return _SLOTS[slot]


def slot_of(key: str) -> int:
    return int(key[1:])


@dataclass(eq=False)
class Structure:
    """A traced tensor over slots; ``slot_ndims[s]``: the ndim of the tensor slot ``s`` stands for."""

    tensor: RegionTensor
    slot_ndims: tuple[int, ...]
    used_slots: frozenset[int] = field(init=False)
    covered: int = field(init=False)  # elements the pieces cover, counted once per structure
    blocks: dict[Any, list[Any]] = field(init=False, default_factory=dict)  # shard box -> its blocks

    def __post_init__(self) -> None:
        self.used_slots = frozenset(slot_of(p.key) for p in self.tensor.pieces)
        self.covered = sum(p.numel for p in self.tensor.pieces)

    @classmethod
    def source(cls, shape: Sequence[int], dtype: torch.dtype) -> Structure:
        """A whole checkpoint tensor of ``shape``: one slot."""
        return cls(RegionTensor.source(slot_key(0), shape, dtype), (len(shape),))

    def shifted(self, offset: int) -> RegionTensor:
        """The tensor with its slots renumbered from ``offset`` (an input among others of a group)."""
        if not offset:
            return self.tensor
        pieces = [replace(p, key=slot_key(slot_of(p.key) + offset)) for p in self.tensor.pieces]
        return RegionTensor(self.tensor.shape, pieces, self.tensor.dtype)


class Bound:
    """A :class:`Structure` with the checkpoint keys of its slots: a traced target of one group."""

    __slots__ = ("structure", "keys", "_pieces")

    def __init__(self, structure: Structure, keys: tuple[str, ...]) -> None:
        self.structure = structure
        self.keys = keys
        self._pieces: tuple[Piece, ...] | None = None

    @property
    def shape(self) -> torch.Size:
        return self.structure.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.structure.tensor.dtype

    def source_keys(self) -> set[str]:
        """Checkpoint keys this tensor reads from."""
        return {self.keys[slot] for slot in self.structure.used_slots}

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """The structure's pieces naming checkpoint keys (made on first use)."""
        if self._pieces is None:
            keys = self.keys
            self._pieces = tuple(replace(p, key=keys[slot_of(p.key)]) for p in self.structure.tensor.pieces)
        return self._pieces
