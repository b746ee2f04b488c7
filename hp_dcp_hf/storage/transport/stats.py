"""Counters of what the storage layer read, per file.

The point of this package is to read only the bytes each rank needs; these counters are how tests
and benchmarks prove it (bytes read vs bytes needed, requests after coalescing, header traffic).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class FileStats:
    """What was read from one file (or, from :meth:`ReadStats.total`, from all of them)."""

    bytes_read: int = 0
    """Tensor payload bytes fetched, coalescing gaps included."""
    bytes_needed: int = 0
    """Tensor payload bytes the plan asked for."""
    ranges: int = 0
    """Contiguous byte ranges the plan asked for, before coalescing."""
    requests: int = 0
    """Read requests issued for tensor payload, after coalescing. Reads copied out of a memory mapping
    of a local file issue none: for them it counts the contiguous runs copied (ranges that touch
    merged), the figure their requests would be with ``map_local_files=False`` and no gap."""
    header_bytes: int = 0
    """Bytes of headers (8-byte length prefix + JSON) and of the index file read."""
    header_requests: int = 0
    """Read requests issued for headers."""

    def __add__(self, other: FileStats) -> FileStats:
        return FileStats(
            *(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True))
        )


class ReadStats:
    """Thread-safe accumulator of :class:`FileStats` per file name; read it through snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, FileStats] = {}

    def add(self, file: str, **counts: int) -> None:
        """Add ``counts`` (FileStats field names) to ``file``'s counters."""
        with self._lock:
            self._files[file] = self._files.get(file, FileStats()) + FileStats(**counts)

    @property
    def per_file(self) -> dict[str, FileStats]:
        """A snapshot: file name -> its counters."""
        with self._lock:
            return dict(self._files)

    def total(self) -> FileStats:
        """The counters summed over every file."""
        return sum(self.per_file.values(), FileStats())

    def __repr__(self) -> str:
        return f"ReadStats(total={self.total()}, files={len(self.per_file)})"
