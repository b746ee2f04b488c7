"""What travels in a cooperative load: a rank's needs split where spans meet (:class:`Routed`, in the
order its stream sends them) and merged into :class:`Run` s, the regions sender and receiver cut
the same way. Pure numpy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Routed:
    """Parts of one rank's needs, split where spans meet, in the order its stream sends them:
    part ``i`` is bytes ``[start[i], end[i])`` of file ``file[i]``, inside span ``span[i]`` owned by
    ``owner[i]``, landing at byte ``offset[i]`` of need ``need[i]`` (in the order of the needs)."""

    owner: np.ndarray
    span: np.ndarray
    file: np.ndarray
    start: np.ndarray
    end: np.ndarray
    need: np.ndarray
    offset: np.ndarray

    def select(self, mask: np.ndarray) -> Routed:
        return Routed(*(getattr(self, f)[mask] for f in ("owner", "span", "file", "start", "end", "need", "offset")))

    @property
    def nbytes(self) -> int:
        return int((self.end - self.start).sum())


@dataclass(frozen=True)
class Run:
    """Parts of one need inside one span merged: ``rows`` ranges of ``nbytes / rows`` bytes, the
    first at byte ``start`` of the file, each ``stride`` after the previous one, landing one after
    the other from byte ``offset`` of the need's buffer (a block of a row-sharded box is one run)."""

    span: int
    need: int
    offset: int
    start: int
    nbytes: int
    rows: int
    stride: int


def runs(routed: Routed, cap: int) -> list[Run]:
    """``routed``'s parts merged into :class:`Run` s of at most ``cap`` bytes (or one part, cut to
    ``cap``): consecutive parts of one need in one span, of one length, contiguous in the need's
    buffer and evenly spaced in the file. Sender and receiver merge the same parts the same way."""
    out: list[Run] = []
    span, need, start, end, offset = (a.tolist() for a in (routed.span, routed.need, routed.start, routed.end,
                                                           routed.offset))
    i, count = 0, len(start)
    while i < count:
        length = end[i] - start[i]
        if length >= cap:  # one long range: contiguous pieces of at most cap
            for lo in range(0, length, cap):
                out.append(Run(span[i], need[i], offset[i] + lo, start[i] + lo, min(cap, length - lo), 1, 0))
            i += 1
            continue
        j, stride = i + 1, start[i + 1] - start[i] if i + 1 < count else 0
        limit = max(1, cap // length)
        while (j < count and j - i < limit and span[j] == span[i] and need[j] == need[i]
               and end[j] - start[j] == length and offset[j] == offset[j - 1] + length
               and start[j] - start[j - 1] == stride):
            j += 1
        rows = j - i
        out.append(Run(span[i], need[i], offset[i], start[i], rows * length, rows, stride if rows > 1 else 0))
        i = j
    return out
