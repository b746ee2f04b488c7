"""What plain HTTP(S) and the Hugging Face Hub share: one ``requests`` client for ranged reads.

:class:`HttpClient` holds a session (connection pool) per thread, sends our ``User-Agent`` (the
package version and the rank) and ``Accept-Encoding: identity`` with every request, and retries:
transient failures (HTTP 408/425/429/5xx, connection resets, timeouts, bodies cut short) are
retried with exponential backoff and jitter, resuming after the bytes already received, within
:class:`~hp_dcp_hf.storage.transport.backend.RetryPolicy`'s attempts and deadline; then, or at once
for permanent failures (404, 403, a server ignoring ``Range``, a file shorter than its header
says), a :class:`StorageReadError` or :class:`CheckpointNotFoundError` names the file and the last
error.

Every read is a ``GET`` with ``Range``; the answer must be 206 with the asked ``Content-Range`` (a
server that answers 200 with the whole file is reported, the connection dropped before the body is
read). Files changed during a load: every ranged answer's ``Content-Range`` total and version
header (``ETag`` for HTTP, ``X-Repo-Commit`` for the Hub) is checked against the
:class:`FileVersion` its header was read at, so a file rewritten since raises "changed since its
header was read" at once, without a request of its own.
"""

from __future__ import annotations

import contextlib
import http.client
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from hp_dcp_hf.errors import CheckpointNotFoundError, HPDCPHFError, StorageReadError
from hp_dcp_hf.storage.transport.backend import (
    CONTENT_RANGE,
    Body,
    FileVersion,
    FirstAnswer,
    RangeFile,
    RetryPolicy,
    TransientError,
    check_answer,
    etag,
    read_ranged,
)
from hp_dcp_hf.version import __version__

T = TypeVar("T")


def _require_requests():
    try:
        import requests
    except ImportError as e:  # pragma: no cover - requests ships with the [remote] extra
        raise CheckpointNotFoundError(
            "http(s) and Hub checkpoints need the 'requests' package: pip install 'hp-dcp-hf[remote]'"
        ) from e
    return requests


def _user_agent() -> str:
    agent = f"hp-dcp-hf/{__version__}"
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            agent += f" rank/{dist.get_rank()}"
    except Exception:  # pragma: no cover - a label only
        pass
    return agent


def http_error_is_transient(error: BaseException) -> bool:
    """Network failures worth a new try; TLS and URL errors are not."""
    requests = _require_requests()
    import urllib3

    exc = requests.exceptions
    if isinstance(error, exc.SSLError | exc.InvalidURL | exc.InvalidSchema | exc.MissingSchema | exc.InvalidHeader):
        return False
    return isinstance(
        error,
        (
            exc.ConnectionError,
            exc.Timeout,
            exc.ChunkedEncodingError,
            urllib3.exceptions.ProtocolError,
            urllib3.exceptions.TimeoutError,
            http.client.HTTPException,
            ConnectionError,
            TimeoutError,
        ),
    )


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: use our own backoff


def _header(response: Any, name: str) -> str | None:
    """Header ``name`` of ``response``, or of the last redirect that carried it."""
    for r in (response, *reversed(getattr(response, "history", None) or ())):
        value = r.headers.get(name)
        if value:
            return value
    return None


def unanswered(is_transient: Callable[[BaseException], bool]) -> Callable[[BaseException | None], bool]:
    """The :class:`FirstAnswer` rule of a client whose transport failures ``is_transient`` accepts:
    an error with no HTTP answer behind it (no status code) that is such a failure."""

    def no_answer(error: BaseException | None) -> bool:
        return (
            error is not None
            and getattr(getattr(error, "response", None), "status_code", None) is None
            and is_transient(error)
        )

    return no_answer


class HttpClient:
    """Ranged GETs and HEADs over ``requests``: one session (connection pool) per thread, retries.

    ``headers`` go with every request (after ours: ``User-Agent``, ``Accept-Encoding: identity``);
    ``session_options`` are ``verify``, ``cert``, ``proxies`` of a ``requests.Session``. Size
    probes (the metadata rank's first requests) follow the :class:`FirstAnswer` rule: until the
    server has answered once, they wait at most the policy's ``first_answer_timeout_s`` and one that
    gets no answer fails at once.
    """

    def __init__(
        self,
        retry: RetryPolicy,
        headers: Mapping[str, str] | None = None,
        session_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.retry = retry
        self.headers = dict(headers or {})
        self.session_options = dict(session_options or {})
        self._local = threading.local()
        self.first_answer = FirstAnswer(
            unanswered(http_error_is_transient),
            "the server",
            "check the URL (host and port) and that the server is up and reachable from here",
        )

    def _session(self):
        session = getattr(self._local, "session", None)
        if session is None:
            requests = _require_requests()
            session = requests.Session()
            for name, value in self.session_options.items():
                setattr(session, name, value)
            self._local.session = session
        return session

    def _headers(self, extra: Mapping[str, str]) -> dict[str, str]:
        return {"User-Agent": _user_agent(), "Accept-Encoding": "identity", **self.headers, **extra}

    @staticmethod
    def _status_error(response: Any, what: str, file: str) -> HPDCPHFError:
        code = response.status_code
        detail = f"HTTP {code} {response.reason or ''}".rstrip()
        hub_code = response.headers.get("X-Error-Code")
        if hub_code:
            detail += f" ({hub_code})"
        if code in (404, 410):
            return CheckpointNotFoundError(f"{what}: not found, {detail}", file=file)
        if code in (401, 403):
            return StorageReadError(
                f"{what}: access denied, {detail}; pass credentials (token= for the Hub, headers= for http)",
                file=file,
            )
        if code in (408, 425, 429) or (500 <= code < 600 and code not in (501, 505)):
            return TransientError(
                f"{what}: {detail}", file=file, retry_after=_retry_after(response.headers.get("Retry-After"))
            )
        return StorageReadError(f"{what}: unexpected {detail}", file=file)

    def _run(self, attempt: Callable[[], T], what: str, file: str) -> T:
        return self.retry.run(attempt, what=what, file=file, is_transient=http_error_is_transient)

    def _get(self, url: str, headers: Mapping[str, str], timeout: tuple[float, float] | None = None):
        return self._session().get(
            url, headers=self._headers(headers), stream=True, timeout=timeout or self.retry.timeout,
            allow_redirects=True,
        )

    def probe(self, url: str, file: str) -> int | None:
        """The size of the file at ``url``, or ``None`` when the server says it does not exist."""
        version = self.probe_version(url, file)
        return None if version is None else version.size

    def probe_version(self, url: str, file: str) -> FileVersion | None:
        """The size and ETag of the file at ``url`` (one HEAD), ``None`` when it does not exist."""

        timeout = self.retry.timeout if self.first_answer.answered else self.retry.first_timeout

        def attempt() -> FileVersion | None:
            with self._session().head(
                url, headers=self._headers({}), timeout=timeout, allow_redirects=True
            ) as response:
                if response.status_code in (404, 410):
                    return None
                length = response.headers.get("Content-Length")
                if response.status_code == 200 and length is not None:
                    return FileVersion(int(length), etag(_header(response, "ETag")))
                if response.status_code not in (200, 405, 501):
                    raise self._status_error(response, "HEAD", file)
            # No HEAD, or no length in its answer: ask for the first byte and read the total.
            with self._get(url, {"Range": "bytes=0-0"}, timeout) as response:
                tag = etag(_header(response, "ETag"))
                if response.status_code in (404, 410):
                    return None
                if response.status_code in (206, 416):
                    m = CONTENT_RANGE.match(response.headers.get("Content-Range", "").replace("*/", "0-0/"))
                    if m and m.group(3) != "*":
                        return FileVersion(int(m.group(3)), tag)
                if response.status_code == 200 and response.headers.get("Content-Length") is not None:
                    return FileVersion(int(response.headers["Content-Length"]), tag)
                if response.status_code >= 400:
                    raise self._status_error(response, "size probe", file)
                raise StorageReadError(f"cannot tell the size: HTTP {response.status_code} without a length", file=file)

        return self.first_answer.run(
            self.retry, attempt, what=f"HEAD {urlsplit(url).netloc}", file=file, is_transient=http_error_is_transient
        )

    def read_into(
        self,
        url: str,
        file: str,
        start: int,
        buffers: Sequence[Any],
        expected: FileVersion | None = None,
        tag_header: str = "ETag",
    ) -> None:
        """Fill ``buffers`` from the bytes at ``start``: ranged GETs, resumed after what arrived.

        With ``expected``, every answer's ``Content-Range`` total and ``tag_header`` (``ETag``, or
        the Hub's ``X-Repo-Commit``) must be those of that version, else the file changed.
        """

        @contextlib.contextmanager
        def get(pos: int, end: int) -> Iterator[Body]:
            with self._get(url, {"Range": f"bytes={pos}-{end - 1}"}) as response:
                self._check_range(response, file, pos, end, expected, tag_header)
                yield response.raw.readinto

        read_ranged(file, start, buffers, get, lambda attempt, what: self._run(attempt, what, file))

    def _check_range(
        self,
        response: Any,
        file: str,
        pos: int,
        end: int,
        expected: FileVersion | None = None,
        tag_header: str = "ETag",
    ) -> None:
        """The answer carries exactly the bytes ``[pos, end)`` of the ``expected`` version, or raise
        (before reading the body)."""
        code = response.status_code
        asked = f"bytes [{pos}, {end})"
        if code in (200, 206):
            encoding = response.headers.get("Content-Encoding", "identity").lower()
            if encoding not in ("identity", ""):
                raise StorageReadError(
                    f"{asked}: the server sent Content-Encoding {encoding!r}; byte ranges need the identity encoding",
                    file=file,
                )
            tag = _header(response, tag_header)
            check_answer(
                file, pos, end, code, response.headers.get("Content-Range"), response.headers.get("Content-Length"),
                expected, etag(tag) if tag_header == "ETag" else tag,
            )
            return
        if code == 416:
            m = CONTENT_RANGE.match(response.headers.get("Content-Range", "").replace("*/", "0-0/"))
            if expected is not None and m and m.group(3) != "*":
                expected.check(file, size=int(m.group(3)))
            raise StorageReadError(
                f"{asked}: range not satisfiable ({response.headers.get('Content-Range', 'no size given')}); "
                "the file is shorter than its header says (it changed since?)",
                file=file,
            )
        raise self._status_error(response, f"GET {asked}", file)


class HttpRangeFile(RangeFile):
    """One file behind a URL, read with ranged GETs (no I/O until the first read), each answer
    checked against the ``expected`` version (its ``tag_header`` carries the version tag)."""

    def __init__(
        self,
        file: str,
        url: str,
        client: HttpClient,
        expected: FileVersion | None = None,
        tag_header: str = "ETag",
    ) -> None:
        super().__init__(file)
        self.url = url
        self._client = client
        self._expected = expected
        self._tag_header = tag_header

    def read_into(self, start: int, buffers: Sequence[Any]) -> None:
        self._client.read_into(self.url, self.file, start, buffers, self._expected, self._tag_header)
