"""Span ownership: the cluster reads every needed checkpoint byte once, in large contiguous reads.

Every rank needs some boxes of some stored tensors (its *needs*: the chunks of its plan). From
every rank's needs, which the ranks gather as integers, each rank computes the same plan:

1. the union of the byte ranges any rank needs, per file (a tensor whose needed boxes tile it is
   one range, without listing rows);
2. cut into contiguous *spans*: runs of needed bytes, holes nobody needs bridged only up to a
   small gap, cut where a stretch of at least ``OWN_RUN_BYTES`` that one rank alone needs begins
   or ends (that rank can read it without sending a byte), each piece cut into near-equal spans
   of at least ``span_bytes`` (page aligned), and finer where a span holds more bytes that
   several ranks need than half the mean rank's (ranks needing the same bytes that are not twins);
3. each span owned by one rank, within a fair share of the bytes read (bytes / ranks, plus a
   span): spans one rank alone needs first, to it; then spans whose owner sends most of them,
   each to the needer that has sent least; then the others, in file order, to the rank that
   needs most of it; a span no needer can take to the least loaded rank on a node that needs
   it, else the least loaded rank.

Owners read their spans; every rank then receives the bytes of its own needs inside others' spans,
from each sender as a stream in file order (:meth:`ClusterPlan.route`, :meth:`ClusterPlan.senders`):
sender and receiver derive the same stream from the receiver's needs alone.

Ranks with identical needs (*twins*: the replicas of HSDP, ...) are planned once: the union, the
extents and the needers are computed over the distinct needs, and a route serves every twin. Their
bytes travel down a *chain*: of a span, the owner sends a class of twins' bytes to one of them (the
next after itself when it is one of them, else the one on its node, else one rotated by span), and
each twin forwards them to the next, cyclically, from its own need buffers once they arrived; so an
owner sends each byte once per class of twins, not once per replica, and the forwarding spreads
over the twins. Pure index arithmetic (numpy, no
torch.distributed), unit-tested in one process. The needs' integer form lives in
:mod:`~hp_dcp_hf.storage.read.needs`, their union in :mod:`~hp_dcp_hf.storage.read.union`, what
travels in :mod:`~hp_dcp_hf.storage.read.routing`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from hp_dcp_hf.storage.read.needs import (
    BYTE_MASK,
    FILE_SHIFT,
    Need,
    Needs,
    StoredTensor,
    Tensors,
    byte_key,
    table_of,
)
from hp_dcp_hf.storage.read.payoff import span_costs
from hp_dcp_hf.storage.read.routing import Routed
from hp_dcp_hf.storage.read.union import concatenated, consecutive, merge, union_of

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

_NONE = np.iinfo(np.int64).max
"""Stands for a rank a span cannot go to, where the least of some per-rank count is sought."""


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
    twins: np.ndarray = field(repr=False, compare=False)
    """Per rank, its class of twins: ranks whose needs are identical share one (numbered by their
    first rank's order)."""
    nodes: np.ndarray = field(repr=False, compare=False)
    distinct: tuple[Needs, ...] = field(repr=False, compare=False)
    """The needs of every class of twins (its first rank's, the caller's arrays: no copy), numbered
    one class after the other: class ``c``'s are rows ``bounds[c]:bounds[c + 1]``; routes of other
    ranks are cut from them, and their extents were found in :meth:`build` once."""
    bounds: np.ndarray = field(repr=False, compare=False)
    touched: tuple[np.ndarray, np.ndarray] = field(repr=False, compare=False)
    """Per row of ``distinct`` (so numbered), the first and last span its extent may touch."""

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
        table = table_of(tensors)
        needs_by_rank = [Needs.of(n, table) for n in needs_by_rank]
        world = len(needs_by_rank)
        twins, distinct = twin_classes(needs_by_rank)
        population = np.bincount(twins, minlength=len(distinct))
        first, last, density, wanted, order, union = _extents_and_union(
            table, [needs_by_rank[r] for r in distinct], len(files))
        bounds = np.cumsum([0, *(len(needs_by_rank[r]) for r in distinct)])
        group = np.repeat(np.arange(len(distinct)), np.diff(bounds))  # each need's class of twins
        total = sum(int((e - s).sum()) for s, e in union)
        # about a sixteenth of a rank's share: owners balance to within that (a span's requests
        # are cut to the reader's size whatever its length)
        target = max(span_bytes, min(MAX_SPAN_BYTES, -(-total // (16 * world))))
        lows, highs = _cut(*_keyed([merge(starts, ends, gap) for starts, ends in union]),
                           _sole_stretches(first, last, group, population == 1, order), target)
        needed_lo, needed_hi = _keyed(union)
        # per tensor, bytes its needs hold more than once: ranks needing the same bytes that are not
        # twins (a rank's own overlapping boxes count too: they only cut spans finer)
        again = wanted - (_covered(needed_lo, needed_hi, table.key + table.nbytes)
                          - _covered(needed_lo, needed_hi, table.key))
        pieces = _send_pieces(lows, highs, table, again, world, span_bytes)
        if bool((pieces > 1).any()):
            lows, highs = _divide(lows, highs, pieces)
        needed = _covered(needed_lo, needed_hi, highs) - _covered(needed_lo, needed_hi, lows)
        # the spans each need touches and each span's needers, from the extents in byte order (each
        # array rebound as it is sorted: the build holds one copy of a million entries, not two)
        first = first[order]
        last = last[order]
        group = group[order]
        density = density[order]
        lo, hi = _touching(lows, first, last, in_order=True)
        indptr, classes, nbytes = _needers(lows, highs, first, last, density, (lo, hi), group)
        span_index = _index_type(len(lows))
        touched = np.empty(len(lo), dtype=span_index), np.empty(len(hi), dtype=span_index)
        touched[0][order], touched[1][order] = lo, hi
        del order, lo, hi, first, last, density
        sending = _per_span(indptr, nbytes)  # what an owner sends of each span: once per class of twins
        indptr, needers, nbytes = _expand(indptr, classes, nbytes, twins)
        node_of = np.asarray(nodes if nodes is not None else range(world), dtype=np.int64)
        owner = _assign(highs - lows, indptr, needers, nbytes, sending, node_of, target)
        return cls(tuple(files), lows >> FILE_SHIFT, lows & BYTE_MASK, highs & BYTE_MASK, owner, needed, world,
                   table, (indptr, needers.astype(_index_type(world))), twins, node_of,
                   tuple(needs_by_rank[r] for r in distinct), bounds, touched)

    def __len__(self) -> int:
        return len(self.start)

    def needing(self, spans: np.ndarray) -> np.ndarray:
        """The ranks that may need bytes of ``spans`` (sorted): the only ones their owner routes."""
        indptr, ranks = self.needers
        return np.unique(ranks[consecutive(indptr[spans], indptr[spans + 1] - indptr[spans])])

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
        index = np.arange(len(needs))
        if within is not None:
            within = np.sort(within)
            index = self._reaching(within, *_touching(self._keys, *needs.extents(table)))
            needs = Needs.from_rows(needs.rows[index], table)
        routed, _ = self._parts(needs, index)
        return routed if within is None else routed.select(np.isin(routed.span, within, assume_unique=True))

    def sends(self, rank: int, incoming: Routed, owned: np.ndarray) -> list[Routed | None]:
        """Per peer, the parts of its route that ``rank`` sends it (:meth:`senders`): of its own
        spans ``owned``, and to a twin, bytes it forwards (``incoming``: ``rank``'s own route);
        ``None`` for itself and for ranks needing none of its spans. The peers' routes come from the
        needs gathered in :meth:`build`, every class of twins in one pass."""
        needing = np.union1d(self.needing(owned), self.members(rank))
        needing = needing[needing != rank]
        mine = int(self.twins[rank])
        classes = np.unique(self.twins[needing])
        routes = self._routes_within(classes[classes != mine], np.sort(owned))
        routes[mine] = incoming
        chains = {c: self._chain(c, routes[c]) for c in classes.tolist()}
        out: list[Routed | None] = [None] * self.world
        for peer, twins in zip(needing.tolist(), self.twins[needing].tolist()):
            routed = routes[twins]
            out[peer] = routed.select(self._senders(peer, routed.owner, chains[twins]) == rank)
        return out

    def _routes_within(self, classes: np.ndarray, within: np.ndarray) -> dict[int, Routed]:
        """:meth:`route` of every class of twins in ``classes`` (sorted) into ``within`` (sorted), at once."""
        bounds = self.bounds
        rows = consecutive(bounds[classes], bounds[classes + 1] - bounds[classes])
        first, last = self.touched
        rows = rows[self._reaching(within, first[rows], last[rows])]
        group = np.searchsorted(bounds, rows, side="right") - 1
        index = rows - bounds[group]
        cuts = np.searchsorted(group, np.append(classes, len(bounds)))
        chosen = [self.distinct[c].rows[index[lo:hi]] for c, lo, hi in zip(classes.tolist(), cuts[:-1], cuts[1:])]
        none = np.zeros((0, 1 + 2 * self.table.ndim), dtype=np.int64)
        routed, at = self._parts(Needs.from_rows(np.concatenate([none, *chosen]), self.table), index, group)
        keep = np.isin(routed.span, within, assume_unique=True)
        routed, group = routed.select(keep), group[at[keep]]
        cuts = np.searchsorted(group, np.append(classes, np.iinfo(np.int64).max))
        return {c: routed.select(slice(lo, hi)) for c, lo, hi in zip(classes.tolist(), cuts[:-1], cuts[1:])}

    def _reaching(self, within: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
        """Indices of the needs whose spans ``first..last`` include one of ``within`` (sorted): by
        how many of them lie below each span, two lookups a need instead of a search (a million
        needs of 1024 fsdp ranks: 4.7 ms, where searching a rank's owned spans took 9.5 ms)."""
        below = np.zeros(len(self) + 1, dtype=np.int64)
        below[within + 1] = 1
        np.cumsum(below, out=below)
        return np.flatnonzero(below[last + 1] > below[first])

    def _parts(self, needs: Needs, index: np.ndarray, group: np.ndarray | None = None) -> tuple[Routed, np.ndarray]:
        """The byte ranges of ``needs`` (need ``i`` known as ``index[i]``) in stream order, split
        where spans meet; with ``group`` (per need, ascending), each group's stream after the
        previous one's. Also, per part, its need's position in ``needs``."""
        table = self.table
        need, start, length, offset = needs.byte_runs(table)
        file = table.file[needs.tensor][need]
        keys = (start, file) if group is None else (start, file, group[need])
        order = np.lexsort(keys)  # stable: ties keep need order
        need = need[order]
        routed, at = self._split(file[order], start[order], start[order] + length[order], index[need], offset[order])
        return routed, need[at]

    def senders(self, rank: int, routed: Routed) -> np.ndarray:
        """Who sends ``rank`` each part of ``routed`` (its own route, or a twin's: the same): the
        span's owner, or for a class of twins the previous twin in the span's chain (cyclically,
        starting after the owner when it is a twin, else at the head: the twin on the owner's node,
        else the one the span index picks). ``rank`` itself for bytes of its own spans."""
        return self._senders(rank, routed.owner, self._chain(int(self.twins[rank]), routed))

    def _chain(self, twins: int, routed: Routed) -> tuple[np.ndarray, np.ndarray] | None:
        """What the senders of a route of class ``twins`` share across the class: per part, whether
        its owner is a twin and which twin the owner sends it to (:meth:`_head`); ``None`` for a
        class of one (its owners send it everything)."""
        members = self._members[twins]
        if len(members) == 1:
            return None
        return np.isin(routed.owner, members), self._head(routed.span, members)

    def _senders(self, rank: int, owner: np.ndarray, chain: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
        """:meth:`senders` from the route's ``owner`` s and its class's :meth:`_chain`."""
        if chain is None:
            return owner
        members = self._members[int(self.twins[rank])]
        at = int(np.searchsorted(members, rank))
        previous = members[(at - 1) % len(members)]
        inside, head = chain
        return np.where(owner == rank, rank, np.where(~inside & (head == at), owner, previous))

    def _head(self, spans: np.ndarray, members: np.ndarray) -> np.ndarray:
        """For spans whose owner is not one of ``members`` (twins, sorted), the index of the twin it
        sends to: the first on its node, else ``span % len(members)`` (rotated, so that which twin
        forwards nothing varies)."""
        local = self.nodes[members][None, :] == self.nodes[self.owner[spans]][:, None]
        return np.where(local.any(1), local.argmax(1), spans % len(members))

    @cached_property
    def _members(self) -> list[np.ndarray]:
        order = np.argsort(self.twins, kind="stable")
        return np.split(order, np.flatnonzero(np.diff(self.twins[order])) + 1)

    def members(self, rank: int) -> np.ndarray:
        """``rank``'s twins, itself included (sorted)."""
        return self._members[int(self.twins[rank])]

    @cached_property
    def _keys(self) -> np.ndarray:
        return byte_key(self.file, self.start)

    def _split(self, file, start, end, need, offset) -> tuple[Routed, np.ndarray]:
        """Each range cut where it crosses a span boundary, with its span and owner; and per part,
        the range it came from."""
        keys = self._keys
        first = np.searchsorted(keys, byte_key(file, start), side="right") - 1
        last = np.searchsorted(keys, byte_key(file, end - 1), side="right") - 1
        if len(first) and (np.any(first < 0) or np.any(self.file[first] != file) or np.any(self.end[last] < end)):
            raise ValueError("a needed byte range lies outside every span: the plan was built from other needs")
        counts = last - first + 1
        if bool((counts == 1).all()):
            return Routed(self.owner[first], first, file, start, end, need, offset), np.arange(len(first))
        span, at = consecutive(first, counts), np.repeat(np.arange(len(first)), counts)
        lo, hi = np.maximum(start[at], self.start[span]), np.minimum(end[at], self.end[span])
        return Routed(self.owner[span], span, file[at], lo, hi, need[at], offset[at] + lo - start[at]), at


def _extents_and_union(table: Tensors, classes: list[Needs], files: int) -> tuple[
        np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """Every class's needs, one class after the other: their extents, the share of each extent's
    bytes the need holds (a box cut across a tensor's rows holds a slice of every row its extent
    spans), per stored tensor the bytes all classes' needs of it hold, a stable sort of the needs'
    first bytes, and their union per file. The needs are concatenated only while these are found
    (41.7 MB at 1024 FSDP ranks of DeepSeek-V3): the plan keeps the classes' own arrays, and the
    rest of the build does not pile its temporaries on top of the copy."""
    every = concatenated(classes, table)
    first, last = every.extents(table)
    held = every.byte_counts(table)
    extent = last - first
    np.maximum(extent, 1, out=extent)
    density = held / extent
    del extent
    wanted = np.bincount(every.tensor, weights=held, minlength=len(table))  # integers below 2**53: exact
    order = np.argsort(first, kind="stable")  # cheap: each rank's needs are a run in byte order
    return first, last, density, wanted, order, union_of(table, every, first, last, files, order)


def _index_type(count: int) -> type[np.signedinteger]:
    """The smallest of int32 and int64 holding indices below ``count``: the plan's per-need and
    per-pair indices at half the memory (fresh memory costs this VM more than the arithmetic)."""
    return np.int32 if count <= np.iinfo(np.int32).max else np.int64


def twin_classes(needs_by_rank: Sequence[Needs]) -> tuple[np.ndarray, list[int]]:
    """Per rank its class of twins (identical needs, row for row), and each class's first rank.
    Needs are told apart by a fingerprint, their entries' dot product with fixed random odd
    weights (wrapping), then compared entry by entry, keeping no copy of them (1024 hsdp ranks:
    10 ms, where hashing their bytes took 27 ms and copied 95 MB)."""
    longest = max((needs.rows.size for needs in needs_by_rank), default=0)
    weights = np.random.default_rng(0).integers(1, 2**62, size=longest, dtype=np.int64) | 1
    seen: dict[int, list[int]] = {}  # fingerprint of a class's needs -> the classes with that fingerprint
    classes = np.zeros(len(needs_by_rank), dtype=np.int64)
    distinct: list[int] = []
    for rank, needs in enumerate(needs_by_rank):
        entries = needs.rows.reshape(-1)
        alike = seen.setdefault(int(np.dot(entries, weights[: len(entries)])), [])
        same = next((c for c in alike if np.array_equal(needs_by_rank[distinct[c]].rows, needs.rows)), None)
        if same is None:
            same = len(distinct)
            alike.append(same)
            distinct.append(rank)
        classes[rank] = same
    return classes, distinct


def _expand(indptr: np.ndarray, classes: np.ndarray, nbytes: np.ndarray, twins: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-span classes of twins (CSR, as :func:`_needers` gives them) as per-span ranks, ascending."""
    if np.array_equal(twins, np.arange(len(twins))):  # no twins: class c is rank c
        return indptr, classes, nbytes
    order = np.argsort(twins, kind="stable")
    sizes = np.bincount(twins, minlength=int(classes.max(initial=-1)) + 1)
    starts = np.concatenate(([0], np.cumsum(sizes)))
    counts = sizes[classes]
    ranks = order[consecutive(starts[classes], counts)]
    span = np.repeat(np.repeat(np.arange(len(indptr) - 1), np.diff(indptr)), counts)
    weight = np.repeat(nbytes, counts)
    # each (span, rank) pair once: one int64 key sorts them as lexsort would (hsdp at 1024 ranks,
    # 670k pairs: 4 ms, where lexsort takes 24 ms)
    sort = np.argsort(span * len(twins) + ranks, kind="stable")
    return np.searchsorted(span[sort], np.arange(len(indptr))), ranks[sort], weight[sort]


def _page_floor(positions: np.ndarray) -> np.ndarray:
    """``positions`` rounded down to a page: spans start where ``O_DIRECT`` can."""
    return positions - positions % _PAGE


def _touching(keys: np.ndarray, first: np.ndarray, last: np.ndarray, in_order: bool = False
              ) -> tuple[np.ndarray, np.ndarray]:
    """For byte extents (keys), the first and last span (of those starting at ``keys``) they may
    touch, clipped to the plan. ``in_order``: ``first`` is sorted; then the first spans come from
    where each span starts among the extents (a search per span, not per extent). The last spans
    by a search only for the extents reaching past their first span (few)."""
    if not len(keys):
        return np.zeros_like(first), np.zeros_like(first)
    top = len(keys) - 1
    if in_order:
        # the extents from where span j starts up to where span j + 1 does begin in span j
        starts = np.searchsorted(first, keys)
        lo = np.clip(np.repeat(np.arange(-1, len(keys)), np.diff(starts, prepend=0, append=len(first))), 0, top)
    else:
        lo = np.clip(np.searchsorted(keys, first, side="right") - 1, 0, top)
    hi = lo.copy()
    beyond = np.flatnonzero(last - 1 >= np.append(keys, np.iinfo(np.int64).max)[lo + 1])
    hi[beyond] = np.maximum(np.searchsorted(keys, last[beyond] - 1, side="right") - 1, lo[beyond])
    return lo, hi


def _needers(lows: np.ndarray, highs: np.ndarray, first: np.ndarray, last: np.ndarray, density: np.ndarray,
             touched: tuple[np.ndarray, np.ndarray], rank: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per span (``[lows, highs)``, keys), the ranks needing bytes in it and about how many (the
    extents ``first``, ``last`` of every rank's needs, need ``i`` of rank ``rank[i]``, inside the
    span, times the share ``density[i]`` of its extent the need holds: an estimate for choosing
    owners, not an exact count), as ``(indptr, ranks, nbytes)``: span ``s``'s are
    ``ranks[indptr[s]:indptr[s+1]]``. ``touched``: the spans each need may touch
    (:func:`_touching`). Any order of needs gives the same; by first byte, the pairs below come
    nearly sorted (cheap to sort)."""
    if not len(lows) or not len(first):
        return np.zeros(len(lows) + 1, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    lo, hi = touched
    counts = hi - lo + 1
    span = consecutive(lo, counts)
    # each (need, span) pair's bytes, computed in place: a million pairs at 1024 FSDP ranks, where
    # every fresh array costs more than its arithmetic (this function's peak: 59 -> 52 MB)
    inside = np.repeat(last, counts)
    np.minimum(inside, highs[span], out=inside)
    begin = np.repeat(first, counts)
    np.maximum(begin, lows[span], out=begin)
    inside -= begin
    del begin
    np.maximum(inside, 0, out=inside)
    np.multiply(inside, np.repeat(density, counts), out=inside, casting="unsafe")  # truncated, as astype
    # one pair per (span, rank), span-major
    ranks = int(rank.max()) + 1
    pair = span
    pair *= ranks
    pair += np.repeat(rank, counts)
    sort = np.argsort(pair, kind="stable")
    pair = pair[sort]
    inside = inside[sort]
    starts = np.flatnonzero(np.concatenate(([True], pair[1:] != pair[:-1])))
    pair, nbytes = pair[starts], np.add.reduceat(inside, starts)
    return np.searchsorted(pair, np.arange(len(lows) + 1) * ranks), pair % ranks, nbytes


def _keyed(ranges_by_file: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-file sorted ``(starts, ends)`` as one sorted pair of key arrays."""
    empty = np.zeros(0, dtype=np.int64)
    return (np.concatenate([empty, *(byte_key(f, starts) for f, (starts, _) in enumerate(ranges_by_file))]),
            np.concatenate([empty, *(byte_key(f, ends) for f, (_, ends) in enumerate(ranges_by_file))]))


def _sole_stretches(first: np.ndarray, last: np.ndarray, group: np.ndarray, alone: np.ndarray, order: np.ndarray
                    ) -> np.ndarray:
    """The bounds (keys, sorted) of the stretches of at least :data:`OWN_RUN_BYTES` that one rank's
    need extents alone cover (holes nobody's extents cover may lie inside): no other rank needs a
    byte there. Need ``i`` (extent ``first[i]``, ``last[i]``) is of class of twins ``group[i]``
    (ascending); ``alone[c]``: class ``c`` is one rank (the extents of a class of several cover,
    but are nobody's alone); ``order``: a stable sort of ``first``."""
    if not len(first) or not alone.any():
        return np.zeros(0, dtype=np.int64)
    if np.any((group[1:] == group[:-1]) & (first[1:] < first[:-1])):
        regroup = np.lexsort((first, group))
        first, last, group = first[regroup], last[regroup], group[regroup]
        order = np.argsort(first, kind="stable")
    # a class's own overlapping boxes count once: its extents merged (each kept at its first need)
    reach = _running_max(last, group)
    merged = np.concatenate(([True], (group[1:] != group[:-1]) | (first[1:] > reach[:-1])))
    heads = np.flatnonzero(merged)
    ends = np.empty_like(last)
    tails = np.append(heads[1:], len(first))
    tails -= 1
    ends[heads] = reach[tails]
    del reach, heads, tails
    # the merged extents by first byte: their starts sorted, their ends nearly (one extent rarely
    # holds another), so that sorting both together merges two runs (ties between keys do not
    # matter: only the coverage past each distinct key is read). Two million events at 1024 FSDP
    # ranks: written into buffers already held, and each array dropped once read, this function
    # peaks 66 MB above its start instead of 127 MB (tracemalloc; fresh memory costs the time).
    starts = order[merged[order]]
    count = len(starts)
    events = np.empty(2 * count, dtype=np.int64)
    np.take(first, starts, out=events[:count])
    np.take(ends, starts, out=events[count:])
    del ends
    order = np.argsort(events, kind="stable")
    keys = events[order]
    # per segment between consecutive keys: how many ranks cover it and, where one does, which
    label = group[starts]
    del starts
    weight = events[:count]
    np.left_shift(label, 20, out=weight)
    weight += 1
    weight[~alone[label]] = 2  # a class of several as two ranks: never depth one
    del label
    np.negative(weight, out=events[count:])
    cover = events[order]
    del events, order
    np.cumsum(cover, out=cover)  # in place: a fresh 2M-entry array costs more in page faults than the sum
    # the segments of positive length some rank covers, and which one alone (-1: several)
    covered = np.flatnonzero(((cover[:-1] & (2**20 - 1)) > 0) & (keys[1:] > keys[:-1]))
    cover = cover[covered]
    label = np.where((cover & (2**20 - 1)) == 1, cover >> 20, -1)
    lo, hi = keys[covered], keys[covered + 1]
    del cover, keys, covered
    # runs of segments one rank covers alone in one file (holes nobody covers inside)
    file = lo >> FILE_SHIFT
    new = np.concatenate(([True], (label[1:] != label[:-1]) | (file[1:] != file[:-1]) | (label[1:] < 0)))
    groups = np.flatnonzero(new)
    lo, hi = lo[groups], hi[np.append(groups[1:], len(new)) - 1]
    keep = (label[groups] >= 0) & (hi - lo >= OWN_RUN_BYTES)
    return _sorted_distinct(np.concatenate([lo[keep], hi[keep]]))


def _running_max(values: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Per position, the largest of ``values`` up to it within its group (groups contiguous), by
    doubling steps, stopping at the first step that changes nothing (then none would)."""
    out, step = values, 1
    while step < len(out):
        before = out[:-step]
        later = (group[step:] == group[:-step]) & (before > out[step:])
        if not later.any():
            break
        out = np.concatenate((out[:step], np.where(later, before, out[step:])))
        step *= 2
    return out


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
    cuts = _sorted_distinct(bounds[keep])
    piece_lo, piece_hi = np.sort(np.concatenate([lo, cuts])), np.sort(np.concatenate([hi, cuts]))
    return _divide(piece_lo, piece_hi, np.maximum(1, np.rint((piece_hi - piece_lo) / target)).astype(np.int64))


def _divide(lo: np.ndarray, hi: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each of the spans ``[lo, hi)`` (sorted keys) cut into ``count`` near-equal ones, page aligned."""
    extra = count - 1
    piece = np.repeat(np.arange(len(lo)), extra)
    step = consecutive(np.ones(len(extra), dtype=np.int64), extra)
    inner = _page_floor(lo[piece] + (hi - lo)[piece] * step // count[piece])
    inner = _sorted_distinct(inner[(inner > lo[piece]) & (inner < hi[piece])])
    return np.sort(np.concatenate([lo, inner])), np.sort(np.concatenate([hi, inner]))


def _send_pieces(lows: np.ndarray, highs: np.ndarray, table: Tensors, again: np.ndarray, world: int,
                 smallest: int) -> np.ndarray:
    """Into how many spans to cut each span ``[lows, highs)`` (keys) so that none holds more than
    half the mean rank's bytes needed more than once (``again``: per stored tensor, the bytes its
    needs hold beyond its needed bytes, taken as spread evenly over it; the least a span's owner
    sends), where its pieces stay at least ``smallest`` bytes (cuts a page apart or closer merge:
    a span may end up in fewer). Where ranks that are not twins need the same bytes (FSDP's shards
    of a tensor that tensor parallelism leaves whole are needed by every rank of a tensor-parallel
    group), a span's sends are several times its size, and whole spans would put the sends on a
    few owners whatever the assignment; at half the mean, the greedy assignment ends within about
    that of it."""
    sizes = highs - lows
    mean = float(again.sum()) / max(world, 1)
    if mean <= 0:
        return np.ones(len(sizes), dtype=np.int64)
    holding = np.flatnonzero(table.nbytes > 0)  # an empty tensor may start where the next one does
    order = holding[np.argsort(table.key[holding], kind="stable")]
    starts, lengths, extra = table.key[order], table.nbytes[order], again[order]
    before = np.concatenate(([0.0], np.cumsum(extra)))

    def below(keys: np.ndarray) -> np.ndarray:  # bytes needed more than once before each key
        at = np.maximum(np.searchsorted(starts, keys, side="right") - 1, 0)
        inside = np.clip(keys - starts[at], 0, lengths[at])
        return before[at] + extra[at] * inside / np.maximum(lengths[at], 1)

    spans_again = np.maximum(below(highs) - below(lows), 0)
    return np.clip(np.ceil(2 * spans_again / mean), 1, np.maximum(sizes // max(smallest, 1), 1)).astype(np.int64)


def _sorted_distinct(keys: np.ndarray) -> np.ndarray:
    """``np.unique`` of keys that come in runs already sorted: a stable sort merges the runs, where
    ``unique`` would hash every key."""
    keys = np.sort(keys, kind="stable")
    first = np.ones(len(keys), dtype=bool)
    first[1:] = keys[1:] != keys[:-1]
    return keys[first]


def _covered(starts: np.ndarray, ends: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Bytes of the disjoint sorted ranges below each of ``positions``."""
    if not len(starts):
        return np.zeros(len(positions), dtype=np.int64)
    below = np.concatenate(([0], np.cumsum(ends - starts)))
    at = np.searchsorted(starts, positions, side="right")  # ranges starting at or before
    inside = np.where(at > 0, np.minimum(positions, ends[np.maximum(at - 1, 0)]) - starts[np.maximum(at - 1, 0)], 0)
    return below[np.maximum(at - 1, 0)] * (at > 0) + np.maximum(inside, 0)


def _per_span(indptr: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per span, the sum of its pairs' ``values`` (CSR by ``indptr``)."""
    total = np.concatenate(([0], np.cumsum(values)))
    return total[indptr[1:]] - total[indptr[:-1]]


def _most(indptr: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per span, the largest of its pairs' ``values`` (CSR by ``indptr``; 0 for a span without any)."""
    most = np.zeros(len(indptr) - 1, dtype=values.dtype)
    some = np.diff(indptr) > 0
    if len(values):
        most[some] = np.maximum.reduceat(values, indptr[:-1][some])
    return most


def _assign(sizes: np.ndarray, indptr: np.ndarray, needers: np.ndarray, needed: np.ndarray, sending: np.ndarray,
            nodes: np.ndarray, target: int) -> np.ndarray:
    """Owners balanced by bytes read and sent, each within a fair share of the bytes read (bytes /
    ranks, plus a span). Spans one rank alone needs go first, to that rank (those are never sent).
    Then the spans whose owner sends most of them whoever reads them (no needer needs half of the
    bytes ``sending`` counts: what its needers need, once per class of twins), most sent first, each
    to the needer that has sent least so far: spans every rank needs a sliver of (FSDP's shards of
    each tensor) spread their sends over the ranks instead of piling them on a few. The others in
    span order, each to the rank needing most of it, so that a rank reads much of what it needs
    itself. A span none of its needers can take goes to the least loaded rank on a node that
    needs it, else to the least loaded rank."""
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
    # The others: first those whose owner sends most of them, most sent first (the largest first
    # keep the greedy within about one span's sends of the mean), then the rest in span order.
    rest = np.flatnonzero(owners < 0)
    spread = 2 * _most(indptr, needed)[rest] < sending[rest]
    rest = np.concatenate([rest[spread][np.argsort(-sending[rest[spread]], kind="stable")], rest[~spread]])
    spreads = np.arange(len(rest)) < int(spread.sum())
    counts = indptr[rest + 1] - indptr[rest]
    listed = consecutive(indptr[rest], counts)
    # each span's needers by most needed bytes first (stably: then in rank order), read one by one:
    # the loop below looks at a few of them per span, where numpy costs more than the work
    span = np.repeat(np.arange(len(rest)), counts)
    listed = listed[_by_span_then_most(span, needed[listed])]
    ranks, wanted = needers[listed], needed[listed]
    ends = np.append(np.flatnonzero((span[1:] != span[:-1]) | (wanted[1:] != wanted[:-1])) + 1, len(listed))
    his = np.cumsum(counts)
    first_ends = ends[np.searchsorted(ends, his - counts, "right")]  # where each span's first run ends
    level = (ranks, memoryview(ranks), ends.tolist())
    share = memoryview(wanted)
    held = load.tolist()
    sent = np.zeros(world, dtype=np.int64), [0] * world  # by the spread spans, which come first
    node = np.unique(nodes, return_inverse=True)[1].reshape(-1)
    chosen = []
    lo = 0
    for size, hi, end, sends, spreading in zip(sizes[rest].tolist(), his.tolist(), first_ends.tolist(),
                                               sending[rest].tolist(), spreads.tolist()):
        at = (_least_sending(load, held, sent, level, lo, hi, size, fair) if spreading
              else _preferred(load, held, level, lo, hi, end, size, fair))
        owner = level[1][at] if at >= 0 else _fallback(load, ranks[lo:hi], size, fair, node)
        if spreading:  # about what it sends: all but its own bytes (with twins, those go down a chain too)
            away = sends - (share[at] if at >= 0 else 0)
            sent[0][owner] += away
            sent[1][owner] += away
        chosen.append(owner)
        load[owner] += size
        held[owner] += size
        lo = hi
    owners[rest] = chosen
    return owners


def _by_span_then_most(span: np.ndarray, needed: np.ndarray) -> np.ndarray:
    """The order of pairs by ``span`` (ascending, already in runs), then most ``needed`` bytes
    first, stably: one int64 key where it fits (hsdp at 1024 ranks: 10 ms, where ``lexsort``
    takes 23 ms), else ``lexsort``."""
    top = int(needed.max(initial=0)) + 1
    if len(span) and (int(span[-1]) + 1) * top >= 2**63:
        return np.lexsort((-needed, span))
    return np.argsort(span * top + (top - 1 - needed), kind="stable")


def _preferred(load: np.ndarray, held: list[int], level: tuple[np.ndarray, memoryview, list[int]], lo: int, hi: int,
               end: int, size: int, fair: float) -> int:
    """Of a span's needers ``level[0][lo:hi]`` (most needed bytes first; ``level[1]`` the same,
    read entry by entry as ints without converting them all, 670k at hsdp; ``level[2]``: where
    the runs of needers needing as much end, ``end`` the first's), the position of the first of
    the least loaded among those needing most while within ``fair`` after ``size`` more bytes
    (each rank's ``load``, ``held`` as a list); -1 when none fits."""
    ranks, listed, ends = level
    for i in range(lo, hi):
        if held[listed[i]] + size <= fair:
            break
    else:
        return -1
    if i >= end:
        end = ends[bisect_right(ends, i)]
    if end - i > 16:  # many: numpy
        loads = load[ranks[i:end]]
        return i + int(np.argmin(np.where(loads + size <= fair, loads, _NONE)))
    best = i
    least = held[listed[i]]
    for at in range(i + 1, end):
        rank = listed[at]
        if held[rank] < least and held[rank] + size <= fair:
            best, least = at, held[rank]
    return best


def _least_sending(load: np.ndarray, held: list[int], sent: tuple[np.ndarray, list[int]],
                   level: tuple[np.ndarray, memoryview, list[int]], lo: int, hi: int, size: int, fair: float) -> int:
    """Of a span's needers ``level[0][lo:hi]`` (most needed bytes first, then in rank order, as
    :func:`_preferred` reads them) within ``fair`` after ``size`` more bytes, the position of the
    least loaded of those that have ``sent`` least (each rank's, as an array and a list), the
    first of them on a tie; -1 when none fits."""
    ranks, listed, _ = level
    if hi - lo > 16:  # many: numpy, in the copies the gathers made (fewer calls: thousands of spans)
        candidates = ranks[lo:hi]
        loads, sends = load[candidates], sent[0][candidates]
        sends[loads + size > fair] = _NONE
        least = sends.min()
        if least == _NONE:
            return -1
        loads[sends != least] = _NONE
        return lo + int(loads.argmin())
    best, least = -1, (0, 0)
    for at in range(lo, hi):
        rank = listed[at]
        if held[rank] + size <= fair and (best < 0 or (sent[1][rank], held[rank]) < least):
            best, least = at, (sent[1][rank], held[rank])
    return best


def _fallback(load: np.ndarray, candidates: np.ndarray, size: int, fair: float, nodes: np.ndarray) -> int:
    """The owner of a span no needer of which (``candidates``) can take within ``fair``: the least
    loaded rank on a node that needs it if it can, else the least loaded rank. ``nodes``: each
    rank's node, numbered from 0."""
    if len(candidates):
        needing = np.zeros(int(nodes.max()) + 1, dtype=bool)
        needing[nodes[candidates]] = True
        local = np.flatnonzero(needing[nodes])
        best = int(local[np.argmin(load[local])])
        if load[best] + size <= fair:
            return best
    return int(np.argmin(load))


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
    """Every rank's :class:`Traffic` under ``plan`` (what the CLI's ``plan`` and the simulation show):
    one route per class of twins, its parts sent by each twin's senders (relays included)."""
    sent = np.zeros(plan.world, dtype=np.int64)
    received = np.zeros(plan.world, dtype=np.int64)
    routes: dict[int, Routed] = {}
    for rank, needs in enumerate(needs_by_rank):
        twins = int(plan.twins[rank])
        if twins not in routes:
            routes[twins] = plan.route(needs)
        routed = routes[twins]
        senders = plan.senders(rank, routed)
        others = senders != rank
        sizes = (routed.end - routed.start)[others]
        np.add.at(sent, senders[others], sizes)
        received[rank] = int(sizes.sum())
    reads = span_costs(plan.owner, plan.end - plan.start, plan.world, request_bytes)
    return [Traffic(own.nbytes, own.requests, int(received[r]), int(sent[r])) for r, own in enumerate(reads)]
