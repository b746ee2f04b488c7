"""The union of every rank's needed bytes, per file: sorted disjoint byte ranges, a tensor whose
needed boxes tile it found as one range without listing its rows. Pure numpy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hp_dcp_hf.storage.format.ranges import box_byte_runs
from hp_dcp_hf.storage.read.needs import Need, Needs, StoredTensor, Tensors, table_of


def merge(starts: np.ndarray, ends: np.ndarray, gap: int) -> tuple[np.ndarray, np.ndarray]:
    """Ranges sorted and merged where they overlap, touch, or are at most ``gap`` apart."""
    if not len(starts):
        return starts, ends
    order = np.lexsort((ends, starts))
    starts, ends = starts[order], ends[order]
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


def union_of(table: Tensors, needs: Needs, first: np.ndarray, last: np.ndarray, files: int
           ) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`needed_union` of every rank's ``needs`` together, their extents ``first``, ``last``."""
    empty = np.zeros(0, dtype=np.int64)
    if not len(needs):
        return [(empty, empty) for _ in range(files)]
    rows = needs.rows
    # In byte order (tensors never share a first byte), identical boxes side by side, then dropped.
    mix = np.power(1_000_003, np.arange(table.ndim), dtype=np.int64)  # sizes folded into one key (may wrap)
    order = np.lexsort(((needs.sizes * mix).sum(1), first))
    rows, first, last = rows[order], first[order], last[order]
    duplicate = (first[1:] == first[:-1]) & (rows[1:, 1 + table.ndim :] == rows[:-1, 1 + table.ndim :]).all(1)
    keep = np.concatenate(([True], ~duplicate))
    distinct = Needs.from_rows(rows[keep], table)
    first, last = first[keep], last[keep]
    numel = distinct.sizes.prod(1)
    groups = np.concatenate(([0], np.flatnonzero(np.diff(distinct.tensor)) + 1))
    tensor = distinct.tensor[groups]
    reach = np.maximum.accumulate(last)
    overlaps = np.concatenate(([False], (first[1:] < reach[:-1]) & (distinct.tensor[1:] == distinct.tensor[:-1])))
    whole = ((np.add.reduceat(numel, groups) == table.shape[tensor].prod(1))
             & ~np.add.reduceat(overlaps, groups).astype(bool))
    bounds = [*groups.tolist(), len(distinct)]
    for g in np.flatnonzero(~whole).tolist():  # the rest: a grid, or listed range by range
        lo, hi, index = bounds[g], bounds[g + 1], int(tensor[g])
        whole[g] = _tiles(distinct.offsets[lo:hi], distinct.sizes[lo:hi], table.shape[index])
    full = tensor[whole]
    starts = [table.data_start[full]]
    ends = [table.data_start[full] + table.nbytes[full]]
    owners = [table.file[full]]
    for g in np.flatnonzero(~whole).tolist():
        index = int(tensor[g])
        stored, base = table.stored[index], int(table.data_start[index])
        for i in range(bounds[g], bounds[g + 1]):
            runs_, run = box_byte_runs(stored.shape, stored.itemsize, distinct.box(i, table))
            starts.append(runs_ + base)
            ends.append(runs_ + base + run)
            owners.append(np.full(len(runs_), stored.file, dtype=np.int64))
    start, end, file = np.concatenate(starts), np.concatenate(ends), np.concatenate(owners)
    return [merge(start[file == f], end[file == f], 0) for f in range(files)]


