"""``HFStorageReader``: a DCP ``StorageReader`` that reads only the bytes of a safetensors
checkpoint each rank's plan needs.

Metadata: rank 0 reads the index and every header (ranged reads) and broadcasts them as JSON; the
DCP metadata has one whole-tensor chunk per checkpoint key, so any planner's read items are boxes
of checkpoint tensors, also where a tensor is stored in chunks across files (torch's distributed
HF files): the reader splits each box by chunk and reads every piece from its own file
(:mod:`hp_dcp_hf.storage.read.chunks`). Data: ``read_data`` hands the plan to one read mode,
picked once per load from the options and the world size: each rank reads its own ranges
(:mod:`hp_dcp_hf.storage.read.direct`, through the staging slots of
:mod:`hp_dcp_hf.storage.read.staging` where a destination cannot take the bytes as read), or the ranks read every byte once between them and exchange
it (:mod:`hp_dcp_hf.storage.read.cooperative`). The options are one checked
:class:`~hp_dcp_hf.storage.read.options.ReaderOptions`.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

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
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from hp_dcp_hf.errors import HPDCPHFError, PlanningError
from hp_dcp_hf.storage.format.catalog import QUANTIZATION_CONFIG, Catalog, CheckpointTensor, find_files, scan
from hp_dcp_hf.storage.format.journal import leftovers_warning
from hp_dcp_hf.storage.format.ranges import Request
from hp_dcp_hf.storage.read.chunks import Chunker
from hp_dcp_hf.storage.read.cooperative import CooperativeRead
from hp_dcp_hf.storage.read.direct import DirectRead
from hp_dcp_hf.storage.read.exchange import ExchangeStats
from hp_dcp_hf.storage.read.leftovers import unfinished_save
from hp_dcp_hf.storage.read.mode import ReadMode, ReadRecord
from hp_dcp_hf.storage.read.options import ReaderOptions, ReadSettings
from hp_dcp_hf.storage.read.ring import StagingStats
from hp_dcp_hf.storage.read.span_reads import SpanLoad
from hp_dcp_hf.storage.read.spans import ClusterPlan, Traffic
from hp_dcp_hf.storage.transport.location import CheckpointLocation, filesystem, locate
from hp_dcp_hf.storage.transport.stats import ReadStats
from hp_dcp_hf.util.collectives import share_from_rank0, should_broadcast
from hp_dcp_hf.util.perf import paused_gc


def dcp_metadata(entries: Mapping[str, CheckpointTensor], quantization_config: Mapping[str, Any] | None, *,
                 checkpoint_id: str, load_id: str) -> Metadata:
    """DCP's view of a checkpoint: one whole-tensor chunk per key, however it is stored (planners
    read boxes of it), and each key's :class:`CheckpointTensor` under ``MetadataIndex(key, origin)``,
    where DCP's planners look chunks up.

    Keys of one dtype and shape share one ``TensorStorageMetadata`` (DCP's planners read it, never
    write it): DeepSeek-V3's 45,395 keys come in a few dozen, and building one set of objects per key
    was half of every rank's metadata phase (0.25 s of 0.56 s on a core here)."""
    shared: dict[tuple[torch.dtype, tuple[int, ...]], TensorStorageMetadata] = {}
    origins: dict[int, torch.Size] = {}
    state_dict_metadata: dict[str, Any] = {}
    storage_data: dict[MetadataIndex, CheckpointTensor] = {}
    for key, tensor in entries.items():
        shape = tensor.shape
        spec = shared.get((tensor.dtype, shape))
        if spec is None:
            size = torch.Size(shape)
            origin = origins.setdefault(len(shape), torch.Size([0] * len(shape)))
            spec = shared[tensor.dtype, shape] = TensorStorageMetadata(
                properties=TensorProperties(dtype=tensor.dtype), size=size,
                chunks=[ChunkStorageMetadata(offsets=origin, sizes=size)],
            )
        state_dict_metadata[key] = spec
        storage_data[MetadataIndex(key, spec.chunks[0].offsets)] = tensor
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        # The planner needs it to read quantized tensors as their values (see mapping.quantized).
        planner_data={QUANTIZATION_CONFIG: quantization_config},
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, load_id=load_id),
    )


class HFStorageReader(StorageReader):
    """Loads a Hugging Face safetensors checkpoint through ``torch.distributed.checkpoint``.

    ``path``: a ``.safetensors`` file or a directory (with or without
    ``model.safetensors.index.json``; the index file's own path names its directory), as a local
    path or any fsspec URL; the files torch's ``HuggingFaceStorageWriter(save_distributed=True)``
    writes (a tensor in chunks across per-rank files) load like any checkpoint.
    ``storage_options`` and any keyword not an option go to the fsspec filesystem (the options
    are kept, checked once, as ``options``: a
    :class:`~hp_dcp_hf.storage.read.options.ReaderOptions`). ``coalesce_gap``:
    neighbouring byte ranges at most this far apart are read in one request (gap bytes are read
    and dropped); by default 0 on local files (bytes read = bytes needed) and 1 MiB on remote
    stores, where a request costs a round trip (``REMOTE_COALESCE_GAP``; pass 0 to fetch needed
    bytes only). ``num_threads``: reads in flight (on remote stores: requests in flight, those of
    one batch too; a batch there is at least 8 MiB whatever the thread count, so GETs do not shrink
    as threads grow); by default 8 on remote stores and, on local files, the cores this process
    may run on shared among the node's ranks (``LOCAL_WORLD_SIZE``, else the process group's size),
    2 to 8 (:func:`~hp_dcp_hf.storage.read.options.local_threads`).
    ``staging_bytes``: the most memory reads in flight may hold for staging, or keep mapped (a
    part's span in the file, holes included, counts); a larger tensor is read a block of rows at a
    time. With CUDA destinations the staging ring holds one batch more (a batch's reads overlap the
    previous one's copy to the device), in pinned memory. ``broadcast_metadata``: in a process group, rank 0 alone reads the headers and broadcasts
    them (every rank must then call ``read_metadata``, which ``dcp.load`` does). ``retry``: the
    :class:`~hp_dcp_hf.storage.transport.backend.RetryPolicy` of remote reads, or a dict of its fields.
    ``record_requests``: keep every request issued in ``requests_log`` as ``(file, start, end)``
    (for pictures of a plan; off by default). ``cooperate``: span ownership
    (:mod:`hp_dcp_hf.storage.read.spans`): the ranks read every checkpoint byte any of them needs once
    between them, in spans of at least ``span_bytes`` each owned by one rank (balanced by bytes read
    and sent, preferring a rank on a ``node`` that needs it; ``node`` defaults to the host name), and send
    each other the raw bytes each needs: ``"always"``, ``"never"``, or ``"auto"`` (the default):
    on storage other machines share (remote stores, network, cluster and FUSE file systems), where
    every byte read costs egress, requests and server load, not on a node's own disk, whose page
    cache already serves its ranks one copy; and there only where it pays: once the ranks have
    gathered each other's needs, they read directly unless cooperating saves a fifth of the bytes
    (direct reads fetch 1.25x or more) or three quarters of the busiest rank's requests (:mod:`~hp_dcp_hf.storage.read.payoff`;
    ``cooperating`` says, after a load, which it did). ``map_local_files``: copy boxes out of a memory
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

    def __init__(self, path: str | os.PathLike, **options: Any) -> None:
        super().__init__()
        self.options = ReaderOptions.of(**options)
        self.reset(path)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new load (of ``checkpoint_id`` when given): forget entries, zero the stats."""
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            self._fs, self._fspath = filesystem(
                self.path, self.options.storage_options, retry=self.options.retry,
                concurrency=self.options.request_threads,
            )
        self.entries: dict[str, CheckpointTensor] = {}
        self.stats = ReadStats()
        self.load_id = str(uuid.uuid4())
        self.metadata_error: Exception | None = None
        self.seconds: dict[str, float] = {}  # wall time of this load's phases (see LoadReport.seconds)
        # read_metadata: whether reads go the cooperative way (cooperates()); read_data: whether they
        # read spans (with cooperate="auto", where that pays) or each rank its own items
        self.cooperating = False
        self._may_cooperate = False
        self.exchange = ExchangeStats()
        self.spans: SpanLoad | None = None  # a cooperative load's cluster plan and this rank's part
        self.requests_log: list[tuple[str, int, int]] = []
        self.staging = StagingStats()  # what went through the staging ring in the last read_data
        # the last read_data's items into whose destinations bytes may have gone, committed or not
        self.written_items: tuple[ReadItem, ...] = ()
        self.settings = ReadSettings(self.options, None)  # located by read_metadata
        self._shared = False  # the checkpoint's storage is shared with other machines (Catalog.shared)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @property
    def storage_options(self) -> Mapping[str, Any]:
        """The fsspec filesystem's options (``storage_options`` and the extra keywords together)."""
        return self.options.storage_options

    @property
    def resolved_root(self) -> str | None:
        """The directory files are read from, as located by ``read_metadata`` (a Hub root names its
        commit); ``None`` before."""
        location = self.settings.location
        return location.root if location is not None else None

    @property
    def request_bytes(self) -> int:
        """The largest request of a cooperative load's span reads: a batch's bytes."""
        return self.settings.batch_bytes

    def cooperates(self, world_size: int) -> bool:
        """Whether the ranks of a load on ``world_size`` ranks share their reads: with
        ``cooperate="auto"``, on storage other machines share (remote stores, network, cluster and
        FUSE file systems), not on a node's own disk (its reads cost less than the exchange). Every
        rank decides from what the scanning rank saw (``Catalog.shared``): the same on all."""
        if world_size < 2 or self.options.cooperate == "never" or self.settings.location is None:
            return False
        return self.options.cooperate == "always" or self._shared

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
        catalog = scan(location, single_file, self.stats, self.options.request_threads)
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
        if self.options.broadcast_metadata and should_broadcast():
            scanned: list[Catalog] = []

            def produce() -> bytes:
                scanned.append(self._scan())
                return scanned[0].to_json()

            raw = share_from_rank0(produce)
            catalog = scanned[0] if scanned else Catalog.from_json(raw)
        else:
            catalog = self._scan()
        # The files' versions travel with the headers: every rank's reads are checked against them.
        self.settings = ReadSettings(self.options, CheckpointLocation(self._fs, catalog.root, catalog.versions))
        self._shared = catalog.shared
        self.cooperating = self._may_cooperate = self.cooperates(dist.get_world_size() if should_broadcast() else 1)
        self.entries = dict(catalog.entries)
        return dcp_metadata(self.entries, catalog.quantization_config, checkpoint_id=self.path, load_id=self.load_id)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self.settings.location is None:
            raise PlanningError("read_metadata() must run before set_up_storage_reader()", file=self.path)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # -- data -----------------------------------------------------------------------------------

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into ``planner.resolve_tensor(item)``, then commit it, by
        this load's read mode (:meth:`_mode`)."""
        start = time.perf_counter()
        for phase in ("spans", "first_byte", "convert", "exchange", "copy"):
            self.seconds.pop(phase, None)
        record = ReadRecord(self.stats, self.seconds, self.requests_log if self.options.record_requests else None,
                            started=start)
        try:
            with paused_gc():
                self._mode().read(plan, planner, record)
        finally:
            self.written_items = tuple(plan.items[i] for i in sorted(record.written))
            if record.staging is not None:
                self.staging = record.staging
            if record.spans is not None:
                self.spans, self.exchange = record.spans, record.spans.exchange
            if record.cooperated is not None:
                self.cooperating = record.cooperated
            apart = self.seconds.get("spans", 0.0) + self.seconds.get("exchange", 0.0)
            self.seconds["read"] = time.perf_counter() - start - apart
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _mode(self) -> ReadMode:
        """This load's read mode: cooperative when :meth:`cooperates` said so in ``read_metadata``
        (the same on every rank; with ``cooperate="auto"``, it reads directly where spans do not pay),
        else direct."""
        if self.settings.location is None:
            raise PlanningError("read_metadata() must run before read_data()", file=self.path)
        return (CooperativeRead if self._may_cooperate else DirectRead)(self.settings, self._chunker())

    def _chunker(self) -> Chunker:
        return Chunker(self.entries, self.path, self.settings.batch_bytes)

    def plan_requests(self, items: Sequence[ReadItem]) -> list[tuple[str, Request]]:
        """The ``(file, request)`` pairs ``read_data`` would issue for ``items``, without any I/O.

        The same chunking, batching and coalescing as a real read, so a plan made elsewhere (the
        CLI's ``plan``) reports exactly the ranges and requests a load will measure.
        """
        return DirectRead(self.settings, self._chunker()).plan(items)

    def plan_spans(
        self, items_by_rank: Sequence[Sequence[ReadItem]], nodes: Sequence[str] | None = None
    ) -> tuple[ClusterPlan, list[Traffic], bool]:
        """The span ownership of a cooperative load whose ranks plan ``items_by_rank`` (on
        ``nodes``, default one node each), each rank's :class:`Traffic`, and whether it reads the
        spans (``cooperate="always"``, or where they pay), without any I/O: the plan a cooperative
        ``read_data`` builds, for the CLI's ``plan`` and the benchmarks."""
        return CooperativeRead(self.settings, self._chunker()).plan(items_by_rank, nodes)
