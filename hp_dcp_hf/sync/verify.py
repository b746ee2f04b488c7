"""A loaded model checked against its checkpoint: every rank's shards, mapped back to the checkpoint's
tensors by the save's inversion, against the checkpoint's bytes of the same boxes.

The check is independent of the load: the load read along the mapping's composition, the check
goes back along the save's inversion (:class:`~hp_dcp_hf.sync.source.HFWeightSource`), so a
mapping that put values in the wrong place (a fused qkv under TP cut at the wrong row) is found,
not just bytes that failed to land. The inversion gives every checkpoint element to exactly one
rank, so the ranks read each checkpoint byte once between them (a replica reads nothing the other
reads), through the storage layer's own reader: any store a load reads, chunked files, its
counters in :attr:`VerifyReport.read`.

What is compared: the checkpoint's bytes of each box, cast to the model's dtype by the reader as a
load casts them, against the model's values in that dtype, by :func:`~hp_dcp_hf.sync.checksums.digest`
(bit-exact: a bf16 checkpoint loaded into a float32 model compares the float32 values the load
wrote). The headers are read afresh: the check is against the checkpoint as it is now.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from transformers.core_model_loading import WeightTransform

from hp_dcp_hf.errors import HPDCPHFError, VerificationError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.geometry.replicas import ReplicaGroups
from hp_dcp_hf.geometry.shards import local_shard_pieces, local_tensor
from hp_dcp_hf.storage import HFStorageReader
from hp_dcp_hf.storage.format.catalog import QUANTIZATION_CONFIG, CheckpointTensor
from hp_dcp_hf.storage.transport.stats import FileStats
from hp_dcp_hf.sync.checksums import digest, dtype_name
from hp_dcp_hf.sync.source import HFWeightSource
from hp_dcp_hf.util.collectives import agree_on_failure, collective_device, should_broadcast
from hp_dcp_hf.util.dcp import is_rank0

logger = logging.getLogger(__name__)

ROUND_BYTES = 1 << 30
"""The most checkpoint values (in the model's dtype) one rank holds in buffers at a time: the
slices are read in rounds of at most this many bytes (a slice larger than it is a round alone)."""


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_against_checkpoint` compared on this rank."""

    slices: int
    """Slices of checkpoint tensors this rank holds and compared."""
    bytes_compared: int
    """Their bytes in the model's dtype."""
    read: FileStats
    """What this rank read from storage for them (and, on the rank that read them, the headers)."""
    absent: tuple[str, ...]
    """Tensors the model's save would write that the checkpoint lacks, so not compared: those a
    ``strict=False`` load left to the model's init (the same on every rank)."""


def verify_against_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    reader: HFStorageReader | None = None,
    weights_mapping: Sequence[WeightTransform] | None = None,
    hf_config: Any = None,
    round_bytes: int = ROUND_BYTES,
    **reader_options: Any,
) -> VerifyReport:
    """Check that ``model`` holds the checkpoint at ``path``'s values; every rank calls it.

    Raises :class:`~hp_dcp_hf.errors.VerificationError` on every rank when any rank's slice differs,
    naming the tensor (``key``), the file(s) holding the box (``file``), the box and the rank
    (``error.rank``); a read that fails raises its storage error on every rank alike. A quantized
    checkpoint is refused: its bytes are not the values a load writes.

    ``reader``: the reader to read through, reset first (its statistics then count the check alone);
    default ``HFStorageReader(path, **reader_options)``. ``weights_mapping``, ``hf_config``: as
    :class:`~hp_dcp_hf.sync.source.HFWeightSource` takes them, for a model that is not a
    transformers model. ``round_bytes``: see :data:`ROUND_BYTES`.
    """
    if reader is not None and reader_options:
        raise ValueError(f"pass reader= or reader options, not both (got {sorted(reader_options)})")
    source = HFWeightSource(model, weights_mapping=weights_mapping, hf_config=hf_config)
    reader = reader if reader is not None else HFStorageReader(path, **reader_options)
    reader.reset()
    metadata = reader.read_metadata()  # rank 0 reads the headers, every rank gets them (or its error)
    if metadata.planner_data.get(QUANTIZATION_CONFIG) is not None:
        raise VerificationError(
            "the checkpoint is quantized (config.json has a quantization_config): its bytes are not the values "
            "a load writes, so they cannot be compared with the model's", file=str(path))
    absent = tuple(meta.name for meta in source.metadata() if meta.name not in reader.entries)
    if absent and is_rank0():
        logger.warning("%d tensors the model would save are not in %s and were not verified: %s",
                       len(absent), reader.path, ", ".join(absent[:5]) + (", ..." if len(absent) > 5 else ""))
    check = _Comparison(source, reader.entries)
    error: BaseException | None = None
    try:
        check.shapes()
        for plan in _rounds(check.items, source, round_bytes, collective=reader.cooperating):
            reader.read_data(plan, check).wait()
        check.raise_first()
    except HPDCPHFError as exc:
        error = exc
    if should_broadcast():
        error = agree_on_failure(error) or agree_on_failure(_replicas_differ(model))
    if error is not None:
        raise error
    return VerifyReport(len(check.items), check.bytes_compared, reader.stats.total(), absent)


def _replicas_differ(model: nn.Module) -> VerificationError | None:
    """A :class:`VerificationError` when this rank's local values of a tensor differ from a replica's.

    The checkpoint check reads each element once, so it compares one replica of each tensor; the
    others are compared with their replicas by digest (one ``all_gather_object`` of a digest per
    tensor and rank), no byte read again. Which replica of two is the one the checkpoint check
    passed is not told here, so the error names them all."""
    tensors = {name: t for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
    groups = ReplicaGroups.gather(tensors)
    mine = {name: digest(local_tensor(tensor)) for name, tensor in tensors.items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for name, tensor in tensors.items():
        group = groups.group(tensor, name)
        odd = [r for r in group if every[r].get(name) != mine[name]]
        if odd:
            boxes = [list(p.global_box.offsets) + list(p.global_box.sizes) for p in local_shard_pieces(tensor, key=name)]
            return VerificationError(
                f"rank {dist.get_rank()}'s local values (boxes [offsets + sizes] {boxes}) differ from those of its "
                f"replica(s) on ranks {odd}, which hold the same elements (replicas {list(group)})", key=name)
    return None


class _Comparison:
    """The read items of this rank's slices, and the planner half ``read_data`` asks for: a buffer in
    the model's dtype per item (the reader casts into it as a load does), compared when committed."""

    def __init__(self, source: HFWeightSource, entries: dict[str, CheckpointTensor]) -> None:
        self.source = source
        self.entries = entries
        self.items: list[ReadItem] = []
        self._index: dict[ReadItem, int] = {}
        for index, held in enumerate(source.slices()):
            if held.name in entries and not held.box.is_empty():
                item = _read_item(held.name, held.box)
                self._index[item] = index
                self.items.append(item)
        self.differing: list[int] = []  # slice indices
        self.bytes_compared = 0
        self._lock = threading.Lock()  # the reader commits from its threads

    def shapes(self) -> None:
        """Every held tensor's shape is the checkpoint's: else its boxes mean other elements."""
        for meta in self.source.metadata():
            stored = self.entries.get(meta.name)
            if stored is not None and tuple(stored.shape) != meta.shape:
                raise VerificationError(
                    f"the model's tensor has shape {list(meta.shape)}, the checkpoint's {list(stored.shape)}",
                    file=_files(stored, Box.full(stored.shape)), key=meta.name)

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return torch.empty(tuple(item.lengths), dtype=self.source.meta(item.storage_index.fqn).dtype)

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        index = self._index[item]
        same = digest(tensor) == digest(self.source.read(index))
        with self._lock:
            if not same:
                self.differing.append(index)
            self.bytes_compared += tensor.numel() * tensor.element_size()

    def raise_first(self) -> None:
        """A :class:`VerificationError` naming the first differing slice (in planning order), if any."""
        if not self.differing:
            return
        index = min(self.differing)
        held = self.source.slices()[index]
        dtype = self.source.meta(held.name).dtype
        others = f"; {len(self.differing) - 1} more of this rank's slices differ" if len(self.differing) > 1 else ""
        raise VerificationError(
            f"box at offsets {list(held.box.offsets)} of sizes {list(held.box.sizes)} holds other values in the "
            f"model than in the checkpoint (compared as {dtype_name(dtype)}, the model's "
            f"dtype){others}", file=_files(self.entries[held.name], held.box), key=held.name)


def _read_item(name: str, box: Box) -> ReadItem:
    origin = (0,) * box.ndim
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(name, box.offsets),
        dest_offsets=torch.Size(origin),
        storage_index=MetadataIndex(name, origin),  # the reader's one whole-tensor chunk per key
        storage_offsets=torch.Size(box.offsets),
        lengths=torch.Size(box.sizes),
    )


def _rounds(items: list[ReadItem], source: HFWeightSource, budget: int, *, collective: bool) -> list[LoadPlan]:
    """``items`` cut into plans of at most ``budget`` bytes each in the model's dtype. A cooperative
    reader's ``read_data`` is collective: then every rank runs as many rounds as the rank with the
    most (the extra ones empty)."""
    plans: list[list[ReadItem]] = []
    used = 0
    for item in items:
        nbytes = torch.Size(item.lengths).numel() * source.meta(item.storage_index.fqn).dtype.itemsize
        if not plans or used + nbytes > budget:
            plans.append([])
            used = 0
        plans[-1].append(item)
        used += nbytes
    if collective:
        count = torch.tensor([len(plans)], dtype=torch.int64, device=collective_device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        plans.extend([] for _ in range(int(count.item()) - len(plans)))
    return [LoadPlan(plan) for plan in plans]


def _files(tensor: CheckpointTensor, box: Box) -> str:
    """The file(s) holding ``box`` of ``tensor`` (several for a box across chunks in several files)."""
    return ", ".join(sorted({part.file for part, _ in tensor.pieces(box)}))
