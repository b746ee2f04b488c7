"""What a read mode is: one way of carrying out ``read_data`` (each rank its own ranges, or spans
read once per cluster and exchanged), picked once per load by the reader, as torch's own reader
and fsspec's caches pick theirs; and what a mode leaves behind for the reader's counters."""

from __future__ import annotations

from dataclasses import dataclass
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
    ``requests`` is a list, the staging ring's use, a cooperative read's plan and exchange."""

    stats: ReadStats
    seconds: dict[str, float]
    requests: list[tuple[str, int, int]] | None = None
    staging: StagingStats | None = None
    spans: SpanLoad | None = None

    def log(self, file: str, requests: list[Request]) -> None:
        if self.requests is not None:
            self.requests.extend((file, r.start, r.end) for r in requests)  # list.extend is atomic


class ReadMode(Protocol):
    """Reads every item of a plan into ``planner.resolve_tensor(item)`` and commits it."""

    def read(self, plan: LoadPlan, planner: LoadPlanner, record: ReadRecord) -> None: ...
