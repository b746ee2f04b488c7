"""The direct read mode: each rank reads its own chunks' bytes, in per-file batches on a thread pool.

Local files are mapped into memory and each chunk is one strided ``copy_`` out of the mapping (a
row-sharded box would otherwise be one read per row), except batches that land as stored in
ranges of :data:`LARGE_RANGE` or more on average, read with ``os.preadv`` straight into their
destinations (a mapping's page faults would slow them down). Other backends read byte ranges, coalesced
into requests: when the destination is a contiguous CPU tensor of the checkpoint dtype, the bytes
land in it directly; otherwise they go through a slot of a bounded staging ring and ``copy_``
(which casts and writes through non-contiguous views). CUDA destinations are always staged, in
pinned slots, and copied to the device asynchronously while the next reads run
(:mod:`hp_dcp_hf.storage.read.staging`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from hp_dcp_hf.errors import CheckpointNotFoundError, HPDCPHFError, StorageReadError
from hp_dcp_hf.storage.format.ranges import Request, coalesce, count_requests, request_views
from hp_dcp_hf.storage.read.chunks import (
    Chunk,
    Chunker,
    batches,
    committer,
    destination,
    meta_destinations,
    pieces,
)
from hp_dcp_hf.storage.read.copy import copy_into
from hp_dcp_hf.storage.read.mode import ReadRecord
from hp_dcp_hf.storage.read.options import ReadSettings
from hp_dcp_hf.storage.read.prefetch import Prefetcher, advise
from hp_dcp_hf.storage.read.staging import Staging
from hp_dcp_hf.storage.transport.backend import placing
from hp_dcp_hf.storage.transport.location import CheckpointLocation, RangeFile

LARGE_RANGE = 1 << 20
"""A batch whose ranges average at least this many bytes and land straight in their destinations
is read with ``preadv`` even from a mappable file: copying out of a fresh mapping page-faults
through the same bytes (15-20% slower on contiguous 8 MiB batches here). Mappings win on strided
boxes, where ranged reads cost a call per row."""


class DirectRead:
    """Reads ``settings``' checkpoint by this rank's own chunks (cut by ``chunker``)."""

    def __init__(self, settings: ReadSettings, chunker: Chunker) -> None:
        self.settings, self.chunker = settings, chunker
        self._request_pool: ThreadPoolExecutor | None = None

    def plan(self, items: Sequence[ReadItem]) -> list[tuple[str, Request]]:
        """The ``(file, request)`` pairs :meth:`read` would issue for ``items``, without any I/O."""
        chunks = self.chunker.all(items, meta_destinations(items))
        return [
            (batch[0].entry.file, request)
            for batch in batches(chunks, self.settings.batch_bytes)
            for request in coalesce(pieces(batch), self.settings.gap)
        ]

    def read(self, plan: LoadPlan, planner: LoadPlanner, record: ReadRecord) -> None:
        dests = [destination(item, planner) for item in plan.items]
        self.read_into(dests, self.chunker.all(plan.items, dests), plan, planner, record)

    def read_into(self, dests: list[torch.Tensor], chunks: list[Chunk], plan: LoadPlan, planner: LoadPlanner,
                  record: ReadRecord) -> None:
        """:meth:`read` into ``dests``, the plan's items' destinations as ``planner`` resolved them,
        by their ``chunks`` (:class:`Chunker`'s, in any order: batches go by file and byte)."""
        settings, options = self.settings, self.settings.options
        location = settings.location
        assert location is not None
        chunk_budget = settings.batch_bytes
        chunk_done = committer(plan, planner, chunks, dests)
        # One slot per batch being read, and one more: a batch's reads overlap the previous batch's
        # copies to the device. Host destinations release their slot before the next batch, so they
        # never hold more than one slot per reader.
        staging = Staging(dests, settings.batch_workers + 1, chunk_budget)

        todo = [part for batch in batches(chunks, chunk_budget) for part in self._by_method(batch)]
        prefetcher = (
            Prefetcher(location, todo, settings.gap, 4 * options.staging_bytes)
            if options.prefetch and location.backend.local and todo
            else None
        )

        def finish(batch: list[Chunk]) -> None:
            if prefetcher is not None:
                prefetcher.done(sum(chunk.nbytes for chunk in batch))
            for chunk in batch:
                chunk_done(chunk.item)

        # Remote requests (those of one batch too) run on a pool of their own, num_threads in
        # flight whatever the batches; it outlives the batch pool, whose tasks submit to it.
        remote = not location.backend.local
        requests = ThreadPoolExecutor(settings.threads, "hp-dcp-hf-get") if remote else contextlib.nullcontext()
        try:
            with requests as self._request_pool, ThreadPoolExecutor(settings.batch_workers) as pool:
                futures = [pool.submit(self._read_batch, location, batch, finish, staging, record) for batch in todo]
                completed, _ = wait(futures, return_when=FIRST_EXCEPTION)
                failed = [f for f in completed if f.exception() is not None]
                if failed:
                    for f in futures:
                        f.cancel()
        finally:
            if prefetcher is not None:
                prefetcher.close()
            copy_error = staging.close()  # every device copy done, its items committed
            record.staging = staging.stats
            if staging.devices:
                record.seconds["copy"] = record.staging.wait_seconds
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        if copy_error is not None:
            raise copy_error

    def _by_method(self, batch: list[Chunk]) -> list[list[Chunk]]:
        """``batch`` as read: with mappings, its chunks that land as read in large ranges apart from
        the others, so that each part goes the way that suits it (:func:`_large_reads`). Whole,
        a batch of 1 MiB expert boxes with one small norm among them was copied out of mappings:
        94% of the MoE benchmark's bytes at 4 ranks, at the cost of a page fault per 4 KiB."""
        if not self.settings.mapped:
            return [batch]
        parts: tuple[list[Chunk], list[Chunk]] = ([], [])
        for chunk in batch:
            parts[not _large_reads([chunk])].append(chunk)
        return [part for part in parts if part]

    def _read_batch(
        self,
        location: CheckpointLocation,
        batch: list[Chunk],
        finish: Callable[[list[Chunk]], None],
        staging: Staging,
        record: ReadRecord,
    ) -> None:
        """Read one batch (one file, at most the per-thread budget) into its destinations, or into a
        staging slot emptied into them; commit it once they hold its values."""
        options = self.settings.options
        file = batch[0].entry.file
        mapped = self.settings.mapped and all(chunk.mappable for chunk in batch) and not _large_reads(batch)
        staged = staging.stage(batch, mapped)
        targets = staged.targets
        try:
            with location.open(file) as handle:  # closing checks the file is unchanged
                if options.direct_io:
                    handle.use_direct_io()
                elif options.prefetch:  # the batch's own ranges, whatever the thread ahead did
                    advise(handle, batch, self.settings.gap)
                if mapped:
                    _copy_mapped(handle, batch, targets, record)
                else:
                    self._read_ranges(handle, batch, targets, record)
        except BaseException as e:
            staged.release()
            if isinstance(e, StorageReadError | CheckpointNotFoundError) and e.key is None:
                raise _naming(e, (chunk.entry.key for chunk in batch)) from e
            raise
        record.writing(batch[i].item for i in staged.staged)
        with record.converting():
            staged.deliver(lambda: finish(batch))

    def _read_ranges(
        self, handle: RangeFile, batch: list[Chunk], targets: list[torch.Tensor], record: ReadRecord
    ) -> None:
        """Coalesced ranged reads of each chunk's bytes, as stored, into its (contiguous) target."""
        buffers = [_byte_view(target) for target in targets]
        ranges = pieces(batch)
        requests = coalesce(ranges, self.settings.gap)
        scratch = memoryview(bytearray(max(r.nbytes - sum(p.nbytes for p in r.pieces) for r in requests)))
        in_place = [target is chunk.dest for chunk, target in zip(batch, targets)]

        def wrote(request: Request) -> None:
            record.writing(batch[p.owner].item for p in request.pieces if in_place[p.owner])

        self._read_requests(handle, requests, lambda r: request_views(r, buffers, scratch), batch, wrote)
        record.landed()
        record.log(handle.file, requests)
        record.stats.add(
            handle.file,
            bytes_read=sum(r.nbytes for r in requests),
            bytes_needed=sum(p.nbytes for p in ranges),
            ranges=len(ranges),
            requests=len(requests),
        )

    def _read_requests(
        self,
        handle: RangeFile,
        requests: list[Request],
        views: Callable[[Request], list[memoryview]],
        batch: list[Chunk],
        wrote: Callable[[Request], None],
    ) -> None:
        """``requests`` read into their ``views``: one after the other from a local file, at once on
        the request pool from a remote store. Returns (or raises the first error) only once none of
        them still writes into the batch's buffers; ``wrote(request)`` once a request may have
        written some of its bytes."""
        pool = self._request_pool
        if pool is None:
            for request in requests:
                _read_request(handle, request, views(request), batch, wrote)
            return
        futures = [pool.submit(_read_request, handle, request, views(request), batch, wrote) for request in requests]
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            future.cancel()
        wait(futures)
        errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
        if errors:
            raise errors[0]  # type: ignore[misc]


def _copy_mapped(handle: RangeFile, batch: list[Chunk], targets: list[torch.Tensor], record: ReadRecord) -> None:
    """Each chunk: its span of the file mapped, one strided copy (:func:`copy_into`, casting as
    needed) into its target, unmapped (so a thread holds at most one chunk's span resident)."""
    for chunk, target in zip(batch, targets, strict=True):
        first, last, _ = chunk.span
        view = handle.mapped(first, last)
        assert view is not None, "read from a mapping of a backend that cannot map"
        source = torch.frombuffer(view, dtype=chunk.entry.dtype).as_strided(chunk.box.sizes, chunk.strides)
        if target is chunk.dest:
            record.writing((chunk.item,))
        copy_into(target, source)
        record.landed()
        del source, view
    requests = count_requests(chunk.span for chunk in batch)
    if requests is None or record.requests is not None:
        coalesced = coalesce(pieces(batch), 0)
        requests = len(coalesced)
        record.log(handle.file, coalesced)
    needed = sum(chunk.nbytes for chunk in batch)
    ranges = sum(chunk.span[2] for chunk in batch)
    record.stats.add(handle.file, bytes_read=needed, bytes_needed=needed, ranges=ranges, requests=requests)


def _read_request(handle: RangeFile, request: Request, views: list[memoryview], batch: list[Chunk],
                  wrote: Callable[[Request], None]) -> None:
    try:
        with placing(lambda: wrote(request)):
            handle.read_into(request.start, views)
    except (StorageReadError, CheckpointNotFoundError) as e:
        raise _naming(e, (batch[p.owner].entry.key for p in request.pieces)) from e


def _naming(error: StorageReadError | CheckpointNotFoundError, keys: Iterable[str]) -> HPDCPHFError:
    """``error`` again, naming the checkpoint keys whose bytes the failed read was for: a missing
    file stays a :class:`CheckpointNotFoundError`, any other failure is a :class:`StorageReadError`."""
    kind = CheckpointNotFoundError if isinstance(error, CheckpointNotFoundError) else StorageReadError
    return kind(error.reason, file=error.file, key=", ".join(dict.fromkeys(keys)))


def _large_reads(batch: list[Chunk]) -> bool:
    """Every chunk lands as read, in its destination or (not a host tensor) in a staging slot, in
    ranges of :data:`LARGE_RANGE` bytes on average: no host copy out of a mapping is needed."""
    ranges = sum(chunk.span[2] for chunk in batch)
    landing = all(chunk.direct or not chunk.host for chunk in batch)
    return landing and sum(chunk.nbytes for chunk in batch) >= LARGE_RANGE * ranges


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The writable bytes of a contiguous CPU tensor (any dtype, 0-d included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
