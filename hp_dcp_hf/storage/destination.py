"""Where a save's bytes go: one small interface, a backend per kind of storage.

:class:`~hp_dcp_hf.storage.writer.HFStorageWriter` lays the files out and drives a save through a
:class:`Destination`: the coordinator *stages* the files (invisible under their final names), every
rank *writes* its boxes, the coordinator *publishes* once every rank succeeded (the index last) or
*aborts*. Local and shared file systems are a :class:`Directory` (a staging directory, ``pwrite``
at final offsets, renames); object stores are multipart uploads
(:mod:`hp_dcp_hf.storage.multipart`). The writer never branches on the backend.

:func:`box_runs` is what both write: a box of a tensor as ``(file offset, bytes)`` runs in the
file's dtype, cast and laid out a staging budget at a time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hp_dcp_hf.box import Box, flat_range_boxes
from hp_dcp_hf.errors import StorageWriteError
from hp_dcp_hf.storage.catalog import INDEX_FILE
from hp_dcp_hf.storage.files import SavedFile, SavedTensor
from hp_dcp_hf.storage.ranges import box_byte_ranges, box_span, split_box

STAGING_PREFIX = ".hp-dcp-hf-staging-"
SHARD_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
"""The names of a checkpoint's weight files: an older checkpoint's that the new one lacks are removed."""


@dataclass(frozen=True)
class BoxWrite:
    """The values of ``box`` of ``tensor`` (``data``, in any dtype), to be written into its file."""

    tensor: SavedTensor
    box: Box
    data: torch.Tensor

    def span(self) -> tuple[int, int]:
        """The file bytes from the box's first to its last (holes included)."""
        first, last, _ = box_span(self.tensor.shape, self.tensor.dtype.itemsize, self.box)
        return self.tensor.start + first, self.tensor.start + last


def box_runs(write: BoxWrite, staging_bytes: int, window: tuple[int, int] | None = None) -> Iterator[tuple[int, memoryview]]:
    """``(file offset, bytes)`` of ``write``'s box in ascending order, only those inside the file's
    byte ``window`` when given. Runs are views of the model's memory when it already holds the
    file's dtype contiguously, else of a fresh buffer of at most ``staging_bytes``."""
    tensor, itemsize = write.tensor, write.tensor.dtype.itemsize
    regions = [write.box]
    if window is not None:
        lo, hi = window[0] - tensor.start, window[1] - tensor.start
        elements = flat_range_boxes(tensor.shape, lo // itemsize, -(-hi // itemsize))
        regions = [r for r in (e.intersect(write.box) for e in elements) if r is not None]
    for region in regions:
        for part in split_box(region, itemsize, max(itemsize, staging_bytes), tensor.shape):
            source = write.data[part.relative_to(write.box.offsets).slices()]
            flat = source.reshape(-1) if source.dtype == tensor.dtype and source.is_contiguous() else None
            if flat is None or flat.stride() != (1,):  # strided or cast: through a row-major buffer
                flat = torch.empty(part.sizes, dtype=tensor.dtype)
                flat.copy_(source)
                flat = flat.view(-1)
            raw = memoryview(flat.view(torch.uint8).numpy())
            position = 0
            for start, end in box_byte_ranges(tensor.shape, itemsize, part):
                run = raw[position : position + end - start]
                position += end - start
                if window is not None:  # elements straddling the window's edges: their bytes inside
                    cut_lo, cut_hi = max(start, lo), min(end, hi)
                    if cut_hi <= cut_lo:
                        continue
                    run, start = run[cut_lo - start : cut_hi - start], cut_lo
                yield tensor.start + start, run


class Destination(ABC):
    """Where the files of a save go (see the module docstring). ``stage`` and ``publish`` run on the
    coordinator only; ``write`` on every rank, with the token ``stage`` returned."""

    url: str

    @abstractmethod
    def stage(self, files: Sequence[SavedFile], extra_files: Mapping[str, str]) -> Any:
        """Prepare every file, invisible under its final name; the token every rank writes with."""

    @abstractmethod
    def write(self, token: Any, files: Sequence[SavedFile], writes: Sequence[BoxWrite], staging_bytes: int,
              failure: BaseException | None = None) -> list[int]:
        """Write every box of ``writes``; the tensor bytes of each. Every rank calls it, also after
        failing to prepare its writes (``failure``, raised here once the other ranks know)."""

    @abstractmethod
    def publish(self, token: Any, files: Sequence[SavedFile], extra_files: Mapping[str, str],
                index: Mapping[str, Any] | None) -> None:
        """Make the files visible under their final names, the index last, and remove the shards of
        an older checkpoint that this one does not have."""

    @abstractmethod
    def abort(self, token: Any) -> None:
        """Drop what was staged; an older checkpoint at the path stays as it was."""


def index_text(index: Mapping[str, Any]) -> str:
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


class Directory(Destination):
    """A local or shared (POSIX) directory: a staging directory beside the files, every file created
    there at its final size, ``pwrite`` of each box at its final offsets, then renames."""

    def __init__(self, path: str) -> None:
        self.url = path

    def stage(self, files: Sequence[SavedFile], extra_files: Mapping[str, str]) -> str:
        os.makedirs(self.url, exist_ok=True)
        staging = os.path.join(self.url, f"{STAGING_PREFIX}{uuid.uuid4().hex}")
        os.mkdir(staging)
        for file in files:
            with open(os.path.join(staging, file.name), "wb") as handle:
                handle.write(file.header)
                handle.truncate(file.size)
        for name, text in extra_files.items():
            with open(os.path.join(staging, name), "w") as handle:
                handle.write(text)
        return staging

    def write(self, token: str, files: Sequence[SavedFile], writes: Sequence[BoxWrite], staging_bytes: int,
              failure: BaseException | None = None) -> list[int]:
        if failure is not None:  # no other rank waits for this one's bytes
            raise failure
        handles: dict[str, int] = {}
        written = []
        try:
            for write in writes:
                name = write.tensor.file
                if name not in handles:
                    handles[name] = os.open(os.path.join(token, name), os.O_WRONLY)
                total = 0
                for offset, run in box_runs(write, staging_bytes):
                    if os.pwrite(handles[name], run, offset) != len(run):
                        raise OSError(f"short write of {write.tensor.key}")
                    total += len(run)
                written.append(total)
            for fd in handles.values():
                os.fsync(fd)
        except OSError as e:
            raise StorageWriteError(f"writing failed: {e}", file=token) from e
        finally:
            for fd in handles.values():
                os.close(fd)
        return written

    def publish(self, token: str, files: Sequence[SavedFile], extra_files: Mapping[str, str],
                index: Mapping[str, Any] | None) -> None:
        names = {f.name for f in files}
        for name in [*sorted(names), *sorted(extra_files)]:
            os.replace(os.path.join(token, name), os.path.join(self.url, name))
        index_path = os.path.join(self.url, INDEX_FILE)
        if index is not None:
            staged_index = os.path.join(token, INDEX_FILE)
            with open(staged_index, "w") as handle:
                handle.write(index_text(index))
            os.replace(staged_index, index_path)
        elif os.path.exists(index_path):
            os.remove(index_path)
        for name in os.listdir(self.url):
            if SHARD_NAME.fullmatch(name) and name not in names:
                os.remove(os.path.join(self.url, name))
        self.abort(token)

    def abort(self, token: str | None) -> None:
        if token is not None:
            shutil.rmtree(token, ignore_errors=True)
