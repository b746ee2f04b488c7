"""S3: metadata through s3fs (on the rank that reads headers), data through a botocore client of our own.

Why not s3fs for data: it moves every byte through one event-loop thread per process, joins each
answer into one ``bytes`` that is copied again, and its pool holds 10 connections (single process,
8 MiB GETs, 8 in flight: 330-420 MiB/s through s3fs against 570-760 MiB/s for boto3 threads). Here
each ranged ``GetObject`` is sent from the reader's own worker thread through one thread-safe
botocore client, and its body is read in 1 MiB chunks from the socket straight into the
destination buffers (:func:`_body_reader`: not through urllib3's ``readinto``, which copies each
chunk once more; :func:`~hp_dcp_hf.storage.transport.backend.read_ranged`, the loop HTTP uses too). Every answer's
``ContentRange`` total and ``ETag`` are checked against the version the header was read at.

Settings come from where s3fs takes them, so the same storage options work: ``key``, ``secret``,
``token``, ``anon``, ``endpoint_url``, ``use_ssl``, ``client_kwargs`` (``endpoint_url``,
``region_name``, ``verify``, ...), ``config_kwargs`` (botocore ``Config``), ``profile`` (and other
session arguments), ``requester_pays``, ``s3_additional_kwargs`` (those ``GetObject`` takes, e.g.
SSE-C keys), versioned paths; then botocore's own chain (environment, ``~/.aws/config`` and
credentials, instance metadata). Defaults of our own, each overridden by ``config_kwargs``:

* ``max_pool_connections``: at least the reader's concurrency (``num_threads``; botocore's default
  is 10), so no request waits for a connection or opens one that is thrown away after it;
* ``connect_timeout`` / ``read_timeout``: the retry policy's (10 s / 60 s; s3fs uses 5 s / 15 s);
* ``retries``: one attempt. Retries are the :class:`~hp_dcp_hf.storage.transport.backend.RetryPolicy`'s,
  which resume a cut body after the bytes that arrived; botocore's would repeat whole requests
  and stack their backoff on ours.

Metadata (s3fs) gets one retry layer too, the policy's: s3fs's own retries and botocore's are
turned off for the filesystem this package makes (:func:`metadata_options`, :func:`one_retry_layer`),
and until the endpoint has answered once its requests wait at most the policy's
``first_answer_timeout_s`` and one that gets no answer is not retried
(:class:`~hp_dcp_hf.storage.transport.backend.FirstAnswer`): a wrong endpoint or a dead host fails
in seconds naming the endpoint, not after three stacked retry loops. Missing credentials fail on
the first request, naming what to set.

Making the client (importing botocore, loading its S3 model: 0.3-1 s, more on a busy machine)
starts in a background thread as soon as the backend exists, i.e. on every rank while rank 0
reads the headers, and the client is shared by every backend of the process with the same
settings (fsspec shares its filesystems the same way), so a second load starts warm.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from fsspec import AbstractFileSystem

from hp_dcp_hf.errors import CheckpointNotFoundError, HPDCPHFError, StorageReadError
from hp_dcp_hf.storage.transport.backend import (
    Body,
    FileVersion,
    FirstAnswer,
    RangeFile,
    RetryPolicy,
    TransientError,
    changed_error,
    check_answer,
    etag,
    read_ranged,
)
from hp_dcp_hf.storage.transport.fsspec_backend import FsspecBackend, fsspec_error_is_transient

T = TypeVar("T")

_DEFAULT_POOL = 10
"""botocore's own ``max_pool_connections``."""

_TRANSIENT_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling",
                    "ThrottlingException", "RequestTimeTooSkewed"}
_NOT_FOUND_CODES = {"NoSuchKey", "NoSuchBucket", "NoSuchVersion", "404"}

_clients: dict[str, Future[Any]] = {}
_clients_lock = threading.Lock()


_NO_RETRIES = {"total_max_attempts": 1}
"""botocore's ``retries`` config for one attempt: the retry policy's are the only ones."""


def metadata_options(options: dict[str, Any]) -> dict[str, Any]:
    """s3fs options with botocore's retries off unless ``config_kwargs.retries`` says otherwise."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", dict(_NO_RETRIES))  # a copy: botocore's Config writes into it
    return {**options, "config_kwargs": config}


def one_retry_layer(fs: AbstractFileSystem, retry: RetryPolicy) -> None:
    """s3fs's own retries off, and its timeouts (where ``config_kwargs`` sets none) those of a
    store that has not answered yet: s3fs has one client for every call, so they stay after the
    first answer too, when a metadata request that times out is retried under the policy (listing
    and size answers start within milliseconds; s3fs's own defaults are 5 s / 15 s)."""
    s3: Any = fs
    s3.retries = 1
    s3.connect_timeout, s3.read_timeout = retry.first_timeout


def endpoint(fs: AbstractFileSystem) -> str:
    """The endpoint requests of ``fs`` go to, as errors name it."""
    s3: Any = fs
    url = s3.client_kwargs.get("endpoint_url") or s3.endpoint_url
    if url:
        return str(url)
    region = s3.client_kwargs.get("region_name")
    return f"AWS S3{f' in {region}' if region else ''} (no endpoint_url set)"


def no_answer(error: BaseException | None) -> bool:
    """``error`` is a request to S3 that got no answer at all: refused, timed out, closed unanswered."""
    from botocore import exceptions as exc

    if error is None or isinstance(error, exc.SSLError):
        return False
    return isinstance(error, (exc.ConnectionError, exc.ReadTimeoutError, exc.ConnectionClosedError,
                              ConnectionError, TimeoutError))


def credentials_error(error: BaseException, fs: AbstractFileSystem, file: str | None) -> StorageReadError | None:
    """The one-line error of botocore's ``NoCredentialsError`` (or ``PartialCredentialsError``),
    naming what to set; ``None`` for other errors."""
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    if not isinstance(error, NoCredentialsError | PartialCredentialsError):
        return None
    return StorageReadError(
        f"no AWS credentials for {endpoint(fs)} ({error}; looked in the environment, ~/.aws and the instance "
        "metadata): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass the storage "
        "options key= and secret= (CLI: --storage-option key=... --storage-option secret=...), or anon=true "
        "for a public bucket",
        file=file,
    )


def client_settings(fs: AbstractFileSystem, retry: RetryPolicy, concurrency: int | None) -> dict[str, Any]:
    """How to make the client for ``fs`` as s3fs makes its own, with this module's defaults: the
    ``session`` and ``client`` arguments, the ``config`` (``Config`` arguments) and ``anon``."""
    s3: Any = fs
    client = dict(s3.client_kwargs)
    given = {
        "aws_access_key_id": s3.key,
        "aws_secret_access_key": s3.secret,
        "aws_session_token": s3.token,
        "endpoint_url": s3.endpoint_url,
    }
    client = {**{k: v for k, v in given.items() if v is not None}, **client}
    client.setdefault("use_ssl", s3.use_ssl)
    config = {
        "connect_timeout": retry.connect_timeout_s,
        "read_timeout": retry.read_timeout_s,
        "retries": dict(_NO_RETRIES),
        **s3.config_kwargs,
    }
    config["max_pool_connections"] = max(config.get("max_pool_connections", _DEFAULT_POOL), concurrency or 0)
    if s3.anon:  # unsigned requests, as s3fs sends them: no credentials at all
        client = {k: v for k, v in client.items() if k not in given or k == "endpoint_url"}
    return {"session": dict(s3.kwargs), "client": client, "config": config, "anon": bool(s3.anon)}


def _make_client(settings: dict[str, Any]) -> Any:
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config

    config = copy.deepcopy(settings["config"])  # botocore's Config writes into its ``retries``
    if settings["anon"]:
        config["signature_version"] = UNSIGNED
    session = botocore.session.Session(**settings["session"])
    return session.create_client("s3", config=Config(**config), **settings["client"])


def start_client(settings: dict[str, Any]) -> Future[Any]:
    """The client for ``settings``: this process's shared one, or one made now in a background
    thread (a failure is not kept: the next backend tries again)."""
    key = repr(sorted(settings.items()))
    with _clients_lock:
        future = _clients.get(key)
        if future is not None:
            return future
        future = _clients[key] = Future()

    def make() -> None:
        try:
            future.set_result(_make_client(settings))
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the client
            with _clients_lock:
                _clients.pop(key, None)
            future.set_exception(error)

    threading.Thread(target=make, name="hp-dcp-hf-s3-client", daemon=True).start()
    return future


def _error_code(error: BaseException) -> tuple[str, int | None]:
    """The S3 error code and HTTP status of a botocore ``ClientError``."""
    response: dict[str, Any] = getattr(error, "response", None) or {}
    code = str((response.get("Error") or {}).get("Code", ""))
    return code, (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")


def _is_transient(error: BaseException) -> bool:
    """Dropped connections, timeouts and cut bodies are worth a new try; TLS errors are not."""
    import urllib3
    from botocore import exceptions as exc

    if isinstance(error, exc.SSLError):
        return False
    return isinstance(
        error,
        (exc.HTTPClientError, exc.ConnectionError, exc.IncompleteReadError, urllib3.exceptions.HTTPError,
         http.client.HTTPException, ConnectionError, TimeoutError),
    )


def _body_reader(body: Any) -> tuple[Body, Callable[[], None]]:
    """The ``readinto`` of a ``GetObject`` body that fills the caller's buffer straight from the
    socket, and what returns its connection to the pool once the body is read.

    botocore's ``StreamingBody.readinto`` goes through urllib3's, which reads each chunk into a new
    ``bytes`` and copies it into the buffer: a second copy of every byte, and an allocation a chunk,
    both holding the GIL that the other request threads wait for. The ``http.client`` response under
    it (which botocore asks urllib3 not to decode) reads into the buffer itself. urllib3 hands the
    connection back only when its own reads see the end, so :func:`release` does it here; a body
    left unread is closed with its connection, as before. Any other body is read through its own
    ``readinto``."""
    raw = getattr(body, "_raw_stream", None)
    answer = getattr(raw, "_fp", None)
    if not isinstance(answer, http.client.HTTPResponse) or not hasattr(raw, "release_conn"):
        return body.readinto, lambda: None

    def release() -> None:
        if answer.isclosed():  # every byte read: the connection can serve the next request
            raw.release_conn()

    return answer.readinto, release


class _S3File(RangeFile):
    """One S3 object, read with ranged ``GetObject`` calls straight into the caller's buffers."""

    def __init__(self, file: str, backend: S3Backend, path: str, expected: FileVersion | None) -> None:
        super().__init__(file)
        self._backend = backend
        self._bucket, self._key, version_id = backend.fs.split_path(path)
        self._version = {"VersionId": version_id} if version_id else {}
        self._expected = expected

    def read_into(self, start: int, buffers: Sequence[Any]) -> None:
        retry = self._backend.retry or RetryPolicy()
        try:
            read_ranged(
                self.file, start, buffers, self._get,
                lambda attempt, what: retry.run(attempt, what=what, file=self.file, is_transient=_is_transient),
            )
        except HPDCPHFError:
            raise
        except Exception as e:  # credentials, parameters, ...: one typed error naming the file
            raise credentials_error(e, self._backend.fs, self.file) or StorageReadError(
                f"ranged GET failed: {type(e).__name__}: {e}", file=self.file
            ) from e

    @contextlib.contextmanager
    def _get(self, pos: int, end: int) -> Iterator[Body]:
        from botocore.exceptions import ClientError

        client, extra = self._backend.client()
        try:
            response = client.get_object(
                Bucket=self._bucket, Key=self._key, Range=f"bytes={pos}-{end - 1}", **self._version, **extra
            )
        except ClientError as e:
            raise self._client_error(e, pos, end) from e
        body = response["Body"]
        try:
            length = response.get("ContentLength")
            check_answer(
                self.file, pos, end, response["ResponseMetadata"]["HTTPStatusCode"], response.get("ContentRange"),
                None if length is None else str(length), self._expected, etag(response.get("ETag")),
            )
            readinto, release = _body_reader(body)
            yield readinto
            release()
        finally:
            body.close()

    def _client_error(self, error: BaseException, pos: int, end: int) -> HPDCPHFError:
        code, status = _error_code(error)
        what = f"GET bytes [{pos}, {end}): {code or status} {error}"
        if code == "InvalidRange" or status == 416:
            if self._expected is not None:
                return changed_error(self.file, f"size {self._expected.size} -> at most {pos}")
            return StorageReadError(
                f"bytes [{pos}, {end}): range not satisfiable, the object is shorter than its header says",
                file=self.file,
            )
        if code in _NOT_FOUND_CODES or status == 404:
            return CheckpointNotFoundError(f"file does not exist ({what})", file=self.file)
        if status in (401, 403):
            return StorageReadError(f"access denied ({what}); check the credentials", file=self.file)
        if code in _TRANSIENT_CODES or status in (408, 425, 429) or (
            status is not None and 500 <= status < 600 and status not in (501, 505)
        ):
            return TransientError(what, file=self.file)
        return StorageReadError(what, file=self.file)


class S3Backend(FsspecBackend):
    """S3: metadata through s3fs (sizes come with their ETag), data through our own botocore client,
    started in the background for ``concurrency`` requests in flight."""

    def __init__(
        self, fs: AbstractFileSystem, retry: RetryPolicy | None = None, *, concurrency: int | None = None
    ) -> None:
        super().__init__(fs, retry)
        self.first_answer = FirstAnswer(
            no_answer, endpoint(fs),
            "check the endpoint (storage option client_kwargs.endpoint_url=URL) and that it is reachable from here",
        )
        self.settings = client_settings(fs, self.retry or RetryPolicy(), concurrency)
        self._client = start_client(self.settings)
        self._extra: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return "S3Backend()"

    def is_transient(self, error: BaseException) -> bool:
        return fsspec_error_is_transient(error) or no_answer(error)

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        """A metadata call under the first-answer rule, missing credentials named in one line."""
        try:
            return super()._call(what, path, fn)
        except StorageReadError as e:
            named = None if e.__cause__ is None else credentials_error(e.__cause__, self.fs, e.file)
            if named is None:
                raise
            raise named from e.__cause__

    def client(self) -> tuple[Any, dict[str, Any]]:
        """The client (waiting for it to be made) and the extra ``GetObject`` arguments from the options."""
        try:
            client = self._client.result()
        except Exception as e:
            raise StorageReadError(f"cannot make the S3 client: {type(e).__name__}: {e}") from e
        if self._extra is None:
            s3: Any = self.fs
            members = client.meta.service_model.operation_model("GetObject").input_shape.members
            self._extra = {k: v for k, v in {**s3.s3_additional_kwargs, **s3.req_kw}.items() if k in members}
        return client, self._extra

    def stat(self, path: str) -> FileVersion:
        info = self._call("info", path, lambda: self.fs.info(path))
        if info.get("type") != "file":
            raise FileNotFoundError(path)
        return FileVersion(int(info["size"]), etag(info.get("ETag")))

    def open(self, path: str, file: str, expected: FileVersion | None = None) -> RangeFile:
        return _S3File(file, self, path, expected)
