"""The union of every rank's needed bytes, per file: sorted disjoint byte ranges, a tensor whose
needed boxes tile it found as one range without listing its rows. Pure numpy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hp_dcp_hf.storage.read.needs import BYTE_MASK, Need, Needs, StoredTensor, Tensors, byte_key, table_of


def merge(starts: np.ndarray, ends: np.ndarray, gap: int) -> tuple[np.ndarray, np.ndarray]:
    """Ranges sorted and merged where they overlap, touch, or are at most ``gap`` apart."""
    if not len(starts):
        return starts, ends
    order = np.lexsort((ends, starts))
    return _merge_sorted(starts[order], ends[order], gap)


def _merge_sorted(starts: np.ndarray, ends: np.ndarray, gap: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`merge` of non-empty ranges already sorted by start."""
    if not len(starts):
        return starts, ends
    reach = np.maximum.accumulate(ends)
    breaks = np.nonzero(starts[1:] > reach[:-1] + gap)[0] + 1
    first = np.concatenate(([0], breaks))
    last = np.concatenate((breaks - 1, [len(starts) - 1]))
    return starts[first], reach[last]


def _tiles(offsets: np.ndarray, sizes: np.ndarray, shape: np.ndarray) -> bool:
    """Whether the distinct boxes (rows) tile a tensor of ``shape``: along every dim their extents
    partition it, and there are as many boxes as cells of that grid (each box is then one cell,
    each cell one box: row blocks, column blocks, FSDP x TP grids); else no two may overlap and
    their elements must sum to the tensor's (checked pairwise, a block of rows at a time)."""
    cells = 1
    for d in range(offsets.shape[1]):
        extent = int(shape[d]) + 1  # (offset, size) pairs as one sortable integer: offset-major
        pairs = np.unique(offsets[:, d] * extent + sizes[:, d])
        starts, lengths = pairs // extent, pairs % extent
        if starts[0] or np.any(starts[1:] != (starts + lengths)[:-1]) or starts[-1] + lengths[-1] != shape[d]:
            cells = -1
            break
        cells *= len(pairs)
    if cells == len(offsets):
        return True
    if sizes.prod(1).sum() != shape.prod():
        return False
    ends = offsets + sizes
    for lo in range(0, len(offsets), 512):
        a_off, a_end = offsets[lo : lo + 512, None, :], ends[lo : lo + 512, None, :]
        overlap = ((a_off < ends[None]) & (offsets[None] < a_end)).all(2)
        overlap[np.arange(overlap.shape[0]), np.arange(lo, lo + overlap.shape[0])] = False
        if overlap.any():
            return False
    return True


def needed_union(
    tensors: Sequence[StoredTensor] | Tensors, needs_by_rank: Sequence[Sequence[Need] | Needs], files: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per file, the sorted disjoint ``(starts, ends)`` of the bytes at least one rank needs.

    A tensor whose distinct needed boxes tile it is one range, found without listing rows: the
    boxes' elements sum to the tensor's and, in byte order, their extents do not overlap (row
    blocks), or else they tile it as a grid (:func:`_tiles`). Others (a pipeline stage's part,
    overlapping layouts) are listed range by range."""
    table = table_of(tensors)
    needs = concatenated([Needs.of(n, table) for n in needs_by_rank], table)
    return union_of(table, needs, *needs.extents(table), files)


def concatenated(needs_by_rank: Sequence[Needs], table: Tensors) -> Needs:
    parts = [n.rows for n in needs_by_rank]
    return Needs.from_rows(np.concatenate(parts) if parts else np.zeros((0, 1 + 2 * table.ndim), dtype=np.int64),
                           table)


def union_of(table: Tensors, needs: Needs, first: np.ndarray, last: np.ndarray, files: int,
             order: np.ndarray | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`needed_union` of every rank's ``needs`` together, their extents ``first``, ``last``
    (``order``: a stable sort of ``first``, when known).

    A box that is one run of bytes (a block of rows: its extent holds exactly its bytes) is its
    extent, so tensors whose every needed box is one are merged from the extents in ``order`` in
    one pass, without comparing boxes (FSDP's shards: all of them); only the others' boxes are
    deduplicated and tested for tiling."""
    empty = np.zeros(0, dtype=np.int64)
    if not len(needs):
        return [(empty, empty) for _ in range(files)]
    if order is None:
        order = np.argsort(first, kind="stable")
    rows, ndim, tensor = needs.rows, table.ndim, needs.tensor
    nbytes = table.itemsize[tensor]
    for d in range(ndim):
        nbytes *= rows[:, 1 + ndim + d]
    runs = (last - first == nbytes) & (nbytes > 0)
    boxed = np.zeros(len(table), dtype=bool)  # tensors with a box of several runs (or none)
    boxed[tensor[~runs]] = True
    in_boxed = boxed[tensor][order]
    solid = order[~in_boxed] if in_boxed.any() else order
    starts, ends = _merge_sorted(first[solid], last[solid], 0)
    start, end, file = _boxed_ranges(table, needs, first, last, order[in_boxed])
    if len(start):
        starts, ends = merge(np.concatenate((starts, byte_key(file, start))),
                             np.concatenate((ends, byte_key(file, end))), 0)
    cuts = np.searchsorted(starts, byte_key(np.arange(files + 1), 0))  # a range never crosses files
    return [(starts[lo:hi] & BYTE_MASK, ends[lo:hi] & BYTE_MASK) for lo, hi in zip(cuts[:-1], cuts[1:])]


def _boxed_ranges(table: Tensors, needs: Needs, first: np.ndarray, last: np.ndarray, order: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The byte ranges ``(start, end, file)`` of the needs ``order`` (a stable sort of some by
    first byte, every need of their tensors). A tensor whose distinct needed boxes tile it is one
    range, found without listing rows: the boxes' elements sum to the tensor's and, in byte order,
    their extents do not overlap (row blocks), or else they tile it as a grid (:func:`_tiles`).
    Others (a pipeline stage's part, overlapping layouts) are listed range by range."""
    if not len(order):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    rows, ndim = needs.rows, table.ndim
    index = _distinct_in_byte_order(needs, first, order)
    first, last, tensors = first[index], last[index], rows[:, 0][index]
    numel = np.multiply.reduce([rows[:, 1 + ndim + d][index] for d in range(ndim)])
    groups = np.concatenate(([0], np.flatnonzero(np.diff(tensors)) + 1))
    tensor = tensors[groups]
    reach = np.maximum.accumulate(last)
    overlaps = np.concatenate(([False], (first[1:] < reach[:-1]) & (tensors[1:] == tensors[:-1])))
    whole = ((np.add.reduceat(numel, groups) == table.shape[tensor].prod(1))
             & ~np.add.reduceat(overlaps, groups).astype(bool))
    bounds = np.append(groups, len(index))
    for g in np.flatnonzero(~whole).tolist():  # the rest: a grid, or listed range by range
        box = rows[index[bounds[g] : bounds[g + 1]]]
        whole[g] = _tiles(box[:, 1 : 1 + ndim], box[:, 1 + ndim :], table.shape[tensor[g]])
    full = tensor[whole]
    lo = bounds[:-1][~whole]
    listed = Needs.from_rows(rows[index[consecutive(lo, bounds[1:][~whole] - lo)]], table)
    need, begin, length, _ = listed.byte_runs(table)
    start = np.concatenate((table.data_start[full], begin))
    end = np.concatenate((table.data_start[full] + table.nbytes[full], begin + length))
    file = np.concatenate((table.file[full], table.file[listed.tensor[need]]))
    return start, end, file


def _distinct_in_byte_order(needs: Needs, first: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The distinct boxes of ``needs`` (indices) by first byte (tensors never share one), from
    ``order``, a stable sort of ``first`` (cheap: each rank's needs are a run in byte order), where
    identical boxes are neighbours unless boxes of one first byte differ in size: then by size too."""
    duplicate, mixed = _neighbours(needs, first, order)
    if mixed:
        sizes = needs.sizes
        mix = np.power(1_000_003, np.arange(sizes.shape[1]), dtype=np.int64)  # sizes folded into one key (may wrap)
        order = np.lexsort(((sizes * mix).sum(1), first))
        duplicate, _ = _neighbours(needs, first, order)
    return order[np.concatenate(([True], ~duplicate))]


def _neighbours(needs: Needs, first: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, bool]:
    """Per pair of neighbours in ``order``, whether they are the same box; and whether any two of
    one first byte differ in size. Column by column: numpy compares short rows slowly."""
    first = first[order]
    same = first[1:] == first[:-1]
    columns = needs.rows.shape[1] // 2
    sized = np.logical_and.reduce([(c[1:] == c[:-1]) for c in (needs.rows[:, 1 + columns + d][order]
                                                                for d in range(columns))])
    return same & sized, bool(np.any(same & ~sized))


def consecutive(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``first[i], first[i] + 1, ...`` (``counts[i]`` of them) for every ``i``, concatenated."""
    return np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
