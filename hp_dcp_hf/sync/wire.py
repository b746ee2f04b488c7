"""The weight-sync wire format: frames of a JSON header and raw tensor bytes over TCP.

A frame is an 8-byte little-endian header length, the header (UTF-8 JSON, an object), and then
``header["nbytes"]`` bytes of payload (0 when absent). JSON and raw little-endian tensor bytes
only: nothing received is unpickled. Every socket operation has a deadline; a peer that closes,
resets or stays silent past it is a :class:`~hp_dcp_hf.errors.SyncError` naming the peer.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from hp_dcp_hf.errors import SyncError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.sync.checksums import dtype_name, tensor_bytes
from hp_dcp_hf.sync.source import TensorMeta

__all__ = ["PROTOCOL", "Connection", "box_from_json", "box_json", "dtype_from_name", "dtype_name", "tensors_from_json",
           "tensors_json"]

PROTOCOL = 1
_LENGTH = struct.Struct("<Q")
_MAX_HEADER = 64 << 20  # a header is metadata: a longer one is a broken peer, not a big model


class Connection:
    """One TCP connection to a peer (``peer`` names it in errors), with a deadline per operation."""

    def __init__(self, sock: socket.socket, peer: str, timeout_s: float) -> None:
        self.sock = sock
        self.peer = peer
        self._sending = threading.Lock()  # frames are whole: a keepalive never lands inside another
        sock.settimeout(timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.bytes_sent = 0
        self.bytes_received = 0

    @classmethod
    def connect(cls, address: tuple[str, int], peer: str, timeout_s: float) -> Connection:
        try:
            sock = socket.create_connection(address, timeout=timeout_s)
        except OSError as error:
            raise SyncError(f"cannot connect to {peer} at {address[0]}:{address[1]}: {error}") from error
        return cls(sock, peer, timeout_s)

    def send(self, header: dict[str, Any], payload: Sequence[torch.Tensor] = ()) -> None:
        """One frame: ``header`` (its ``nbytes`` set here) and the bytes of ``payload``'s tensors,
        in order, without joining them first."""
        views = [tensor_bytes(t) for t in payload if t.numel()]
        header = {**header, "nbytes": sum(v.nbytes for v in views)}
        raw = json.dumps(header, separators=(",", ":")).encode()
        try:
            with self._sending:
                self.sock.sendall(_LENGTH.pack(len(raw)) + raw)
                for view in views:
                    self.sock.sendall(view)
                self.bytes_sent += header["nbytes"]
        except OSError as error:  # timeouts included (socket.timeout is an OSError)
            raise SyncError(f"sending to {self.peer} failed: {_why(error)}") from error

    def receive(self) -> tuple[dict[str, Any], bytearray]:
        """The next frame's header and payload."""
        header = self.receive_header()
        return header, self.read(int(header.get("nbytes", 0)))

    def receive_header(self) -> dict[str, Any]:
        """The next frame's header; its ``nbytes`` of payload are for :meth:`read` / :meth:`read_into`."""
        (length,) = _LENGTH.unpack(self.read(_LENGTH.size, count=False))
        if length > _MAX_HEADER:
            raise SyncError(f"{self.peer} sent a header of {length} bytes: not this protocol")
        try:
            header = json.loads(self.read(length, count=False))
        except ValueError as error:
            raise SyncError(f"{self.peer} sent a header that is not JSON: {error}") from error
        if not isinstance(header, dict):
            raise SyncError(f"{self.peer} sent a header that is not a JSON object")
        return header

    def read(self, n: int, *, count: bool = True) -> bytearray:
        """Exactly ``n`` bytes, in a new buffer."""
        buffer = bytearray(n)
        self.read_into(memoryview(buffer), count=count)
        return buffer

    def read_into(self, view: memoryview, *, count: bool = True) -> None:
        """Exactly ``len(view)`` bytes, straight into ``view`` (a tensor's own bytes: no copy)."""
        n, got = view.nbytes, 0
        view = view.cast("B")
        try:
            while got < n:
                k = self.sock.recv_into(view[got:])
                if k == 0:
                    raise SyncError(f"{self.peer} closed the connection ({got} of {n} bytes of a frame received)")
                got += k
        except OSError as error:
            raise SyncError(f"receiving from {self.peer} failed: {_why(error)}") from error
        if count:
            self.bytes_received += n

    def has_input(self) -> bool:
        """Whether the peer has sent something not yet read (a sender's check for an early verdict)."""
        try:
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):  # closed: the next operation says so
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def close_after_peer(self, deadline: float) -> None:
        """Close once the peer has read what was sent: stop sending, discard what still arrives until
        the peer closes (or ``deadline``, a ``time.monotonic()`` value), then close. A plain close with
        unread input resets the connection, and a reset may overtake the last frame sent."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
            sink = bytearray(1 << 16)
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                if not self.sock.recv_into(sink):
                    break
        self.close()


def _why(error: OSError) -> str:
    if isinstance(error, TimeoutError):  # socket.timeout is an alias
        return "no answer within the deadline (the peer is gone or stuck)"
    return f"{type(error).__name__}: {error}"


def box_json(box: Box) -> list[list[int]]:
    return [list(box.offsets), list(box.sizes)]


def box_from_json(value: Any) -> Box:
    offsets, sizes = value
    return Box(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SyncError(f"unknown dtype {name!r} on the wire")
    return dtype


def tensors_json(tensors: Sequence[TensorMeta]) -> list[list[Any]]:
    """The checkpoint tensors as the trainer describes them to the engine: ``[name, dtype, shape]``."""
    return [[meta.name, dtype_name(meta.dtype), list(meta.shape)] for meta in tensors]


def tensors_from_json(rows: Sequence[Sequence[Any]]) -> list[TensorMeta]:
    return [TensorMeta(str(name), dtype_from_name(dtype), tuple(int(n) for n in shape)) for name, dtype, shape in rows]
