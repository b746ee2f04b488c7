"""The trainer side of a weight update: each rank sends the bytes it holds to the engine workers
that consume them, once each, in bounded buckets.

Every trainer rank listens on a TCP port; the ranks' addresses are gathered to every rank and given
to the engine (rank 0 does, through the engine's control plane). Each engine worker connects to
every trainer rank and says which boxes of which checkpoint tensors it consumes (its *needs*). A
rank's route to a worker is then local arithmetic: its held slices cut against the worker's needs.
The ranks' slices partition every tensor (the save's inversion gives each element to one rank), so
every needed element travels once, from the one rank that holds it, to each worker that needs it.

An update, per worker connection: the worker says it is ready (and whether it still has the last
update's bytes, for deltas), the rank sends its pieces in frames of at most ``bucket_bytes`` and a
closing frame, and waits for the worker's verdict. Workers are served concurrently.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hp_dcp_hf.errors import HPDCPHFError, SyncError, VerificationError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.sync.checksums import digest
from hp_dcp_hf.sync.source import HFWeightSource
from hp_dcp_hf.sync.wire import PROTOCOL, Connection, box_from_json, box_json, dtype_name
from hp_dcp_hf.util.collectives import all_gather_bytes, should_broadcast

DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class Route:
    """Part ``box`` of this rank's slice ``index`` (of tensor ``name``) goes to one worker."""

    index: int
    name: str
    box: Box


@dataclass
class UpdateStats:
    """What one rank did in one update (figures for logs and for tests that count)."""

    update: int
    bytes_sent: int = 0
    pieces_sent: int = 0
    pieces_unchanged: int = 0
    bytes_per_worker: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0


def routes(source: HFWeightSource, needs: Mapping[str, Sequence[Box]], bucket_bytes: int) -> list[Route]:
    """This rank's slices cut against one worker's needs: what it sends that worker, in pieces of
    at most ``bucket_bytes`` (row ranges; a single row larger than that travels whole)."""
    out = []
    for index, held in enumerate(source.slices()):
        itemsize = source.meta(held.name).dtype.itemsize
        for box in needs.get(held.name, ()):
            part = held.box.intersect(box)
            if part is not None and not part.is_empty():
                out.extend(Route(index, held.name, piece) for piece in _row_ranges(part, itemsize, bucket_bytes))
    return out


def _row_ranges(box: Box, itemsize: int, bucket_bytes: int) -> list[Box]:
    row_bytes = math.prod(box.sizes[1:]) * itemsize
    rows = max(1, bucket_bytes // max(row_bytes, 1))
    if not box.ndim or box.sizes[0] <= rows:
        return [box]
    return [Box((box.offsets[0] + start,) + box.offsets[1:], (min(rows, box.sizes[0] - start),) + box.sizes[1:])
            for start in range(0, box.sizes[0], rows)]


class WeightSender:
    """One trainer rank's end of the transfer (see the module docstring); every rank builds one.

    Args:
        source: this rank's slices of the checkpoint tensors.
        host: the address engine workers reach this rank at (it listens there, on a free port).
        timeout_s: the longest any peer may stay silent before the update fails with SyncError.
        bucket_bytes: the most bytes of tensor data in one frame (pieces are cut to fit); the rank's
            extra memory is about one bucket per worker served at once.
        delta: send only the pieces whose bytes changed since the last update the worker kept.
    """

    def __init__(self, source: HFWeightSource, *, host: str = "127.0.0.1", timeout_s: float = 60.0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, delta: bool = False) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.delta = delta
        self.rank = dist.get_rank() if should_broadcast() else 0
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(timeout_s)
        own = f"{host}:{self._listener.getsockname()[1]}".encode()
        gathered = all_gather_bytes(own) if should_broadcast() else [own]
        self.addresses = [(a.decode().rsplit(":", 1)[0], int(a.decode().rsplit(":", 1)[1])) for a in gathered]
        self._workers: dict[int, tuple[Connection, list[Route]]] = {}
        self._last_digests: dict[int, list[str | None]] = {}  # worker -> per route, the digest it holds
        self.stats: UpdateStats | None = None

    def accept(self) -> None:
        """Wait for every engine worker to connect and say what it needs (they connect once the
        engine has the addresses; the first one says how many there are)."""
        expected = None
        while expected is None or len(self._workers) < expected:
            try:
                sock, peer = self._listener.accept()
            except OSError as error:
                raise SyncError(f"trainer rank {self.rank}: {len(self._workers)} engine workers connected, "
                                f"then none within {self.timeout_s:g} s") from error
            connection = Connection(sock, f"engine worker at {peer[0]}:{peer[1]}", self.timeout_s)
            hello, _ = connection.receive()
            if hello.get("kind") != "hello" or hello.get("protocol") != PROTOCOL:
                connection.close()
                raise SyncError(f"{connection.peer} does not speak weight-sync protocol {PROTOCOL}: {hello}")
            worker, expected = int(hello["worker"]), int(hello["workers"])
            connection.peer = f"engine worker {worker}"
            needs = {name: [box_from_json(b) for b in boxes] for name, boxes in hello["needs"].items()}
            self._check_needs(needs, connection.peer)
            self._workers[worker] = connection, routes(self.source, needs, self.bucket_bytes)
            self._last_digests[worker] = [None] * len(self._workers[worker][1])

    def _check_needs(self, needs: Mapping[str, Sequence[Box]], peer: str) -> None:
        known = {meta.name: meta for meta in self.source.metadata()}
        for name, boxes in needs.items():
            if name not in known:
                raise SyncError(f"{peer} asks for a tensor the trainer does not have", key=name)
            whole = Box.full(known[name].shape)
            if any(not whole.contains(box) for box in boxes):
                raise SyncError(f"{peer} asks for a box outside the tensor's shape {known[name].shape}", key=name)

    def send(self, update: int) -> UpdateStats:
        """Run update ``update`` with every worker (the engine receives it at the same time)."""
        if not self._workers:
            raise SyncError(f"trainer rank {self.rank}: no engine worker is connected (accept() first)")
        start = time.perf_counter()
        try:
            self.source.snapshot()
        except BaseException:
            self.close()  # the workers hear at once that this rank is out, not at their deadline
            raise
        stats = UpdateStats(update)
        errors: list[BaseException] = []
        lock = threading.Lock()
        threads = [threading.Thread(target=self._serve, args=(worker, update, stats, lock, errors), daemon=True)
                   for worker in sorted(self._workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats.seconds = time.perf_counter() - start
        self.stats = stats
        if errors:
            self.close()  # the other workers' connections fail at once instead of at their deadline
            raise errors[0]
        return stats

    def _serve(self, worker: int, update: int, stats: UpdateStats, lock: threading.Lock,
               errors: list[BaseException]) -> None:
        try:
            connection, worker_routes = self._workers[worker]
            ready, _ = connection.receive()
            if ready.get("kind") != "ready" or ready.get("update") != update:
                raise SyncError(f"{connection.peer} expected update {ready.get('update')}, the trainer sends {update}")
            compare = self.delta and ready.get("has_kept_copy")
            last = self._last_digests[worker]
            digests: list[str | None] = []
            unchanged: list[list[Any]] = []
            header: list[dict[str, Any]] = []
            payload: list[torch.Tensor] = []
            buffered = 0
            for position, route in enumerate(worker_routes):
                values = self.source.read(route.index, route.box).contiguous().cpu()  # to the host once
                code = digest(values) if self.delta or ready.get("verify") else None
                digests.append(code)
                if compare and code is not None and last[position] == code:
                    unchanged.append([route.name, box_json(route.box), code])
                    continue
                if buffered and buffered + values.nbytes > self.bucket_bytes:
                    self._send(connection, update, {"kind": "pieces", "update": update, "pieces": header}, payload)
                    header, payload, buffered = [], [], 0
                header.append({"name": route.name, "box": box_json(route.box), "dtype": dtype_name(values.dtype),
                               "digest": code})
                payload.append(values)
                buffered += values.nbytes
            if header:
                self._send(connection, update, {"kind": "pieces", "update": update, "pieces": header}, payload)
            self._send(connection, update, {"kind": "done", "update": update, "unchanged": unchanged})
            self._verdict(connection, update)
            self._last_digests[worker] = digests
            with lock:
                stats.bytes_per_worker[worker] = connection.bytes_sent
                stats.bytes_sent += connection.bytes_sent
                stats.pieces_sent += len(worker_routes) - len(unchanged)
                stats.pieces_unchanged += len(unchanged)
            connection.bytes_sent = 0
        except BaseException as error:
            errors.append(error if isinstance(error, HPDCPHFError) else SyncError(
                f"trainer rank {self.rank}, update {update}: {type(error).__name__}: {error}"))

    def _send(self, connection: Connection, update: int, header: dict[str, Any],
              payload: Sequence[torch.Tensor] = ()) -> None:
        """One frame to a worker, unless the worker has already given its verdict: a worker that
        fails an update (a piece that does not verify, another rank gone) says so at once and stops
        reading, so its reason is what this rank raises, not the broken send that follows."""
        if connection.has_input():
            self._verdict(connection, update)
            raise SyncError(f"{connection.peer} ended update {update} before this rank finished sending")
        try:
            connection.send(header, payload)
        except SyncError:
            if connection.has_input():
                self._verdict(connection, update)
            raise

    @staticmethod
    def _verdict(connection: Connection, update: int) -> None:
        """Read the worker's verdict on ``update`` (past its keepalives); raise the failure it names."""
        verdict, _ = connection.receive()
        while verdict.get("kind") == "wait":  # the worker still receives from other ranks, or verifies
            verdict, _ = connection.receive()
        if verdict.get("kind") != "ack" or verdict.get("update") != update:
            raise SyncError(f"{connection.peer} answered {verdict.get('kind')!r} to update {update}")
        if not verdict.get("ok"):
            cls = VerificationError if verdict.get("error_type") == "VerificationError" else SyncError
            raise cls(str(verdict.get("reason")), key=verdict.get("key"))

    def close(self) -> None:
        for connection, _ in self._workers.values():
            connection.close()
        self._workers.clear()
        self._listener.close()
