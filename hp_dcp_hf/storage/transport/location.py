"""Where a checkpoint lives, and byte-range reads from it, whatever the backend.

Everything above this module sees a :class:`CheckpointLocation`: a root directory plus file names
relative to it, answered by a :class:`Backend`, the one small interface every kind of storage
implements (``locate``, ``isfile``, ``size``, ``list_files``, ``open``). Callers never branch on
the backend. Local files get ``os.preadv`` straight into the caller's buffers (no intermediate
copy), or are mapped into memory (:meth:`RangeFile.mapped`) so that a box is one strided copy
instead of one read per row; other fsspec filesystems (``s3://``, ``memory://``, ...) get exact ranged ``cat_file``
calls (never ``open()``, whose read-ahead fetches far past the range), retried on transient
errors. Each kind of store keeps what differs in its own module:

* **S3** (``s3://``): :mod:`~hp_dcp_hf.storage.transport.s3`, metadata through s3fs, data through a
  botocore client of our own; storage options as s3fs takes them (``key``, ``secret``,
  ``client_kwargs={"endpoint_url": ...}``, ``config_kwargs``, ``anon``, ...);
* **other fsspec stores** (``gs://``, ``memory://``, ...):
  :mod:`~hp_dcp_hf.storage.transport.fsspec_backend`;
* **HTTP(S)**: :mod:`~hp_dcp_hf.storage.transport.http_backend`;
* **Hugging Face Hub** (``hf://``, bare ``org/repo``): :mod:`~hp_dcp_hf.storage.transport.hub`;
  the last two read through one client, :mod:`~hp_dcp_hf.storage.transport.http_client`.

:func:`filesystem` picks the backend from the path alone.

Only :meth:`Backend.open` (and the reads of the handle it returns) runs on every rank during a
load; everything else is metadata, asked by the rank that reads the headers.

Files that change during a load are caught: when the metadata rank asks a file's size it gets a
:class:`FileVersion` (the size plus the version tag the backend gives for free: local mtime and
inode, an S3 or HTTP ETag, a Hub commit), which travels with the headers; a handle opened with that
version checks every read against it (local: ``os.fstat`` of its descriptor; remote: the
``Content-Range`` total and the version header of each ranged answer) and raises
:class:`StorageReadError` "changed since its header was read (...)" on a mismatch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from hp_dcp_hf.errors import ArgumentError, CheckpointNotFoundError, HPDCPHFError
from hp_dcp_hf.storage.transport import s3
from hp_dcp_hf.storage.transport.backend import (
    REMOTE_COALESCE_GAP,
    Backend,
    FileVersion,
    RangeFile,
    RetryPolicy,
    UnreachableError,
    changed_error,
    fill_views,
    host_name,
)
from hp_dcp_hf.storage.transport.fsspec_backend import (
    REMOTE_BLOCK_BYTES,
    FsspecBackend,
    _FsspecFile,
    _LocalFile,
    fsspec_error_is_transient,
    local_version,
)
from hp_dcp_hf.storage.transport.http_backend import INDEX_FILE, HttpBackend
from hp_dcp_hf.storage.transport.hub import HubBackend
from hp_dcp_hf.storage.transport.options import check_storage_options
from hp_dcp_hf.storage.transport.s3 import S3Backend

__all__ = [  # the backend interface and the fsspec backend, importable from here as before
    "REMOTE_BLOCK_BYTES",
    "REMOTE_COALESCE_GAP",
    "Backend",
    "CheckpointLocation",
    "FileVersion",
    "FsspecBackend",
    "RangeFile",
    "RetryPolicy",
    "S3Backend",
    "_FsspecFile",
    "_LocalFile",
    "as_backend",
    "backend_for_filesystem",
    "changed_error",
    "check_options",
    "filesystem",
    "fill_views",
    "fsspec_error_is_transient",
    "host_name",
    "local_version",
    "locate",
]


# -- choosing a backend ---------------------------------------------------------------------------


def backend_for_filesystem(
    fs: AbstractFileSystem, retry: RetryPolicy | None = None, *, concurrency: int | None = None
) -> Backend:
    """The backend reading through an fsspec filesystem: the Hub's own for ``HfFileSystem``, ours
    for ``S3FileSystem`` (its client sized for ``concurrency`` requests in flight)."""
    try:
        from huggingface_hub import HfFileSystem
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        HfFileSystem = ()  # type: ignore[assignment]  # noqa: N806
    if isinstance(fs, HfFileSystem):
        return HubBackend(retry, fs=fs)
    if type(fs).__name__ == "S3FileSystem" and hasattr(fs, "_call_s3") and hasattr(fs, "split_path"):
        return S3Backend(fs, retry, concurrency=concurrency)
    return FsspecBackend(fs, retry)


_BARE_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9_][\w.-]*(?:@[^\s]+)?$")


def _is_bare_repo_id(path: str) -> bool:
    return "://" not in path and bool(_BARE_REPO.match(path)) and not os.path.exists(path.split("@", 1)[0])


def _remote_kind(path: str) -> str | None:
    """``"http"`` for http(s) URLs, ``"hub"`` for Hub repos, ``None`` for everything fsspec handles."""
    if re.match(r"^https?://", path, re.IGNORECASE):
        return "http"
    if path.startswith("hf://") or _is_bare_repo_id(path):
        return "hub"
    return None


def _remote_backend(path: str, options: dict[str, Any], retry: RetryPolicy) -> tuple[Backend, str] | None:
    """The backend and path for http(s) URLs and Hub repos; ``None`` for everything fsspec handles."""
    store = _remote_kind(path)
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


def as_backend(fs: Backend | AbstractFileSystem) -> Backend:
    """``fs`` if it is a :class:`Backend`, else the backend of that fsspec filesystem."""
    if isinstance(fs, Backend):
        return fs
    return backend_for_filesystem(fs)


# -- public entry points --------------------------------------------------------------------------


def filesystem(
    path: str | os.PathLike,
    storage_options: Mapping[str, Any] | None = None,
    *,
    retry: RetryPolicy | Mapping[str, Any] | None = None,
    concurrency: int | None = None,
) -> tuple[Backend, str]:
    """The backend of ``path`` and the path in its terms; no network I/O.

    ``path`` is a local path, any fsspec URL (``s3://``, ``gs://``, ``memory://``, ...), an
    ``http(s)://`` URL, ``hf://[datasets/|spaces/]org/repo[@revision][/subdir]`` or a bare Hub
    repo id ``org/repo[@revision]`` that is not an existing local path. A path starting with
    ``./``, ``../``, ``/`` or ``~``, or ending in ``.safetensors``, is always local (never a Hub
    repo id), so a missing one fails as "does not exist locally". ``storage_options`` go to
    the backend (see :mod:`~hp_dcp_hf.storage.transport.http_backend` and
    :mod:`~hp_dcp_hf.storage.transport.hub` for the http and Hub ones); ``retry`` is the
    :class:`~hp_dcp_hf.storage.transport.backend.RetryPolicy` (or its fields as a dict) of remote reads;
    ``concurrency`` is how many reads the caller keeps in flight (S3 sizes its connection pool and
    starts its client for it; see :mod:`hp_dcp_hf.storage.transport.s3`). An option key the store
    does not take raises :class:`~hp_dcp_hf.errors.ArgumentError` naming the valid ones, before any
    request (:mod:`hp_dcp_hf.storage.transport.options`).
    """
    text = os.fspath(path)
    options = dict(storage_options or {})
    policy = RetryPolicy.of(retry)
    found = None if _always_local(text) else _remote_backend(text, options, policy)
    if found is not None:
        return found
    try:
        kind = _check_fsspec_options(text, options)
        if kind == "s3":
            options = s3.metadata_options(options)
        fs, fspath = fsspec.core.url_to_fs(text, **options)
        if kind == "s3":
            s3.one_retry_layer(fs, policy)
    except ArgumentError:  # an unknown option key, named with the valid ones
        raise
    except ImportError as e:
        raise CheckpointNotFoundError(
            f"no filesystem for this path: {e} (remote stores need pip install 'hp-dcp-hf[remote]')", file=text
        ) from e
    except ValueError as e:
        raise CheckpointNotFoundError(f"no filesystem for this path: {e}", file=text) from e
    return backend_for_filesystem(fs, policy, concurrency=concurrency), fspath.rstrip("/") or fspath


def check_options(path: str | os.PathLike, storage_options: Mapping[str, Any] | None) -> None:
    """Raise :class:`~hp_dcp_hf.errors.ArgumentError` when ``storage_options`` has a key the store
    of ``path`` does not take (:mod:`hp_dcp_hf.storage.transport.options`); no I/O, no filesystem is
    made: the CLI asks before it starts any rank."""
    text, options = os.fspath(path), dict(storage_options or {})
    store = None if _always_local(text) else _remote_kind(text)
    if store is not None:
        check_storage_options(text, options, store)
        return
    try:
        _check_fsspec_options(text, options)
    except (ImportError, ValueError) as e:
        if isinstance(e, ArgumentError):
            raise
        raise CheckpointNotFoundError(f"no filesystem for this path: {e}", file=text) from e


def _check_fsspec_options(path: str, options: Mapping[str, Any]) -> str:
    """Check ``options`` against the fsspec filesystem class of ``path``; its kind: ``"local"``,
    ``"s3"`` (s3fs, which gets this package's retry defaults) or ``"fsspec"``."""
    fs_class = None if "::" in path else fsspec.get_filesystem_class(fsspec.utils.get_protocol(path))
    if fs_class is not None and issubclass(fs_class, LocalFileSystem):
        kind = "local"
    elif fs_class is not None and fs_class.__name__ == "S3FileSystem":
        kind = "s3"
    else:
        kind = "fsspec"
    check_storage_options(path, options, kind, fs_class)
    return kind


def _always_local(path: str) -> bool:
    """A path that names a local file whether or not it exists: never a Hub repo id or URL."""
    if "://" in path or "::" in path:
        return False
    return path in (".", "..", "~") or path.startswith(("./", "../", "/", "~")) or path.lower().endswith(".safetensors")


class CheckpointLocation:
    """A directory of checkpoint files, named relative to it, on some :class:`Backend`.

    ``fs`` may be a backend or a plain fsspec filesystem (wrapped in its backend). ``versions``
    (file name -> :class:`FileVersion`) are what the files were when their headers were read;
    :meth:`size` records them, :meth:`open` hands them to the handle, which checks its reads.
    """

    def __init__(
        self, fs: Backend | AbstractFileSystem, root: str, versions: Mapping[str, FileVersion] | None = None
    ) -> None:
        self.backend = as_backend(fs)
        self.fs = self.backend.fs
        self.root = root
        self.versions: dict[str, FileVersion] = dict(versions or {})

    def __repr__(self) -> str:
        return f"CheckpointLocation({self.backend!r}, {self.root!r})"

    def path(self, file: str) -> str:
        return self.backend.join(self.root, file)

    def url(self, file: str | None = None) -> str:
        """How errors name ``file`` (the root without one): with the store's scheme (``s3://``,
        ``hf://``, ``https://``) on remote stores, so no remote path reads like a local one."""
        return self.backend.url(self.root if file is None else self.path(file))

    def exists(self, file: str) -> bool:
        return self.backend.isfile(self.path(file))

    def size(self, file: str) -> int:
        """The size of ``file``, whose version is recorded: later handles of it check against it."""
        return self.stat(file).size

    def stat(self, file: str) -> FileVersion:
        """The current version of ``file`` (asked of the backend), recorded in :attr:`versions`."""
        try:
            version = self.backend.stat(self.path(file))
        except FileNotFoundError as e:
            raise CheckpointNotFoundError("file does not exist", file=file) from e
        self.versions[file] = version
        return version

    def version(self, file: str) -> FileVersion:
        """The recorded version of ``file`` (its :meth:`stat` when none is recorded yet)."""
        return self.versions.get(file) or self.stat(file)

    def list_files(self) -> list[str]:
        """Names of the plain files directly under the root, sorted."""
        return self.backend.list_files(self.root)

    def open(self, file: str) -> RangeFile:
        """A handle for ranged reads of ``file``, checked against its recorded version if any; use
        it as a context manager."""
        return self.backend.open(self.path(file), file, self.versions.get(file))


def locate(fs: Backend | AbstractFileSystem, fspath: str) -> tuple[CheckpointLocation, str | None]:
    """The location of ``fspath`` and, when it names a single file, that file's name.

    The index file names its directory: ``dir/model.safetensors.index.json`` is ``dir`` (those who
    pass it mean the checkpoint it indexes; transformers takes the directory). Remote backends may
    pin the location here (a Hub revision is resolved to its commit). A bare ``org/repo`` that was
    no local path and that the Hub does not answer for (or that reaches no Hub) fails naming both.
    """
    backend = as_backend(fs)
    try:
        root, single_file = backend.locate(fspath)
    except HPDCPHFError as e:
        # _remote_backend gives a Hub backend its hint only for a bare repo id that is no local path
        if not getattr(backend, "hint", ""):
            raise
        outcome = e.reason if isinstance(e, UnreachableError) else f"the Hub answered: {e.reason}"
        raise type(e)(f"no local directory {fspath!r}, and {outcome}", file=e.file, key=e.key) from e
    return CheckpointLocation(backend, root), None if single_file == INDEX_FILE else single_file
