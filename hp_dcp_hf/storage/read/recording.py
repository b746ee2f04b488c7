"""A reader that keeps its requests, for the CLI's and the demo's tables (its own module, so that
:mod:`hp_dcp_hf.tools` imports torch's DCP only when a command reads data)."""

from __future__ import annotations

from typing import Any

from hp_dcp_hf.storage.read.reader import HFStorageReader


class RecordingReader(HFStorageReader):
    """An :class:`HFStorageReader` that keeps every request it issues (``reads``: ``(file, start,
    end)``, coalescing gaps included)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, record_requests=True, **kwargs)

    @property
    def reads(self) -> list[tuple[str, int, int]]:
        return self.requests_log
