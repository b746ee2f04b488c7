"""One cooperative ``read_data``: this rank reads the spans it owns and exchanges raw bytes.

The ranks gather each other's needs (the chunks of their plans, as integers: no pickling), build
the same :class:`~hp_dcp_hf.storage.read.spans.ClusterPlan`, then each reads its own spans (large
ranged reads, in file order, at most ``window`` bytes held at once) while a thread runs the
exchange (:mod:`hp_dcp_hf.storage.read.exchange`): every rank receives exactly the checkpoint bytes it
needs from the spans of others, as stored, into its chunks' buffers (its destinations themselves
where they take the file's bytes as they are). Casts, conversions and dequantization happen on
the receiving rank as in a direct read, when a chunk's bytes are all in.
"""

from __future__ import annotations

import bisect
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hp_dcp_hf.storage.format.catalog import CheckpointTensor
from hp_dcp_hf.storage.format.header import TensorEntry
from hp_dcp_hf.storage.format.ranges import Piece, Request, request_views
from hp_dcp_hf.storage.read.copy import copy_into
from hp_dcp_hf.storage.read.exchange import ExchangeStats, ReadProgress, Region, Stream, exchange
from hp_dcp_hf.storage.read.needs import Need, Needs, StoredTensor, Tensors, decode_needs, encode_needs
from hp_dcp_hf.storage.read.payoff import ReadCost, direct_cost
from hp_dcp_hf.storage.read.routing import Run, runs
from hp_dcp_hf.storage.read.spans import ClusterPlan
from hp_dcp_hf.storage.transport.backend import placing
from hp_dcp_hf.storage.transport.location import CheckpointLocation
from hp_dcp_hf.storage.transport.stats import ReadStats
from hp_dcp_hf.util.collectives import collective_device


@dataclass(frozen=True)
class StoredTable:
    """Every stored tensor (a part of a checkpoint key) by index, the same on every rank: files in
    name order, tensors in file then byte order."""

    files: tuple[str, ...]
    entries: tuple[TensorEntry, ...]
    index: dict[tuple[str, str, int], int] = field(repr=False)

    @classmethod
    def of(cls, checkpoint: dict[str, CheckpointTensor]) -> StoredTable:
        parts = sorted((p for t in checkpoint.values() for p in t.parts), key=lambda p: (p.file, p.data_start))
        return cls(tuple(sorted({p.file for p in parts})), tuple(parts),
                   {(p.key, p.file, p.data_start): i for i, p in enumerate(parts)})

    @cached_property
    def tensors(self) -> Tensors:
        position = {name: i for i, name in enumerate(self.files)}
        return Tensors([StoredTensor(position[e.file], e.data_start, e.shape, e.itemsize) for e in self.entries])

    def needs(self, chunks: Sequence[Any]) -> Needs:
        """``chunks``' boxes as needs of the stored tensors, in their order."""
        index = self.index
        return Needs.of([Need(index[c.entry.key, c.entry.file, c.entry.data_start], c.box) for c in chunks],
                        self.tensors)


def node_id(node: str) -> int:
    """An integer standing for a node's name (ranks of one node report the same)."""
    return zlib.crc32(node.encode())


def gather_needs(needs: np.ndarray, header: Sequence[int]) -> tuple[list[np.ndarray], list[list[int]]]:
    """Every rank's encoded needs and ``header`` (a few integers, as many on every rank), on every
    rank (two ``all_gather`` of int64 tensors)."""
    device, world = collective_device(), dist.get_world_size()
    mine = torch.from_numpy(np.concatenate((np.asarray(header, dtype=np.int64), needs)).astype(np.int64))
    length = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    sizes = [int(n.item()) for n in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.int64)
    padded[: mine.numel()] = mine
    every = [torch.empty(max(sizes), dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(every, padded.to(device))
    arrays = [e.cpu().numpy()[:n] for e, n in zip(every, sizes)]
    return [a[len(header):] for a in arrays], [a[: len(header)].tolist() for a in arrays]


@dataclass(frozen=True)
class GatheredPlan:
    """A cooperative load's plan, the same on every rank, before any read: this rank's needs
    (``mine``), the cluster's span plan, and what each rank would read on its own (``direct``)."""

    mine: Needs
    plan: ClusterPlan
    direct: tuple[ReadCost, ...]
    began: float  # when gathering began: the start of the ``spans`` phase


def gather_plan(*, table: StoredTable, chunks: Sequence[Any], node: str, gap: int, span_bytes: int,
                direct_gap: int, request_bytes: int) -> GatheredPlan:
    """Every rank's needs gathered and the cluster's span plan built from them (every rank calls
    it together): ``chunks`` are this rank's, sorted by file and first byte; ``gap``: holes bridged
    inside a span; ``direct_gap``: those a direct read would bridge (for ``GatheredPlan.direct``)."""
    began = time.perf_counter()
    tensors = table.tensors
    mine = table.needs(chunks)
    own = direct_cost(mine, tensors, direct_gap, request_bytes)
    encoded, headers = gather_needs(encode_needs(mine, tensors), (node_id(node), own.nbytes, own.requests))
    rank = dist.get_rank()
    needs = [mine if r == rank else decode_needs(flat, tensors) for r, flat in enumerate(encoded)]
    plan = ClusterPlan.build(tensors, needs, table.files, nodes=[h[0] for h in headers], gap=gap,
                             span_bytes=span_bytes)
    return GatheredPlan(mine, plan, tuple(ReadCost(h[1], h[2]) for h in headers), began)


@dataclass
class SpanLoad:
    """What one rank does in a cooperative read, and what it counted."""

    plan: ClusterPlan
    storage_bytes: int = 0  # read from storage by this rank
    own_bytes: int = 0  # of this rank's needs, the bytes inside its own spans (not received)
    landed_bytes: int = 0  # of those, read straight into their destinations (spans only this rank needs)
    relay_bytes: int = 0  # sent to twins from this rank's own needs (bytes of others' spans it received)
    exchange: ExchangeStats = field(default_factory=ExchangeStats)
    seconds: dict[str, float] = field(default_factory=dict)  # "spans": gather and plan; "exchange": after the reads


class _Needs:
    """This rank's chunks as the exchange fills them: each chunk's bytes land in its destination
    when it takes them as stored, else in a staging buffer made on first arrival; once a chunk's
    bytes are all in, and those it forwards to twins (``relays``: need -> bytes) all sent, its values
    go to the destination and ``finished(chunk)`` is called. ``writing(chunk)`` is told, once a
    chunk, when bytes go into its destination (before they do, or after a read straight into it)."""

    def __init__(self, chunks: Sequence[Any], finished: Callable[[int], None], relays: dict[int, int],
                 writing: Callable[[int], None]) -> None:
        self._chunks, self._finished, self._writing = chunks, finished, writing
        self._written: set[int] = set()
        self._lock = threading.Lock()
        self._remaining = [chunk.nbytes + relays.get(i, 0) for i, chunk in enumerate(chunks)]
        self._arrived: dict[int, tuple[list[int], list[int]]] = {i: ([], []) for i in relays}
        self._buffers: dict[int, torch.Tensor] = {
            i: chunk.dest.reshape(-1).view(torch.uint8) for i, chunk in enumerate(chunks) if chunk.direct}

    def lands(self, index: int) -> bool:
        """Whether chunk ``index``'s buffer is its destination (it takes the file's bytes as stored)."""
        return self._chunks[index].direct

    def buffer(self, index: int) -> torch.Tensor:
        """Where chunk ``index``'s bytes go as they arrive, its destination or staging, to be written
        now (a destination is named to ``writing`` first)."""
        buffer = self.place(index)
        if self._chunks[index].direct:
            self.write(index)
        return buffer

    def place(self, index: int) -> torch.Tensor:
        """:meth:`buffer`, for a read that names what it wrote itself (:meth:`write`) once it has."""
        with self._lock:
            buffer = self._buffers.get(index)
            if buffer is None:
                buffer = self._buffers[index] = torch.empty(self._chunks[index].nbytes, dtype=torch.uint8)
            return buffer

    def write(self, index: int) -> None:
        """Bytes go (or went) into chunk ``index``'s destination: ``writing`` is told, the first time."""
        with self._lock:
            first = index not in self._written
            self._written.add(index)
        if first:
            self._writing(index)

    def received(self, region: Region) -> None:
        """``region``'s bytes arrived from a peer (noted where they are forwarded)."""
        arrived = self._arrived.get(region.key)
        if arrived is not None:
            lo, hi = region.offset, region.offset + region.nbytes
            with self._lock:  # merged into the need's sorted, disjoint arrived ranges
                starts, ends = arrived
                i, j = bisect.bisect_left(ends, lo), bisect.bisect_right(starts, hi)
                if i < j:
                    lo, hi = min(lo, starts[i]), max(hi, ends[j - 1])
                starts[i:j], ends[i:j] = [lo], [hi]
        self.moved(region.key, region.nbytes)

    def arrived(self, region: Region) -> bool:
        """Whether every byte of ``region`` (to forward) is here."""
        with self._lock:
            starts, ends = self._arrived[region.key]
            i = bisect.bisect_right(starts, region.offset) - 1
            return i >= 0 and ends[i] >= region.offset + region.nbytes

    def moved(self, index: int, nbytes: int) -> None:
        """``nbytes`` of need ``index`` arrived, or were forwarded."""
        with self._lock:
            self._remaining[index] -= nbytes
            if self._remaining[index]:
                return
            buffer = self._buffers.pop(index)
        chunk = self._chunks[index]
        if not chunk.direct:
            self.write(index)
            copy_into(chunk.dest, chunk.staged_view(buffer, 0))
        self._finished(index)


class _Spans:
    """The spans this rank owns, read into buffers and freed once every byte of them reached the
    ranks that need it (this one included): at most ``window`` bytes held (one span at least)."""

    def __init__(self, plan: ClusterPlan, owned: np.ndarray, pending: dict[int, int], window: int) -> None:
        self.plan, self.owned, self.window = plan, owned, window
        self._pending = dict(pending)
        self._buffers: dict[int, torch.Tensor] = {}
        self._held = 0
        self._cond = threading.Condition()

    def size(self, span: int) -> int:
        return int(self.plan.end[span] - self.plan.start[span])

    def allocate(self, span: int, stop: Callable[[], bool]) -> torch.Tensor | None:
        """A buffer for ``span`` once the window has room for it (``None`` when ``stop()`` says so)."""
        size = self.size(span)
        with self._cond:
            self._cond.wait_for(lambda: stop() or not self._held or self._held + size <= self.window)
            if stop():
                return None
            self._held += size
            buffer = self._buffers[span] = torch.empty(size, dtype=torch.uint8)
            return buffer

    def buffer(self, span: int) -> torch.Tensor:
        with self._cond:
            return self._buffers[span]

    def moved(self, span: int, nbytes: int) -> None:
        with self._cond:
            self._pending[span] -= nbytes
            if not self._pending[span]:
                self._release(span)

    def read(self, span: int) -> None:
        """``span`` is in memory: freed at once when nobody needs its bytes (a bridged hole)."""
        with self._cond:
            if not self._pending.get(span, 0):
                self._release(span)

    def _release(self, span: int) -> None:
        if self._buffers.pop(span, None) is not None:
            self._held -= self.size(span)
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


def read_spans(
    gathered: GatheredPlan,
    *,
    location: CheckpointLocation,
    table: StoredTable,
    chunks: Sequence[Any],
    finished: Callable[[int], None],
    request_bytes: int,
    threads: int,
    budget: int,
    stats: ReadStats,
    log: Callable[[str, int, int], None] | None,
    direct_io: bool,
    landed: Callable[[], None],
    writing: Callable[[int], None],
) -> SpanLoad:
    """The cooperative read of ``chunks`` (this rank's, sorted by file and first byte) under
    ``gathered``'s plan: every rank calls it together. ``finished(i)``: chunk ``i`` holds its
    values; ``landed()``: a request's bytes are in; ``writing(i)``: bytes go into chunk ``i``'s
    destination (once a chunk). Raises this rank's error, or
    returns having left the outcome of the others to agree on (``SpanLoad.exchange`` counts)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, plan = gathered.mine, gathered.plan
    owned = plan.owned(rank)
    load = SpanLoad(plan, plan.bytes_read(rank))

    incoming = plan.route(mine)
    senders = plan.senders(rank, incoming)
    own = incoming.select(senders == rank)  # this rank's own spans
    load.own_bytes = own.nbytes
    from_peers = [incoming.select(senders == peer) if peer != rank else None for peer in range(world)]
    to_peers = plan.sends(rank, incoming, owned)
    # Every rank sends each peer at most `chunk` bytes a round: the budget over twice the most peers
    # any rank sends to or receives from, so no rank moves more than the budget a round.
    degree = max(sum(1 for r in to_peers if r is not None and r.nbytes),
                 sum(1 for r in from_peers if r is not None and r.nbytes))
    most = torch.tensor([degree], dtype=torch.int64, device=collective_device())
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    chunk = max(1, budget // (2 * max(1, int(most.item()))))
    receives = [[Region(r.need, r.offset, r.nbytes, span=r.span) for r in runs(routed, chunk)]
                if routed is not None else [] for routed in from_peers]
    outgoing = [[_in_span(plan, r) if plan.owner[r.span] == rank else Region(r.need, r.offset, r.nbytes, span=r.span,
                                                                              relay=True)
                 for r in runs(routed, chunk)] if routed is not None else [] for routed in to_peers]
    own_runs: dict[int, list[Run]] = defaultdict(list)
    for r in runs(own, chunk):
        own_runs[r.span].append(r)
    pending: dict[int, int] = defaultdict(int)  # span -> its bytes still to copy here or send
    relays: dict[int, int] = defaultdict(int)  # need -> its bytes still to forward
    for regions in (*outgoing, [_in_span(plan, r) for rs in own_runs.values() for r in rs]):
        for region in regions:
            (relays if region.relay else pending)[region.key] += region.nbytes
    load.relay_bytes = sum(relays.values())
    target = _Needs(chunks, finished, relays, writing)
    landing = {} if direct_io else _landing(own_runs, pending, target)
    load.landed_bytes = sum(pending[span] for span in landing)
    load.seconds["spans"] = time.perf_counter() - gathered.began
    spans = _Spans(plan, owned, pending, window=max(4 * budget, 2 * int((plan.end - plan.start).max(initial=0))))
    progress = ReadProgress()

    def source(region: Region) -> torch.Tensor:
        return target.buffer(region.key) if region.relay else spans.buffer(region.key)

    def sent(region: Region) -> None:
        (target if region.relay else spans).moved(region.key, region.nbytes)

    def ready(region: Region) -> bool:
        return target.arrived(region) if region.relay else progress.ready(region.key)

    sends = [Stream(r, source, sent, ready) for r in outgoing]
    streams = [Stream(r, lambda g: target.buffer(g.key), target.received) for r in receives]
    outcome: dict[str, Any] = {"stats": ExchangeStats()}

    def run_exchange() -> None:
        try:
            outcome["stats"] = exchange(sends, streams, chunk, progress)
        except BaseException as e:  # noqa: BLE001 - agreed on by the caller
            outcome["error"] = e
        finally:
            spans.wake()

    thread = threading.Thread(target=run_exchange, name="hp-dcp-hf-exchange", daemon=True)
    thread.start()
    error: BaseException | None = None
    try:
        _read_owned(location, plan, spans, own_runs, landing, target, progress, request_bytes, threads,
                    stats, log, direct_io, landed, stop=lambda: "error" in outcome or outcome["stats"].aborted)
    except BaseException as e:  # noqa: BLE001 - every rank learns of it through the exchange
        error = e
    finally:
        progress.finish(error)
        reads_done = time.perf_counter()
        thread.join()
    load.seconds["exchange"] = time.perf_counter() - reads_done
    load.exchange = outcome["stats"]
    if error is not None:
        raise error
    if "error" in outcome:
        raise outcome["error"]
    return load


def _in_span(plan: ClusterPlan, run: Run) -> Region:
    """Where ``run``'s bytes are in its span's buffer."""
    return Region(run.span, run.start - int(plan.start[run.span]), run.nbytes, run.rows, run.stride)


def _landing(own_runs: dict[int, list[Run]], pending: dict[int, int], target: _Needs) -> dict[int, list[Piece]]:
    """The owned spans whose bytes go nowhere but into this rank's own destinations as stored
    (no other rank needs a byte of them, every chunk of theirs takes the file's bytes as they are,
    no two of their parts share a byte), each as its parts in file order: such a span is read
    straight into the destinations, without a span buffer to fill and copy out of. Spans are cut
    there only where one rank alone needs 1 MiB or more (``OWN_RUN_BYTES``): large row blocks."""
    landing = {}
    for span, own in own_runs.items():
        if sum(run.nbytes for run in own) != pending[span] or not all(target.lands(run.need) for run in own):
            continue
        parts = sorted(
            (Piece(run.start + i * run.stride, run.start + i * run.stride + run.nbytes // run.rows, run.need,
                   run.offset + i * (run.nbytes // run.rows))
             for run in own for i in range(run.rows)),
            key=lambda part: part.start,
        )
        if all(a.end <= b.start for a, b in zip(parts, parts[1:])):
            landing[span] = parts
    return landing


def _landing_views(parts: list[Piece], start: int, end: int, target: _Needs) -> list[memoryview]:
    """What a read of ``[start, end)`` of a landing span fills (:func:`request_views`): its parts'
    bytes, cut to the read, in their destinations, and scratch for the holes between them."""
    inside = [Piece(max(p.start, start), min(p.end, end), p.owner, p.offset + max(p.start, start) - p.start)
              for p in parts[bisect.bisect_right(parts, start, key=lambda p: p.end) :] if p.start < end]
    buffers = {p.owner: memoryview(target.place(p.owner).numpy()) for p in inside}
    scratch = memoryview(bytearray(end - start - sum(p.nbytes for p in inside)))
    return request_views(Request(start, end, tuple(inside)), buffers, scratch)


def _read_owned(location, plan, spans: _Spans, own_runs: dict[int, list[Run]], landing: dict[int, list[Piece]],
                target: _Needs, progress: ReadProgress,
                request_bytes: int, threads: int, stats: ReadStats, log, direct_io: bool,
                landed: Callable[[], None], stop: Callable[[], bool]) -> None:
    """Read every owned span (requests of at most ``request_bytes``, ``threads`` at once); as each
    span is in, copy this rank's own parts out of it and mark it ready for the exchange. A span of
    ``landing`` is read straight into its parts' destinations instead (:func:`_landing`)."""
    lock = threading.Lock()
    left: dict[int, int] = {}  # span -> its requests still reading
    requests: dict[int, int] = {}
    failed = threading.Event()

    def finish(span: int, buffer: torch.Tensor | None) -> None:
        stats.add(plan.files[int(plan.file[span])], bytes_read=spans.size(span),
                  bytes_needed=int(plan.needed[span]), ranges=1, requests=requests[span])
        for run in own_runs.get(span, ()):
            if buffer is not None:
                source = _in_span(plan, run)
                mine = target.buffer(run.need)[run.offset : run.offset + run.nbytes]
                mine.view(run.rows, -1).copy_(source.view(buffer))
                spans.moved(span, run.nbytes)
            target.moved(run.need, run.nbytes)
        progress.read(span)
        if buffer is not None:
            spans.read(span)

    def read(span: int, buffer: torch.Tensor | None, start: int, end: int) -> None:
        try:
            file = plan.files[int(plan.file[span])]
            base = int(plan.start[span])
            # a landing read writes destinations in place: they are named once it may have
            landed_in = [p.owner for p in landing[span] if p.start < end and p.end > start] if buffer is None else []

            def wrote() -> None:
                for need in landed_in:
                    target.write(need)

            with location.open(file) as handle:  # closing checks the file is unchanged
                if direct_io:
                    handle.use_direct_io()
                views = (_landing_views(landing[span], start, end, target) if buffer is None
                         else [memoryview(buffer[start - base : end - base].numpy())])
                with placing(wrote):
                    handle.read_into(start, views)
            landed()
            if log is not None:
                log(file, start, end)
            with lock:
                left[span] -= 1
                done = not left[span]
            if done:
                finish(span, buffer)
        except BaseException:
            failed.set()
            spans.wake()
            raise

    def stopping() -> bool:
        return stop() or failed.is_set()

    futures = []
    with ThreadPoolExecutor(threads, "hp-dcp-hf-span") as pool:
        for span in spans.owned.tolist():
            buffer = None if span in landing else spans.allocate(span, stopping)
            if stopping():
                break
            start, end = int(plan.start[span]), int(plan.end[span])
            cuts = [*range(start, end, request_bytes), end]
            requests[span] = left[span] = len(cuts) - 1
            futures.extend(pool.submit(read, span, buffer, a, b) for a, b in zip(cuts, cuts[1:]))
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            future.cancel()
    errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
    if errors:
        raise errors[0]
