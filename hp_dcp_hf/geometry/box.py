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


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The elements at row-major flat indices ``[start, stop)`` of a tensor of ``shape``, as at
    most ``2 * ndim - 1`` disjoint boxes in flat order: a ragged head row, full rows, a ragged tail.

    The inverse of flattening a box into ranges: which part of a box falls inside a byte window of
    a file (a multipart upload's part), or which boxes make a flat share of a tensor (a replica's
    slice), without listing rows.
    """
    start, stop = max(start, 0), min(stop, math.prod(shape))
    if start >= stop:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    head, tail = start - first * inner, stop - last * inner

    def row(index: int, lo: int, hi: int) -> list[Box]:
        return [Box((index, *b.offsets), (1, *b.sizes)) for b in flat_range_boxes(shape[1:], lo, hi)]

    if first == last:
        return row(first, head, tail)
    boxes = row(first, head, inner) if head else []
    full_lo, full_hi = first + (head > 0), last + (tail == inner)
    if full_hi > full_lo:
        boxes.append(Box((full_lo, *(0,) * (len(shape) - 1)), (full_hi - full_lo, *shape[1:])))
    return boxes + (row(last, 0, tail) if tail < inner else [])
