"""The engine side of a weight update: one engine worker receives, from every trainer rank, the
bytes of the checkpoint-tensor boxes it consumes, and nothing else.

The worker keeps one full-shape buffer per checkpoint tensor it consumes (its *kept copy*); an update
fills the needed boxes in place, from all trainer ranks at once (one thread per connection; the
boxes are disjoint). Only a complete update is handed on: a trainer rank that dies or breaks the
protocol mid-update fails it with a :class:`~hp_dcp_hf.errors.SyncError` before the engine loads a
byte, so the engine keeps serving its previous weights. A kept copy also lets a delta update send only
what changed. A failed update closes the worker's connections: the next transfer (a new init) starts
without a kept copy, and its first update is sent whole.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hp_dcp_hf.errors import HPDCPHFError, SyncError, VerificationError
from hp_dcp_hf.geometry.box import Box, disjoint_cover
from hp_dcp_hf.sync.checksums import digest, tensor_bytes
from hp_dcp_hf.sync.source import TensorMeta
from hp_dcp_hf.sync.wire import PROTOCOL, Connection, box_from_json, box_json, dtype_from_name

_VERDICT_GRACE_S = 10.0
"""How long a failing worker waits for the trainer ranks to read its verdict and hang up."""


@dataclass
class ReceiveStats:
    """What one worker received in one update."""

    update: int
    bytes_received: int = 0
    pieces_received: int = 0
    pieces_unchanged: int = 0
    bytes_per_trainer: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0


class WeightReceiver:
    """One engine worker's end of the transfer (see the module docstring).

    Args:
        trainers: every trainer rank's ``(host, port)``, in rank order.
        tensors: the checkpoint tensors (name, wire dtype, full shape), as the trainer describes them.
        needs: the boxes of each tensor this worker consumes (a tensor it does not consume is absent).
        worker, workers: this worker's index and how many workers the engine has.
        verify: check every received box's digest against the trainer's (VerificationError on a
            mismatch, naming the tensor and box).
    """

    def __init__(self, trainers: Sequence[tuple[str, int]], tensors: Sequence[TensorMeta],
                 needs: Mapping[str, Sequence[Box]], *, worker: int = 0, workers: int = 1,
                 timeout_s: float = 60.0, verify: bool = False) -> None:
        self.tensors = {meta.name: meta for meta in tensors}
        unknown = sorted(set(needs) - set(self.tensors))
        if unknown:
            raise SyncError("the engine needs a tensor the trainer does not send", key=unknown[0])
        self.needs = {name: list(boxes) for name, boxes in needs.items() if boxes}
        self.worker = worker
        self.verify = verify
        self.timeout_s = timeout_s
        self.kept: dict[str, torch.Tensor] = {}  # name -> full-shape buffer (needed boxes valid)
        self._has_kept_copy = False  # a previous update of this receiver completed
        self.stats: ReceiveStats | None = None
        self._connections = [Connection.connect(tuple(address), f"trainer rank {rank}", timeout_s)
                             for rank, address in enumerate(trainers)]
        hello = {"kind": "hello", "protocol": PROTOCOL, "worker": worker, "workers": workers,
                 "needs": {name: [box_json(b) for b in boxes] for name, boxes in self.needs.items()}}
        for connection in self._connections:
            connection.send(hello)

    @property
    def needed_bytes(self) -> int:
        return sum(box.numel * self.tensors[name].dtype.itemsize for name, boxes in self.needs.items()
                   for box in boxes)

    def receive(self, update: int) -> dict[str, torch.Tensor]:
        """Run update ``update``; return the worker's tensors (full shape; the needed boxes hold the
        trainer's values, the rest is undefined), once every needed element has arrived exactly once."""
        start = time.perf_counter()
        for name in self.needs:
            if name not in self.kept:
                meta = self.tensors[name]
                self.kept[name] = torch.empty(meta.shape, dtype=meta.dtype)
        has_kept_copy, self._has_kept_copy = self._has_kept_copy, False
        stats = ReceiveStats(update)
        arrived: dict[str, list[Box]] = {name: [] for name in self.needs}
        lock = threading.Lock()
        errors: list[BaseException] = []
        finished: list[Connection] = []  # done sending; they hear a keepalive until the verdict

        def serve(rank: int, connection: Connection) -> None:
            try:
                connection.send({"kind": "ready", "update": update, "has_kept_copy": has_kept_copy,
                                 "verify": self.verify})
                while True:
                    header = connection.receive_header()
                    if header.get("update") != update:
                        raise SyncError(f"{connection.peer} sent update {header.get('update')} during {update}")
                    if header.get("kind") == "done":
                        if header["unchanged"] and not has_kept_copy:
                            raise SyncError(f"{connection.peer} skipped unchanged pieces the worker does not keep")
                        for name, box, code in header["unchanged"]:
                            box = box_from_json(box)
                            self._arrived(name, box, arrived, lock)
                            self._verify(name, box, code)
                        with lock:
                            stats.pieces_unchanged += len(header["unchanged"])
                            stats.bytes_per_trainer[rank] = connection.bytes_received
                            stats.bytes_received += connection.bytes_received
                            finished.append(connection)
                        connection.bytes_received = 0
                        return
                    self._store(connection, header, arrived, stats, lock)
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=serve, args=(rank, c), daemon=True)
                   for rank, c in enumerate(self._connections)]
        for thread in threads:
            thread.start()
        self._keep_alive(update, threads, finished, lock)
        failure: BaseException | None = errors[0] if errors else None
        if failure is None:
            failure = self._check_complete(arrived)
        if failure is not None:
            self._answer(update, failure)
            raise failure if isinstance(failure, HPDCPHFError) else SyncError(
                f"engine worker {self.worker}, update {update}: {type(failure).__name__}: {failure}")
        self._answer(update, None)
        self._has_kept_copy = True
        stats.seconds = time.perf_counter() - start
        self.stats = stats
        return {name: self.kept[name] for name in self.needs}

    def _keep_alive(self, update: int, threads: Sequence[threading.Thread], finished: list[Connection],
                    lock: threading.Lock) -> None:
        """Wait for every connection's part of the update; meanwhile tell the trainer ranks that are
        done sending, every third of the deadline, that the worker is still at it (the slowest rank's
        sends are not theirs to time out on)."""
        for thread in threads:
            while thread.is_alive():
                thread.join(self.timeout_s / 3)
                with lock:
                    waiting = list(finished)
                for connection in waiting if thread.is_alive() else ():
                    with contextlib.suppress(SyncError):  # a gone rank is its own failure
                        connection.send({"kind": "wait", "update": update})

    def _arrived(self, name: str, box: Box, arrived: dict[str, list[Box]], lock: threading.Lock) -> None:
        if not any(need.contains(box) for need in self.needs.get(name, ())):
            raise SyncError(f"a trainer sent a box {box} this worker does not consume", key=name)
        with lock:
            arrived[name].append(box)

    def _verify(self, name: str, box: Box, expected: str | None) -> None:
        """The kept copy's bytes of ``box`` against the trainer's digest of them: catches bytes
        changed on the wire or in the worker's buffers (verified as they arrive, in parallel)."""
        if self.verify and (expected is None or digest(self.kept[name][box.slices()]) != expected):
            raise VerificationError(f"engine worker {self.worker} holds other bytes for box offsets {box.offsets} "
                                    f"sizes {box.sizes} than the trainer sent", key=name)

    def _store(self, connection: Connection, header, arrived, stats: ReceiveStats, lock) -> None:
        """Read a frame's pieces into the kept copy: straight into the tensor where the box is
        contiguous in it (row ranges), else through one piece-sized buffer."""
        total = 0
        for piece in header["pieces"]:
            name, box = piece["name"], box_from_json(piece["box"])
            meta = self.tensors.get(name)
            if meta is None:
                raise SyncError("a trainer sent a tensor this worker does not consume", key=name)
            self._arrived(name, box, arrived, lock)
            dtype = dtype_from_name(piece["dtype"])
            if dtype != meta.dtype:
                raise SyncError(f"a trainer sent {dtype}, the tensor is {meta.dtype}", key=name)
            total += box.numel * dtype.itemsize
            if total > int(header.get("nbytes", 0)):
                raise SyncError(f"a frame's pieces describe more than the {header.get('nbytes')} bytes it carries")
            target = self.kept[name][box.slices()]
            if target.is_contiguous():
                connection.read_into(tensor_bytes(target))
            else:
                target.copy_(torch.frombuffer(connection.read(target.nbytes), dtype=dtype).reshape(box.sizes))
            self._verify(name, box, piece.get("digest"))
            with lock:
                stats.pieces_received += 1
        if total != int(header.get("nbytes", 0)):
            raise SyncError(f"a frame's pieces describe {total} bytes, it carries {header.get('nbytes')}")

    def _check_complete(self, arrived: Mapping[str, Sequence[Box]]) -> SyncError | None:
        """Every needed box tiled exactly by what arrived (or stayed unchanged): nothing twice,
        nothing left out."""
        for name, needs in self.needs.items():
            for need in needs:
                inside = [box.relative_to(need.offsets) for box in arrived[name] if need.contains(box)]
                if not disjoint_cover(inside, need.sizes):
                    got = sum(box.numel for box in inside)
                    return SyncError(f"engine worker {self.worker}: the pieces of box offsets {need.offsets} sizes "
                                     f"{need.sizes} do not tile it ({got} of its {need.numel} elements arrived; "
                                     "a trainer rank holds none of the rest, or some came twice)", key=name)
        return None

    def _answer(self, update: int, failure: BaseException | None) -> None:
        """Tell every trainer rank how the update ended (its send() returns or raises with it)."""
        verdict = {"kind": "ack", "update": update, "ok": failure is None}
        if failure is not None:
            verdict.update(reason=getattr(failure, "reason", str(failure)), key=getattr(failure, "key", None),
                           error_type=type(failure).__name__)
        for connection in self._connections:
            with contextlib.suppress(SyncError):  # a trainer rank that is gone hears nothing
                connection.send(verdict)
        if failure is not None:  # ranks still sending stop at the verdict (a frame later): let them read it
            deadline = time.monotonic() + min(self.timeout_s, _VERDICT_GRACE_S)
            for connection in self._connections:
                connection.close_after_peer(deadline)

    def close(self) -> None:
        for connection in self._connections:
            connection.close()
