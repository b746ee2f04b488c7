"""``ReaderOptions``: every option of :class:`~hp_dcp_hf.storage.read.reader.HFStorageReader`, in
one frozen value checked once, so that the read modes take the options as given and never re-check
them; and ``ReadSettings``, what the options come to on the checkpoint's storage (gaps, batch sizes,
mappings), derived once a load knows where its files are."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch.distributed as dist

from hp_dcp_hf.storage.read.spans import SPAN_BYTES, SPAN_GAP
from hp_dcp_hf.storage.transport.backend import RetryPolicy
from hp_dcp_hf.storage.transport.fsspec_backend import DIRECT_IO_ALIGN
from hp_dcp_hf.storage.transport.location import CheckpointLocation

ALIGN = 16
"""Staged chunks start at multiples of this, so a byte slice can be viewed as any dtype."""

REQUEST_THREADS = 8
"""Threads of remote reads and header reads when ``num_threads`` is not given: requests in flight,
which wait on the network, not on a core."""

LOCAL_THREADS = (2, 8)
"""The fewest and most threads of local reads when ``num_threads`` is not given (see
:func:`local_threads`)."""

REMOTE_BATCH_BYTES = 8 * 2**20
"""Smallest batch on remote stores (whatever ``num_threads``): the requests of a batch are at most
this big where the layout allows (at 20-50 ms per round trip a connection moves several MiB)."""


@dataclass(frozen=True)
class ReaderOptions:
    """The options of an :class:`HFStorageReader` (its keywords; see its docstring for each).

    Built by :meth:`of` from the reader's keywords: keywords that are not options are fsspec
    filesystem arguments, merged into ``storage_options``; ``retry`` may be a dict of
    :class:`RetryPolicy` fields; ``node`` defaults to the host name.
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    coalesce_gap: int | None = None
    num_threads: int | None = None
    staging_bytes: int = 64 * 2**20
    broadcast_metadata: bool = True
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    record_requests: bool = False
    map_local_files: bool = True
    cooperate: Literal["auto", "always", "never"] = "auto"
    span_bytes: int = SPAN_BYTES
    node: str = field(default_factory=socket.gethostname)
    prefetch: bool = False
    direct_io: bool = False

    def __post_init__(self) -> None:
        if self.cooperate not in ("auto", "always", "never"):
            raise ValueError(f"cooperate must be 'auto', 'always' or 'never', got {self.cooperate!r}")
        if self.span_bytes < 1:
            raise ValueError(f"span_bytes must be positive, got {self.span_bytes}")
        threads = self.num_threads if self.num_threads is not None else max(REQUEST_THREADS, LOCAL_THREADS[1])
        if (self.coalesce_gap or 0) < 0 or threads < 1 or self.staging_bytes < ALIGN * threads:
            raise ValueError(
                f"need coalesce_gap >= 0, num_threads >= 1 and staging_bytes >= {ALIGN} per thread; got "
                f"{self.coalesce_gap}, {self.num_threads}, {self.staging_bytes}"
            )
        # A dict of its fields (or None) becomes the policy, checked after the options above.
        object.__setattr__(self, "retry", RetryPolicy.of(self.retry))

    @classmethod
    def of(
        cls,
        *,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | Mapping[str, Any] | None = None,
        node: str | None = None,
        **keywords: Any,
    ) -> ReaderOptions:
        """The options of ``HFStorageReader(path, **keywords)``."""
        known = {f.name for f in fields(cls)}
        fs_kwargs = {k: keywords.pop(k) for k in list(keywords) if k not in known}
        return cls(
            storage_options={**(storage_options or {}), **fs_kwargs},
            retry=retry,  # type: ignore[arg-type]  # made a RetryPolicy by __post_init__
            node=node if node is not None else socket.gethostname(),
            **keywords,
        )

    @property
    def request_threads(self) -> int:
        """Threads of requests that wait on storage, not on a core (header reads, the remote
        filesystem's connection pool): ``num_threads``, or :data:`REQUEST_THREADS`."""
        return self.num_threads if self.num_threads is not None else REQUEST_THREADS


@dataclass(frozen=True)
class ReadSettings:
    """What ``options`` come to on a checkpoint's storage (``location``; ``None`` before
    ``read_metadata`` located it): how reads are cut and coalesced, the same for a load and for a
    plan of it (``plan_requests``, ``plan_spans``)."""

    options: ReaderOptions
    location: CheckpointLocation | None

    @property
    def threads(self) -> int:
        """Reads in flight: ``num_threads`` when given; else :data:`REQUEST_THREADS` on remote stores
        and :func:`local_threads` on local files, where a warm read is a copy that needs a core."""
        if self.options.num_threads is not None:
            return self.options.num_threads
        if self.location is None or not self.location.backend.local:
            return self.options.request_threads
        return local_threads()

    @property
    def mapped(self) -> bool:
        """Data is copied out of mappings of the files rather than read by ranges."""
        options = self.options
        return (
            options.map_local_files and not options.direct_io and self.location is not None
            and self.location.backend.mappable
        )

    @property
    def gap(self) -> int:
        """The coalescing gap requests are made with (none when mapping: gaps would cost a copy)."""
        if self.mapped:
            return 0
        if self.options.coalesce_gap is not None:
            return self.options.coalesce_gap
        if self.location is None:
            return 0
        if self.options.direct_io and self.location.backend.local:
            return DIRECT_IO_ALIGN  # O_DIRECT reads whole pages: a hole inside one costs nothing more
        return self.location.backend.coalesce_gap

    @property
    def span_gap(self) -> int:
        """Holes nobody needs that a span may bridge: the given ``coalesce_gap`` (at most a span),
        else none on local files and :data:`SPAN_GAP` on remote stores."""
        if self.options.coalesce_gap is not None:
            return min(self.options.coalesce_gap, self.options.span_bytes)
        assert self.location is not None
        return 0 if self.location.backend.local else SPAN_GAP

    @property
    def batch_bytes(self) -> int:
        """The most bytes of one batch: the per-thread share of ``staging_bytes``; on remote stores at
        least :data:`REMOTE_BATCH_BYTES` (within the budget) however many threads, since a batch is
        a GET where the layout allows and smaller GETs only multiply round trips (issue 14). A
        multiple of :data:`ALIGN`, so a batch's chunks, aligned, fit one staging slot. Also the
        largest request of a cooperative load's span reads."""
        staging = self.options.staging_bytes
        share = staging // self.threads
        if self.location is not None and not self.location.backend.local:
            share = max(share, min(REMOTE_BATCH_BYTES, staging))
        return share - share % ALIGN

    @property
    def batch_workers(self) -> int:
        """Batches read at once: as many as ``staging_bytes`` holds, at most ``num_threads``."""
        return max(1, min(self.threads, self.options.staging_bytes // self.batch_bytes))


def local_threads() -> int:
    """Read threads of one rank on local files: this process's cores shared among the ranks of this
    node, within :data:`LOCAL_THREADS`. Warm, a local read is a copy out of the page cache: threads
    beyond the cores only take turns (4 ranks x 8 threads on 2 cores loaded the 2 GB dense
    checkpoint 1.5-2x slower than x 1 or 2 threads), and each thread maps and unmaps its boxes, so
    more of them contend for the process's mappings. At least two, so that one thread's page faults
    or disk waits overlap another's copies. The ranks of the node: ``LOCAL_WORLD_SIZE`` (torchrun
    sets it), else the process group's size (ranks all on this node), else one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.isdigit() and int(local) > 0:
        ranks = int(local)
    else:
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    low, high = LOCAL_THREADS
    return max(low, min(high, cores // ranks))
