"""The limits: the bytes a rank needs, moved with nothing else around them.

Both start from this project's plan for the rank (its ReadItems: boxes of checkpoint tensors) and
fill one preallocated, already touched buffer with the same number of threads as the loaders: no
planning, no metadata, no dtype handling, no model.

* :class:`RawReads` (``limit``, the limit the targets are measured against): plain ``os.preadv``
  of the boxes' ``[start, end)`` byte ranges (ranges that touch merged, as a reader with coalescing gap 0 does).
  A row-sharded box is one call per row.
* :class:`MappedCopies` (``limit-mmap``): each box one strided ``copy_`` out of a memory mapping of
  its file: the floor of this project's own local path, below ``limit`` when boxes are strided.
"""

from __future__ import annotations

import math
import mmap
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.storage import TensorEntry, box_byte_ranges

CHUNK = 8 * 2**20
"""Largest single preadv: the reader's per-thread staging budget (64 MiB / 8 threads)."""


def plan_ranges(items: Iterable, entries: Mapping[str, TensorEntry]) -> dict[str, list[tuple[int, int]]]:
    """File -> sorted, merged absolute ``[start, end)`` ranges of every ReadItem's box."""
    per_file: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for item in items:
        entry = entries[item.storage_index.fqn]
        box = Box(tuple(item.storage_offsets), tuple(item.lengths))
        per_file[entry.file].extend((entry.data_start + s, entry.data_start + e)
                                    for s, e in box_byte_ranges(entry.shape, entry.itemsize, box))
    merged: dict[str, list[tuple[int, int]]] = {}
    for file, ranges in per_file.items():
        out: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            if out and start == out[-1][1]:
                out[-1] = (out[-1][0], end)
            else:
                out.append((start, end))
        merged[file] = out
    return merged


class RawReads:
    """Open files, a touched buffer and the list of preadv calls for one rank's ranges."""

    def __init__(self, root: str | os.PathLike, ranges: Mapping[str, list[tuple[int, int]]]) -> None:
        self.total = sum(e - s for rs in ranges.values() for s, e in rs)
        self.buffer = np.ones(max(self.total, 1), dtype=np.uint8)  # touched: no page faults while timed
        self.fds = {file: os.open(Path(root, file), os.O_RDONLY) for file in ranges}
        self.calls: list[tuple[int, int, int, int]] = []  # (fd, file offset, buffer offset, length)
        position = 0
        for file, file_ranges in ranges.items():
            for start, end in file_ranges:
                for lo in range(start, end, CHUNK):
                    n = min(CHUNK, end - lo)
                    self.calls.append((self.fds[file], lo, position, n))
                    position += n
        self.ranges = sum(len(r) for r in ranges.values())

    @property
    def requests(self) -> int:
        return len(self.calls)

    def batches(self, threads: int) -> list[list[tuple[int, int, int, int]]]:
        """The calls dealt to ``threads`` threads, in file order, about equal bytes each."""
        per_thread = -(-sum(c[3] for c in self.calls) // threads)
        out: list[list[tuple[int, int, int, int]]] = [[]]
        load = 0
        for call in self.calls:
            if load >= per_thread and len(out) < threads:
                out.append([])
                load = 0
            out[-1].append(call)
            load += call[3]
        return out

    def read(self, threads: int) -> int:
        """Issue every preadv, each thread a loop over its batch; the number of bytes read."""
        view = memoryview(self.buffer)

        def loop(batch: list[tuple[int, int, int, int]]) -> int:
            total = 0
            for fd, offset, at, n in batch:
                done = 0
                while done < n:
                    got = os.preadv(fd, [view[at + done: at + n]], offset + done)
                    if got <= 0:
                        raise OSError(f"short read at {offset + done}")
                    done += got
                total += done
            return total

        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(loop, self.batches(threads)))

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


class MappedCopies:
    """The boxes of a rank's plan, each copied out of a mapping of its file into a touched buffer."""

    def __init__(self, root: str | os.PathLike, items: Iterable, entries: Mapping[str, TensorEntry]) -> None:
        self.root = root
        self.copies: list[tuple[TensorEntry, tuple[slice, ...], int]] = []  # (entry, box, buffer offset)
        position = 0
        for item in sorted(items, key=lambda i: (entries[i.storage_index.fqn].file, entries[i.storage_index.fqn].data_start)):
            entry = entries[item.storage_index.fqn]
            box = Box(tuple(item.storage_offsets), tuple(item.lengths))
            self.copies.append((entry, box.slices(), position))
            position += box.numel * entry.itemsize
        self.total = position
        self.buffer = torch.ones(max(position, 1), dtype=torch.uint8)  # touched: no page faults while timed

    @property
    def requests(self) -> int:
        return len(self.copies)

    def batches(self, threads: int) -> list[list[tuple[TensorEntry, tuple[slice, ...], int]]]:
        """The copies dealt to ``threads`` threads, in file order, about equal bytes each."""
        per_thread = -(-self.total // threads)
        out: list[list[tuple[TensorEntry, tuple[slice, ...], int]]] = [[]]
        load = 0
        for copy in self.copies:
            if load >= per_thread and len(out) < threads:
                out.append([])
                load = 0
            out[-1].append(copy)
            load += _nbytes(copy)
        return out

    def read(self, threads: int) -> int:
        """Every copy, each thread mapping the files of its batch once; the number of bytes copied."""

        def loop(batch: list[tuple[TensorEntry, tuple[slice, ...], int]]) -> int:
            total, maps = 0, {}
            try:
                for entry, box, at in batch:
                    if entry.file not in maps:
                        with open(Path(self.root, entry.file), "rb") as f:
                            maps[entry.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                    data = torch.frombuffer(maps[entry.file], dtype=torch.uint8)
                    source = data[entry.data_start : entry.data_end].view(entry.dtype).view(entry.shape)[box]
                    n = source.numel() * entry.itemsize
                    self.buffer[at : at + n].view(entry.dtype).view(source.shape).copy_(source)
                    total += n
                    del data, source
            finally:
                for m in maps.values():
                    m.close()
            return total

        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(loop, self.batches(threads)))

    def close(self) -> None:
        """Nothing held between reads: each one maps and unmaps its files."""


def _nbytes(copy: tuple[TensorEntry, tuple[slice, ...], int]) -> int:
    entry, box, _ = copy
    return math.prod(s.stop - s.start for s in box) * entry.itemsize
