"""Readahead advice for a direct read from a cold page cache (the reader's ``prefetch`` option):
``posix_fadvise(WILLNEED)`` of the batches' ranges, on a thread that runs ahead of the reads."""

from __future__ import annotations

import contextlib
import threading

from hp_dcp_hf.storage.format.ranges import coalesce
from hp_dcp_hf.storage.read.chunks import Chunk, pieces
from hp_dcp_hf.storage.transport.fsspec_backend import DIRECT_IO_ALIGN
from hp_dcp_hf.storage.transport.location import CheckpointLocation, RangeFile


def advise(handle: RangeFile, batch: list[Chunk], gap: int) -> None:
    """:meth:`RangeFile.advise` of the batch's ranges, coalesced across holes below ``gap`` or a page."""
    for request in coalesce(pieces(batch), max(gap, DIRECT_IO_ALIGN)):
        handle.advise(request.start, request.end)


class Prefetcher:
    """``posix_fadvise(WILLNEED)`` of every batch's ranges (coalesced with the reader's gap, at least
    a page), in the order the batches are read, on a thread of its own that stays at most
    ``window`` bytes ahead of the batches read. Advice only: an error stops it, never the load."""

    def __init__(self, location: CheckpointLocation, batches: list[list[Chunk]], gap: int, window: int) -> None:
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
                advise(handles[file], batch, self._gap)
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
