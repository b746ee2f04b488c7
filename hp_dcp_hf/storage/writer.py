"""``HFStorageWriter``: a DCP ``StorageWriter`` that writes a Hugging Face checkpoint in one parallel
pass, each rank its own bytes at their final offsets, published atomically.

Every rank lays the files out alike from the tensor specs its planner gives
(:mod:`hp_dcp_hf.storage.files`); no data is exchanged for it. The coordinator stages the files
(invisible under their final names), every rank writes the boxes its plan holds, and only after
every rank reported success does the coordinator publish them, ``model.safetensors.index.json``
last, removing what an older checkpoint at the path had and this one does not. A failure on any
rank fails the save on every rank (DCP raises on all of them) before anything was published; what
was staged is then dropped by :func:`hp_dcp_hf.save_hf_checkpoint` (or is left, named, by a bare
``dcp.save``). Where the bytes go is a :class:`~hp_dcp_hf.storage.destination.Destination`: a
local or shared directory, or S3 multipart uploads.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import fsspec
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from hp_dcp_hf.box import Box
from hp_dcp_hf.errors import PlanningError, StorageWriteError
from hp_dcp_hf.storage.destination import BoxWrite, Destination, Directory
from hp_dcp_hf.storage.files import SavedFile, SavedTensor, layout_files
from hp_dcp_hf.storage.multipart import DEFAULT_PART_BYTES, MultipartUploads


def destination_for(path: str, storage_options: dict[str, Any], part_bytes: int) -> Destination:
    """The destination of ``path``: a directory (local path or ``file://``), or S3 (``s3://``)."""
    if "://" not in path or path.startswith("file://"):
        return Directory(path.removeprefix("file://"))
    if path.startswith(("s3://", "s3a://")):
        fs, root = fsspec.core.url_to_fs(path, **storage_options)
        return MultipartUploads(fs, root, path, part_bytes)
    raise StorageWriteError("saves go to local or shared file systems and to S3 (multipart uploads); "
                            "save to a directory, then upload it", file=path)


class HFStorageWriter(StorageWriter):
    """Writes ``dcp.save`` plans of :class:`~hp_dcp_hf.save_planner.HFSavePlanner` as a Hugging Face
    checkpoint at ``path``: a directory, or an ``s3://`` prefix (``storage_options`` as s3fs takes
    them: ``key``, ``secret``, ``endpoint_url``, ``client_kwargs``, ...).

    ``max_shard_size``: as ``save_pretrained``'s (``"5GB"``, or bytes). ``dtype``: cast floating-point
    tensors to it on write (default: each tensor's own dtype). ``staging_bytes``: the most memory a
    rank uses at once to cast and lay out a box before writing it. ``part_bytes``: the part size of
    S3 uploads (at least 5 MiB).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | None = None,
        staging_bytes: int = 64 * 2**20,
        part_bytes: int = DEFAULT_PART_BYTES,
        **storage_options: Any,
    ) -> None:
        super().__init__()
        self.max_shard_size = max_shard_size
        self.dtype = dtype
        self.staging_bytes = staging_bytes
        self.part_bytes = part_bytes
        self.storage_options = storage_options
        self.reset(path)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            self.destination = destination_for(self.path, self.storage_options, self.part_bytes)
        self.files: list[SavedFile] = []
        self.index: dict[str, Any] | None = None
        self.tensors: dict[str, SavedTensor] = {}
        self.extra_files: dict[str, str] = {}
        self.token: Any = None
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
        """Coordinator: stage the files; every rank writes with the token."""
        self.token = self.destination.stage(self.files, self.extra_files)
        return [dataclasses.replace(plan, storage_data=self.token) for plan in plans]

    # -- data -----------------------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write every box of ``plan`` at its final offsets."""
        self.token = plan.storage_data
        writes: list[BoxWrite] = []
        failure: BaseException | None = None
        try:
            for item in plan.items:
                tensor = self.tensors.get(item.index.fqn)
                if tensor is None or item.tensor_data is None:
                    raise PlanningError("the plan writes a key the layout does not have", key=item.index.fqn)
                box = Box(tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes))
                writes.append(BoxWrite(tensor, box, planner.resolve_data(item)))
        except Exception as e:  # noqa: BLE001 - the destination raises it, once the other ranks know
            writes, failure = [], e
        sizes = self.destination.write(self.token, self.files, writes, self.staging_bytes, failure)
        self.bytes_written = sum(sizes)
        future: Future[list[WriteResult]] = Future()
        future.set_result([WriteResult(index=item.index, size_in_bytes=size, storage_data=None)
                           for item, size in zip(plan.items, sizes)])
        return future

    # -- commit ---------------------------------------------------------------------------------
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, once every rank wrote: publish the files, the index last."""
        expected = sum(f.size - len(f.header) for f in self.files)
        written = sum(r.size_in_bytes for rank in results for r in rank)
        if written != expected:
            raise StorageWriteError(f"the ranks wrote {written} bytes of tensor data, the files hold {expected}",
                                    file=self.path)
        self.destination.publish(self.token, self.files, self.extra_files, self.index)
        self.token = None

    def abort(self) -> None:
        """Drop what was staged (nothing of it was published, or all of it was)."""
        if self.token is not None:
            self.destination.abort(self.token)
            self.token = None
