"""Staging for a direct read: the chunks of a batch whose destinations cannot take the file's bytes
as read (a cast, a strided view, a CUDA tensor) land in a slot of the load's staging ring
(:mod:`hp_dcp_hf.storage.read.ring`), copied out into their destinations once the batch is read.
Set up once per load from its destinations: pinned slots and asynchronous copies to the device
when any is a CUDA tensor, plain host slots otherwise (allocated only if a chunk needs one)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hp_dcp_hf.storage.read.chunks import Chunk, aligned
from hp_dcp_hf.storage.read.ring import Copy, Slot, SlotCopier, StagingRing, StagingStats


class Staging:
    """A load's staging ring of ``slots`` slots of ``slot_bytes`` each, and its copier."""

    def __init__(self, dests: Sequence[torch.Tensor], slots: int, slot_bytes: int) -> None:
        self.devices = {dest.device for dest in dests if dest.device.type == "cuda"}
        self._copier = SlotCopier(StagingRing(slots, slot_bytes, pin=bool(self.devices)), self.devices)

    def stage(self, batch: list[Chunk], mapped: bool) -> StagedBatch:
        """Where each chunk of ``batch`` is read into: its destination where that takes the bytes
        (any host tensor when copied out of a mapping, which casts and writes strided views; else
        a contiguous host tensor of the stored dtype), otherwise its part of one slot (waiting
        for a free one)."""
        offsets: dict[int, int] = {}
        size = 0
        for i, chunk in enumerate(batch):
            if not (chunk.host if mapped else chunk.direct):
                offsets[i] = size
                size += aligned(chunk.nbytes)
        slot = self._copier.ring.acquire(size) if size else None
        staged = {i: batch[i].staged_view(slot.data, offset) for i, offset in offsets.items()} if slot is not None else {}
        return StagedBatch(self._copier, batch, slot, staged)

    def close(self) -> BaseException | None:
        """Wait for every copy out of the slots (and the commits after them); the first error of one."""
        return self._copier.close()

    @property
    def stats(self) -> StagingStats:
        return self._copier.stats


@dataclass(frozen=True)
class StagedBatch:
    """One batch's read targets: ``staged[i]`` is chunk ``i``'s part of ``slot`` (when it has one)."""

    copier: SlotCopier
    batch: list[Chunk]
    slot: Slot | None
    staged: dict[int, torch.Tensor]

    @property
    def targets(self) -> list[torch.Tensor]:
        """Per chunk, what its bytes are read into."""
        return [self.staged.get(i, chunk.dest) for i, chunk in enumerate(self.batch)]

    def deliver(self, done: Callable[[], None]) -> None:
        """The batch is read: copy the staged values into their destinations, free the slot, then
        call ``done`` (once the copies to a device are done, when there are any)."""
        copies: list[Copy] = [(self.batch[i].dest, values) for i, values in self.staged.items()]
        self.copier.copy(self.slot, copies, done)

    def release(self) -> None:
        """The read failed: free the slot, nothing copied."""
        if self.slot is not None:
            self.copier.ring.release(self.slot)
