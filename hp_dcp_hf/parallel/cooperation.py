"""Cooperative loads: replicas read each shared byte once, then send each other their slices.

Ranks holding the same local values of a tensor (:mod:`hp_dcp_hf.parallel.replicas`: HSDP and
data-parallel copies, ``Replicate`` norms and embeddings) would each read the same checkpoint
bytes. Instead, each of the ``g`` replicas plans the reads of one ``1/g`` block of the local
tensor's rows only (its *slice*; conversions, rewrites and dequantization apply to a slice as to
any shard), and after every rank's reads succeeded each sends its slice of every shared tensor to
the other replicas: each rank receives exactly the slices it did not read, in the model's dtype,
and nothing else. Every rank derives the slices from the layouts alone; the bytes travel in rounds
of ``all_to_all`` on the default group (counts with a failure flag, then data), each round at most
the staging budget per rank, so a failure anywhere stops every rank at the same round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hp_dcp_hf.box import Box
from hp_dcp_hf.errors import HPDCPHFError, StorageReadError
from hp_dcp_hf.layout import ShardPiece

COOPERATE = "hp_dcp_hf.cooperate"
"""``Metadata.planner_data`` key: True when the reader shares replicated reads (and will exchange)."""


@dataclass(frozen=True)
class SharedTarget:
    """A state dict entry whose local values ``local`` the ranks of ``group`` (rank order) all hold."""

    key: str
    local: torch.Tensor
    group: tuple[int, ...]

    def rows(self, rank: int) -> tuple[int, int]:
        """The local rows (dim 0; a 0-d tensor has one) replica ``rank`` reads and sends."""
        index, count = self.group.index(rank), len(self.group)
        rows = self.local.shape[0] if self.local.ndim else 1
        return index * rows // count, (index + 1) * rows // count

    def slice_bytes(self, rank: int) -> torch.Tensor:
        """Replica ``rank``'s slice as a flat uint8 view of ``local``."""
        lo, hi = self.rows(rank)
        return self.local.reshape(-1, *self.local.shape[1:])[lo:hi].reshape(-1).view(torch.uint8)


def restrict_rows(pieces: Sequence[ShardPiece], lo: int, hi: int) -> tuple[ShardPiece, ...]:
    """The parts of ``pieces`` in local rows ``[lo, hi)`` (dim 0; all of a 0-d tensor's when the
    range holds its one row)."""
    kept = []
    for piece in pieces:
        box = piece.global_box
        if box.ndim == 0:
            if lo < hi:
                kept.append(piece)
            continue
        start, end = max(piece.local_offsets[0], lo), min(piece.local_offsets[0] + box.sizes[0], hi)
        if start >= end:
            continue
        shift = start - piece.local_offsets[0]
        kept.append(ShardPiece(Box((box.offsets[0] + shift, *box.offsets[1:]), (end - start, *box.sizes[1:])),
                               (start, *piece.local_offsets[1:])))
    return tuple(kept)


class _Stream:
    """Consecutive byte regions (flat uint8 tensors) walked by a cursor."""

    def __init__(self, regions: Sequence[torch.Tensor]) -> None:
        self.regions = [r for r in regions if r.numel()]
        self.total = sum(r.numel() for r in self.regions)
        self.done = 0
        self._index = self._offset = 0

    def _walk(self, nbytes: int):
        while nbytes and self._index < len(self.regions):
            region = self.regions[self._index]
            take = min(nbytes, region.numel() - self._offset)
            yield region[self._offset : self._offset + take]
            self._offset += take
            self.done += take
            nbytes -= take
            if self._offset == region.numel():
                self._index, self._offset = self._index + 1, 0

    def take(self, nbytes: int) -> list[torch.Tensor]:
        return list(self._walk(nbytes))

    def put(self, data: torch.Tensor) -> None:
        if data.numel() > self.total - self.done:
            raise StorageReadError(f"{data.numel()} bytes, more than the {self.total - self.done} of the slices "
                                   "still expected: the replicas planned differently")
        position = 0
        for region in self._walk(data.numel()):
            region.copy_(data[position : position + region.numel()])
            position += region.numel()


@dataclass
class ExchangeStats:
    """What one rank sent to and received from its replicas."""

    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0


def share_slices(shared: Sequence[SharedTarget], budget: int) -> ExchangeStats:
    """Send this rank's slice of every shared target to its other replicas, and receive theirs.

    Every rank calls it (with an empty ``shared`` too) once every rank's reads succeeded. Raises on
    every rank, with the same :mod:`hp_dcp_hf.errors` error, when any rank fails.
    """
    from hp_dcp_hf.storage.broadcast import agree_on_failure, collective_device

    rank, world = dist.get_rank(), dist.get_world_size()
    ordered = sorted(shared, key=lambda t: t.key)
    device = collective_device()
    sends = [_Stream([t.slice_bytes(rank) for t in ordered if peer in t.group]) if peer != rank else _Stream([])
             for peer in range(world)]
    receives = [_Stream([t.slice_bytes(peer) for t in ordered if peer in t.group]) if peer != rank else _Stream([])
                for peer in range(world)]
    peers = sum(1 for s in sends if s.total) or 1
    chunk = max(1, budget // peers)
    rounds = torch.tensor([max((math.ceil(s.total / chunk) for s in sends), default=0)], device=device)
    dist.all_reduce(rounds, op=dist.ReduceOp.MAX)
    stats = ExchangeStats(rounds=int(rounds.item()))
    error: HPDCPHFError | None = None
    for _ in range(stats.rounds):
        data = torch.empty(0, dtype=torch.uint8, device=device)
        sizes = [0] * world
        if error is None:
            try:
                parts = [[p.to(device) for p in s.take(chunk)] for s in sends]
                sizes = [sum(p.numel() for p in ps) for ps in parts]
                if any(sizes):
                    data = torch.cat([p for ps in parts for p in ps])
            except Exception as e:  # noqa: BLE001 - every rank learns of it with the counts
                error, sizes = _typed(e), [0] * world
        counts = torch.tensor([[n, error is not None] for n in sizes], dtype=torch.int64, device=device)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts)
        if bool(got[:, 1].any()):  # the failing rank's own error reaches every rank below
            break
        received = data.new_empty(int(got[:, 0].sum()))
        dist.all_to_all_single(received, data, output_split_sizes=got[:, 0].tolist(), input_split_sizes=sizes)
        stats.bytes_sent += sum(sizes)
        position = 0
        for peer, nbytes in enumerate(got[:, 0].tolist()):
            try:
                receives[peer].put(received[position : position + nbytes])
            except Exception as e:  # noqa: BLE001 - reported with the next counts, or agreed below
                error = error or _typed(e, f"from rank {peer}: ")
            position += nbytes
            stats.bytes_received += nbytes
    else:
        short = [peer for peer, s in enumerate(receives) if s.done != s.total]
        if short and error is None:
            error = StorageReadError(f"ranks {short} sent less than their slices: the replicas planned differently")
    error = agree_on_failure(error)
    if error is not None:
        raise error
    return stats


def _typed(error: BaseException, prefix: str = "") -> HPDCPHFError:
    if isinstance(error, HPDCPHFError):
        return error
    return StorageReadError(f"{prefix}exchanging slices with the replicas failed: {type(error).__name__}: {error}")
