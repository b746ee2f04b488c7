"""``HFStorageReader``: a DCP ``StorageReader`` that reads only the bytes of a safetensors
checkpoint each rank's plan needs.

Metadata: rank 0 reads the index and every header (ranged reads) and broadcasts them as JSON; the
DCP metadata has one whole-tensor chunk per checkpoint key, so any planner's read items are boxes
of checkpoint tensors, also where a tensor is stored in chunks across files (torch's distributed
HF files): the reader splits each box by chunk and reads every piece from its own file. Data:
items are cut to the staging budget and packed into per-file batches that a thread pool reads.
Local files are mapped into memory and each box is one strided ``copy_`` out of the mapping (a
row-sharded box would otherwise be one read per row). Other
backends read byte ranges, coalesced into requests: when the destination is a contiguous CPU
tensor of the checkpoint dtype, the bytes land in it directly; otherwise they go through a slot of a
bounded staging ring and ``copy_`` (which casts and writes through non-contiguous views). CUDA
destinations are always staged, in pinned slots, and copied to the device asynchronously while the
next reads run (:mod:`hp_dcp_hf.storage.read.ring`).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
import uuid
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from hp_dcp_hf.errors import HPDCPHFError, PlanningError, StorageReadError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.storage.format.catalog import QUANTIZATION_CONFIG, Catalog, CheckpointTensor, find_files, scan
from hp_dcp_hf.storage.format.header import TensorEntry
from hp_dcp_hf.storage.format.journal import leftovers_warning
from hp_dcp_hf.storage.format.ranges import (
    Piece,
    Request,
    box_byte_ranges,
    box_span,
    coalesce,
    count_requests,
    split_box,
)
from hp_dcp_hf.storage.read.copy import copy_into
from hp_dcp_hf.storage.read.exchange import ExchangeStats, typed
from hp_dcp_hf.storage.read.leftovers import unfinished_save
from hp_dcp_hf.storage.read.ring import Copy, SlotCopier, StagingRing, StagingStats
from hp_dcp_hf.storage.read.span_reads import SpanLoad, StoredTable, node_id, read_spans
from hp_dcp_hf.storage.read.spans import SPAN_BYTES, SPAN_GAP, ClusterPlan, Traffic, traffic
from hp_dcp_hf.storage.transport.backend import RetryPolicy
from hp_dcp_hf.storage.transport.fsspec_backend import DIRECT_IO_ALIGN
from hp_dcp_hf.storage.transport.location import CheckpointLocation, RangeFile, filesystem, locate
from hp_dcp_hf.storage.transport.stats import ReadStats
from hp_dcp_hf.util.collectives import agree_on_failure, share_from_rank0, should_broadcast
from hp_dcp_hf.util.perf import paused_gc

_ALIGN = 16
"""Staged chunks start at multiples of this, so a byte slice can be viewed as any dtype."""

_REMOTE_BATCH_BYTES = 8 * 2**20
"""Smallest batch on remote stores (whatever ``num_threads``): the requests of a batch are at most
this big where the layout allows (at 20-50 ms per round trip a connection moves several MiB)."""

_LARGE_RANGE = 1 << 20
"""A batch whose ranges average at least this many bytes and land straight in their destinations
is read with ``preadv`` even from a mappable file: copying out of a fresh mapping page-faults
through the same bytes (15-20% slower on contiguous 8 MiB batches here). Mappings win on strided
boxes, where ranged reads cost a call per row."""


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`_ALIGN`: what a staged chunk takes of a slot."""
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class _Chunk:
    """A part of one read item small enough for the staging budget, with where its bytes go: ``box``
    is in the coordinates of ``entry``, the tensor (or chunk of one) stored in one file."""

    item: int
    entry: TensorEntry
    box: Box
    dest: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.entry.itemsize

    @cached_property
    def ranges(self) -> list[tuple[int, int]]:
        """Absolute ``[start, end)`` byte ranges of the box, in file order (one per row, or fewer)."""
        start = self.entry.data_start
        return [(start + s, start + e) for s, e in box_byte_ranges(self.entry.shape, self.entry.itemsize, self.box)]

    @cached_property
    def span(self) -> tuple[int, int, int]:
        """Absolute start of the first range, end of the last, and how many ranges, without listing them."""
        first, last, count = box_span(self.entry.shape, self.entry.itemsize, self.box)
        return self.entry.data_start + first, self.entry.data_start + last, count

    @property
    def strides(self) -> tuple[int, ...]:
        """The checkpoint tensor's row-major strides, in elements."""
        shape = self.entry.shape
        return tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))

    @property
    def mappable(self) -> bool:
        """The tensor's bytes can be viewed as its dtype in place (its start is aligned to it)."""
        return self.entry.data_start % self.entry.itemsize == 0

    @property
    def host(self) -> bool:
        """The destination is a plain CPU tensor: a copy out of a mapping can write it (anything else,
        a CUDA tensor above all, is staged in the ring)."""
        return type(self.dest) is torch.Tensor and self.dest.device.type == "cpu"

    @property
    def direct(self) -> bool:
        """The destination's own memory can receive the file bytes as they are."""
        return self.host and self.dest.dtype == self.entry.dtype and self.dest.is_contiguous()

    def staged_view(self, slot: torch.Tensor, offset: int) -> torch.Tensor:
        """This chunk's values as stored, in ``slot``'s bytes from ``offset`` (aligned)."""
        return slot[offset : offset + self.nbytes].view(self.entry.dtype).view(self.box.sizes)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The writable bytes of a contiguous CPU tensor (any dtype, 0-d included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _request_views(request: Request, buffers: list[memoryview], scratch: memoryview) -> list[memoryview]:
    """The buffers ``request``'s bytes fill, in file order; gaps land in ``scratch`` and are dropped."""
    views, position = [], request.start
    for piece in request.pieces:
        if piece.start > position:
            views.append(scratch[: piece.start - position])
        views.append(buffers[piece.owner][piece.offset : piece.offset + piece.nbytes])
        position = piece.end
    return views


class HFStorageReader(StorageReader):
    """Loads a Hugging Face safetensors checkpoint through ``torch.distributed.checkpoint``.

    ``path``: a ``.safetensors`` file or a directory (with or without
    ``model.safetensors.index.json``; the index file's own path names its directory), as a local
    path or any fsspec URL; the files torch's ``HuggingFaceStorageWriter(save_distributed=True)``
    writes (a tensor in chunks across per-rank files) load like any checkpoint.
    ``storage_options`` and ``fs_kwargs`` go to the fsspec filesystem. ``coalesce_gap``:
    neighbouring byte ranges at most this far apart are read in one request (gap bytes are read
    and dropped); by default 0 on local files (bytes read = bytes needed) and 1 MiB on remote
    stores, where a request costs a round trip (``REMOTE_COALESCE_GAP``; pass 0 to fetch needed
    bytes only). ``num_threads``: reads in flight (on remote stores: requests in flight, those of
    one batch too; a batch there is at least 8 MiB whatever the thread count, so GETs do not shrink
    as threads grow).
    ``staging_bytes``: the most memory reads in flight may hold for staging, or keep mapped (a
    part's span in the file, holes included, counts); a larger tensor is read a block of rows at a
    time. With CUDA destinations the staging ring holds one batch more (a batch's reads overlap the
    previous one's copy to the device), in pinned memory. ``broadcast_metadata``: in a process group, rank 0 alone reads the headers and broadcasts
    them (every rank must then call ``read_metadata``, which ``dcp.load`` does). ``retry``: the
    :class:`~hp_dcp_hf.storage.transport.backend.RetryPolicy` of remote reads, or a dict of its fields.
    ``record_requests``: keep every request issued in ``requests_log`` as ``(file, start, end)``
    (for pictures of a plan; off by default). ``cooperate``: span ownership
    (:mod:`hp_dcp_hf.storage.read.spans`): the ranks read every checkpoint byte any of them needs once
    between them, in spans of at least ``span_bytes`` each owned by one rank (balanced by bytes,
    preferring a rank on a ``node`` that needs it; ``node`` defaults to the host name), and send
    each other the raw bytes each needs: ``"always"``, ``"never"``, or ``"auto"`` (the default):
    on storage other machines share (remote stores, network, cluster and FUSE file systems), where
    every byte read costs egress, requests and server load, not on a node's own disk, whose page
    cache already serves its ranks one copy. ``map_local_files``: copy boxes out of a memory
    mapping of local files (the fast path, and ``coalesce_gap`` does not apply: only needed bytes
    are copied); ``False`` reads them with ``os.preadv`` instead, which is slower on row-sharded
    layouts but turns a disk error or a file truncated during the read into
    :class:`StorageReadError` where a mapping gets SIGBUS. Cold page cache, local files (both off
    by default; ``bench/cold.py`` measures them): ``prefetch`` hands each batch's ranges to the
    kernel's readahead (``posix_fadvise(WILLNEED)``) from a thread that runs ahead of the reads by
    at most four staging budgets, and again as each batch starts, and turns the kernel's own
    readahead guesses off for those files (``FADV_RANDOM``, ``MADV_RANDOM``); ``direct_io`` reads with ``O_DIRECT`` (around the page cache;
    ranged reads, not mappings; requests coalesced across holes shorter than a page unless
    ``coalesce_gap`` says otherwise; buffered where the file system refuses it).

    Remote paths: ``s3://bucket/prefix`` (and other fsspec URLs), ``http(s)://`` directories that
    serve ``model.safetensors.index.json`` (or one ``.safetensors`` file), ``hf://org/repo[@rev]
    [/subdir]`` and bare ``org/repo[@rev]`` Hub ids; see :mod:`hp_dcp_hf.storage.transport.location` for their
    options. A Hub revision is resolved to its commit on the rank that reads the headers and
    travels with them, so every rank reads that commit (``resolved_root`` names it after
    ``read_metadata``).

    After a load, ``entries`` maps every checkpoint key to its
    :class:`~hp_dcp_hf.storage.format.catalog.CheckpointTensor` (its parts: where its bytes are), ``stats``
    counts what was read (reset by :meth:`reset`) and ``staging`` what went through the staging
    ring (:class:`~hp_dcp_hf.storage.read.ring.StagingStats`, of the last ``read_data``).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        storage_options: Mapping[str, Any] | None = None,
        coalesce_gap: int | None = None,
        num_threads: int = 8,
        staging_bytes: int = 64 * 2**20,
        broadcast_metadata: bool = True,
        retry: RetryPolicy | Mapping[str, Any] | None = None,
        record_requests: bool = False,
        map_local_files: bool = True,
        cooperate: Literal["auto", "always", "never"] = "auto",
        span_bytes: int = SPAN_BYTES,
        node: str | None = None,
        prefetch: bool = False,
        direct_io: bool = False,
        **fs_kwargs: Any,
    ) -> None:
        super().__init__()
        if cooperate not in ("auto", "always", "never"):
            raise ValueError(f"cooperate must be 'auto', 'always' or 'never', got {cooperate!r}")
        if span_bytes < 1:
            raise ValueError(f"span_bytes must be positive, got {span_bytes}")
        self.cooperate = cooperate
        self.span_bytes = span_bytes
        self.node = node if node is not None else socket.gethostname()
        self.record_requests = record_requests
        self.map_local_files = map_local_files
        self.prefetch = prefetch
        self.direct_io = direct_io
        self._request_pool: ThreadPoolExecutor | None = None
        if (coalesce_gap or 0) < 0 or num_threads < 1 or staging_bytes < _ALIGN * num_threads:
            raise ValueError(
                f"need coalesce_gap >= 0, num_threads >= 1 and staging_bytes >= {_ALIGN} per thread; got "
                f"{coalesce_gap}, {num_threads}, {staging_bytes}"
            )
        self.storage_options = {**(storage_options or {}), **fs_kwargs}
        self.coalesce_gap = coalesce_gap
        self.num_threads = num_threads
        self.staging_bytes = staging_bytes
        self.broadcast_metadata = broadcast_metadata
        self.retry = RetryPolicy.of(retry)
        self.reset(path)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new load (of ``checkpoint_id`` when given): forget entries, zero the stats."""
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            self._fs, self._fspath = filesystem(
                self.path, self.storage_options, retry=self.retry, concurrency=self.num_threads
            )
        self.entries: dict[str, CheckpointTensor] = {}
        self.stats = ReadStats()
        self.load_id = str(uuid.uuid4())
        self.metadata_error: Exception | None = None
        self.seconds: dict[str, float] = {}  # wall time of this load's phases (see LoadReport.seconds)
        self.cooperating = False
        self.exchange = ExchangeStats()
        self.spans: SpanLoad | None = None  # a cooperative load's cluster plan and this rank's part
        self.requests_log: list[tuple[str, int, int]] = []
        self.staging = StagingStats()  # what went through the staging ring in the last read_data
        self._location: CheckpointLocation | None = None
        self._shared = False  # the checkpoint's storage is shared with other machines (Catalog.shared)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @property
    def resolved_root(self) -> str | None:
        """The directory files are read from, as located by ``read_metadata`` (a Hub root names its
        commit); ``None`` before."""
        return self._location.root if self._location is not None else None

    @property
    def _maps(self) -> bool:
        """Data is copied out of mappings of the files rather than read by ranges."""
        return (
            self.map_local_files and not self.direct_io and self._location is not None
            and self._location.backend.mappable
        )

    @property
    def _gap(self) -> int:
        """The coalescing gap requests are made with (none when mapping: gaps would cost a copy)."""
        if self._maps:
            return 0
        if self.coalesce_gap is not None:
            return self.coalesce_gap
        if self._location is None:
            return 0
        if self.direct_io and self._location.backend.local:
            return DIRECT_IO_ALIGN  # O_DIRECT reads whole pages: a hole inside one costs nothing more
        return self._location.backend.coalesce_gap

    @property
    def _batch_bytes(self) -> int:
        """The most bytes of one batch: the per-thread share of ``staging_bytes``; on remote stores at
        least :data:`_REMOTE_BATCH_BYTES` (within the budget) however many threads, since a batch is
        a GET where the layout allows and smaller GETs only multiply round trips (issue 14). A
        multiple of :data:`_ALIGN`, so a batch's chunks, aligned, fit one staging slot."""
        share = self.staging_bytes // self.num_threads
        if self._location is not None and not self._location.backend.local:
            share = max(share, min(_REMOTE_BATCH_BYTES, self.staging_bytes))
        return share - share % _ALIGN

    @property
    def request_bytes(self) -> int:
        """The largest request of a cooperative load's span reads: a batch's bytes."""
        return self._batch_bytes

    @property
    def _batch_workers(self) -> int:
        """Batches read at once: as many as ``staging_bytes`` holds, at most ``num_threads``."""
        return max(1, min(self.num_threads, self.staging_bytes // self._batch_bytes))

    def cooperates(self, world_size: int) -> bool:
        """Whether the ranks of a load on ``world_size`` ranks share their reads: with
        ``cooperate="auto"``, on storage other machines share (remote stores, network, cluster and
        FUSE file systems), not on a node's own disk (its reads cost less than the exchange). Every
        rank decides from what the scanning rank saw (``Catalog.shared``): the same on all."""
        if world_size < 2 or self.cooperate == "never" or self._location is None:
            return False
        return self.cooperate == "always" or self._shared

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True when ``checkpoint_id`` is a safetensors file or a directory holding them."""
        try:
            location, single_file = locate(*filesystem(checkpoint_id))
            find_files(location, single_file, ReadStats())
        except (HPDCPHFError, OSError, ValueError):
            return False
        return True

    # -- metadata -------------------------------------------------------------------------------

    def _scan(self) -> Catalog:
        location, single_file = locate(self._fs, self._fspath)
        catalog = scan(location, single_file, self.stats, self.num_threads)
        found = unfinished_save(location) if single_file is None else []
        if found:  # on the rank that reads the headers: one line per load, dcp.load's too
            warnings.warn(leftovers_warning(location.url(), found), stacklevel=2)
        return catalog

    def read_metadata(self) -> Metadata:
        """One whole-tensor chunk per checkpoint key (stored whole or in chunks), read once on rank 0
        when in a process group.

        An error is also kept in ``metadata_error``: torch's ``dcp.load`` turns exceptions of
        ``read_metadata`` into an ``AssertionError`` carrying only their text. Collection waits
        until the entries are built: a process holding a model runs full collections over it
        otherwise (DeepSeek-V3's catalog, 45,395 tensors: 0.8-1.0 s to decode with them, 0.25-0.31
        s without; as much again to encode on rank 0).
        """
        start = time.perf_counter()
        try:
            with paused_gc():
                return self._read_metadata()
        except Exception as error:
            self.metadata_error = error
            raise
        finally:
            self.seconds["metadata"] = time.perf_counter() - start

    def _read_metadata(self) -> Metadata:
        self.metadata_error = None
        if self.broadcast_metadata and should_broadcast():
            scanned: list[Catalog] = []

            def produce() -> bytes:
                scanned.append(self._scan())
                return scanned[0].to_json()

            raw = share_from_rank0(produce)
            catalog = scanned[0] if scanned else Catalog.from_json(raw)
        else:
            catalog = self._scan()
        # The files' versions travel with the headers: every rank's reads are checked against them.
        self._location = CheckpointLocation(self._fs, catalog.root, catalog.versions)
        self._shared = catalog.shared
        self.cooperating = self.cooperates(dist.get_world_size() if should_broadcast() else 1)
        self.entries = dict(catalog.entries)
        state_dict_metadata: dict[str, Any] = {}
        storage_data: dict[MetadataIndex, CheckpointTensor] = {}
        for key, tensor in self.entries.items():
            origin = torch.Size([0] * len(tensor.shape))
            # The whole tensor as one chunk, however it is stored: planners read boxes of it.
            state_dict_metadata[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=tensor.dtype),
                size=torch.Size(tensor.shape),
                chunks=[ChunkStorageMetadata(offsets=origin, sizes=torch.Size(tensor.shape))],
            )
            # DCP's planners look chunks up as MetadataIndex(fqn, chunk offsets).
            storage_data[MetadataIndex(key, origin)] = tensor
        return Metadata(
            state_dict_metadata=state_dict_metadata,
            # The planner needs it to read quantized tensors as their values (see mapping.quantized).
            planner_data={QUANTIZATION_CONFIG: catalog.quantization_config},
            storage_data=storage_data,
            storage_meta=StorageMeta(checkpoint_id=self.path, load_id=self.load_id),
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._location is None:
            raise PlanningError("read_metadata() must run before set_up_storage_reader()", file=self.path)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # -- data -----------------------------------------------------------------------------------

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into ``planner.resolve_tensor(item)``, then commit it."""
        start = time.perf_counter()
        for phase in ("spans", "exchange", "copy"):
            self.seconds.pop(phase, None)
        try:
            with paused_gc():
                if not self.cooperating:
                    return self._read_data(plan, planner)
                return self._read_cooperatively(plan, planner)
        finally:
            apart = self.seconds.get("spans", 0.0) + self.seconds.get("exchange", 0.0)
            self.seconds["read"] = time.perf_counter() - start - apart

    def _read_cooperatively(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Span ownership (:mod:`hp_dcp_hf.storage.read.span_reads`): this rank reads the spans it owns
        and the ranks exchange the raw bytes each needs. Every rank raises the same error when one
        fails, marked ``agreed`` (no rank needs to agree on it again)."""
        assert self._location is not None
        error: BaseException | None = None
        chunks: list[_Chunk] = []
        try:
            dests = [self._resolve(item, planner) for item in plan.items]
            chunks = self._span_chunks(plan.items, dests)
        except Exception as e:  # noqa: BLE001 - agreed on before any collective of the exchange
            error = e
        # Every rank planned before any exchanges: a rank whose planning failed is agreeing on its
        # error in load_hf_checkpoint, and this matches that collective.
        error = agree_on_failure(error)
        if error is None:
            chunk_done = _committer(plan, planner, chunks, dests)
            try:
                load = read_spans(
                    location=self._location, table=StoredTable.of(self.entries), chunks=chunks,
                    finished=lambda index: chunk_done(chunks[index].item),
                    gap=self._span_gap, span_bytes=self.span_bytes, request_bytes=self.request_bytes,
                    threads=self.num_threads, budget=self.staging_bytes, node=self.node, stats=self.stats,
                    log=(lambda f, s, e: self.requests_log.append((f, s, e))) if self.record_requests else None,
                    direct_io=self.direct_io,
                )
                self.spans, self.exchange = load, load.exchange
                self.seconds.update(load.seconds)
            except Exception as e:  # noqa: BLE001 - every rank learns of it below
                error = e
            try:
                error = agree_on_failure(error)
            except Exception as e:  # noqa: BLE001 - a rank left: this rank's own error, or the lost agreement
                error = error or typed(e, "agreeing on the load's outcome failed (did a rank leave the load?): ")
        if error is not None:
            error.agreed = True  # type: ignore[attr-defined]
            raise error
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @property
    def _span_gap(self) -> int:
        """Holes nobody needs that a span may bridge: the given ``coalesce_gap`` (at most a span),
        else none on local files and :data:`SPAN_GAP` on remote stores."""
        if self.coalesce_gap is not None:
            return min(self.coalesce_gap, self.span_bytes)
        assert self._location is not None
        return 0 if self._location.backend.local else SPAN_GAP

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._location is None:
            raise PlanningError("read_metadata() must run before read_data()", file=self.path)
        chunk_budget = self._batch_bytes
        dests = [self._resolve(item, planner) for item in plan.items]
        chunks = self._all_chunks(plan.items, dests)
        chunk_done = _committer(plan, planner, chunks, dests)
        # One slot per batch being read, and one more: a batch's reads overlap the previous batch's
        # copies to the device. Host destinations release their slot before the next batch, so they
        # never hold more than one slot per reader.
        devices = {dest.device for dest in dests if dest.device.type == "cuda"}
        ring = StagingRing(self._batch_workers + 1, chunk_budget, pin=bool(devices))
        copier = SlotCopier(ring, devices)

        batches = _batches(chunks, chunk_budget)
        prefetcher = (
            _Prefetcher(self._location, batches, self._gap, 4 * self.staging_bytes)
            if self.prefetch and self._location.backend.local and batches
            else None
        )

        def finish(batch: list[_Chunk]) -> None:
            if prefetcher is not None:
                prefetcher.done(sum(chunk.nbytes for chunk in batch))
            for chunk in batch:
                chunk_done(chunk.item)

        # Remote requests (those of one batch too) run on a pool of their own, num_threads in
        # flight whatever the batches; it outlives the batch pool, whose tasks submit to it.
        remote = not self._location.backend.local
        requests = ThreadPoolExecutor(self.num_threads, "hp-dcp-hf-get") if remote else contextlib.nullcontext()
        try:
            with requests as self._request_pool, ThreadPoolExecutor(self._batch_workers) as pool:
                futures = [
                    pool.submit(self._read_batch, self._location, batch, finish, copier)
                    for batch in batches
                ]
                completed, _ = wait(futures, return_when=FIRST_EXCEPTION)
                failed = [f for f in completed if f.exception() is not None]
                if failed:
                    for f in futures:
                        f.cancel()
        finally:
            if prefetcher is not None:
                prefetcher.close()
            copy_error = copier.close()  # every device copy done, its items committed
            self.staging = copier.stats
            if devices:
                self.seconds["copy"] = self.staging.wait_seconds
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        if copy_error is not None:
            raise copy_error
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def plan_requests(self, items: Sequence[ReadItem]) -> list[tuple[str, Request]]:
        """The ``(file, request)`` pairs ``read_data`` would issue for ``items``, without any I/O.

        The same chunking, batching and coalescing as a real read, so a plan made elsewhere (the
        CLI's ``plan``) reports exactly the ranges and requests a load will measure.
        """
        chunks = self._all_chunks(items, [torch.empty(tuple(i.lengths), device="meta") for i in items])
        return [
            (batch[0].entry.file, request)
            for batch in _batches(chunks, self._batch_bytes)
            for request in coalesce(_pieces(batch), self._gap)
        ]

    def plan_spans(
        self, items_by_rank: Sequence[Sequence[ReadItem]], nodes: Sequence[str] | None = None
    ) -> tuple[ClusterPlan, list[Traffic]]:
        """The span ownership of a cooperative load whose ranks plan ``items_by_rank`` (on
        ``nodes``, default one node each), and each rank's :class:`Traffic`, without any I/O:
        the plan a cooperative ``read_data`` builds, for the CLI's ``plan`` and the benchmarks."""
        table = StoredTable.of(self.entries)
        tensors = table.tensors
        needs = [[table.need(c) for c in self._span_chunks(items, [torch.empty(tuple(i.lengths), device="meta")
                                                                   for i in items])]
                 for items in items_by_rank]
        node_ids = [node_id(n) for n in nodes] if nodes is not None else None
        plan = ClusterPlan.build(tensors, needs, table.files, nodes=node_ids, gap=self._span_gap,
                                 span_bytes=self.span_bytes)
        return plan, traffic(plan, needs, self.request_bytes)

    def _span_chunks(self, items: Sequence[ReadItem], dests: Sequence[torch.Tensor]) -> list[_Chunk]:
        """The chunks of a cooperative read, in the order its needs are told: by file and first byte."""
        return sorted(self._all_chunks(items, dests), key=lambda c: (c.entry.file, c.span[0]))

    def _all_chunks(self, items: Sequence[ReadItem], dests: Sequence[torch.Tensor]) -> list[_Chunk]:
        budget = self._batch_bytes
        return [c for index, item in enumerate(items) for c in self._chunks(index, item, dests[index], budget)]

    def _resolve(self, item: ReadItem, planner: LoadPlanner) -> torch.Tensor:
        key = item.storage_index.fqn
        if item.type != LoadItemType.TENSOR:
            raise PlanningError(
                f"read item of type {item.type.name}: safetensors holds tensors only", key=key
            )
        dest = planner.resolve_tensor(item).detach()
        if tuple(dest.shape) != tuple(item.lengths):
            raise PlanningError(
                f"destination shape {tuple(dest.shape)} != read lengths {tuple(item.lengths)}", key=key
            )
        return dest

    def _chunks(self, index: int, item: ReadItem, dest: torch.Tensor, budget: int) -> list[_Chunk]:
        """The item's box split by the files that hold it, each piece cut to ``budget``."""
        key = item.storage_index.fqn
        tensor = self.entries.get(key)
        if tensor is None:
            raise PlanningError("the plan reads a key the checkpoint does not have", file=self.path, key=key)
        box = Box(tuple(item.storage_offsets), tuple(item.lengths))
        if box.ndim != len(tensor.shape) or not Box.full(tensor.shape).contains(box):
            raise PlanningError(
                f"read box {box} is outside the tensor of shape {tensor.shape}",
                file=self.path if tensor.chunked else tensor.file,
                key=key,
            )
        if box.is_empty():
            return []
        chunks = []
        for entry, piece in tensor.pieces(box):
            local = piece.relative_to(entry.box.offsets)  # the piece in the stored tensor's coordinates
            view = dest[piece.relative_to(box.offsets).slices()]
            chunks.extend(
                _Chunk(item=index, entry=entry, box=part, dest=view[part.relative_to(local.offsets).slices()])
                for part in split_box(local, entry.itemsize, budget, entry.shape)
            )
        return chunks

    def _read_batch(
        self,
        location: CheckpointLocation,
        batch: list[_Chunk],
        finish: Callable[[list[_Chunk]], None],
        copier: SlotCopier,
    ) -> None:
        """Read one batch (one file, at most the per-thread budget) into its destinations, or into a
        staging slot that ``copier`` empties into them; commit it once they hold its values."""
        file = batch[0].entry.file
        mapped = self._maps and all(chunk.mappable for chunk in batch) and not _large_reads(batch)
        # A mapping copies into any host tensor (casting, strided); ranges land only where bytes fit.
        offsets: dict[int, int] = {}
        size = 0
        for i, chunk in enumerate(batch):
            if not (chunk.host if mapped else chunk.direct):
                offsets[i] = size
                size += _aligned(chunk.nbytes)
        slot = copier.ring.acquire(size) if size else None
        staged = {i: batch[i].staged_view(slot.data, offset) for i, offset in offsets.items()} if slot is not None else {}
        targets = [staged.get(i, chunk.dest) for i, chunk in enumerate(batch)]
        try:
            with location.open(file) as handle:  # closing checks the file is unchanged
                if self.direct_io:
                    handle.use_direct_io()
                elif self.prefetch:  # the batch's own ranges, whatever the thread ahead did
                    _advise(handle, batch, self._gap)
                if mapped:
                    self._copy_mapped(handle, batch, targets)
                else:
                    self._read_ranges(handle, batch, targets)
        except BaseException as e:
            if slot is not None:
                copier.ring.release(slot)
            if isinstance(e, StorageReadError) and e.key is None:
                keys = ", ".join(dict.fromkeys(chunk.entry.key for chunk in batch))
                raise StorageReadError(e.reason, file=e.file, key=keys) from e
            raise
        copies: list[Copy] = [(batch[i].dest, values) for i, values in staged.items()]
        copier.copy(slot, copies, lambda: finish(batch))

    def _copy_mapped(self, handle: RangeFile, batch: list[_Chunk], targets: list[torch.Tensor]) -> None:
        """Each chunk: its span of the file mapped, one strided copy (:func:`copy_into`, casting as
        needed) into its target, unmapped (so a thread holds at most one chunk's span resident)."""
        for chunk, target in zip(batch, targets, strict=True):
            first, last, _ = chunk.span
            view = handle.mapped(first, last)
            assert view is not None, "read from a mapping of a backend that cannot map"
            source = torch.frombuffer(view, dtype=chunk.entry.dtype).as_strided(chunk.box.sizes, chunk.strides)
            copy_into(target, source)
            del source, view
        requests = count_requests(chunk.span for chunk in batch)
        if requests is None or self.record_requests:
            coalesced = coalesce(_pieces(batch), 0)
            requests = len(coalesced)
            self._log(handle.file, coalesced)
        needed = sum(chunk.nbytes for chunk in batch)
        ranges = sum(chunk.span[2] for chunk in batch)
        self.stats.add(handle.file, bytes_read=needed, bytes_needed=needed, ranges=ranges, requests=requests)

    def _read_ranges(self, handle: RangeFile, batch: list[_Chunk], targets: list[torch.Tensor]) -> None:
        """Coalesced ranged reads of each chunk's bytes, as stored, into its (contiguous) target."""
        buffers = [_byte_view(target) for target in targets]
        pieces = _pieces(batch)
        requests = coalesce(pieces, self._gap)
        scratch = memoryview(bytearray(max(r.nbytes - sum(p.nbytes for p in r.pieces) for r in requests)))
        self._read_requests(handle, requests, lambda r: _request_views(r, buffers, scratch), batch)
        self._log(handle.file, requests)
        self.stats.add(
            handle.file,
            bytes_read=sum(r.nbytes for r in requests),
            bytes_needed=sum(p.nbytes for p in pieces),
            ranges=len(pieces),
            requests=len(requests),
        )

    def _log(self, file: str, requests: list[Request]) -> None:
        if self.record_requests:
            self.requests_log.extend((file, r.start, r.end) for r in requests)  # list.extend is atomic

    def _read_requests(
        self,
        handle: RangeFile,
        requests: list[Request],
        views: Callable[[Request], list[memoryview]],
        batch: list[_Chunk],
    ) -> None:
        """``requests`` read into their ``views``: one after the other from a local file, at once on
        the request pool from a remote store. Returns (or raises the first error) only once none of
        them still writes into the batch's buffers."""
        pool = self._request_pool
        if pool is None:
            for request in requests:
                self._read_request(handle, request, views(request), batch)
            return
        futures = [pool.submit(self._read_request, handle, request, views(request), batch) for request in requests]
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            future.cancel()
        wait(futures)
        errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
        if errors:
            raise errors[0]  # type: ignore[misc]

    @staticmethod
    def _read_request(
        handle: RangeFile, request: Request, views: list[memoryview], batch: list[_Chunk]
    ) -> None:
        try:
            handle.read_into(request.start, views)
        except StorageReadError as e:
            keys = ", ".join(dict.fromkeys(batch[p.owner].entry.key for p in request.pieces))
            raise StorageReadError(e.reason, file=e.file, key=keys) from e


class _Prefetcher:
    """``posix_fadvise(WILLNEED)`` of every batch's ranges (coalesced with the reader's gap, at least
    a page), in the order the batches are read, on a thread of its own that stays at most
    ``window`` bytes ahead of the batches read. Advice only: an error stops it, never the load."""

    def __init__(self, location: CheckpointLocation, batches: list[list[_Chunk]], gap: int, window: int) -> None:
        self._location, self._batches = location, batches
        self._gap, self._window = gap, window
        self._done = 0  # bytes of the batches read
        self._advised = 0  # bytes of the batches advised (by the thread)
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hp-dcp-hf-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        handles: dict[str, RangeFile] = {}
        try:
            for batch in self._batches:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or self._advised - self._done <= self._window)
                    if self._stop:
                        return
                file = batch[0].entry.file
                if file not in handles:
                    handles[file] = self._location.open(file)
                _advise(handles[file], batch, self._gap)
                self._advised += sum(chunk.nbytes for chunk in batch)
        except Exception:  # noqa: BLE001 - advice only: the reads themselves report errors
            return
        finally:
            for handle in handles.values():
                with contextlib.suppress(Exception):
                    handle.close()

    def done(self, nbytes: int) -> None:
        with self._cond:
            self._done += nbytes
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()


def _committer(plan: LoadPlan, planner: LoadPlanner, chunks: Sequence[_Chunk],
               dests: Sequence[torch.Tensor]) -> Callable[[int], None]:
    """Commits each item of ``plan`` once all its chunks hold their values: those with none at once,
    the others through the returned callback, called with a chunk's item as each chunk is done."""
    remaining: dict[int, int] = defaultdict(int)
    for chunk in chunks:
        remaining[chunk.item] += 1
    for index, item in enumerate(plan.items):
        if not remaining[index]:
            planner.commit_tensor(item, dests[index])
    lock = threading.Lock()

    def chunk_done(item: int) -> None:
        with lock:
            remaining[item] -= 1
            done = not remaining[item]
        if done:
            planner.commit_tensor(plan.items[item], dests[item])

    return chunk_done


def _advise(handle: RangeFile, batch: list[_Chunk], gap: int) -> None:
    """:meth:`RangeFile.advise` of the batch's ranges, coalesced across holes below ``gap`` or a page."""
    for request in coalesce(_pieces(batch), max(gap, DIRECT_IO_ALIGN)):
        handle.advise(request.start, request.end)


def _large_reads(batch: list[_Chunk]) -> bool:
    """Every chunk lands as read, in its destination or (not a host tensor) in a staging slot, in
    ranges of :data:`_LARGE_RANGE` bytes on average: no host copy out of a mapping is needed."""
    ranges = sum(chunk.span[2] for chunk in batch)
    landing = all(chunk.direct or not chunk.host for chunk in batch)
    return landing and sum(chunk.nbytes for chunk in batch) >= _LARGE_RANGE * ranges


def _pieces(batch: list[_Chunk]) -> list[Piece]:
    """The byte ranges of one batch, each owned by its chunk at its offset in the chunk's buffer."""
    pieces = []
    for i, chunk in enumerate(batch):
        offset = 0
        for start, end in chunk.ranges:
            pieces.append(Piece(start, end, i, offset))
            offset += end - start
    return pieces


def _batches(chunks: list[_Chunk], budget: int) -> list[list[_Chunk]]:
    """Chunks grouped per file in file order, packed into batches of at most ``budget`` bytes (each
    chunk counted :func:`_aligned`, as it would take a staging slot)."""
    per_file: dict[str, list[_Chunk]] = defaultdict(list)
    for chunk in chunks:
        per_file[chunk.entry.file].append(chunk)
    batches: list[list[_Chunk]] = []
    for file_chunks in per_file.values():
        current: list[_Chunk] = []
        used = 0
        for chunk in sorted(file_chunks, key=lambda c: c.span[0]):
            if current and used + _aligned(chunk.nbytes) > budget:
                batches.append(current)
                current, used = [], 0
            current.append(chunk)
            used += _aligned(chunk.nbytes)
        batches.append(current)
    return batches
