"""Span ownership: the cluster reads every needed checkpoint byte once, in large contiguous reads.

Every rank needs some boxes of some stored tensors (its *needs*: the chunks of its plan). From
every rank's needs, which the ranks gather as integers, each rank computes the same plan:

1. the union of the byte ranges any rank needs, per file (a tensor whose needed boxes tile it is
   one range, without listing rows);
2. cut into contiguous *spans*: runs of needed bytes, holes nobody needs bridged only up to a
   small gap, each run cut into near-equal spans of at least ``span_bytes`` (page aligned);
3. each span owned by one rank: in file order, the rank that needs most of it while its load
   stays within a fair share (bytes / ranks, plus a span), else the least loaded rank on a node
   that needs it, else the least loaded rank.

Owners read their spans; every rank then receives, from each owner, the bytes of its own needs
inside that owner's spans, as a stream in file order (:meth:`ClusterPlan.route`): sender and
receiver derive the same stream from the receiver's needs alone. Pure index arithmetic (numpy, no
torch.distributed), unit-tested in one process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hp_dcp_hf.box import Box
from hp_dcp_hf.storage.format.ranges import box_byte_runs

SPAN_BYTES = 8 * 2**20
"""Smallest span where the needed bytes run that long: a request moves several MiB per round trip."""

MAX_SPAN_BYTES = 64 * 2**20
"""Largest span: an owner holds a span's bytes until every rank needing them has received them."""

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
    """One rank's needs as arrays, in its order: need ``i`` is the box ``offsets[i]``, ``sizes[i]``
    (padded at the front, as :class:`Tensors` pads shapes) of stored tensor ``tensor[i]``."""

    tensor: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray

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
        return cls.from_rows(rows, table)

    @classmethod
    def from_rows(cls, rows: np.ndarray, table: Tensors) -> Needs:
        rows = rows.reshape(-1, 1 + 2 * table.ndim)
        return cls(rows[:, 0], rows[:, 1 : 1 + table.ndim], rows[:, 1 + table.ndim :])

    @property
    def rows(self) -> np.ndarray:
        return np.concatenate([self.tensor[:, None], self.offsets, self.sizes], axis=1)

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
        spans = np.unique(np.stack([offsets[:, d], sizes[:, d]], 1), axis=0)
        if spans[0, 0] or np.any(spans[1:, 0] != spans[:-1].sum(1)) or spans[-1].sum() != shape[d]:
            cells = -1
            break
        cells *= len(spans)
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
    parts = [Needs.of(n, table).rows for n in needs_by_rank]
    rows = np.concatenate(parts) if parts else np.zeros((0, 1 + 2 * table.ndim), dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    if not len(rows):
        return [(empty, empty) for _ in range(files)]
    needs = Needs.from_rows(rows, table)
    first, last = needs.extents(table)
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
        union = needed_union(table, needs_by_rank, len(files))
        total = sum(int((e - s).sum()) for s, e in union)
        target = max(span_bytes, min(MAX_SPAN_BYTES, -(-total // (4 * world))))
        span_file, span_start, span_end, span_needed = [], [], [], []
        for index, (starts, ends) in enumerate(union):
            run_starts, run_ends = _merge(starts, ends, gap)
            cuts = []
            for lo, hi in zip(run_starts.tolist(), run_ends.tolist()):
                count = max(1, round((hi - lo) / target))
                cuts.append(sorted({lo, hi, *(_page_floor(lo + (hi - lo) * i // count, lo) for i in range(1, count))}))
            lows = np.asarray([c for run in cuts for c in run[:-1]], dtype=np.int64)
            highs = np.asarray([c for run in cuts for c in run[1:]], dtype=np.int64)
            span_file.append(np.full(len(lows), index, dtype=np.int64))
            span_start.append(lows)
            span_end.append(highs)
            span_needed.append(_covered(starts, ends, highs) - _covered(starts, ends, lows))
        file, start, end, needed = (np.concatenate(a) if a else np.zeros(0, dtype=np.int64)
                                    for a in (span_file, span_start, span_end, span_needed))
        plan = cls(tuple(files), file, start, end, np.zeros(len(start), dtype=np.int64), needed, world, table)
        plan.owner[:] = _assign(end - start, *plan._needers(needs_by_rank),
                                np.asarray(nodes if nodes is not None else range(world), dtype=np.int64), target)
        return plan

    def __len__(self) -> int:
        return len(self.start)

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
        selected = None
        if within is not None:
            selected = np.zeros(len(self), dtype=bool)
            selected[within] = True
            lo, hi = self._span_range(*needs.extents(table))
            reached = np.concatenate(([0], np.cumsum(selected)))
            chosen = np.flatnonzero(reached[hi + 1] - reached[lo] > 0)
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
        return routed if selected is None else routed.select(selected[routed.span])

    @property
    def _keys(self) -> np.ndarray:
        return _key(self.file, self.start)

    def _span_range(self, first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For byte extents (keys), the first and last span they may touch (clipped to the plan)."""
        keys = self._keys
        lo = np.clip(np.searchsorted(keys, first, side="right") - 1, 0, max(len(keys) - 1, 0))
        hi = np.clip(np.searchsorted(keys, last - 1, side="right") - 1, lo, max(len(keys) - 1, 0))
        return lo, hi

    def _needers(self, needs_by_rank: Sequence[Needs]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per span, the ranks needing bytes in it and about how many (their needs' extents inside
        the span: a preference for owners, not an exact count), as ``(indptr, ranks, nbytes)``:
        span ``s``'s are ``ranks[indptr[s]:indptr[s+1]]``."""
        keys, ends = self._keys, _key(self.file, self.end)
        pair_keys, pair_bytes = [], []
        for rank, needs in enumerate(needs_by_rank):
            if not len(needs) or not len(self):
                continue
            first, last = needs.extents(self.table)
            lo, hi = self._span_range(first, last)
            counts = hi - lo + 1
            at = np.repeat(np.arange(len(lo)), counts)
            span = lo[at] + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
            inside = np.minimum(last[at], ends[span]) - np.maximum(first[at], keys[span])
            pair_keys.append(span * self.world + rank)
            pair_bytes.append(np.maximum(inside, 0))
        if not pair_keys:
            return np.zeros(len(self) + 1, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        merged, where = np.unique(np.concatenate(pair_keys), return_inverse=True)
        nbytes = np.bincount(where, weights=np.concatenate(pair_bytes)).astype(np.int64)
        spans, ranks = merged // self.world, merged % self.world
        return np.searchsorted(spans, np.arange(len(self) + 1)), ranks, nbytes

    def _split(self, file, start, end, need, offset) -> Routed:
        """Each range cut where it crosses a span boundary, with its span and owner."""
        keys = self._keys
        first = np.searchsorted(keys, _key(file, start), side="right") - 1
        last = np.searchsorted(keys, _key(file, end - 1), side="right") - 1
        if len(first) and (np.any(first < 0) or np.any(self.file[first] != file) or np.any(self.end[last] < end)):
            raise ValueError("a needed byte range lies outside every span: the plan was built from other needs")
        simple = first == last
        if bool(simple.all()):
            return Routed(self.owner[first], first, file, start, end, need, offset)
        rows = []
        for i in range(len(file)):
            if simple[i]:
                rows.append((first[i], file[i], start[i], end[i], need[i], offset[i]))
                continue
            position = start[i]
            for span in range(first[i], last[i] + 1):
                stop = min(end[i], self.end[span])
                rows.append((span, file[i], position, stop, need[i], offset[i] + position - start[i]))
                position = stop
        span_, file_, start_, end_, need_, offset_ = (np.asarray(c, dtype=np.int64) for c in zip(*rows))
        return Routed(self.owner[span_], span_, file_, start_, end_, need_, offset_)


def _key(file, position):
    """One sortable integer per (file, byte): files are far below 2**20, bytes below 2**43."""
    return np.asarray(file, dtype=np.int64) * (1 << 43) + np.asarray(position, dtype=np.int64)


def _page_floor(position: int, lo: int) -> int:
    """``position`` rounded down to a page, not below ``lo``: spans start where ``O_DIRECT`` can."""
    return max(lo, position - position % _PAGE)


def _covered(starts: np.ndarray, ends: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Bytes of the disjoint sorted ranges below each of ``positions``."""
    below = np.concatenate(([0], np.cumsum(ends - starts)))
    at = np.searchsorted(starts, positions, side="right")  # ranges starting at or before
    inside = np.where(at > 0, np.minimum(positions, ends[np.maximum(at - 1, 0)]) - starts[np.maximum(at - 1, 0)], 0)
    return below[np.maximum(at - 1, 0)] * (at > 0) + np.maximum(inside, 0)


def _assign(sizes: np.ndarray, indptr: np.ndarray, needers: np.ndarray, needed: np.ndarray, nodes: np.ndarray,
            target: int) -> np.ndarray:
    """Owners, in span order, balanced by bytes: the rank needing most of the span while its load
    stays within a fair share (bytes / ranks, plus a span), so that a rank reads much of what it
    needs itself; else the least loaded rank on a node that needs it; else the least loaded rank."""
    world = len(nodes)
    fair = int(sizes.sum()) / max(world, 1) + target
    load = np.zeros(world, dtype=np.int64)
    owners = np.empty(len(sizes), dtype=np.int64)
    for span, size in enumerate(sizes.tolist()):
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
