"""Span ownership: the cluster reads every needed checkpoint byte once, in large contiguous reads.

Every rank needs some boxes of some stored tensors (its *needs*: the chunks of its plan). From
every rank's needs, which the ranks gather as integers, each rank computes the same plan:

1. the union of the byte ranges any rank needs, per file (a tensor whose needed boxes tile it is
   one range, without listing rows);
2. cut into contiguous *spans*: runs of needed bytes, holes nobody needs bridged only up to a
   small gap, each run cut into near-equal spans of at least ``span_bytes`` (page aligned);
3. each span owned by one rank: in file order, the least loaded rank that needs some of it while
   its load stays within a fair share (bytes / ranks, plus a span), else the least loaded rank on
   a node that needs it, else the least loaded rank.

Owners read their spans; every rank then receives, from each owner, the bytes of its own needs
inside that owner's spans, as a stream in file order (:meth:`ClusterPlan.route`): sender and
receiver derive the same stream from the receiver's needs alone. Pure index arithmetic (numpy, no
torch.distributed), unit-tested in one process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hp_dcp_hf.box import Box
from hp_dcp_hf.storage.ranges import box_byte_ranges, box_byte_runs, box_span

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


def encode_needs(needs: Sequence[Need], tensors: Sequence[StoredTensor]) -> np.ndarray:
    """``needs`` as one flat int64 array (tensor index, offsets, sizes each): what ranks gather."""
    flat: list[int] = []
    for need in needs:
        flat.append(need.tensor)
        flat.extend(need.box.offsets)
        flat.extend(need.box.sizes)
    return np.asarray(flat, dtype=np.int64)


def decode_needs(flat: np.ndarray, tensors: Sequence[StoredTensor]) -> list[Need]:
    """The inverse of :func:`encode_needs` (each tensor's rank says how many integers follow)."""
    values = flat.tolist()
    needs, position = [], 0
    while position < len(values):
        index = values[position]
        ndim = len(tensors[index].shape)
        offsets = tuple(values[position + 1 : position + 1 + ndim])
        sizes = tuple(values[position + 1 + ndim : position + 1 + 2 * ndim])
        needs.append(Need(index, Box(offsets, sizes)))
        position += 1 + 2 * ndim
    return needs


def _ranges(need: Need, tensors: Sequence[StoredTensor]) -> list[tuple[int, int]]:
    """Absolute ``[start, end)`` byte ranges of ``need`` in its file, in order."""
    tensor = tensors[need.tensor]
    start = tensor.data_start
    return [(start + s, start + e) for s, e in box_byte_ranges(tensor.shape, tensor.itemsize, need.box)]


def _extent(need: Need, tensors: Sequence[StoredTensor]) -> tuple[int, int]:
    """First and last byte (exclusive) of ``need`` in its file."""
    tensor = tensors[need.tensor]
    first, last, _ = box_span(tensor.shape, tensor.itemsize, need.box)
    return tensor.data_start + first, tensor.data_start + last


def _tiles(boxes: Sequence[Box], shape: tuple[int, ...]) -> bool:
    """Whether the distinct ``boxes`` tile the tensor exactly: their elements sum to its own and no
    two overlap (a sweep along dim 0 compares only boxes whose rows overlap)."""
    if sum(b.numel for b in boxes) != math.prod(shape):
        return False
    ordered = sorted(boxes, key=lambda b: b.offsets)
    active: list[Box] = []
    for box in ordered:
        active = [a for a in active if a.ends[0] > box.offsets[0]]
        if any(a.intersect(box) is not None for a in active):
            return False
        active.append(box)
    return True


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


def needed_union(
    tensors: Sequence[StoredTensor], needs_by_rank: Sequence[Sequence[Need]], files: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per file, the sorted disjoint ``(starts, ends)`` of the bytes at least one rank needs."""
    boxes: dict[int, set[Box]] = {}
    for needs in needs_by_rank:
        for need in needs:
            boxes.setdefault(need.tensor, set()).add(need.box)
    starts: list[list[int]] = [[] for _ in range(files)]
    ends: list[list[int]] = [[] for _ in range(files)]
    for index, distinct in boxes.items():
        tensor = tensors[index]
        if _tiles(list(distinct), tensor.shape):
            ranges = [(tensor.data_start, tensor.data_start + tensor.nbytes)]
        else:
            ranges = [r for box in distinct for r in _ranges(Need(index, box), tensors)]
        starts[tensor.file].extend(s for s, _ in ranges)
        ends[tensor.file].extend(e for _, e in ranges)
    return [_merge(np.asarray(s, dtype=np.int64), np.asarray(e, dtype=np.int64), 0)
            for s, e in zip(starts, ends)]


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
    rank; ``file`` indexes ``files``, the checkpoint's file names."""

    files: tuple[str, ...]
    file: np.ndarray
    start: np.ndarray
    end: np.ndarray
    owner: np.ndarray
    needed: np.ndarray  # bytes of each span some rank needs (the rest are holes bridged)
    world: int

    @classmethod
    def build(
        cls,
        tensors: Sequence[StoredTensor],
        needs_by_rank: Sequence[Sequence[Need]],
        files: Sequence[str],
        *,
        nodes: Sequence[int] | None = None,
        gap: int = 0,
        span_bytes: int = SPAN_BYTES,
    ) -> ClusterPlan:
        """The plan of ``len(needs_by_rank)`` ranks (``nodes[r]``: rank ``r``'s node, default one
        node per rank); holes of at most ``gap`` bytes inside a span are read and dropped."""
        world = len(needs_by_rank)
        union = needed_union(tensors, needs_by_rank, len(files))
        total = sum(int((e - s).sum()) for s, e in union)
        target = max(span_bytes, min(MAX_SPAN_BYTES, -(-total // (4 * world))))
        span_file, span_start, span_end, span_needed = [], [], [], []
        for index, (starts, ends) in enumerate(union):
            run_starts, run_ends = _merge(starts, ends, gap)
            # bytes needed up to each union range's end, to count the needed bytes of each span
            for lo, hi in zip(run_starts.tolist(), run_ends.tolist()):
                count = max(1, round((hi - lo) / target))
                cuts = [lo] + [_page_floor(lo + (hi - lo) * i // count, lo) for i in range(1, count)] + [hi]
                cuts = sorted(set(cuts))
                for a, b in zip(cuts, cuts[1:]):
                    span_file.append(index)
                    span_start.append(a)
                    span_end.append(b)
                    span_needed.append(_covered(starts, ends, a, b))
        file = np.asarray(span_file, dtype=np.int64)
        start = np.asarray(span_start, dtype=np.int64)
        end = np.asarray(span_end, dtype=np.int64)
        owners = _assign(file, start, end, _needers(tensors, needs_by_rank, file, start, end),
                         np.asarray(nodes if nodes is not None else range(world), dtype=np.int64), target)
        return cls(tuple(files), file, start, end, owners, np.asarray(span_needed, dtype=np.int64), world)

    def __len__(self) -> int:
        return len(self.start)

    def owned(self, rank: int) -> np.ndarray:
        """Indices of the spans ``rank`` reads, in file order."""
        return np.nonzero(self.owner == rank)[0]

    def bytes_read(self, rank: int | None = None) -> int:
        """Bytes ``rank`` (default: the whole cluster) reads from storage."""
        sizes = self.end - self.start
        return int(sizes.sum() if rank is None else sizes[self.owner == rank].sum())

    def route(self, needs: Sequence[Need], tensors: Sequence[StoredTensor], within: np.ndarray | None = None) -> Routed:
        """``needs`` (one rank's, in its order) as the parts its owners send it, in stream order:
        sorted by file and start (stably: a byte two needs share is sent once for each), split
        where spans meet. ``within``: spans to route into (say, one owner's); needs wholly outside
        them are skipped without listing their rows."""
        selected = None
        if within is not None:
            selected = np.zeros(len(self), dtype=bool)
            selected[within] = True
        file, start, end, need, offset = [], [], [], [], []
        for index, item in enumerate(needs):
            tensor = tensors[item.tensor]
            if selected is not None and not self._touches(tensor.file, *_extent(item, tensors), selected):
                continue
            starts, run = box_byte_runs(tensor.shape, tensor.itemsize, item.box)
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

    def _touches(self, file: int, first: int, last: int, selected: np.ndarray) -> bool:
        lo = np.searchsorted(self._keys, _key(file, first), side="right") - 1
        hi = np.searchsorted(self._keys, _key(file, last), side="left")
        return bool(selected[max(lo, 0) : max(hi, lo + 1)].any())

    @property
    def _keys(self) -> np.ndarray:
        return _key(self.file, self.start)

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


def _covered(starts: np.ndarray, ends: np.ndarray, lo: int, hi: int) -> int:
    """Bytes of the disjoint sorted ranges inside ``[lo, hi)``."""
    first = np.searchsorted(ends, lo, side="right")
    last = np.searchsorted(starts, hi, side="left")
    clipped = np.minimum(ends[first:last], hi) - np.maximum(starts[first:last], lo)
    return int(clipped[clipped > 0].sum())


def _needers(tensors, needs_by_rank, file, start, end) -> np.ndarray:
    """``[rank, span]``: whether the rank needs bytes within the span's extent (its needs' first to
    last bytes, merged: a preference for owners, not an exact count)."""
    world = len(needs_by_rank)
    result = np.zeros((world, len(start)), dtype=bool)
    span_keys_lo, span_keys_hi = _key(file, start), _key(file, end)
    for rank, needs in enumerate(needs_by_rank):
        if not needs:
            continue
        extents = [_extent(n, tensors) for n in needs]
        f = np.asarray([tensors[n.tensor].file for n in needs], dtype=np.int64)
        lo, hi = _merge(_key(f, [e[0] for e in extents]), _key(f, [e[1] for e in extents]), 0)
        at = np.searchsorted(hi, span_keys_lo, side="right")
        inside = at < len(lo)
        result[rank, inside] = lo[at[inside]] < span_keys_hi[inside]
    return result


def _assign(file, start, end, needers: np.ndarray, nodes: np.ndarray, target: int) -> np.ndarray:
    """Owners, in span order: balanced by bytes, preferring ranks (then nodes) that need the span."""
    world = len(nodes)
    sizes = (end - start).tolist()
    fair = sum(sizes) / max(world, 1) + target
    load = np.zeros(world, dtype=np.int64)
    owners = np.empty(len(sizes), dtype=np.int64)
    for span, size in enumerate(sizes):
        candidates = np.nonzero(needers[:, span])[0]
        owner = -1
        if len(candidates):
            best = candidates[np.argmin(load[candidates])]
            if load[best] + size <= fair:
                owner = best
            else:
                local = np.nonzero(np.isin(nodes, nodes[candidates]))[0]
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


def traffic(plan: ClusterPlan, tensors: Sequence[StoredTensor], needs_by_rank: Sequence[Sequence[Need]],
            request_bytes: int) -> list[Traffic]:
    """Every rank's :class:`Traffic` under ``plan`` (what the CLI's ``plan`` and the simulation show)."""
    sent = np.zeros(plan.world, dtype=np.int64)
    received = []
    for rank, needs in enumerate(needs_by_rank):
        routed = plan.route(needs, tensors)
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
