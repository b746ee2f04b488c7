"""What a read mode is: one way of carrying out ``read_data`` (each rank its own ranges, or spans
read once per cluster and exchanged), picked once per load by the reader, as torch's own reader
and fsspec's caches pick theirs; and what a mode leaves behind for the reader's counters."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from hp_dcp_hf.storage.format.ranges import Request
from hp_dcp_hf.storage.read.ring import StagingStats
from hp_dcp_hf.storage.read.span_reads import SpanLoad
from hp_dcp_hf.storage.transport.stats import ReadStats


@dataclass
class ReadRecord:
    """What one ``read_data`` counted, filled in by its mode as it goes (a failed read keeps what
    it counted): bytes and requests (``stats``), phase times (``seconds``), every request when
    ``requests`` is a list, the staging ring's use, a cooperative read's plan and exchange.
    ``started``: when ``read_data`` began, the origin of ``seconds["first_byte"]`` (:meth:`landed`).
    ``cooperated``: whether a cooperative read read spans or, not paying, each rank its own items.
    ``written``: the items (indices into the plan) into whose destinations bytes may have gone,
    committed or not: what a read that fails midway may have changed (:meth:`writing`)."""

    stats: ReadStats
    seconds: dict[str, float]
    requests: list[tuple[str, int, int]] | None = None
    staging: StagingStats | None = None
    spans: SpanLoad | None = None
    cooperated: bool | None = None
    started: float = field(default_factory=time.perf_counter)
    written: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def log(self, file: str, requests: list[Request]) -> None:
        if self.requests is not None:
            self.requests.extend((file, r.start, r.end) for r in requests)  # list.extend is atomic

    def writing(self, items: Iterable[int]) -> None:
        """Bytes go, or went, into the destinations of ``items`` in place: marked before the
        first byte moves where the mode can, else as soon as a read may have moved one, so that a
        read failing at any point after it names them."""
        with self._lock:
            self.written.update(items)

    def landed(self) -> None:
        """Bytes read from storage are in memory: the first call sets ``seconds["first_byte"]``, the
        time from ``started`` (what a load waits before its first byte: plan, chunking, opening, the
        storage's latency), later calls keep it."""
        if "first_byte" not in self.seconds:
            self.seconds.setdefault("first_byte", time.perf_counter() - self.started)  # setdefault is atomic

    @contextlib.contextmanager
    def converting(self) -> Iterator[None]:
        """Time the body into ``seconds["convert"]``, summed over the threads that run one: copies out
        of staging slots and the commits after them (dequantization, conversions of whole tensors)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - began
            with self._lock:
                self.seconds["convert"] = self.seconds.get("convert", 0.0) + spent


class ReadMode(Protocol):
    """Reads every item of a plan into ``planner.resolve_tensor(item)`` and commits it."""

    def read(self, plan: LoadPlan, planner: LoadPlanner, record: ReadRecord) -> None: ...
