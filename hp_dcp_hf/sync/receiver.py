"""The engine side of a weight update: one engine worker receives, from every trainer rank, the
bytes of the checkpoint-tensor boxes it consumes, and nothing else.

The worker keeps one full-shape buffer per checkpoint tensor it consumes (its *kept copy*); an update
fills the needed boxes in place, from all trainer ranks at once (one thread per connection; the
boxes are disjoint). Only a complete update is handed on: a trainer rank that dies or breaks the
protocol mid-update fails it with a :class:`~hp_dcp_hf.errors.SyncError` before the engine loads a
byte, so the engine keeps serving its previous weights. A kept copy also lets a delta update send only
what changed; it is marked lost when an update fails, and the next update is sent whole.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hp_dcp_hf.errors import HPDCPHFError, SyncError, VerificationError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.sync.checksums import digest, tensor_bytes
from hp_dcp_hf.sync.source import TensorMeta
from hp_dcp_hf.sync.wire import PROTOCOL, Connection, box_from_json, box_json, dtype_from_name


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
        self.kept: dict[str, torch.Tensor] = {}  # name -> full-shape buffer (needed boxes valid)
        self._kept_valid = False
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
        trainer's values, the rest is undefined), once every needed element has arrived."""
        start = time.perf_counter()
        for name in self.needs:
            if name not in self.kept:
                meta = self.tensors[name]
                self.kept[name] = torch.empty(meta.shape, dtype=meta.dtype)
        kept, self._kept_valid = self._kept_valid, False
        stats = ReceiveStats(update)
        arrived: dict[str, int] = dict.fromkeys(self.needs, 0)
        digests: list[tuple[str, Box, str]] = []
        lock = threading.Lock()
        errors: list[BaseException] = []

        def serve(rank: int, connection: Connection) -> None:
            try:
                connection.send({"kind": "ready", "update": update, "kept": kept, "verify": self.verify})
                while True:
                    header = connection.receive_header()
                    if header.get("update") != update:
                        raise SyncError(f"{connection.peer} sent update {header.get('update')} during {update}")
                    if header.get("kind") == "done":
                        unchanged = [(name, box_from_json(box)) for name, box in header["unchanged"]]
                        if unchanged and not kept:
                            raise SyncError(f"{connection.peer} skipped unchanged pieces the worker does not keep")
                        with lock:
                            for name, box in unchanged:
                                arrived[name] = arrived.get(name, 0) + box.numel
                            stats.pieces_unchanged += len(unchanged)
                            stats.bytes_per_trainer[rank] = connection.bytes_received
                            stats.bytes_received += connection.bytes_received
                        connection.bytes_received = 0
                        return
                    self._store(connection, header, arrived, digests, stats, lock)
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=serve, args=(rank, c), daemon=True)
                   for rank, c in enumerate(self._connections)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        failure: BaseException | None = errors[0] if errors else None
        if failure is None:
            failure = self._check_complete(arrived) or self._check_digests(digests)
        if failure is not None:
            self._answer(update, failure)
            raise failure if isinstance(failure, HPDCPHFError) else SyncError(
                f"engine worker {self.worker}, update {update}: {type(failure).__name__}: {failure}")
        self._answer(update, None)
        self._kept_valid = True
        stats.seconds = time.perf_counter() - start
        self.stats = stats
        return {name: self.kept[name] for name in self.needs}

    def _store(self, connection: Connection, header, arrived, digests, stats: ReceiveStats, lock) -> None:
        """Read a frame's pieces into the kept copy: straight into the tensor where the box is
        contiguous in it (row ranges), else through one piece-sized buffer."""
        total = 0
        for piece in header["pieces"]:
            name, box = piece["name"], box_from_json(piece["box"])
            meta = self.tensors.get(name)
            if meta is None or not any(need.contains(box) for need in self.needs.get(name, ())):
                raise SyncError(f"a trainer sent a box {box} this worker does not consume", key=name)
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
            with lock:
                arrived[name] += box.numel
                stats.pieces_received += 1
                if self.verify:
                    digests.append((name, box, piece.get("digest")))
        if total != int(header.get("nbytes", 0)):
            raise SyncError(f"a frame's pieces describe {total} bytes, it carries {header.get('nbytes')}")

    def _check_complete(self, arrived: Mapping[str, int]) -> SyncError | None:
        for name, boxes in self.needs.items():
            needed = sum(box.numel for box in boxes)
            if arrived.get(name, 0) != needed:
                return SyncError(f"engine worker {self.worker} received {arrived.get(name, 0)} of the {needed} "
                                 "elements it needs (a trainer rank holds none of the rest, or sent some twice)",
                                 key=name)
        return None

    def _check_digests(self, digests: Sequence[tuple[str, Box, str | None]]) -> VerificationError | None:
        """The kept copy's bytes of every received box against the trainer's digest of them: catches
        bytes changed on the wire or in the worker's buffers, and boxes stored in the wrong place."""
        for name, box, expected in digests:
            if expected is None or digest(self.kept[name][box.slices()]) != expected:
                return VerificationError(f"engine worker {self.worker} holds other bytes for box offsets "
                                         f"{box.offsets} sizes {box.sizes} than the trainer sent", key=name)
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
        if failure is not None:
            self.close()

    def close(self) -> None:
        for connection in self._connections:
            connection.close()
