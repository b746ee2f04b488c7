"""``HFStorageWriter``: a DCP ``StorageWriter`` that writes a Hugging Face checkpoint in one parallel
pass, each rank its own bytes at their final offsets, published atomically.

Every rank lays the files out alike from the tensor specs its planner gives
(:mod:`hp_dcp_hf.storage.format.files`); no data is exchanged for it. The coordinator stages the files
(invisible under their final names), every rank writes the boxes its plan holds, and only after
every rank reported success does the coordinator publish them through one atomic switch
(:mod:`hp_dcp_hf.storage.format.journal`), removing what an older checkpoint at the path had and this one
does not. Every file and the index carry the save's id, so a reader can tell a mix. A failure on
any rank fails the save on every rank (DCP raises on all of them) before anything was published;
what was staged is then dropped by :func:`hp_dcp_hf.save_hf_checkpoint`, or by the next save into
the path (a killed save's too). Where the bytes go is a
:class:`~hp_dcp_hf.storage.write.destination.Destination`: a local or shared directory, or S3 multipart
uploads.

A quantized save (the planner's ``quantize="fp8"``) is quantized here, inside the same pass: before
its first byte, each rank takes the amax of every scale block it writes part of, the ranks complete
the blocks they share with one ``all_reduce(MAX)`` of those blocks only
(:class:`~hp_dcp_hf.quant.encode.BlockAmax`), and each box is then quantized a staging slice at a time
as it is written, its scales written by the rank that writes their block's first element.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import fsspec
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from hp_dcp_hf.errors import ArgumentError, PlanningError, StorageWriteError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.storage.format.files import SavedFile, SavedTensor, layout_files
from hp_dcp_hf.storage.format.journal import SAVE_ID_KEY, SAVE_ID_LENGTH
from hp_dcp_hf.storage.write.destination import BoxWrite, Destination, Directory, Staged
from hp_dcp_hf.storage.write.multipart import DEFAULT_PART_BYTES, LEASE_SECONDS, MultipartUploads


class Quantization(Protocol):
    """Weights a save stores quantized, as its planner hands them to every rank's writer
    (:class:`hp_dcp_hf.quant.encode.Fp8Layout`, a layer above this one)."""

    shapes: dict[str, tuple[int, ...]]  # quantized key -> its shape

    @property
    def scales(self) -> dict[str, str]:
        """Scale key -> its weight's key."""

    def quantized_writes(self, writes: Sequence[BoxWrite], through: torch.dtype | None,
                         failure: BaseException | None) -> tuple[list[BoxWrite], BaseException | None, int]:
        """This rank's ``writes`` with the weights quantized and their scales' values (a
        collective: every rank calls it, after a ``failure`` too, which it returns)."""


def destination_for(path: str, storage_options: dict[str, Any], part_bytes: int = DEFAULT_PART_BYTES,
                    lease_seconds: float = LEASE_SECONDS) -> Destination:
    """The destination of ``path``: a directory (local path or ``file://``), or S3 (``s3://``)."""
    if "://" not in path or path.startswith("file://"):
        return Directory(path.removeprefix("file://"))
    if path.startswith(("s3://", "s3a://")):
        fs, root = fsspec.core.url_to_fs(path, **storage_options)
        return MultipartUploads(fs, root, path, part_bytes, lease_seconds)
    raise StorageWriteError("saves go to local or shared file systems and to S3 (multipart uploads); "
                            "save to a directory, then upload it", file=path)


_ID_PLACEHOLDER = "hp-dcp-hf-save-id-not-drawn-yet!"
assert len(_ID_PLACEHOLDER) == SAVE_ID_LENGTH


class HFStorageWriter(StorageWriter):
    """Writes ``dcp.save`` plans of :class:`~hp_dcp_hf.save.planner.HFSavePlanner` as a Hugging Face
    checkpoint at ``path``: a directory, or an ``s3://`` prefix (``storage_options`` as s3fs takes
    them: ``key``, ``secret``, ``endpoint_url``, ``client_kwargs``, ...).

    ``max_shard_size``: as ``save_pretrained``'s (``"5GB"``, or bytes; by default its default). ``dtype``: cast floating-point
    tensors to it on write (default: each tensor's own dtype; FP8 weights are quantized from the values
    it gives, their scales stay float32); ``config.json`` names the dtype the files hold.
    ``staging_bytes``: the most memory a rank uses at once to cast and lay out a box before writing
    it. ``part_bytes``: the part size of S3 uploads (at least 5 MiB).
    ``lease_seconds``: how long an S3 save's lease on its prefix lasts unrenewed. ``progress``: called
    as ``progress(done, total)`` with this rank's tensor bytes written so far and in all, when its
    writes start and after each box (one call at a time; ``bytes_written`` counts along), so a
    long save can show it moves. ``amax_reduced``: after a quantized save, the scale blocks this
    rank's amax reduction carried (the same on every rank; 0 when no block is split between ranks).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        max_shard_size: int | str | None = None,
        dtype: torch.dtype | None = None,
        staging_bytes: int = 64 * 2**20,
        part_bytes: int = DEFAULT_PART_BYTES,
        lease_seconds: float = LEASE_SECONDS,
        progress: Callable[[int, int], None] | None = None,
        **storage_options: Any,
    ) -> None:
        super().__init__()
        self.lease_seconds = lease_seconds
        self.progress = progress
        self._written_lock = threading.Lock()
        try:  # save_pretrained's size units ("5GB", bytes), refused before anything is written
            layout_files({}, max_shard_size)
        except ValueError as e:
            raise ArgumentError(f"max_shard_size={max_shard_size!r}: {e}") from None
        self.max_shard_size = max_shard_size
        self.dtype = dtype
        self.staging_bytes = staging_bytes
        self.part_bytes = part_bytes
        self.storage_options = storage_options
        self.reset(path)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            if getattr(self, "destination", None) is not None:
                self.destination.unlock()  # a failed save's lock (DCP does not tell a writer it failed)
            self.path = os.fspath(checkpoint_id)
            self.destination = destination_for(self.path, self.storage_options, self.part_bytes, self.lease_seconds)
        self.files: list[SavedFile] = []
        self.index: dict[str, Any] | None = None
        self.tensors: dict[str, SavedTensor] = {}
        self.extra_files: dict[str, str] = {}
        self.save_id: str | None = None
        self.staged: Staged | None = None
        self.bytes_written = 0
        self._bytes_to_write = 0
        self.quantization: Quantization | None = None
        self.amax_reduced = 0
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
        # Headers hold a placeholder of the save id's fixed width until the coordinator draws the id
        self.quantization = request.quantization
        stored = set() if self.quantization is None else {*self.quantization.shapes, *self.quantization.scales}
        specs = {key: (dtype if key in stored else self._dtype(dtype), shape)
                 for key, (dtype, shape) in request.tensors.items()}
        self.files, self.index = layout_files(specs, self.max_shard_size, request.storage,
                                              {SAVE_ID_KEY: _ID_PLACEHOLDER})
        if self.index is not None:
            self.index["metadata"] = {**request.index_metadata, **self.index["metadata"]}
        self.tensors = {t.key: t for f in self.files for t in f.tensors}
        self.extra_files = request.extra_files(self.dtype)
        return dataclasses.replace(plan, planner_data=None)

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: draw the save's id and stage the files; every rank writes into what was staged."""
        self._take_id(uuid.uuid4().hex)
        self.staged = self.destination.stage(self.files, self.save_id)
        return [dataclasses.replace(plan, storage_data=self.staged) for plan in plans]

    def _take_id(self, save_id: str) -> None:
        """Put the save's id in every header (same width as the placeholder: offsets stay) and the index."""
        if self.save_id == save_id:
            return
        self.save_id = save_id
        self.files = [dataclasses.replace(f, header=f.header.replace(_ID_PLACEHOLDER.encode(), save_id.encode()))
                      for f in self.files]
        if self.index is not None:
            self.index["metadata"][SAVE_ID_KEY] = save_id

    # -- data -----------------------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write every box of ``plan`` at its final offsets (quantizing FP8 weights on the way)."""
        staged: Staged = plan.storage_data
        self._take_id(staged.save_id)
        writes: list[BoxWrite] = []
        failure: BaseException | None = None
        scales = self.quantization.scales if self.quantization is not None else {}
        try:
            for item in plan.items:
                tensor = self.tensors.get(item.index.fqn)
                if tensor is None or item.tensor_data is None:
                    raise PlanningError("the plan writes a key the layout does not have", key=item.index.fqn)
                box = Box(tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes))
                # Scales have no data in the model: quantized_writes computes them
                writes.append(BoxWrite(tensor, box, None if item.index.fqn in scales else planner.resolve_data(item)))
        except Exception as e:  # noqa: BLE001 - the destination raises it, once the other ranks know
            writes, failure = [], e
        if self.quantization is not None:  # every rank: the amax reduction is a collective
            through = self.dtype if self.dtype is not None and self.dtype.is_floating_point else None
            writes, failure, self.amax_reduced = self.quantization.quantized_writes(writes, through, failure)
        self.bytes_written, self._bytes_to_write = 0, sum(w.box.numel * w.tensor.dtype.itemsize for w in writes)
        self._wrote(0)
        sizes = self.destination.write(staged, self.files, writes, self.staging_bytes, failure, progress=self._wrote)
        self.bytes_written = sum(sizes)
        future: Future[list[WriteResult]] = Future()
        future.set_result([WriteResult(index=item.index, size_in_bytes=size, storage_data=None)
                           for item, size in zip(plan.items, sizes)])
        return future

    def _wrote(self, nbytes: int) -> None:
        """The destination wrote ``nbytes`` more of this rank's boxes."""
        with self._written_lock:
            self.bytes_written += nbytes
            if self.progress is not None:
                self.progress(self.bytes_written, self._bytes_to_write)

    # -- commit ---------------------------------------------------------------------------------
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, once every rank wrote: publish the files (one atomic switch)."""
        self.check_all_written(results)
        assert self.staged is not None
        self.destination.publish(self.staged, self.files, self.extra_files, self.index)
        self.staged = None

    def check_all_written(self, results: list[list[WriteResult]]) -> None:
        """Coordinator: the ranks together wrote exactly the files' tensor data, or nothing is published."""
        expected = sum(f.size - len(f.header) for f in self.files)
        written = sum(r.size_in_bytes for rank in results for r in rank)
        if written != expected:
            raise StorageWriteError(f"the ranks wrote {written} bytes of tensor data, the files hold {expected}",
                                    file=self.path)

    def abort(self) -> None:
        """Coordinator: drop what was staged, unless its publish was journaled (then the next save
        or repair completes it), and release the path. Other ranks never remove anything."""
        if self.is_coordinator and self.staged is not None:
            self.destination.abort(self.staged)
            self.staged = None

    def saved(self) -> bool:
        """Whether the checkpoint at the path now is this save's (asked of the storage)."""
        return self.save_id is not None and self.destination.current_save_id() == self.save_id
