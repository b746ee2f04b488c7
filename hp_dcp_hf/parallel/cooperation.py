"""Cooperative loads: replicas read each shared byte once, then send each other their slices.

Ranks holding the same local values of a tensor (:mod:`hp_dcp_hf.parallel.replicas`: HSDP and
data-parallel copies, ``Replicate`` norms and embeddings) would each read the same checkpoint
bytes. Instead, each of the ``g`` replicas plans the reads of one ``1/g`` flat block of the local
tensor's elements only (its *slice*: a few boxes; conversions, rewrites and dequantization apply to
a slice as to any shard), and sends its slice of every shared tensor to the other replicas as soon
as its reads made it final, while the reads go on: each rank receives exactly the slices it did not
read, in the model's dtype, and nothing else. Every rank derives the slices from the layouts alone;
the bytes travel in rounds of ``all_to_all`` on the default group (counts with a failure flag, then
data), each round at most the staging budget per rank (sent and received together, beside the
reads' own), so a failure anywhere (a read or the exchange) stops every rank at the same round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hp_dcp_hf.box import Box, flat_range_boxes
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

    def elements(self, rank: int) -> tuple[int, int]:
        """The flat range of ``local``'s elements replica ``rank`` reads and sends: an equal share
        (a rank holding two experts shares them with eight replicas as well as one holding many)."""
        index, count, numel = self.group.index(rank), len(self.group), self.local.numel()
        return index * numel // count, (index + 1) * numel // count

    def slice_bytes(self, rank: int) -> torch.Tensor:
        """Replica ``rank``'s slice as a flat uint8 view of ``local``."""
        lo, hi = self.elements(rank)
        return self.local.reshape(-1)[lo:hi].view(torch.uint8)

    def restrict(self, pieces: Sequence[ShardPiece], rank: int) -> tuple[ShardPiece, ...]:
        """The parts of ``pieces`` (this rank's, which its replicas hold alike) in ``rank``'s slice."""
        regions = flat_range_boxes(tuple(self.local.shape), *self.elements(rank))
        kept = []
        for piece in pieces:
            local = piece.local_box()
            for region in regions:
                part = local.intersect(region)
                if part is not None:
                    shift = tuple(p - o for p, o in zip(part.offsets, piece.local_offsets))
                    offsets = tuple(g + d for g, d in zip(piece.global_box.offsets, shift))
                    kept.append(ShardPiece(Box(offsets, part.sizes), part.offsets))
        return tuple(kept)


class ReadProgress:
    """How far this rank's own reads are: which shared targets hold their final values, and how
    the reads ended. Written by the reading threads, read by the exchange's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}
        self._done = False
        self._error: HPDCPHFError | None = None

    def expect(self, key: str, completions: int) -> None:
        """Target ``key`` is final after ``completions`` more :meth:`complete` calls."""
        with self._lock:
            self._pending[key] = completions

    def complete(self, key: str) -> None:
        with self._lock:
            if key in self._pending:
                self._pending[key] -= 1

    def ready(self, key: str) -> bool:
        with self._lock:
            return self._pending.get(key, 0) <= 0

    def finish(self, error: BaseException | None) -> None:
        """The reads ended, with ``error`` when they failed."""
        with self._lock:
            self._done, self._error = True, None if error is None else _typed(error)

    @property
    def ended(self) -> tuple[bool, HPDCPHFError | None]:
        with self._lock:
            return self._done, self._error


class _Stream:
    """Consecutive byte regions (flat uint8 tensors of named targets) walked by a cursor; a
    sender's cursor stops at the first region whose target is not ``ready`` yet."""

    def __init__(self, regions: Sequence[tuple[str, torch.Tensor]], ready: Callable[[str], bool] | None = None) -> None:
        self.regions = [(key, r) for key, r in regions if r.numel()]
        self.ready = ready
        self.total = sum(r.numel() for _, r in self.regions)
        self.done = 0
        self._index = self._offset = 0

    @property
    def finished(self) -> bool:
        return self.done == self.total

    def _walk(self, nbytes: int):
        while nbytes and self._index < len(self.regions):
            key, region = self.regions[self._index]
            if self.ready is not None and not self.ready(key):
                return
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


_IDLE_S = (0.001, 0.02)
"""Wait before the next round when one moved nothing (doubling from the first to the second)."""


def share_slices(shared: Sequence[SharedTarget], budget: int, progress: ReadProgress) -> ExchangeStats:
    """Send this rank's slice of every shared target to its other replicas as soon as its values
    are final, and receive theirs, while ``progress`` 's reads run; returns when every rank sent
    everything or one failed (then raises this rank's error, or nothing when another rank failed:
    the caller agrees on the outcome afterwards).

    Every rank calls it (with an empty ``shared`` too), in a thread of its own beside the reads:
    the rounds are collectives, so nothing else may use the process group meanwhile.
    """
    from hp_dcp_hf.storage.broadcast import collective_device

    rank, world = dist.get_rank(), dist.get_world_size()
    ordered = sorted(shared, key=lambda t: t.key)
    device = collective_device()
    sends = [_Stream([(t.key, t.slice_bytes(rank)) for t in ordered if peer in t.group and peer != rank],
                     progress.ready) for peer in range(world)]
    receives = [_Stream([(t.key, t.slice_bytes(peer)) for t in ordered if peer in t.group and peer != rank])
                for peer in range(world)]
    # A round holds what this rank sends and what it receives: half the budget each (replica
    # groups are symmetric, so a rank receives from as many peers as it sends to).
    peers = sum(1 for s in sends if s.total) or 1
    chunk = max(1, budget // (2 * peers))
    stats = ExchangeStats()
    error: HPDCPHFError | None = None
    idle = _IDLE_S[0]
    # One send and one receive buffer for every round (fresh ones per round leave freed blocks
    # behind, and a rank's memory grows several budgets).
    send_buffer = receive_buffer = torch.empty(0, dtype=torch.uint8, device=device)
    while True:
        stats.rounds += 1
        sizes = [0] * world
        done, read_error = progress.ended
        error = error or read_error
        if error is None:
            try:
                parts = [s.take(chunk) for s in sends]
                sizes = [sum(p.numel() for p in ps) for ps in parts]
                if done and not any(sizes) and not all(s.finished for s in sends):
                    raise StorageReadError("the reads ended without finishing every shared tensor")
                send_buffer = _at_least(send_buffer, sum(sizes))
                position = 0
                for part in (p for ps in parts for p in ps):
                    send_buffer[position : position + part.numel()].copy_(part)
                    position += part.numel()
            except Exception as e:  # noqa: BLE001 - every rank learns of it with the counts
                error, sizes = _typed(e), [0] * world
        more = error is None and not all(s.finished for s in sends)
        counts = torch.tensor([[n, error is not None, more] for n in sizes], dtype=torch.int64, device=device)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts)
        if bool(got[:, 1].any()):  # the failing rank raises its error; the caller agrees on it
            break
        received = got[:, 0].tolist()
        receive_buffer = _at_least(receive_buffer, sum(received))
        dist.all_to_all_single(receive_buffer[: sum(received)], send_buffer[: sum(sizes)],
                               output_split_sizes=received, input_split_sizes=sizes)
        stats.bytes_sent += sum(sizes)
        position = 0
        for peer, nbytes in enumerate(received):
            try:
                receives[peer].put(receive_buffer[position : position + nbytes])
            except Exception as e:  # noqa: BLE001 - reported with the next counts, or agreed after
                error = error or _typed(e, f"from rank {peer}: ")
            position += nbytes
            stats.bytes_received += nbytes
        if not bool(got[:, 2].any()):  # nobody has more to send
            short = [peer for peer, s in enumerate(receives) if not s.finished]
            if short and error is None:
                error = StorageReadError(f"ranks {short} sent less than their slices: the replicas planned "
                                         "differently")
            break
        if sum(sizes) or sum(received):
            idle = _IDLE_S[0]
        else:  # waiting for reads (here or on a replica): do not spin against them
            time.sleep(idle)
            idle = min(2 * idle, _IDLE_S[1])
    if error is not None:
        raise error
    return stats


def _at_least(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    return buffer if buffer.numel() >= nbytes else buffer.new_empty(nbytes)


def _typed(error: BaseException, prefix: str = "") -> HPDCPHFError:
    if isinstance(error, HPDCPHFError):
        return error
    return StorageReadError(f"{prefix}exchanging slices with the replicas failed: {type(error).__name__}: {error}")
