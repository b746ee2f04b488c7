"""The parts of a multipart upload: fixed byte ranges of the final files, and which rank assembles each.

Object stores take a large object as numbered parts (S3: at least 5 MiB each except the last, at
most 10,000), uploaded independently and joined by one final request. The ranks of a save hold
strided pieces of every file, so each part is assembled by one rank from the bytes all ranks send
it. Every rank derives the same parts and owners from the files' sizes alone (pure arithmetic, no
torch.distributed): parts are taken ``world`` at a time in file order, one *round*, in which every
rank assembles at most one part, the largest parts going to the ranks that have uploaded least so
far, so that ranks upload similar byte counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_PART_BYTES = 5 * 2**20
"""S3's smallest part (every part but an object's last)."""

MAX_PARTS = 10_000
"""S3's most parts per object."""


@dataclass(frozen=True)
class Part:
    """Bytes ``[start, end)`` of ``file``, uploaded as part ``number`` (1-based) of its upload."""

    file: str
    number: int
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def part_size(file_size: int, part_bytes: int) -> int:
    """``part_bytes``, or the smallest whole MiB that keeps a file of ``file_size`` within
    :data:`MAX_PARTS` parts."""
    if part_bytes < MIN_PART_BYTES:
        raise ValueError(f"parts must hold at least {MIN_PART_BYTES} bytes (S3's minimum), got {part_bytes}")
    needed = math.ceil(file_size / MAX_PARTS)
    return max(part_bytes, math.ceil(needed / 2**20) * 2**20)


def file_parts(files: Sequence[tuple[str, int]], part_bytes: int) -> list[Part]:
    """The parts of every ``(name, size)`` file, in file order."""
    parts: list[Part] = []
    for name, size in files:
        step = part_size(size, part_bytes)
        for number, start in enumerate(range(0, max(size, 1), step), start=1):
            parts.append(Part(name, number, start, min(start + step, size)))
    return parts


def rounds(parts: Sequence[Part], world: int) -> list[tuple[tuple[int, Part], ...]]:
    """``parts`` in groups of ``world``, each as ``(owner rank, part)`` pairs in file order."""
    uploaded = [0] * world
    grouped = []
    for i in range(0, len(parts), world):
        group = parts[i : i + world]
        ranks = sorted(range(world), key=lambda r: (uploaded[r], r))
        largest_first = sorted(range(len(group)), key=lambda k: (-group[k].nbytes, k))
        owners = dict(zip(largest_first, ranks))
        for k, rank in owners.items():
            uploaded[rank] += group[k].nbytes
        grouped.append(tuple((owners[k], part) for k, part in enumerate(group)))
    return grouped
