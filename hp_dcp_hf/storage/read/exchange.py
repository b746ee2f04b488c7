"""The exchange of a cooperative load: owners send every rank the raw bytes it needs from their spans.

Each (sender, receiver) pair has one stream: a list of regions, on the sender in its span buffers
(or, forwarding bytes to a twin, in its own chunk buffers), on the receiver in its chunk buffers,
both in the order :meth:`ClusterPlan.route` gives. The bytes
travel in rounds of ``all_to_all`` on the default group (counts with a failure flag, then data);
a rank sends each peer at most ``chunk`` bytes a round, so with ``chunk`` = budget / (2 x the
largest number of peers any rank has) no rank sends or receives more than the budget a round.
A sender's stream stops at the first region not ready yet (its span not read, or, forwarded, its
bytes not arrived), and goes on while the reads and the other streams run; a failure anywhere (a read, the exchange) stops every rank at the same round.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hp_dcp_hf.errors import HPDCPHFError, StorageReadError
from hp_dcp_hf.util.collectives import collective_device


@dataclass(frozen=True)
class Region:
    """Bytes of buffer ``key`` (a span on the sender, a need on the receiver): ``[offset, offset +
    nbytes)``, or with ``rows > 1`` that many runs of ``nbytes / rows`` bytes, ``stride`` apart
    (a block of rows of a row-sharded box, in a span's bytes). ``span``: the span the bytes are
    in, where ``key`` is a need; ``relay``: on a sender, ``key`` is its own need (bytes it
    received and forwards), not a span."""

    key: int
    offset: int
    nbytes: int
    rows: int = 1
    stride: int = 0
    span: int = -1
    relay: bool = False

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The region's bytes in ``buffer`` (flat uint8), as ``(rows, nbytes / rows)``."""
        run = self.nbytes // self.rows
        if self.rows == 1:
            return buffer[self.offset : self.offset + self.nbytes].view(1, run)
        return buffer[self.offset :].as_strided((self.rows, run), (self.stride, 1))


class ReadProgress:
    """Which spans this rank's reads have in memory, and how the reads ended. Written by the
    reading threads, read by the exchange's, which may wait for the next of these events
    (:meth:`wait`) rather than poll."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._ready: set[int] = set()
        self._done = False
        self._error: HPDCPHFError | None = None
        self._events = 0

    def read(self, span: int) -> None:
        with self._lock:
            self._ready.add(span)
            self._note()

    def ready(self, span: int) -> bool:
        with self._lock:
            return span in self._ready

    def finish(self, error: BaseException | None) -> None:
        """The reads ended, with ``error`` when they failed."""
        with self._lock:
            self._done, self._error = True, None if error is None else typed(error, "reading a span failed: ")
            self._note()

    @property
    def events(self) -> int:
        """How many spans were read, and the reads' end, so far: a mark for :meth:`wait`."""
        with self._lock:
            return self._events

    def wait(self, since: int, timeout: float) -> None:
        """Until something happened after mark ``since`` (a span read, the reads' end), at most ``timeout`` s."""
        with self._lock:
            self._changed.wait_for(lambda: self._events != since, timeout)

    def _note(self) -> None:
        self._events += 1
        self._changed.notify_all()

    @property
    def ended(self) -> tuple[bool, HPDCPHFError | None]:
        with self._lock:
            return self._done, self._error


class Stream:
    """Consecutive regions walked a whole region at a time (both ends cut a stream at the same
    region borders, so none is ever split). ``buffer(region)`` gives a region's buffer (flat uint8);
    ``ready(region)`` whether a sender may take it yet; ``moved(region)`` is told of every region
    copied (the receiver finishes needs with it, the sender frees spans)."""

    def __init__(
        self,
        regions: Sequence[Region],
        buffer: Callable[[Region], torch.Tensor],
        moved: Callable[[Region], None],
        ready: Callable[[Region], bool] | None = None,
    ) -> None:
        self.regions = [r for r in regions if r.nbytes]
        self.buffer, self.moved, self.ready = buffer, moved, ready
        self.total = sum(r.nbytes for r in self.regions)
        self.done = 0
        self._index = 0

    @property
    def finished(self) -> bool:
        return self.done == self.total

    @property
    def waits_on_a_span(self) -> bool:
        """Whether the next region is of a span (not bytes to forward)."""
        return self._index < len(self.regions) and not self.regions[self._index].relay

    def take_into(self, out: torch.Tensor, nbytes: int) -> int:
        """Copy the next ready regions, as many as fit in ``nbytes``, into ``out``; how many bytes."""
        position = 0
        while self._index < len(self.regions):
            region = self.regions[self._index]
            if position + region.nbytes > nbytes or (self.ready is not None and not self.ready(region)):
                break
            out[position : position + region.nbytes].view(region.rows, -1).copy_(region.view(self.buffer(region)))
            position += region.nbytes
            self._index += 1
            self.moved(region)
        self.done += position
        return position

    def put(self, data: torch.Tensor) -> None:
        """Copy ``data`` (whole regions, in order) into the next regions."""
        position = 0
        while position < data.numel():
            if self._index == len(self.regions):
                raise StorageReadError(f"{data.numel() - position} bytes more than expected: the ranks planned "
                                       "differently")
            region = self.regions[self._index]
            if position + region.nbytes > data.numel():
                raise StorageReadError("a region arrived cut: the ranks planned differently")
            region.view(self.buffer(region)).copy_(data[position : position + region.nbytes].view(region.rows, -1))
            position += region.nbytes
            self._index += 1
            self.moved(region)
        self.done += position


@dataclass
class ExchangeStats:
    """What one rank sent to and received from the others."""

    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    aborted: bool = False  # another rank failed: the exchange stopped before its end


_IDLE_S = (0.001, 0.05)
"""Wait before the next round when one moved nothing (doubling from the first to the second),
cut short when this rank reads a span meanwhile: an idle round costs two collectives, which on
gloo take CPU the reads need (at 20 ms, 0.10-0.16 s a rank on a 2.5 s read of 1 GB by 4 ranks on
2 cores), and a span read here starts the next round at once."""


def exchange(sends: Sequence[Stream], receives: Sequence[Stream], chunk: int, progress: ReadProgress) -> ExchangeStats:
    """Send every ``sends[peer]`` stream and fill every ``receives[peer]`` one (one per rank; this
    rank's own are empty), ``chunk`` bytes per peer per round, while ``progress``'s reads run;
    returns when every rank sent everything, or one failed (then raises this rank's error, or
    returns ``aborted`` when another rank failed: the caller agrees on the outcome afterwards).

    Every rank calls it, in a thread of its own beside the reads: the rounds are collectives, so
    nothing else may use the process group meanwhile."""
    world = dist.get_world_size()
    device = collective_device()
    stats = ExchangeStats()
    error: HPDCPHFError | None = None
    idle = _IDLE_S[0]
    # One send and one receive buffer for every round (fresh ones per round leave freed blocks
    # behind, and a rank's memory grows several budgets).
    staged = torch.empty(chunk * sum(1 for s in sends if s.total), dtype=torch.uint8)  # on the host
    send_buffer = staged if device.type == "cpu" else torch.empty(0, dtype=torch.uint8, device=device)
    receive_buffer = torch.empty(0, dtype=torch.uint8, device=device)
    while True:
        stats.rounds += 1
        sizes = [0] * world
        mark = progress.events
        done, read_error = progress.ended
        error = error or read_error
        if error is None:
            try:
                position = 0
                for peer, stream in enumerate(sends):
                    sizes[peer] = stream.take_into(staged[position:], chunk) if stream.total else 0
                    position += sizes[peer]
                if done and not any(sizes) and any(s.waits_on_a_span for s in sends):
                    raise StorageReadError("the reads ended without reading every span this rank sends")
                if send_buffer is not staged:  # NCCL moves device tensors only
                    send_buffer = _at_least(send_buffer, position)
                    send_buffer[:position].copy_(staged[:position])
            except Exception as e:  # noqa: BLE001 - every rank learns of it with the counts
                error, sizes = typed(e), [0] * world
        more = error is None and not all(s.finished for s in sends)
        flags = [error is not None, more, not any(sizes), done]  # failed, more to send, idle, reads over
        counts = torch.tensor([[n, *flags] for n in sizes], dtype=torch.int64, device=device)
        got = torch.empty_like(counts)
        _collective(dist.all_to_all_single, got, counts)
        if bool(got[:, 1].any()):  # the failing rank raises its error; the caller agrees on it
            stats.aborted = True
            break
        received = got[:, 0].tolist()
        receive_buffer = _at_least(receive_buffer, sum(received))
        _collective(dist.all_to_all_single, receive_buffer[: sum(received)], send_buffer[: sum(sizes)],
                    output_split_sizes=received, input_split_sizes=sizes)
        stats.bytes_sent += sum(sizes)
        incoming = receive_buffer[: sum(received)].cpu() if device.type != "cpu" else receive_buffer
        position = 0
        for peer, nbytes in enumerate(received):
            try:
                receives[peer].put(incoming[position : position + nbytes])
            except Exception as e:  # noqa: BLE001 - reported with the next counts, or agreed after
                error = error or typed(e, f"the bytes from rank {peer} did not fit: ")
            position += nbytes
            stats.bytes_received += nbytes
        more, quiet, over = got[:, 2].bool(), got[:, 3].bool(), got[:, 4].bool()
        if bool(more.any()) and bool(quiet.all()) and bool((over | ~more).all()):
            # nobody sent a byte, and every rank with more to send has read its spans: it waits for
            # bytes to forward that no rank will send (every rank sees it at this round)
            error = error or StorageReadError("the streams stalled, every rank waiting for bytes to forward: "
                                              "the ranks planned differently")
            break
        if not bool(got[:, 2].any()):  # nobody has more to send
            short = [peer for peer, s in enumerate(receives) if not s.finished]
            if short and error is None:
                error = StorageReadError(f"ranks {short} sent less than this rank needs from their spans: "
                                         "the ranks planned differently")
            break
        if sum(sizes) or sum(received):
            idle = _IDLE_S[0]
        else:  # waiting for reads (here or on a peer): do not spin against them
            progress.wait(mark, idle)
            idle = min(2 * idle, _IDLE_S[1])
    if error is not None:
        raise error
    return stats


def _collective(op: Callable[..., object], *args: object, **kwargs: object) -> None:
    """``op(*args, **kwargs)``, its failure (a rank gone: gloo's peer closed the connection) typed."""
    try:
        op(*args, **kwargs)
    except Exception as e:
        raise typed(e, "a collective failed (did a rank leave the load?): ") from e


def _at_least(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    return buffer if buffer.numel() >= nbytes else buffer.new_empty(nbytes)


def typed(error: BaseException, context: str = "the exchange of span bytes failed: ") -> HPDCPHFError:
    """``error`` as an :mod:`hp_dcp_hf.errors` one (another becomes a StorageReadError saying ``context``)."""
    if isinstance(error, HPDCPHFError):
        return error
    return StorageReadError(f"{context}{type(error).__name__}: {error}")
