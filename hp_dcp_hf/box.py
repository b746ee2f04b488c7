"""Boxes: axis-aligned regions of an N-d index space.

The common currency of every layer: a rank's shard of a parameter is a set of boxes of the
parameter, a read is a box of a checkpoint tensor, a byte range is a box flattened. Pure Python,
no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """``offsets[d] <= index[d] < offsets[d] + sizes[d]`` for every dim ``d``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"Box rank mismatch: offsets {self.offsets} vs sizes {self.sizes}")
        if any(s < 0 for s in self.sizes) or any(o < 0 for o in self.offsets):
            raise ValueError(f"Box with negative offsets or sizes: {self.offsets}, {self.sizes}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def is_empty(self) -> bool:
        return any(s == 0 for s in self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common part, or None when it is empty."""
        if self.ndim != other.ndim:
            raise ValueError(f"Cannot intersect boxes of rank {self.ndim} and {other.ndim}")
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a, b) for a, b in zip(self.ends, other.ends))
        if any(h <= low for low, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi)))

    def contains(self, other: Box) -> bool:
        return all(a <= b for a, b in zip(self.offsets, other.offsets)) and all(
            a >= b for a, b in zip(self.ends, other.ends)
        )

    def relative_to(self, origin: Sequence[int]) -> Box:
        """The same box in coordinates whose zero is ``origin``."""
        return Box(tuple(o - z for o, z in zip(self.offsets, origin)), self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


def disjoint_cover(boxes: Sequence[Box], shape: Sequence[int]) -> bool:
    """True when ``boxes`` tile ``Box.full(shape)`` exactly: inside, no overlap, nothing left out."""
    full = Box.full(shape)
    if not all(full.contains(b) for b in boxes):
        return False
    if sum(b.numel for b in boxes) != full.numel:
        return False
    return all(a.intersect(b) is None for i, a in enumerate(boxes) for b in boxes[i + 1 :])
