"""Span ownership: the cluster reads every needed checkpoint byte once, in large contiguous reads.

Every rank needs some boxes of some stored tensors (its *needs*: the chunks of its plan). From
every rank's needs, which the ranks gather as integers, each rank computes the same plan:

1. the union of the byte ranges any rank needs, per file (a tensor whose needed boxes tile it is
   one range, without listing rows);
2. cut into contiguous *spans*: runs of needed bytes, holes nobody needs bridged only up to a
   small gap, cut where a stretch of at least ``OWN_RUN_BYTES`` that one rank alone needs begins
   or ends (that rank can read it without sending a byte), each piece cut into near-equal spans
   of at least ``span_bytes`` (page aligned);
3. each span owned by one rank: spans one rank alone needs first, then the others, in file
   order, the rank that needs most of it while its load stays within a fair share (bytes /
   ranks, plus a span), else the least loaded rank on a node that needs it, else the least
   loaded rank.

Owners read their spans; every rank then receives, from each owner, the bytes of its own needs
inside that owner's spans, as a stream in file order (:meth:`ClusterPlan.route`): sender and
receiver derive the same stream from the receiver's needs alone. Pure index arithmetic (numpy, no
torch.distributed), unit-tested in one process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.storage.format.ranges import box_byte_runs

SPAN_BYTES = 8 * 2**20
"""Smallest span where the needed bytes run that long: a request moves several MiB per round trip."""

MAX_SPAN_BYTES = 64 * 2**20
"""Largest span: an owner holds a span's bytes until every rank needing them has received them."""

OWN_RUN_BYTES = 2**20
"""Shortest stretch that one rank alone needs made spans of its own: its owner is then that rank,
and the exchange moves none of it (shorter ones ride in the spans around them)."""

SPAN_GAP = 64 * 2**10
"""Holes nobody needs that a span bridges on remote stores (a request costs more than this)."""

_PAGE = 4096


@dataclass(frozen=True)
class StoredTensor:
    """Where one stored tensor's bytes are: ``file`` (an index into the plan's files), its first
    byte, shape and element size."""

    file: int
    data_start: int
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Need:
    """A box (in the stored tensor's coordinates) of stored tensor ``tensor`` that a rank reads."""

    tensor: int
    box: Box


class Tensors:
    """The stored tensors as arrays, shapes padded at the front to the largest rank (a padded box
    starts at 0 and spans 1 there: its bytes are the same)."""

    def __init__(self, tensors: Sequence[StoredTensor]) -> None:
        self.stored = list(tensors)
        self.ndim = max([len(t.shape) for t in self.stored] + [1])
        count, ndim = len(self.stored), self.ndim
        self.file = np.asarray([t.file for t in self.stored], dtype=np.int64)
        self.data_start = np.asarray([t.data_start for t in self.stored], dtype=np.int64)
        self.itemsize = np.asarray([t.itemsize for t in self.stored], dtype=np.int64)
        self.rank = np.asarray([len(t.shape) for t in self.stored], dtype=np.int64)
        self.shape = np.ones((count, ndim), dtype=np.int64)
        for i, t in enumerate(self.stored):
            if t.shape:
                self.shape[i, ndim - len(t.shape) :] = t.shape
        # byte strides: each dim's step is the bytes of one index of it
        self.strides = np.flip(np.cumprod(np.flip(self.shape, 1), 1), 1) // self.shape * self.itemsize[:, None]
        self.nbytes = self.shape.prod(1) * self.itemsize

    def __len__(self) -> int:
        return len(self.stored)


@dataclass(frozen=True)
class Needs:
    """One rank's needs as one int64 array, in its order: row ``i`` is need ``i``'s stored tensor,
    then its box's offsets and sizes (padded at the front, as :class:`Tensors` pads shapes): the
    form ranks gather, kept as is."""

    rows: np.ndarray

    @classmethod
    def of(cls, needs: Sequence[Need] | Needs, table: Tensors) -> Needs:
        if isinstance(needs, Needs):
            return needs
        rows = np.zeros((len(needs), 1 + 2 * table.ndim), dtype=np.int64)
        rows[:, 1 + table.ndim :] = 1
        for i, need in enumerate(needs):
            pad = table.ndim - need.box.ndim
            rows[i, 0] = need.tensor
            rows[i, 1 + pad : 1 + table.ndim] = need.box.offsets
            rows[i, 1 + table.ndim + pad :] = need.box.sizes
        return cls(rows)

    @classmethod
    def from_rows(cls, rows: np.ndarray, table: Tensors) -> Needs:
        return cls(rows.reshape(-1, 1 + 2 * table.ndim))

    @property
    def tensor(self) -> np.ndarray:
        return self.rows[:, 0]

    @property
    def offsets(self) -> np.ndarray:
        return self.rows[:, 1 : 1 + self.rows.shape[1] // 2]

    @property
    def sizes(self) -> np.ndarray:
        return self.rows[:, 1 + self.rows.shape[1] // 2 :]

    def __len__(self) -> int:
        return len(self.tensor)

    def box(self, i: int, table: Tensors) -> Box:
        """Need ``i``'s box in its tensor's own rank."""
        rank = int(table.rank[self.tensor[i]])
        offsets, sizes = self.offsets[i].tolist(), self.sizes[i].tolist()
        return Box(tuple(offsets[len(offsets) - rank :]), tuple(sizes[len(sizes) - rank :])) if rank else Box((), ())

    def extents(self, table: Tensors) -> tuple[np.ndarray, np.ndarray]:
        """Each need's first and last byte (exclusive) as sortable keys (:func:`_key`: file, byte)."""
        t = self.tensor
        strides = table.strides[t]
        first = (self.offsets * strides).sum(1)
        last = ((self.offsets + self.sizes - 1) * strides).sum(1) + table.itemsize[t]
        base = table.data_start[t]
        return _key(table.file[t], base + first), _key(table.file[t], base + last)


def encode_needs(needs: Sequence[Need] | Needs, tensors: Sequence[StoredTensor] | Tensors) -> np.ndarray:
    """``needs`` as one flat int64 array (tensor index, padded offsets, padded sizes each): what
    ranks gather."""
    return Needs.of(needs, _table(tensors)).rows.reshape(-1)


def decode_needs(flat: np.ndarray, tensors: Sequence[StoredTensor] | Tensors) -> Needs:
    """The inverse of :func:`encode_needs`."""
    return Needs.from_rows(np.asarray(flat, dtype=np.int64), _table(tensors))


def _table(tensors: Sequence[StoredTensor] | Tensors) -> Tensors:
    return tensors if isinstance(tensors, Tensors) else Tensors(tensors)


def _merge(starts: np.ndarray, ends: np.ndarray, gap: int) -> tuple[np.ndarray, np.ndarray]:
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
    table = _table(tensors)
    needs = _concatenated([Needs.of(n, table) for n in needs_by_rank], table)
    return _union(table, needs, *needs.extents(table), files)


def _concatenated(needs_by_rank: Sequence[Needs], table: Tensors) -> Needs:
    parts = [n.rows for n in needs_by_rank]
    return Needs.from_rows(np.concatenate(parts) if parts else np.zeros((0, 1 + 2 * table.ndim), dtype=np.int64),
                           table)


def _union(table: Tensors, needs: Needs, first: np.ndarray, last: np.ndarray, files: int
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
    return [_merge(start[file == f], end[file == f], 0) for f in range(files)]




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
class ClusterPlan:
    """The spans of a load (arrays in file, then byte order) and their owners, the same on every
    rank; ``file`` indexes ``files``, the checkpoint's file names, and ``table`` its stored tensors."""

    files: tuple[str, ...]
    file: np.ndarray
    start: np.ndarray
    end: np.ndarray
    owner: np.ndarray
    needed: np.ndarray  # bytes of each span some rank needs (the rest are holes bridged)
    world: int
    table: Tensors = field(repr=False, compare=False)
    needers: tuple[np.ndarray, np.ndarray] = field(repr=False, compare=False)
    """Per span, the ranks whose needs' extents reach into it (CSR: ``indptr``, ranks): a superset
    of the ranks an owner sends to."""

    @classmethod
    def build(
        cls,
        tensors: Sequence[StoredTensor] | Tensors,
        needs_by_rank: Sequence[Sequence[Need] | Needs],
        files: Sequence[str],
        *,
        nodes: Sequence[int] | None = None,
        gap: int = 0,
        span_bytes: int = SPAN_BYTES,
    ) -> ClusterPlan:
        """The plan of ``len(needs_by_rank)`` ranks (``nodes[r]``: rank ``r``'s node, default one
        node per rank); holes of at most ``gap`` bytes inside a span are read and dropped."""
        table = _table(tensors)
        needs_by_rank = [Needs.of(n, table) for n in needs_by_rank]
        world = len(needs_by_rank)
        every = _concatenated(needs_by_rank, table)
        first, last = every.extents(table)
        union = _union(table, every, first, last, len(files))
        bounds = np.cumsum([0, *map(len, needs_by_rank)])
        extents = [(first[lo:hi], last[lo:hi]) if hi > lo else None for lo, hi in zip(bounds[:-1], bounds[1:])]
        total = sum(int((e - s).sum()) for s, e in union)
        # about a sixteenth of a rank's share: owners balance to within that (a span's requests
        # are cut to the reader's size whatever its length)
        target = max(span_bytes, min(MAX_SPAN_BYTES, -(-total // (16 * world))))
        lows, highs = _cut(*_keyed([_merge(starts, ends, gap) for starts, ends in union]),
                           _sole_stretches(extents), target)
        needed_lo, needed_hi = _keyed(union)
        needed = _covered(needed_lo, needed_hi, highs) - _covered(needed_lo, needed_hi, lows)
        indptr, needers, nbytes = _needers(lows, highs, first, last, np.repeat(np.arange(world), np.diff(bounds)))
        owner = _assign(highs - lows, indptr, needers, nbytes,
                        np.asarray(nodes if nodes is not None else range(world), dtype=np.int64), target)
        return cls(tuple(files), lows >> _FILE_SHIFT, lows & _BYTE_MASK, highs & _BYTE_MASK, owner, needed, world,
                   table, (indptr, needers))

    def __len__(self) -> int:
        return len(self.start)

    def needing(self, spans: np.ndarray) -> np.ndarray:
        """The ranks that may need bytes of ``spans`` (sorted): the only ones their owner routes."""
        indptr, ranks = self.needers
        return np.unique(ranks[_ranges(indptr[spans], indptr[spans + 1] - indptr[spans])])

    def owned(self, rank: int) -> np.ndarray:
        """Indices of the spans ``rank`` reads, in file order."""
        return np.nonzero(self.owner == rank)[0]

    def bytes_read(self, rank: int | None = None) -> int:
        """Bytes ``rank`` (default: the whole cluster) reads from storage."""
        sizes = self.end - self.start
        return int(sizes.sum() if rank is None else sizes[self.owner == rank].sum())

    def route(self, needs: Sequence[Need] | Needs, within: np.ndarray | None = None) -> Routed:
        """``needs`` (one rank's, in its order) as the parts its owners send it, in stream order:
        sorted by file and start (stably: a byte two needs share is sent once for each), split
        where spans meet. ``within``: spans to route into (say, one owner's); needs wholly outside
        them are skipped without listing their rows."""
        table = self.table
        needs = Needs.of(needs, table)
        chosen = np.arange(len(needs))
        if within is not None:
            within = np.sort(within)
            lo, hi = _touching(self._keys, *needs.extents(table))
            after = np.searchsorted(within, lo)  # the first span of within at or after each need's first
            padded = np.append(within, len(self))  # past every span: "none after"
            chosen = np.flatnonzero(padded[after] <= hi)
        file, start, end, need, offset = [], [], [], [], []
        for index in chosen.tolist():
            tensor = table.stored[needs.tensor[index]]
            starts, run = box_byte_runs(tensor.shape, tensor.itemsize, needs.box(index, table))
            file.append(np.full(len(starts), tensor.file, dtype=np.int64))
            start.append(starts + tensor.data_start)
            end.append(starts + (tensor.data_start + run))
            need.append(np.full(len(starts), index, dtype=np.int64))
            offset.append(np.arange(len(starts), dtype=np.int64) * run)
        parts = [np.concatenate(a) if a else np.zeros(0, dtype=np.int64) for a in (file, start, end, need, offset)]
        order = np.lexsort((parts[1], parts[0]))  # stable: ties keep need order
        file_, start_, end_, need_, offset_ = (a[order] for a in parts)
        routed = self._split(file_, start_, end_, need_, offset_)
        return routed if within is None else routed.select(np.isin(routed.span, within, assume_unique=True))

    @cached_property
    def _keys(self) -> np.ndarray:
        return _key(self.file, self.start)

    def _split(self, file, start, end, need, offset) -> Routed:
        """Each range cut where it crosses a span boundary, with its span and owner."""
        keys = self._keys
        first = np.searchsorted(keys, _key(file, start), side="right") - 1
        last = np.searchsorted(keys, _key(file, end - 1), side="right") - 1
        if len(first) and (np.any(first < 0) or np.any(self.file[first] != file) or np.any(self.end[last] < end)):
            raise ValueError("a needed byte range lies outside every span: the plan was built from other needs")
        counts = last - first + 1
        if bool((counts == 1).all()):
            return Routed(self.owner[first], first, file, start, end, need, offset)
        span, at = _ranges(first, counts), np.repeat(np.arange(len(first)), counts)
        lo, hi = np.maximum(start[at], self.start[span]), np.minimum(end[at], self.end[span])
        return Routed(self.owner[span], span, file[at], lo, hi, need[at], offset[at] + lo - start[at])


_FILE_SHIFT = 43
_BYTE_MASK = (1 << _FILE_SHIFT) - 1


def _key(file, position):
    """One sortable integer per (file, byte): files are far below 2**20, bytes below 2**43 (a page
    of a key is a page of its byte)."""
    return np.asarray(file, dtype=np.int64) * (1 << _FILE_SHIFT) + np.asarray(position, dtype=np.int64)


def _page_floor(positions: np.ndarray) -> np.ndarray:
    """``positions`` rounded down to a page: spans start where ``O_DIRECT`` can."""
    return positions - positions % _PAGE


def _touching(keys: np.ndarray, first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For byte extents (keys), the first and last span (of those starting at ``keys``) they may
    touch, clipped to the plan."""
    lo = np.clip(np.searchsorted(keys, first, side="right") - 1, 0, max(len(keys) - 1, 0))
    hi = np.clip(np.searchsorted(keys, last - 1, side="right") - 1, lo, max(len(keys) - 1, 0))
    return lo, hi


def _needers(lows: np.ndarray, highs: np.ndarray, first: np.ndarray, last: np.ndarray, rank: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per span (``[lows, highs)``, keys), the ranks needing bytes in it and about how many (the
    extents ``first``, ``last`` of every rank's needs, need ``i`` of rank ``rank[i]``, inside the
    span: a preference for owners, not an exact count), as ``(indptr, ranks, nbytes)``: span
    ``s``'s are ``ranks[indptr[s]:indptr[s+1]]``."""
    if not len(lows) or not len(first):
        return np.zeros(len(lows) + 1, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    lo, hi = _touching(lows, first, last)
    counts = hi - lo + 1
    at = np.repeat(np.arange(len(lo)), counts)
    span = _ranges(lo, counts)
    inside = np.maximum(np.minimum(last[at], highs[span]) - np.maximum(first[at], lows[span]), 0)
    # one pair per (span, rank): rank-major keys come (nearly) sorted, needs being in byte order
    pair = rank[at] * len(lows) + span
    order = np.argsort(pair, kind="stable")
    pair, inside = pair[order], inside[order]
    starts = np.flatnonzero(np.concatenate(([True], pair[1:] != pair[:-1])))
    pair, nbytes = pair[starts], np.add.reduceat(inside, starts)
    order = np.argsort(pair % len(lows), kind="stable")  # by span, ranks ascending within one
    spans, ranks, nbytes = pair[order] % len(lows), pair[order] // len(lows), nbytes[order]
    return np.searchsorted(spans, np.arange(len(lows) + 1)), ranks, nbytes


def _ranges(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``first[i], first[i] + 1, ...`` (``counts[i]`` of them) for every ``i``, concatenated."""
    return np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))


def _keyed(ranges_by_file: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-file sorted ``(starts, ends)`` as one sorted pair of key arrays."""
    empty = np.zeros(0, dtype=np.int64)
    return (np.concatenate([empty, *(_key(f, starts) for f, (starts, _) in enumerate(ranges_by_file))]),
            np.concatenate([empty, *(_key(f, ends) for f, (_, ends) in enumerate(ranges_by_file))]))


def _sole_stretches(extents: Sequence[tuple[np.ndarray, np.ndarray] | None]) -> np.ndarray:
    """The bounds (keys, sorted) of the stretches of at least :data:`OWN_RUN_BYTES` that one rank's
    need extents alone cover (holes nobody's extents cover may lie inside): no other rank needs a
    byte there."""
    bounds, deltas = [], []
    for rank, extent in enumerate(extents):
        if extent is None:
            continue
        first, last = _merge(*extent, 0)  # a rank's own overlapping boxes count once
        bounds += [first, last]
        deltas += [np.full(len(first), 1 + rank * 2**20, dtype=np.int64),
                   np.full(len(last), -1 - rank * 2**20, dtype=np.int64)]
    if not bounds:
        return np.zeros(0, dtype=np.int64)
    keys = np.concatenate(bounds)
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    # per segment between consecutive keys: how many ranks cover it and, where one does, which
    cover = np.cumsum(np.concatenate(deltas)[order])[:-1]
    depth, rank = cover % 2**20, cover // 2**20
    covered = np.flatnonzero((depth > 0) & (keys[1:] > keys[:-1]))
    label = np.where(depth[covered] == 1, rank[covered], -1)
    file = keys[covered] >> _FILE_SHIFT
    new = np.concatenate(([True], (label[1:] != label[:-1]) | (file[1:] != file[:-1]) | (label[1:] < 0)))
    groups = np.flatnonzero(new)
    lo, hi = keys[covered[groups]], keys[covered[np.append(groups[1:], len(covered)) - 1] + 1]
    keep = (label[groups] >= 0) & (hi - lo >= OWN_RUN_BYTES)
    return np.unique(np.concatenate([lo[keep], hi[keep]]))


def _cut(lo: np.ndarray, hi: np.ndarray, bounds: np.ndarray, target: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs ``[lo, hi)`` (sorted keys) cut into spans: at ``bounds`` (sorted) rounded down to
    pages, except a cut that would leave the piece before it, or the rest of its run, shorter than
    :data:`OWN_RUN_BYTES` (that short piece joins a neighbour); then each piece into near-equal
    spans of about ``target`` bytes, page aligned. The spans' first and last keys."""
    run = np.searchsorted(lo, bounds, side="right") - 1
    inside = run >= 0
    bounds, run = _page_floor(bounds[inside]), run[inside]
    inside = (bounds > lo[run]) & (bounds < hi[run])
    bounds, run = bounds[inside], run[inside]
    same = np.concatenate(([False], run[1:] == run[:-1]))
    before = np.where(same, np.concatenate(([0], bounds[:-1])), lo[run])
    keep = (bounds - before >= OWN_RUN_BYTES) & (hi[run] - bounds >= OWN_RUN_BYTES)
    cuts = np.unique(bounds[keep])
    piece_lo, piece_hi = np.sort(np.concatenate([lo, cuts])), np.sort(np.concatenate([hi, cuts]))
    count = np.maximum(1, np.rint((piece_hi - piece_lo) / target)).astype(np.int64)
    extra = count - 1
    piece = np.repeat(np.arange(len(piece_lo)), extra)
    step = _ranges(np.ones(len(extra), dtype=np.int64), extra)
    inner = _page_floor(piece_lo[piece] + (piece_hi - piece_lo)[piece] * step // count[piece])
    inner = np.unique(inner[(inner > piece_lo[piece]) & (inner < piece_hi[piece])])
    return np.sort(np.concatenate([piece_lo, inner])), np.sort(np.concatenate([piece_hi, inner]))


def _covered(starts: np.ndarray, ends: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Bytes of the disjoint sorted ranges below each of ``positions``."""
    below = np.concatenate(([0], np.cumsum(ends - starts)))
    at = np.searchsorted(starts, positions, side="right")  # ranges starting at or before
    inside = np.where(at > 0, np.minimum(positions, ends[np.maximum(at - 1, 0)]) - starts[np.maximum(at - 1, 0)], 0)
    return below[np.maximum(at - 1, 0)] * (at > 0) + np.maximum(inside, 0)


def _assign(sizes: np.ndarray, indptr: np.ndarray, needers: np.ndarray, needed: np.ndarray, nodes: np.ndarray,
            target: int) -> np.ndarray:
    """Owners balanced by bytes: the rank needing most of the span while its load stays within a
    fair share (bytes / ranks, plus a span), so that a rank reads much of what it needs itself;
    else the least loaded rank on a node that needs it; else the least loaded rank. Spans one
    rank alone needs are given first, to that rank within its share (those are never sent); the
    others follow in span order."""
    world = len(nodes)
    fair = int(sizes.sum()) / max(world, 1) + target
    owners = np.full(len(sizes), -1, dtype=np.int64)
    # Spans one rank alone needs go to it, in span order, while its load stays within the share.
    sole = np.flatnonzero(np.diff(indptr) == 1)
    needer = needers[indptr[sole]]
    order = np.argsort(needer, kind="stable")
    sole, needer = sole[order], needer[order]
    total = np.cumsum(sizes[sole])
    first = np.concatenate(([True], needer[1:] != needer[:-1]))
    before = np.maximum.accumulate(np.where(first, total - sizes[sole], 0))
    within = total - before <= fair
    owners[sole[within]] = needer[within]
    load = np.bincount(needer[within], weights=sizes[sole[within]], minlength=world).astype(np.int64)
    for span in np.flatnonzero(owners < 0).tolist():
        size = int(sizes[span])
        candidates = needers[indptr[span] : indptr[span + 1]]
        owner = -1
        if len(candidates):
            fits = load[candidates] + size <= fair
            if fits.any():
                # most needed bytes first, then the least loaded
                order = np.lexsort((load[candidates][fits], -needed[indptr[span] : indptr[span + 1]][fits]))
                owner = candidates[fits][order[0]]
            else:
                local = np.flatnonzero(np.isin(nodes, nodes[candidates]))
                best = local[np.argmin(load[local])]
                owner = best if load[best] + size <= fair else -1
        if owner < 0:
            owner = int(np.argmin(load))
        owners[span] = owner
        load[owner] += size
    return owners


@dataclass(frozen=True)
class Traffic:
    """One rank's part of a cooperative load: bytes it reads from storage in how many requests
    (spans cut at ``request_bytes``), bytes it receives from owners and sends to the ranks needing
    its spans' bytes."""

    storage_bytes: int
    requests: int
    received: int
    sent: int


def traffic(plan: ClusterPlan, needs_by_rank: Sequence[Sequence[Need] | Needs], request_bytes: int) -> list[Traffic]:
    """Every rank's :class:`Traffic` under ``plan`` (what the CLI's ``plan`` and the simulation show)."""
    sent = np.zeros(plan.world, dtype=np.int64)
    received = []
    for rank, needs in enumerate(needs_by_rank):
        routed = plan.route(needs)
        others = routed.owner != rank
        sizes = (routed.end - routed.start)[others]
        np.add.at(sent, routed.owner[others], sizes)
        received.append(int(sizes.sum()))
    sizes = plan.end - plan.start
    requests = -(-sizes // request_bytes)
    return [Traffic(int(sizes[plan.owner == r].sum()), int(requests[plan.owner == r].sum()), received[r],
                    int(sent[r])) for r in range(plan.world)]


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
