"""A stdlib HTTP server that honours ``Range``, logs every request and injects faults on demand.

Python's ``http.server`` ignores ``Range``; this one answers ``bytes=a-b``, ``bytes=a-`` and
``bytes=-n`` with 206 and ``Content-Range``, an unsatisfiable range with 416, and anything else
with 200 and the whole body. It binds to 127.0.0.1 only, on a free port, serves from a thread per
connection (HTTP/1.1 keep-alive), and stops with :meth:`RangeServer.stop` (or its context manager).

Every request lands in :attr:`RangeServer.log` as a :class:`LoggedRequest` (method, path, range,
status, body bytes sent, User-Agent). Faults (:meth:`RangeServer.add_fault`) apply to the requests
their ``match`` accepts, the first ``count`` of them (``None``: every one):

* ``"status"``: answer with an error status (503 by default) and a short body;
* ``"truncate"``: announce the full ``Content-Length``, send half the body, close the connection;
* ``"reset"``: close the connection without any answer;
* ``"stall"``: wait ``delay_s`` seconds before answering normally (a server that hangs).

:attr:`RangeServer.in_flight` (an :class:`InFlight`) counts the requests being answered at once and
keeps the most it saw (``max``): how tests observe a client's concurrency; a ``stall`` fault on
every request is a per-request latency.

``on_request(method, path, range_header)``, when set, runs before each request is answered (tests
use it to change the served content at a chosen moment).

``ignore_range = True`` makes the server behave like ``http.server``: 200 and the whole file (a
callable ``ignore_range(path) -> bool`` does so for the paths it accepts).

Subclasses route requests by overriding :meth:`RangeServer.route`, which returns a
:class:`Resource` (bytes + extra headers) or an :class:`Error`; :class:`StaticRangeServer` serves
the files under a directory.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import torch
from torch.distributed.checkpoint.planner import ReadItem

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


@dataclass(frozen=True)
class LoggedRequest:
    """One request the server answered (or dropped, for faults)."""

    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int
    user_agent: str
    fault: str | None = None

    @property
    def span(self) -> tuple[int, int] | None:
        """The ``[start, end)`` a ``bytes=a-b`` range asks for (``None`` for other forms)."""
        m = _RANGE.match(self.range or "")
        if not m or not m.group(1) or not m.group(2):
            return None
        return int(m.group(1)), int(m.group(2)) + 1


@dataclass(frozen=True)
class Resource:
    """What a route serves: the body and headers to add to every answer for it."""

    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    content_type: str = "application/octet-stream"


@dataclass(frozen=True)
class Error:
    """An error answer: status, headers (e.g. ``X-Error-Code``), a text body."""

    status: int
    message: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)


class InFlight:
    """Requests being answered right now, and the most at once since :meth:`reset` (a context
    manager around each answer)."""

    def __init__(self) -> None:
        self.now = 0
        self.max = 0
        self._lock = threading.Lock()

    def __enter__(self) -> InFlight:
        with self._lock:
            self.now += 1
            self.max = max(self.max, self.now)
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.now -= 1

    def reset(self) -> None:
        with self._lock:
            self.max = self.now


Match = Callable[[str, str, "str | None"], bool]
"""``match(method, path, range_header)``: whether a fault applies to a request."""


@dataclass
class Fault:
    kind: str
    count: int | None
    status: int = 503
    delay_s: float = 0.0
    match: Match = field(default=lambda method, path, range_: True)
    hits: int = 0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the log is RangeServer.log
        pass

    def do_GET(self) -> None:
        self.server.owner._handle(self, "GET")

    def do_HEAD(self) -> None:
        self.server.owner._handle(self, "HEAD")

    def do_POST(self) -> None:
        self.server.owner._handle(self, "POST")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: RangeServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that time out or give up close their end; a broken pipe here is expected.
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


class RangeServer:
    """The base server: Range handling, request log, faults. Override :meth:`route`."""

    def __init__(self) -> None:
        self.log: list[LoggedRequest] = []
        self.ignore_range: bool | Callable[[str], bool] = False
        self.on_request: Callable[[str, str, str | None], None] | None = None
        self.in_flight = InFlight()
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    # -- control -----------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> RangeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_fault(
        self,
        kind: str,
        count: int | None = None,
        *,
        status: int = 503,
        delay_s: float = 0.0,
        match: Match | None = None,
    ) -> Fault:
        """Inject ``kind`` (``status``/``truncate``/``reset``/``stall``) into the first ``count`` matching requests."""
        if kind not in ("status", "truncate", "reset", "stall"):
            raise ValueError(f"unknown fault kind {kind!r}")
        fault = Fault(kind, count, status, delay_s, match or (lambda method, path, range_: True))
        with self._lock:
            self._faults.append(fault)
        return fault

    def reset(self) -> None:
        """Forget the log and every fault; serve ranges again."""
        with self._lock:
            self.log.clear()
            self._faults.clear()
        self.ignore_range = False
        self.on_request = None
        self.in_flight.reset()

    def requests(self, method: str | None = None, faults: bool = False) -> list[LoggedRequest]:
        """A snapshot of the log (without faulted requests unless ``faults``)."""
        with self._lock:
            return [r for r in self.log if (method is None or r.method == method) and (faults or r.fault is None)]

    # -- routing -----------------------------------------------------------------------------------

    def route(self, method: str, path: str, query: str, body: bytes) -> Resource | Error:
        raise NotImplementedError

    # -- the request cycle -----------------------------------------------------------------------

    def _take_fault(self, method: str, path: str, range_: str | None) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if (fault.count is None or fault.hits < fault.count) and fault.match(method, path, range_):
                    fault.hits += 1
                    return fault
        return None

    def _record(self, handler: _Handler, method: str, path: str, range_: str | None, status: int, nbytes: int,
                fault: str | None = None) -> None:
        entry = LoggedRequest(method, path, range_, status, nbytes, handler.headers.get("User-Agent", ""), fault)
        with self._lock:
            self.log.append(entry)

    def _handle(self, handler: _Handler, method: str) -> None:
        with self.in_flight:
            self._answer(handler, method)

    def _answer(self, handler: _Handler, method: str) -> None:
        split = urlsplit(handler.path)
        path = unquote(split.path)
        range_ = handler.headers.get("Range")
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        if self.on_request is not None:
            self.on_request(method, path, range_)
        fault = self._take_fault(method, path, range_)
        if fault is not None and fault.kind == "stall":
            time.sleep(fault.delay_s)
            fault = None
        if fault is not None and fault.kind == "reset":
            self._record(handler, method, path, range_, 0, 0, "reset")
            handler.close_connection = True
            return
        if fault is not None and fault.kind == "status":
            self._record(handler, method, path, range_, fault.status, 0, "status")
            self._send(handler, method, fault.status, b"injected fault\n", {"Retry-After": "0"}, "text/plain")
            return
        answer = self.route(method, path, split.query, body)
        if isinstance(answer, Error):
            data = answer.message.encode()
            self._record(handler, method, path, range_, answer.status, len(data))
            self._send(handler, method, answer.status, data, dict(answer.headers), "text/plain")
            return
        ignore = self.ignore_range(path) if callable(self.ignore_range) else self.ignore_range
        status, data, headers = self._ranged(answer, None if ignore else range_)
        if fault is not None and fault.kind == "truncate" and method == "GET" and len(data) > 1:
            sent = data[: len(data) // 2]
            self._record(handler, method, path, range_, status, len(sent), "truncate")
            handler.send_response(status)
            for name, value in headers.items():
                handler.send_header(name, value)
            handler.send_header("Content-Type", answer.content_type)
            handler.send_header("Content-Length", str(len(data)))
            handler.send_header("Connection", "close")
            handler.end_headers()
            handler.wfile.write(sent)
            handler.wfile.flush()
            handler.close_connection = True
            return
        self._record(handler, method, path, range_, status, len(data) if method != "HEAD" else 0)
        self._send(handler, method, status, data, headers, answer.content_type)

    @staticmethod
    def _ranged(answer: Resource, range_: str | None) -> tuple[int, bytes, dict[str, str]]:
        size = len(answer.body)
        headers = {"Accept-Ranges": "bytes", **answer.headers}
        m = _RANGE.match(range_.strip()) if range_ else None
        if m is None or (not m.group(1) and not m.group(2)):
            return 200, answer.body, headers  # no Range, or a form we do not serve (multi-range)
        first, last = m.group(1), m.group(2)
        if first:
            start = int(first)
            end = min(size, int(last) + 1) if last else size
            if last and int(last) < start:
                return 200, answer.body, headers  # syntactically invalid: ignored, as RFC 9110 says
        else:
            start, end = max(0, size - int(last)), size
            if int(last) == 0:
                start = end = size
        if start >= size or start >= end:
            return 416, b"", {**headers, "Content-Range": f"bytes */{size}"}
        return 206, answer.body[start:end], {**headers, "Content-Range": f"bytes {start}-{end - 1}/{size}"}

    @staticmethod
    def _send(handler: _Handler, method: str, status: int, data: bytes, headers: Mapping[str, str],
              content_type: str) -> None:
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if method != "HEAD":
            handler.wfile.write(data)


class StaticRangeServer(RangeServer):
    """Serves the files under ``root`` at ``/<relative path>`` (GET and HEAD; no directory listings)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        super().__init__()

    def route(self, method: str, path: str, query: str, body: bytes) -> Resource | Error:
        if method not in ("GET", "HEAD"):
            return Error(405, "method not allowed")
        target = (self.root / path.lstrip("/")).resolve()
        if self.root not in target.parents or not target.is_file():
            return Error(404, "not found")
        return Resource(target.read_bytes())


class _Into:
    """The planner side of ``read_data``: one destination per item."""

    def __init__(self, dests: dict[str, torch.Tensor]) -> None:
        self.dests = dests

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.dests[item.dest_index.fqn]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass
