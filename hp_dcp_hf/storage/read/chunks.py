"""A load's read items cut into chunks: parts of one item, each in one file and small enough for
the staging budget, with where their bytes go; packed into per-file batches. Every read mode (and
every plan of one) starts from the same chunks."""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from hp_dcp_hf.errors import PlanningError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.storage.format.catalog import CheckpointTensor
from hp_dcp_hf.storage.format.header import TensorEntry
from hp_dcp_hf.storage.format.ranges import Piece, box_byte_ranges, box_span, split_box
from hp_dcp_hf.storage.read.options import ALIGN


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`: what a staged chunk takes of a slot."""
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class Chunk:
    """A part of one read item small enough for the staging budget, with where its bytes go: ``box``
    is in the coordinates of ``entry``, the tensor (or chunk of one) stored in one file."""

    item: int
    entry: TensorEntry
    box: Box
    dest: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.entry.itemsize

    @cached_property
    def ranges(self) -> list[tuple[int, int]]:
        """Absolute ``[start, end)`` byte ranges of the box, in file order (one per row, or fewer)."""
        start = self.entry.data_start
        return [(start + s, start + e) for s, e in box_byte_ranges(self.entry.shape, self.entry.itemsize, self.box)]

    @cached_property
    def span(self) -> tuple[int, int, int]:
        """Absolute start of the first range, end of the last, and how many ranges, without listing them."""
        first, last, count = box_span(self.entry.shape, self.entry.itemsize, self.box)
        return self.entry.data_start + first, self.entry.data_start + last, count

    @property
    def strides(self) -> tuple[int, ...]:
        """The checkpoint tensor's row-major strides, in elements."""
        shape = self.entry.shape
        return tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))

    @property
    def mappable(self) -> bool:
        """The tensor's bytes can be viewed as its dtype in place (its start is aligned to it)."""
        return self.entry.data_start % self.entry.itemsize == 0

    @property
    def host(self) -> bool:
        """The destination is a plain CPU tensor: a copy out of a mapping can write it (anything else,
        a CUDA tensor above all, is staged in the ring)."""
        return type(self.dest) is torch.Tensor and self.dest.device.type == "cpu"

    @property
    def direct(self) -> bool:
        """The destination's own memory can receive the file bytes as they are."""
        return self.host and self.dest.dtype == self.entry.dtype and self.dest.is_contiguous()

    def staged_view(self, slot: torch.Tensor, offset: int) -> torch.Tensor:
        """This chunk's values as stored, in ``slot``'s bytes from ``offset`` (aligned)."""
        return slot[offset : offset + self.nbytes].view(self.entry.dtype).view(self.box.sizes)


@dataclass(frozen=True)
class Chunker:
    """Cuts read items into :class:`Chunk` s of at most ``budget`` bytes, from the checkpoint's
    ``entries`` (at ``path``, for errors)."""

    entries: Mapping[str, CheckpointTensor]
    path: str
    budget: int

    def all(self, items: Sequence[ReadItem], dests: Sequence[torch.Tensor]) -> list[Chunk]:
        """Every item's chunks, in item order."""
        return [c for index, item in enumerate(items) for c in self.chunks(index, item, dests[index])]

    def by_file(self, items: Sequence[ReadItem], dests: Sequence[torch.Tensor]) -> list[Chunk]:
        """The chunks in the order a cooperative read tells its needs: by file and first byte."""
        return sorted(self.all(items, dests), key=lambda c: (c.entry.file, c.span[0]))

    def chunks(self, index: int, item: ReadItem, dest: torch.Tensor) -> list[Chunk]:
        """The item's box split by the files that hold it, each piece cut to the budget."""
        key = item.storage_index.fqn
        tensor = self.entries.get(key)
        if tensor is None:
            raise PlanningError("the plan reads a key the checkpoint does not have", file=self.path, key=key)
        box = Box(tuple(item.storage_offsets), tuple(item.lengths))  # offsets checked not negative
        if box.ndim != len(tensor.shape) or any(o + s > n for o, s, n in zip(box.offsets, box.sizes, tensor.shape)):
            raise PlanningError(
                f"read box {box} is outside the tensor of shape {tensor.shape}",
                file=self.path if tensor.chunked else tensor.file,
                key=key,
            )
        if box.is_empty():
            return []
        chunks = []
        for entry, piece in tensor.pieces(box):
            # the piece in the stored tensor's coordinates (a tensor stored whole: its own)
            local = piece.relative_to(entry.box.offsets) if tensor.chunked else piece
            view = _part(dest, piece, box)
            chunks.extend(
                Chunk(item=index, entry=entry, box=part, dest=_part(view, part, local))
                for part in split_box(local, entry.itemsize, self.budget, entry.shape)
            )
        return chunks


def _part(tensor: torch.Tensor, part: Box, whole: Box) -> torch.Tensor:
    """The view of ``tensor`` (laid over ``whole``) that ``part`` covers: ``tensor`` itself when
    ``part`` is all of it. Most chunks are a whole item, and indexing a tensor twice per chunk was
    most of the cut (60-260 ms a rank for the 600 items of the MoE benchmark at 4 ranks), all of it
    before the first read."""
    if part == whole:
        return tensor
    return tensor[part.relative_to(whole.offsets).slices()]


def meta_destinations(items: Sequence[ReadItem]) -> list[torch.Tensor]:
    """Stand-ins for the items' destinations in a plan made without reading (no memory)."""
    return [torch.empty(tuple(i.lengths), device="meta") for i in items]


def destination(item: ReadItem, planner: LoadPlanner) -> torch.Tensor:
    """Where ``planner`` wants ``item``'s values, checked against the item."""
    key = item.storage_index.fqn
    if item.type != LoadItemType.TENSOR:
        raise PlanningError(f"read item of type {item.type.name}: safetensors holds tensors only", key=key)
    dest = planner.resolve_tensor(item).detach()
    if tuple(dest.shape) != tuple(item.lengths):
        raise PlanningError(f"destination shape {tuple(dest.shape)} != read lengths {tuple(item.lengths)}", key=key)
    return dest


def committer(plan: LoadPlan, planner: LoadPlanner, chunks: Sequence[Chunk],
              dests: Sequence[torch.Tensor]) -> Callable[[int], None]:
    """Commits each item of ``plan`` once all its chunks hold their values: those with none at once,
    the others through the returned callback, called with a chunk's item as each chunk is done."""
    remaining: dict[int, int] = defaultdict(int)
    for chunk in chunks:
        remaining[chunk.item] += 1
    for index, item in enumerate(plan.items):
        if not remaining[index]:
            planner.commit_tensor(item, dests[index])
    lock = threading.Lock()

    def chunk_done(item: int) -> None:
        with lock:
            remaining[item] -= 1
            done = not remaining[item]
        if done:
            planner.commit_tensor(plan.items[item], dests[item])

    return chunk_done


def pieces(batch: list[Chunk]) -> list[Piece]:
    """The byte ranges of one batch, each owned by its chunk at its offset in the chunk's buffer."""
    out = []
    for i, chunk in enumerate(batch):
        offset = 0
        for start, end in chunk.ranges:
            out.append(Piece(start, end, i, offset))
            offset += end - start
    return out


def batches(chunks: list[Chunk], budget: int) -> list[list[Chunk]]:
    """Chunks grouped per file in file order, packed into batches of at most ``budget`` bytes (each
    chunk counted :func:`aligned`, as it would take a staging slot)."""
    per_file: dict[str, list[Chunk]] = defaultdict(list)
    for chunk in chunks:
        per_file[chunk.entry.file].append(chunk)
    out: list[list[Chunk]] = []
    for file_chunks in per_file.values():
        current: list[Chunk] = []
        used = 0
        for chunk in sorted(file_chunks, key=lambda c: c.span[0]):
            if current and used + aligned(chunk.nbytes) > budget:
                out.append(current)
                current, used = [], 0
            current.append(chunk)
            used += aligned(chunk.nbytes)
        out.append(current)
    return out
