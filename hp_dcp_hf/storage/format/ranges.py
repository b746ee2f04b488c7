"""Boxes of row-major tensors as byte ranges, and coalescing of ranges into read requests.

Pure index arithmetic (no I/O, no torch.distributed), so it is tested against real bytes in
isolation. A box is contiguous in memory when every dim after the last one it cuts (``size <
shape``) is full; then it is one range. Otherwise it is one run per index of the dims before that
one, and these runs never touch (the cut dim leaves a hole between them), so no merging is needed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from hp_dcp_hf.geometry.box import Box


def _runs(shape: Sequence[int], itemsize: int, box: Box) -> tuple[int, list[int]] | None:
    """The last dim ``box`` cuts (-1 when it cuts none: one contiguous run) and the tensor's byte
    strides; ``None`` for an empty box. Raises ``ValueError`` when ``box`` is not inside ``shape``.

    One pass from the last dim: a load calls it twice per chunk before its first read (a third of
    the chunking of the MoE benchmark's 1,029 items a rank, when it listed the cut dims and the
    strides in separate passes)."""
    # Box checks its offsets are not negative; no Box.full(shape) made: a load spans every chunk's boxes
    offsets, sizes = box.offsets, box.sizes
    ndim = len(shape)
    if ndim != len(sizes):
        raise ValueError(f"box {box} is not inside a tensor of shape {tuple(shape)}")
    strides = [0] * ndim
    stride, last, empty = itemsize, -1, False
    for d in range(ndim - 1, -1, -1):
        n, size = shape[d], sizes[d]
        if offsets[d] + size > n:
            raise ValueError(f"box {box} is not inside a tensor of shape {tuple(shape)}")
        strides[d] = stride
        stride *= n
        empty = empty or size == 0
        if last < 0 and size < n:
            last = d
    return None if empty else (last, strides)


def box_byte_runs(shape: Sequence[int], itemsize: int, box: Box) -> tuple[np.ndarray, int]:
    """The starts (relative to the tensor's first byte, row-major order) of ``box``'s byte ranges,
    which all have the returned length: :func:`box_byte_ranges` as arrays."""
    runs = _runs(shape, itemsize, box)
    if runs is None:
        return np.zeros(0, dtype=np.int64), 0
    last, strides = runs
    if last < 0:
        return np.zeros(1, dtype=np.int64), math.prod(shape) * itemsize
    # Start of every run: the outer dims' indices, expanded in row-major order.
    starts = np.array([box.offsets[last] * strides[last]], dtype=np.int64)
    for d in range(last - 1, -1, -1):
        rows = np.arange(box.offsets[d], box.ends[d], dtype=np.int64) * strides[d]
        starts = (rows[:, None] + starts[None, :]).ravel()
    return starts, box.sizes[last] * strides[last]


def box_byte_ranges(shape: Sequence[int], itemsize: int, box: Box) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges (relative to the tensor's first byte) of ``box``, in row-major order."""
    starts, run = box_byte_runs(shape, itemsize, box)
    return [(s, s + run) for s in starts.tolist()]


def box_span(shape: Sequence[int], itemsize: int, box: Box) -> tuple[int, int, int]:
    """``(start of the first range, end of the last, number of ranges)`` of :func:`box_byte_ranges`,
    without listing the ranges (a row-sharded box has one per row); ``(0, 0, 0)`` when empty."""
    runs = _runs(shape, itemsize, box)
    if runs is None:
        return 0, 0, 0
    last, strides = runs
    if last < 0:
        return 0, math.prod(shape) * itemsize, 1
    offsets, sizes = box.offsets, box.sizes
    first = final = 0  # where the first and the last run start, but for the last cut dim's offset
    count = 1
    for d in range(last):
        first += offsets[d] * strides[d]
        final += (offsets[d] + sizes[d] - 1) * strides[d]
        count *= sizes[d]
    start = offsets[last] * strides[last]
    return first + start, final + start + sizes[last] * strides[last], count


def count_requests(spans: Iterable[tuple[int, int, int]]) -> int | None:
    """How many requests :func:`coalesce` with gap 0 makes of boxes' ranges, from their
    :func:`box_span` alone; ``None`` when two spans overlap (their ranges may interleave: coalesce
    them). A box's own ranges never touch, so only neighbouring boxes can merge, end to start."""
    ordered = sorted(s for s in spans if s[2])
    requests = sum(s[2] for s in ordered)
    for (_, end, _), (start, _, _) in zip(ordered, ordered[1:]):
        if start < end:
            return None
        requests -= start == end
    return requests


def split_box(box: Box, itemsize: int, max_bytes: int, shape: Sequence[int] | None = None) -> list[Box]:
    """``box`` cut along its outer dims into row-major sub-boxes of at most ``max_bytes`` each.

    Bounds the staging memory of one read: a tensor bigger than the budget is read a block of rows
    at a time, and a single row bigger than the budget is cut along the next dim, and so on. With
    the tensor's ``shape``, each part's span in the file (first to last byte, holes included) is
    bounded too: what a copy out of a mapping holds resident.
    """
    if max_bytes < itemsize:
        raise ValueError(f"budget of {max_bytes} bytes is smaller than one {itemsize}-byte element")

    def span(part: Box) -> int:
        first, last, _ = box_span(shape, itemsize, part) if shape is not None else (0, 0, 0)
        return last - first

    if box.ndim == 0 or (box.numel * itemsize <= max_bytes and span(box) <= max_bytes):
        return [box]
    dim = next((d for d in range(box.ndim) if box.sizes[d] > 1), None)
    if dim is None:  # one element, within budget
        return [box]
    slab = Box(box.offsets, (*box.sizes[:dim], 1, *box.sizes[dim + 1 :]))  # one index of dim
    step = max(1, max_bytes // (slab.numel * itemsize))
    if shape is not None:  # k slabs span (k - 1) strides of this dim plus one slab's span
        stride = math.prod(shape[dim + 1 :]) * itemsize
        step = max(1, min(step, (max_bytes - span(slab)) // stride + 1))
    parts: list[Box] = []
    for lo in range(0, box.sizes[dim], step):
        size = min(step, box.sizes[dim] - lo)
        offsets = (*box.offsets[:dim], box.offsets[dim] + lo, *box.offsets[dim + 1 :])
        sizes = (*box.sizes[:dim], size, *box.sizes[dim + 1 :])
        parts.extend(split_box(Box(offsets, sizes), itemsize, max_bytes, shape))
    return parts


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of a file, destined for ``owner``'s buffer at byte ``offset``."""

    start: int
    end: int
    owner: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Request:
    """One read of ``[start, end)``: its pieces in file order, separated by gaps read and dropped."""

    start: int
    end: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


_by_position = attrgetter("start", "end")


def coalesce(pieces: Iterable[Piece], gap: int = 0) -> list[Request]:
    """Pieces merged into requests, in file order.

    Neighbours separated by at most ``gap`` bytes share one request (the gap is read and dropped:
    fewer, larger requests pay off on object stores). Overlapping pieces go to separate requests,
    so that every request reads each of its bytes into exactly one place.
    """
    if gap < 0:
        raise ValueError(f"coalescing gap must be >= 0, got {gap}")
    requests: list[Request] = []
    current: list[Piece] = []
    pieces = list(pieces)
    # Usually in file order already; sorting anyway would allocate a key per piece, which on a
    # layout with one range per row is enough garbage to set off full collections.
    if any(_by_position(b) < _by_position(a) for a, b in zip(pieces, pieces[1:])):
        pieces.sort(key=_by_position)
    for piece in pieces:
        if current and not 0 <= piece.start - current[-1].end <= gap:
            requests.append(Request(current[0].start, current[-1].end, tuple(current)))
            current = []
        current.append(piece)
    if current:
        requests.append(Request(current[0].start, current[-1].end, tuple(current)))
    return requests


def request_views(request: Request, buffers: Sequence[memoryview] | Mapping[int, memoryview],
                  scratch: memoryview) -> list[memoryview]:
    """The memory ``request``'s bytes fill, in file order: each piece's bytes in its owner's buffer
    (``buffers[piece.owner]`` from ``piece.offset``), the bytes between and after them in ``scratch``
    (read and dropped; at most ``request.nbytes`` minus the pieces' bytes)."""
    views, position = [], request.start
    for piece in request.pieces:
        if piece.start > position:
            views.append(scratch[: piece.start - position])
        views.append(buffers[piece.owner][piece.offset : piece.offset + piece.nbytes])
        position = piece.end
    if request.end > position:
        views.append(scratch[: request.end - position])
    return views
