"""Remote checkpoints: S3 (and any fsspec store), plain HTTP(S) and the Hugging Face Hub.

Each kind of store is a :class:`~hp_dcp_hf.storage.transport.backend.Backend`; what differs between them
stays in its own module:

* **S3** (``s3://``): :mod:`hp_dcp_hf.storage.transport.s3`, metadata through s3fs, data through a botocore
  client of our own; storage options as s3fs takes them (``key``, ``secret``,
  ``client_kwargs={"endpoint_url": ...}``, ``config_kwargs``, ``anon``, ...).
* **other fsspec stores** (``gs://``, ``memory://``, ...):
  :class:`~hp_dcp_hf.storage.transport.fsspec_backend.FsspecBackend` with exact ranged ``cat_file`` calls
  (never ``open()``: no read-ahead), retried under :class:`RetryPolicy`.
* **HTTP(S)** (:class:`HttpBackend`): a directory URL must serve ``model.safetensors.index.json``
  (a web server cannot be listed), or the URL names one ``.safetensors`` file. Every read is a
  ``GET`` with ``Range``; the answer must be 206 with the asked ``Content-Range`` (a server that
  answers 200 with the whole file is reported, the connection dropped before the body is read).
  Options: ``headers``, ``verify``, ``cert``, ``proxies`` (as ``requests`` takes them).
* **Hugging Face Hub** (:class:`HubBackend`): ``hf://[datasets/|spaces/]org/repo[@rev][/subdir]``
  or a bare ``org/repo[@rev]``. Metadata goes through ``HfFileSystem`` (options: ``endpoint``,
  ``token``, ``revision``, others to ``HfFileSystem``); the revision is resolved to its commit
  when the checkpoint is located, so the root every rank reads from (broadcast by rank 0 with the
  headers) names the commit, never a branch that could move. Data reads are ranged ``GET``\\ s of
  ``{endpoint}/{repo}/resolve/{commit}/{file}`` through the same client as HTTP, so ranks other
  than the one reading the headers send no metadata request at all.

Files changed during a load: the size and ETag of an HTTP file come with its HEAD, of an S3 object
with its size request, and a Hub file's version is its commit; every ranged answer (its
``Content-Range`` total and ``ETag`` or ``X-Repo-Commit``) is checked against them, so a file
rewritten after its header was read raises "changed since its header was read" at once, without
a request of its own.

Transient failures (HTTP 408/425/429/5xx, connection resets, timeouts, bodies cut short) are
retried with exponential backoff and jitter, resuming after the bytes already received, within
:class:`RetryPolicy`'s attempts and deadline; then, or at once for permanent failures (404, 403,
a server ignoring ``Range``, a file shorter than its header says), a :class:`StorageReadError` or
:class:`CheckpointNotFoundError` names the file and the last error.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

from fsspec import AbstractFileSystem

from hp_dcp_hf.errors import CheckpointNotFoundError, HPDCPHFError, StorageReadError
from hp_dcp_hf.storage.transport.backend import (
    CONTENT_RANGE,
    Backend,
    Body,
    FileVersion,
    FirstAnswer,
    RangeFile,
    RetryPolicy,
    TransientError,
    UnreachableError,
    check_answer,
    etag,
    read_ranged,
)
from hp_dcp_hf.storage.transport.options import check_storage_options
from hp_dcp_hf.version import __version__

__all__ = [
    "HttpBackend",
    "HttpClient",
    "HttpRangeFile",
    "HubBackend",
    "RetryPolicy",
    "TransientError",
    "UnreachableError",
    "resolve",
]

T = TypeVar("T")

INDEX_FILE = "model.safetensors.index.json"  # catalog.INDEX_FILE; catalog imports this package's base
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".json")

# -- HTTP client ----------------------------------------------------------------------------------


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


def _http_error_is_transient(error: BaseException) -> bool:
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
            _no_answer, "the server", "check the URL (host and port) and that the server is up and reachable from here"
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
        return self.retry.run(attempt, what=what, file=file, is_transient=_http_error_is_transient)

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
            self.retry, attempt, what=f"HEAD {urlsplit(url).netloc}", file=file, is_transient=_http_error_is_transient
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


# -- plain HTTP(S) --------------------------------------------------------------------------------

HTTP_OPTIONS = ("headers", "verify", "cert", "proxies")
"""The storage options of http(s) checkpoints: request headers, and the ``requests.Session`` settings."""


class HttpBackend(Backend):
    """Checkpoints behind ``http(s)://`` URLs: the index names the files, reads are ranged GETs."""

    def __init__(self, retry: RetryPolicy | None = None, **options: Any) -> None:
        check_storage_options(None, options, "http")  # resolve() checked them naming the URL; here for direct use
        session_options = {k: options[k] for k in ("verify", "cert", "proxies") if k in options}
        self.client = HttpClient(retry or RetryPolicy(), options.get("headers"), session_options)
        # url -> size and ETag (None: absent), since the last locate()
        self._probed: dict[str, FileVersion | None] = {}

    def _probe(self, url: str) -> FileVersion | None:
        """One HEAD per file per load: ``exists``, ``size`` and ``stat`` of a file ask the server once."""
        if url not in self._probed:
            self._probed[url] = self.client.probe_version(url, url)
        return self._probed[url]

    def __repr__(self) -> str:
        return "HttpBackend()"

    def join(self, root: str, file: str) -> str:
        return f"{root.rstrip('/')}/{quote(file, safe='/')}"

    def locate(self, path: str) -> tuple[str, str | None]:
        self._probed.clear()  # a new load: sizes are asked again
        parts = urlsplit(path)
        if parts.query or parts.fragment:
            raise CheckpointNotFoundError(
                "http(s) checkpoint URLs cannot carry a query or fragment (file URLs are built from the "
                "directory URL and the index's file names)",
                file=path,
            )
        url = path.rstrip("/")
        name = parts.path.rstrip("/").rsplit("/", 1)[-1]
        if name.endswith(_FILE_SUFFIXES):
            return url.rsplit("/", 1)[0], name
        return url, None  # a directory: the catalog reads its index (there is no listing)

    def isfile(self, path: str) -> bool:
        return self._probe(path) is not None

    def isdir(self, path: str) -> bool:
        return not path.rstrip("/").endswith(_FILE_SUFFIXES)

    def size(self, path: str) -> int:
        return self.stat(path).size

    def stat(self, path: str) -> FileVersion:
        version = self._probe(path)
        if version is None:
            raise FileNotFoundError(path)
        return version

    def list_files(self, root: str) -> list[str]:
        if self.isfile(self.join(root, INDEX_FILE)):
            return [INDEX_FILE]
        raise CheckpointNotFoundError(
            f"no {INDEX_FILE} here: an http(s) directory cannot be listed, so it must serve its index "
            "(or pass the URL of a single .safetensors file)",
            file=self.join(root, INDEX_FILE),
        )

    def open(self, path: str, file: str, expected: FileVersion | None = None) -> RangeFile:
        return HttpRangeFile(file, path, self.client, expected)


# -- Hugging Face Hub -----------------------------------------------------------------------------

_HUB_PINNED = re.compile(
    r"^(?:(?P<type>datasets|spaces)/)?(?P<repo>[^/@]+/[^/@]+)@(?P<sha>[0-9a-f]{40})(?:/(?P<path>.*))?$"
)
_BARE_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9_][\w.-]*(?:@[^\s]+)?$")
_REPO_TYPES = {"datasets": "dataset", "spaces": "space"}


def _no_answer(error: BaseException | None) -> bool:
    """``error`` is a transport failure of the Hub's client, with no HTTP answer behind it."""
    return (
        error is not None
        and getattr(getattr(error, "response", None), "status_code", None) is None
        and _hub_error_is_transient(error)
    )


def _hub_error_is_transient(error: BaseException) -> bool:
    response = getattr(error, "response", None)
    code = getattr(response, "status_code", None)
    if code is not None:
        return code in (408, 425, 429) or (500 <= code < 600 and code not in (501, 505))
    transport = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError, AttributeError):
            transport.append(__import__(module).TransportError)
    return isinstance(error, tuple(transport)) or _http_error_is_transient(error)


class HubBackend(Backend):
    """Checkpoints in Hugging Face Hub repos, pinned to a commit when located.

    Options: ``endpoint`` (default ``HF_ENDPOINT`` or huggingface.co), ``token`` (default: the
    saved login; ``False`` sends none), ``revision`` (instead of ``@rev`` in the path), and any
    other ``HfFileSystem`` argument.
    """

    def __init__(
        self,
        retry: RetryPolicy | None = None,
        fs: AbstractFileSystem | None = None,
        *,
        revision: str | None = None,
        hint: str = "",
        **options: Any,
    ) -> None:
        from huggingface_hub import HfFileSystem

        if fs is None:
            check_storage_options(None, options, "hub")
        self.fs = fs if fs is not None else HfFileSystem(**options)
        self.revision = revision
        self.hint = hint
        self.retry = retry or RetryPolicy()
        self.first_answer = FirstAnswer(
            _no_answer, self.fs.endpoint, "check the endpoint (storage option endpoint= or HF_ENDPOINT)"
        )
        self._client: HttpClient | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HubBackend({self.fs.endpoint})"

    def url(self, path: str) -> str:
        """``hf://`` and the path, as ``hf://org/repo@rev/file`` is passed (a bare ``org/repo`` too)."""
        return f"hf://{path}"

    # metadata (the rank that reads headers) -------------------------------------------------

    def _check_online(self, path: str) -> None:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            raise CheckpointNotFoundError(
                f"HF_HUB_OFFLINE is set, so Hub checkpoints cannot be read; unset it, or pass a local copy{self.hint}",
                file=self.url(path),
            )

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        self._check_online(path)
        try:
            return self.first_answer.run(
                self.retry, fn, what=what, file=self.url(path), is_transient=_hub_error_is_transient
            )
        except UnreachableError as e:
            raise UnreachableError(f"the Hub could not be reached at {self.fs.endpoint}: {e.reason}", file=e.file) from e
        except StorageReadError as e:
            if not _no_answer(e.__cause__):
                raise
            reason = f"the Hub could not be reached at {self.fs.endpoint}: {e.reason}"
            raise UnreachableError(reason, file=e.file) from e
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(
                f"not found on the Hub ({self.fs.endpoint}): {e}{self.hint}", file=self.url(path)
            ) from e
        except HPDCPHFError:
            raise
        except Exception as e:
            code = getattr(getattr(e, "response", None), "status_code", None)
            if code in (404, 410) or isinstance(e, ValueError) or type(e).__name__ in (
                "RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError"
            ):
                raise CheckpointNotFoundError(
                    f"not found on the Hub ({self.fs.endpoint}): {e}{self.hint}", file=self.url(path)
                ) from e
            raise StorageReadError(f"{what} failed: {type(e).__name__}: {e}", file=self.url(path)) from e

    def locate(self, path: str) -> tuple[str, str | None]:
        from huggingface_hub import HfApi

        resolved = self._call("resolve", path, lambda: self.fs.resolve_path(path, revision=self.revision))
        if not hasattr(resolved, "repo_id"):
            raise CheckpointNotFoundError(
                "Hub buckets are not checkpoint repos; use hf://org/repo", file=self.url(path)
            )
        api = HfApi(endpoint=self.fs.endpoint, token=self.fs.token)
        info = self._call(
            "resolve revision",
            path,
            lambda: api.repo_info(resolved.repo_id, repo_type=resolved.repo_type, revision=resolved.revision),
        )
        if not info.sha:
            raise StorageReadError(
                f"the Hub gave no commit for revision {resolved.revision!r}", file=self.url(path)
            )
        prefix = {"dataset": "datasets/", "space": "spaces/"}.get(resolved.repo_type, "")
        pinned = f"{prefix}{resolved.repo_id}@{info.sha}"
        sub = resolved.path_in_repo.strip("/")
        if not sub:
            return pinned, None
        full = f"{pinned}/{sub}"
        kind = self._kind(full)
        if kind == "file":
            parent, _, name = full.rpartition("/")
            return parent, name
        if kind == "directory":
            return full, None
        raise CheckpointNotFoundError(
            f"no such file or directory in {resolved.repo_id}@{resolved.revision} ({info.sha})",
            file=self.url(path),
        )

    def _kind(self, path: str) -> str | None:
        def info() -> str | None:
            try:
                return self.fs.info(path)["type"]
            except FileNotFoundError:
                return None

        return self._call("info", path, info)

    def isfile(self, path: str) -> bool:
        return self._kind(path) == "file"

    def isdir(self, path: str) -> bool:
        return self._kind(path) == "directory"

    def size(self, path: str) -> int:
        def size() -> int:
            info = self.fs.info(path)
            if info["type"] != "file":
                raise FileNotFoundError(f"{path} is a directory")
            return int(info["size"])

        self._check_online(path)
        try:
            return self.retry.run(
                size, what="size", file=self.url(path), is_transient=_hub_error_is_transient
            )
        except FileNotFoundError:
            raise
        except HPDCPHFError:
            raise
        except Exception as e:
            raise StorageReadError(f"size failed: {type(e).__name__}: {e}", file=self.url(path)) from e

    def stat(self, path: str) -> FileVersion:
        """The size, and the commit of the pinned root as the version (the Hub sends it back as
        ``X-Repo-Commit``)."""
        m = _HUB_PINNED.match(path)
        return FileVersion(self.size(path), m.group("sha") if m else None)

    def list_files(self, root: str) -> list[str]:
        entries = self._call("list", root, lambda: self.fs.ls(root, detail=True))
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "file")

    # data (every rank, no I/O until read) -----------------------------------------------------

    def resolve_url(self, path: str) -> str:
        """The ``resolve`` URL of a file under a pinned root."""
        from huggingface_hub import hf_hub_url

        m = _HUB_PINNED.match(path)
        if m is None or not m.group("path"):
            raise CheckpointNotFoundError(
                "not a file of a Hub commit (org/repo@<40-hex sha>/file); locate() pins the root first",
                file=self.url(path),
            )
        return hf_hub_url(
            m.group("repo"),
            m.group("path"),
            repo_type=_REPO_TYPES.get(m.group("type") or ""),
            revision=m.group("sha"),
            endpoint=self.fs.endpoint,
        )

    def _http(self) -> HttpClient:
        with self._lock:
            if self._client is None:
                from huggingface_hub.utils import build_hf_headers

                headers = build_hf_headers(token=self.fs.token)
                headers.pop("user-agent", None)
                headers.pop("User-Agent", None)
                self._client = HttpClient(self.retry, headers)
            return self._client

    def open(self, path: str, file: str, expected: FileVersion | None = None) -> RangeFile:
        self._check_online(path)
        return HttpRangeFile(file, self.resolve_url(path), self._http(), expected, tag_header="X-Repo-Commit")


# -- choosing a backend ---------------------------------------------------------------------------


def _is_bare_repo_id(path: str) -> bool:
    return "://" not in path and bool(_BARE_REPO.match(path)) and not os.path.exists(path.split("@", 1)[0])


def kind(path: str) -> str | None:
    """``"http"`` for http(s) URLs, ``"hub"`` for Hub repos, ``None`` for everything fsspec handles."""
    if re.match(r"^https?://", path, re.IGNORECASE):
        return "http"
    if path.startswith("hf://") or _is_bare_repo_id(path):
        return "hub"
    return None


def resolve(path: str, options: dict[str, Any], retry: RetryPolicy) -> tuple[Backend, str] | None:
    """The backend and path for http(s) URLs and Hub repos; ``None`` for everything fsspec handles."""
    store = kind(path)
    if store is not None:
        check_storage_options(path, options, store)
    if store == "http":
        return HttpBackend(retry, **options), path
    if store == "hub" and path.startswith("hf://"):
        return HubBackend(retry, **options), path.removeprefix("hf://").rstrip("/")
    if store == "hub":
        hint = f" ({path!r} is no local path, so it was read as a Hub repo id)"
        return HubBackend(retry, hint=hint, **options), path
    return None
