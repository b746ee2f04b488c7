"""``HFStorageWriter``: a DCP ``StorageWriter`` that writes a Hugging Face checkpoint in one parallel
pass, each rank its own bytes at their final offsets, published atomically.

Every rank lays the files out alike from the tensor specs its planner gives
(:mod:`hp_dcp_hf.storage.files`); no data is exchanged for it. The coordinator creates a staging
directory next to the checkpoint (``.hp-dcp-hf-staging-<id>``), every file in it at its final size
with its header, and ``config.json``; each rank then ``pwrite`` s the boxes its plan holds (a box
is cut to the staging budget and cast to the checkpoint dtype piece by piece, so no rank holds more
than its shards plus that budget). Only after every rank reported success does the coordinator
move the files to their final names, write ``model.safetensors.index.json`` last and remove what
an older checkpoint at the path had and this one does not. A failure on any rank fails the save
on every rank (DCP raises on all of them) before anything was published; the staging directory is
then removed by :func:`hp_dcp_hf.save_hf_checkpoint` (or is left, named, by a bare ``dcp.save``).

Local and shared (POSIX) file systems.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from hp_dcp_hf.box import Box
from hp_dcp_hf.errors import PlanningError, StorageWriteError
from hp_dcp_hf.storage.catalog import INDEX_FILE
from hp_dcp_hf.storage.files import SavedFile, SavedTensor, layout_files
from hp_dcp_hf.storage.ranges import box_byte_ranges, split_box

STAGING_PREFIX = ".hp-dcp-hf-staging-"
_SHARD_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


class HFStorageWriter(StorageWriter):
    """Writes ``dcp.save`` plans of :class:`~hp_dcp_hf.save_planner.HFSavePlanner` as a Hugging Face
    checkpoint in directory ``path`` (see the module docstring).

    ``max_shard_size``: as ``save_pretrained``'s (``"5GB"``, or bytes). ``dtype``: cast floating-point
    tensors to it on write (default: each tensor's own dtype). ``staging_bytes``: the most memory a
    rank uses at once to cast and lay out a box before writing it.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | None = None,
        staging_bytes: int = 64 * 2**20,
    ) -> None:
        super().__init__()
        self.max_shard_size = max_shard_size
        self.dtype = dtype
        self.staging_bytes = staging_bytes
        self.reset(path)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            path = os.fspath(checkpoint_id)
            if "://" in path and not path.startswith("file://"):
                raise StorageWriteError("only local and shared (POSIX) file systems are written so far; "
                                        "save to a directory, then upload it", file=path)
            self.path = path.removeprefix("file://")
        self.files: list[SavedFile] = []
        self.index: dict[str, Any] | None = None
        self.tensors: dict[str, SavedTensor] = {}
        self.extra_files: dict[str, str] = {}
        self.staging: str | None = None
        self.bytes_written = 0
        self.is_coordinator = False

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return not os.path.isfile(os.fspath(checkpoint_id))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    # -- plans ----------------------------------------------------------------------------------
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Lay the files out from the planner's request, then drop it from the plan (every rank has
        its own; only the items travel to the coordinator)."""
        request = plan.planner_data
        if request is None or not hasattr(request, "tensors"):
            raise PlanningError("HFStorageWriter writes the plans of HFSavePlanner", file=self.path)
        specs = {key: (self._dtype(dtype), shape) for key, (dtype, shape) in request.tensors.items()}
        self.files, self.index = layout_files(specs, self.max_shard_size, request.storage)
        if self.index is not None:
            self.index["metadata"] = {**request.index_metadata, **self.index["metadata"]}
        self.tensors = {t.key: t for f in self.files for t in f.tensors}
        self.extra_files = dict(request.extra_files)
        return dataclasses.replace(plan, planner_data=None)

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: the staging directory, every file at its final size with its header."""
        os.makedirs(self.path, exist_ok=True)
        self.staging = os.path.join(self.path, f"{STAGING_PREFIX}{uuid.uuid4().hex}")
        os.mkdir(self.staging)
        for file in self.files:
            with open(os.path.join(self.staging, file.name), "wb") as handle:
                handle.write(file.header)
                handle.truncate(file.size)
        for name, text in self.extra_files.items():
            with open(os.path.join(self.staging, name), "w") as handle:
                handle.write(text)
        return [dataclasses.replace(plan, storage_data=self.staging) for plan in plans]

    # -- data -----------------------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """``pwrite`` every box of ``plan`` at its final offsets in the staging files."""
        staging = plan.storage_data
        self.staging = staging
        results: list[WriteResult] = []
        handles: dict[str, int] = {}
        try:
            for item in plan.items:
                tensor = self.tensors.get(item.index.fqn)
                if tensor is None or item.tensor_data is None:
                    raise PlanningError("the plan writes a key the layout does not have", key=item.index.fqn)
                if tensor.file not in handles:
                    handles[tensor.file] = os.open(os.path.join(staging, tensor.file), os.O_WRONLY)
                data = planner.resolve_data(item)
                box = Box(tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes))
                written = self._write_box(handles[tensor.file], tensor, box, data)
                results.append(WriteResult(index=item.index, size_in_bytes=written, storage_data=None))
            for fd in handles.values():
                os.fsync(fd)
        except OSError as e:
            raise StorageWriteError(f"writing failed: {e}", file=staging) from e
        finally:
            for fd in handles.values():
                os.close(fd)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_box(self, fd: int, tensor: SavedTensor, box: Box, data: torch.Tensor) -> int:
        """Write ``data`` (the values of ``box``) into ``tensor``'s bytes, one staging-sized part at a time."""
        itemsize = tensor.dtype.itemsize
        written = 0
        for part in split_box(box, itemsize, max(itemsize, self.staging_bytes), tensor.shape):
            source = data[part.relative_to(box.offsets).slices()]
            flat = source.reshape(-1) if source.dtype == tensor.dtype and source.is_contiguous() else None
            if flat is None or flat.stride() != (1,):  # strided or cast: through a row-major buffer
                flat = torch.empty(part.sizes, dtype=tensor.dtype)
                flat.copy_(source)
                flat = flat.view(-1)
            raw = memoryview(flat.view(torch.uint8).numpy())
            position = 0
            for start, end in box_byte_ranges(tensor.shape, itemsize, part):
                length = end - start
                if os.pwrite(fd, raw[position : position + length], tensor.start + start) != length:
                    raise OSError(f"short write of {tensor.key}")
                position += length
            written += position
        self.bytes_written += written
        return written

    # -- commit ---------------------------------------------------------------------------------
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, once every rank wrote: publish the files, the index last."""
        assert self.staging is not None
        expected = sum(f.size - len(f.header) for f in self.files)
        written = sum(r.size_in_bytes for rank in results for r in rank)
        if written != expected:
            raise StorageWriteError(f"the ranks wrote {written} bytes of tensor data, the files hold {expected}",
                                    file=self.path)
        names = {f.name for f in self.files}
        for name in [*sorted(names), *sorted(self.extra_files)]:
            os.replace(os.path.join(self.staging, name), os.path.join(self.path, name))
        index_path = os.path.join(self.path, INDEX_FILE)
        if self.index is not None:
            staged_index = os.path.join(self.staging, INDEX_FILE)
            with open(staged_index, "w") as handle:
                json.dump(self.index, handle, indent=2, sort_keys=True)
                handle.write("\n")
            os.replace(staged_index, index_path)
        elif os.path.exists(index_path):
            os.remove(index_path)
        for name in os.listdir(self.path):  # an older checkpoint's shards this one does not have
            if _SHARD_NAME.fullmatch(name) and name not in names:
                os.remove(os.path.join(self.path, name))
        self.abort()

    def abort(self) -> None:
        """Remove the staging directory (nothing of it was published, or all of it was)."""
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)

