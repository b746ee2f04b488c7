"""Where a checkpoint lives, and byte-range reads from it, whatever the backend.

Everything above this module sees a :class:`CheckpointLocation`: a root directory plus file names
relative to it, answered by a :class:`Backend`, the one small interface every kind of storage
implements (``locate``, ``isfile``, ``size``, ``list_files``, ``open``). Callers never branch on
the backend. Local files get ``os.preadv`` straight into the caller's buffers (no intermediate
copy), or are mapped into memory (:meth:`RangeFile.mapped`) so that a box is one strided copy
instead of one read per row; other fsspec filesystems (``s3://``, ``memory://``, ...) get exact ranged ``cat_file``
calls (never ``open()``, whose read-ahead fetches far past the range), retried on transient
errors; ``http(s)://`` URLs and Hugging Face Hub repos (``hf://``, bare ``org/repo``) have
backends of their own in :mod:`hp_dcp_hf.storage.remote`.

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

import asyncio
import functools
import mmap
import os
import posixpath
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from hp_dcp_hf.errors import CheckpointNotFoundError, HPDCPHFError, StorageReadError

if TYPE_CHECKING:
    from hp_dcp_hf.storage.remote import RetryPolicy

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

REMOTE_BLOCK_BYTES = 16 * 2**20
"""Largest single ``cat_file`` request: bounds the temporary ``bytes`` a remote read holds at once."""

REMOTE_COALESCE_GAP = 2**20
"""Default coalescing gap of remote stores: a request costs a round trip (tens of ms on S3), in
which a connection moves about a megabyte, so reading and dropping a hole up to that size is
cheaper than a request of its own. A TP row-sharded box is then one request per staging batch
instead of one per row."""

T = TypeVar("T")


# -- file versions --------------------------------------------------------------------------------


def changed_error(file: str, detail: str) -> StorageReadError:
    """The error of a file whose bytes are no longer those its header described."""
    return StorageReadError(
        f"changed since its header was read ({detail}); it was modified during the load, load it again "
        "once it is complete",
        file=file,
    )


@dataclass(frozen=True)
class FileVersion:
    """A checkpoint file as it was when its header was read: its size and a version tag.

    ``tag`` is what the backend got for free with the size (local: mtime and inode; S3 and HTTP:
    the ETag; Hub: the commit), ``None`` when it gave none. ``scope`` says where the tag means
    something: a host name for local tags (another machine's copy of the same path has its own
    mtime and inode, so only the size is checked there), ``None`` for tags valid everywhere.
    """

    size: int
    tag: str | None = None
    scope: str | None = None

    def check(self, file: str, *, size: int | None = None, tag: str | None = None) -> None:
        """Raise :func:`changed_error` unless ``size`` and ``tag`` (where given) match this version."""
        if size is not None and size != self.size:
            raise changed_error(file, f"size {self.size} -> {size}")
        if tag is not None and self.tag is not None and tag != self.tag and self.scope in (None, host_name()):
            raise changed_error(file, f"version {self.tag} -> {tag}, size {self.size} unchanged")

    def to_json(self) -> list[Any]:
        return [self.size, self.tag, self.scope]

    @classmethod
    def from_json(cls, value: Sequence[Any]) -> FileVersion:
        size, tag, scope = value
        return cls(int(size), tag, scope)


@functools.cache
def host_name() -> str:
    """This machine's name: the scope of local version tags."""
    return socket.gethostname()


def local_version(st: os.stat_result) -> FileVersion:
    """The version of a local file from its ``stat``: size, and mtime + inode on this host."""
    return FileVersion(st.st_size, f"mtime_ns={st.st_mtime_ns} inode={st.st_ino}", host_name())


class RangeFile:
    """One open checkpoint file, read by absolute byte ranges. Thread-safe: reads are positional."""

    def __init__(self, file: str) -> None:
        self.file = file

    def read(self, start: int, end: int) -> bytes:
        """Exactly the bytes ``[start, end)``; a short read raises :class:`StorageReadError`."""
        buf = bytearray(end - start)
        self.read_into(start, [buf])
        return bytes(buf)

    def read_into(self, start: int, buffers: Sequence[Any]) -> None:
        """Fill ``buffers`` (writable, C-contiguous) in order from the bytes starting at ``start``."""
        raise NotImplementedError

    def mapped(self, start: int, end: int) -> memoryview | None:
        """Bytes ``[start, end)`` mapped into memory, for backends that can (:attr:`Backend.mappable`);
        ``None`` for the others. The mapping lives as long as the view (and what is made of it)."""
        return None

    def close(self) -> None:
        """Release what the handle holds."""

    def __enter__(self) -> RangeFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _short(self, start: int, end: int, got: int) -> StorageReadError:
        return StorageReadError(
            f"short read: {got} of {end - start} bytes at [{start}, {end})", file=self.file
        )


def fill_views(views: list[memoryview], position: tuple[int, int], data: memoryview) -> tuple[int, int]:
    """Copy ``data`` into ``views`` from ``position`` (view index, offset); the position after it."""
    index, offset = position
    taken = 0
    while taken < len(data):
        view = views[index]
        n = min(view.nbytes - offset, len(data) - taken)
        view[offset : offset + n] = data[taken : taken + n]
        taken += n
        offset += n
        if offset == view.nbytes:
            index, offset = index + 1, 0
    return index, offset


class _LocalFile(RangeFile):
    """A local file: one descriptor, ``os.preadv`` scatter reads straight into the caller's buffers,
    or private read-only mappings of the ranges asked (:meth:`mapped`).

    With an ``expected`` version, ``os.fstat`` of the descriptor is checked against it before the
    first read or mapping (so a file changed before the load reads nothing) and when the handle
    closes, before the reader commits anything it read (so one changed while it was read raises
    instead of leaving mixed bytes unreported); not after every read, which would double the
    syscalls of a layout that reads one range per row. A mapped file truncated during the copy is
    the exception: the kernel answers the access past its end with SIGBUS, as for every reader that
    maps files.
    """

    def __init__(self, file: str, path: str, expected: FileVersion | None = None) -> None:
        super().__init__(file)
        self._expected = expected
        self._checked = False
        self._size: int | None = None
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError("file does not exist", file=file) from e
        except OSError as e:
            raise StorageReadError(f"cannot open: {e}", file=file) from e

    def _check_unchanged(self) -> None:
        if self._expected is None:
            return
        current = local_version(os.fstat(self._fd))
        self._expected.check(self.file, size=current.size, tag=current.tag)
        self._checked = True

    def read_into(self, start: int, buffers: Sequence[Any]) -> None:
        if not self._checked:
            self._check_unchanged()
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
        end = start + sum(v.nbytes for v in views)
        pos, first = start, 0
        while first < len(views):
            try:
                got = os.preadv(self._fd, views[first : first + _IOV_MAX], pos)
            except OSError as e:
                raise StorageReadError(f"read at {pos} failed: {e}", file=self.file) from e
            if got == 0:
                self._check_unchanged()  # a file cut short since its header was read says so
                raise self._short(start, end, pos - start)
            pos += got
            # preadv may stop early (signals, >2 GiB): drop what is filled, trim the partial view.
            while first < len(views) and views[first].nbytes <= got:
                got -= views[first].nbytes
                first += 1
            if got:
                views[first] = views[first][got:]

    def mapped(self, start: int, end: int) -> memoryview:
        if not self._checked:
            self._check_unchanged()
        if self._size is None:
            self._size = os.fstat(self._fd).st_size
        if end > self._size:  # a mapping past the end of a file answers with SIGBUS, not a short read
            raise self._short(start, end, max(0, self._size - start))
        offset = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            # ACCESS_COPY: private pages, so the view is writable (torch.frombuffer wants that)
            # without any write ever reaching the file.
            mapping = mmap.mmap(self._fd, end - offset, access=mmap.ACCESS_COPY, offset=offset)
        except (OSError, ValueError) as e:
            raise StorageReadError(f"cannot map [{start}, {end}): {e}", file=self.file) from e
        return memoryview(mapping)[start - offset :]

    def close(self) -> None:
        try:
            if self._checked:
                self._check_unchanged()
        finally:
            os.close(self._fd)


# -- fsspec: transient errors ---------------------------------------------------------------------

_PERMANENT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def _network_error_types() -> tuple[type[BaseException], ...]:
    """Transport error types of the async clients fsspec filesystems use, where installed."""
    types: list[type[BaseException]] = [asyncio.TimeoutError]
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    except ImportError:
        pass
    try:
        from botocore.exceptions import HTTPClientError

        types.append(HTTPClientError)
    except ImportError:
        pass
    return tuple(types)


def fsspec_error_is_transient(error: BaseException) -> bool:
    """Worth retrying: I/O errors other than missing/forbidden paths, timeouts, dropped connections."""
    if isinstance(error, _PERMANENT_OS_ERRORS):
        return False
    return isinstance(error, (OSError, *_network_error_types()))


class _FsspecFile(RangeFile):
    """Any other fsspec filesystem: exact ranged ``cat_file`` calls of at most REMOTE_BLOCK_BYTES.

    Transient errors are retried under ``retry`` (see :class:`~hp_dcp_hf.storage.remote.RetryPolicy`);
    a body shorter than asked is a file shorter than its header says, one longer is a server that
    ignored the range: both raise at once. ``cat_file`` shows no response headers, so against an
    ``expected`` version only a short body is checked (as a changed size); stores with headers to
    check (S3) override :meth:`fetch`.
    """

    def __init__(
        self,
        file: str,
        fs: AbstractFileSystem,
        path: str,
        retry: RetryPolicy | None = None,
        expected: FileVersion | None = None,
    ) -> None:
        super().__init__(file)
        self._fs = fs
        self._path = path
        self._retry = retry
        self._expected = expected

    def fetch(self, start: int, end: int) -> bytes:
        """One try at the bytes ``[start, end)`` (fewer at the end of the file)."""
        return self._fs.cat_file(self._path, start=start, end=end)

    def read(self, start: int, end: int) -> bytes:
        def attempt() -> bytes:
            return self.fetch(start, end)

        try:
            if self._retry is None:
                data = attempt()
            else:
                data = self._retry.run(
                    attempt, what=f"ranged read [{start}, {end})", file=self.file,
                    is_transient=fsspec_error_is_transient,
                )
        except HPDCPHFError:
            raise
        except FileNotFoundError as e:
            raise CheckpointNotFoundError("file does not exist", file=self.file) from e
        except Exception as e:
            raise StorageReadError(
                f"ranged read [{start}, {end}) failed: {type(e).__name__}: {e}", file=self.file
            ) from e
        if len(data) > end - start:
            raise StorageReadError(
                f"asked for bytes [{start}, {end}) ({end - start} bytes) and got {len(data)}: the store "
                "ignored the byte range (a whole-file answer); ranged reads need a store that honours Range",
                file=self.file,
            )
        if len(data) < end - start:
            if self._expected is not None and start + len(data) < self._expected.size:
                size = start + len(data) if data else f"at most {start}"
                raise changed_error(self.file, f"size {self._expected.size} -> {size}")
            raise self._short(start, end, len(data))
        return data

    def read_into(self, start: int, buffers: Sequence[Any]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        end = start + sum(v.nbytes for v in views)
        pos, position = start, (0, 0)
        while pos < end:
            data = memoryview(self.read(pos, min(end, pos + REMOTE_BLOCK_BYTES)))
            position = fill_views(views, position, data)
            pos += len(data)


# -- backends -------------------------------------------------------------------------------------


class Backend:
    """What a checkpoint load asks of its storage; one subclass per kind of store.

    ``path`` arguments are in the backend's own terms (what :func:`filesystem` returned, or a
    :meth:`join` of a root and a file name). Every method may do I/O except :meth:`open` and
    :meth:`join`: those run on every rank, from metadata another rank may have resolved.
    """

    fs: AbstractFileSystem | None = None
    """The fsspec filesystem behind the backend, when there is one."""
    local: bool = False
    """Paths of this backend are this machine's local files."""
    mappable: bool = False
    """Handles of this backend map files into memory (:meth:`RangeFile.mapped`)."""
    coalesce_gap: int = REMOTE_COALESCE_GAP
    """The reader's default coalescing gap on this store (0 for local files: a read costs no round trip)."""

    def join(self, root: str, file: str) -> str:
        return posixpath.join(root, file) if root else file

    def locate(self, path: str) -> tuple[str, str | None]:
        """The checkpoint root of ``path`` and, when it names one file, that file's name.

        A backend may pin the root here (a Hub revision becomes its commit), so that every rank
        reading files under the returned root reads the same bytes.
        """
        if self.isfile(path):
            return posixpath.dirname(path), posixpath.basename(path)
        if self.isdir(path):
            return path, None
        if self.local:
            raise CheckpointNotFoundError("does not exist locally (no such file or directory)", file=path)
        raise CheckpointNotFoundError("no such file or directory", file=path)

    def isfile(self, path: str) -> bool:
        raise NotImplementedError

    def isdir(self, path: str) -> bool:
        raise NotImplementedError

    def size(self, path: str) -> int:
        """The size of the file at ``path``; ``FileNotFoundError`` when it does not exist."""
        raise NotImplementedError

    def stat(self, path: str) -> FileVersion:
        """The size of the file at ``path`` and whatever version tag came with it, at no extra cost;
        ``FileNotFoundError`` when it does not exist. Without a tag of its own: the size alone."""
        return FileVersion(self.size(path))

    def list_files(self, root: str) -> list[str]:
        """Names of the plain files directly under ``root``, sorted."""
        raise NotImplementedError

    def open(self, path: str, file: str, expected: FileVersion | None = None) -> RangeFile:
        """A handle for ranged reads of the file at ``path`` (named ``file`` in errors); no I/O.

        With ``expected`` (what :meth:`stat` said when the header was read, maybe on another rank),
        reads raise :func:`changed_error` when the file is no longer that version, checked from
        what the reads see anyway (no extra request).
        """
        raise NotImplementedError


class FsspecBackend(Backend):
    """Any fsspec filesystem; local files are read with ``preadv`` or mapped, others with retried
    ``cat_file``."""

    def __init__(self, fs: AbstractFileSystem, retry: RetryPolicy | None = None) -> None:
        self.fs = fs
        self.local = self.mappable = isinstance(fs, LocalFileSystem)
        self.coalesce_gap = 0 if self.local else REMOTE_COALESCE_GAP
        if retry is None and not self.local:
            from hp_dcp_hf.storage.remote import RetryPolicy

            retry = RetryPolicy()
        self.retry = None if self.local else retry

    def __repr__(self) -> str:
        return f"FsspecBackend({type(self.fs).__name__})"

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        if self.retry is None:
            return fn()
        try:
            return self.retry.run(fn, what=what, file=path, is_transient=fsspec_error_is_transient)
        except (HPDCPHFError, FileNotFoundError):
            raise
        except Exception as e:  # credentials, permissions, ...: one typed error on every rank
            raise StorageReadError(f"{what} failed: {type(e).__name__}: {e}", file=path) from e

    def isfile(self, path: str) -> bool:
        return self._call("isfile", path, lambda: self.fs.isfile(path))

    def isdir(self, path: str) -> bool:
        return self._call("isdir", path, lambda: self.fs.isdir(path))

    def size(self, path: str) -> int:
        return int(self._call("size", path, lambda: self.fs.size(path)))

    def stat(self, path: str) -> FileVersion:
        if self.local:
            return local_version(os.stat(path))
        return super().stat(path)

    def list_files(self, root: str) -> list[str]:
        entries = self._call("list", root, lambda: self.fs.ls(root, detail=True))
        return sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file")

    def open(self, path: str, file: str, expected: FileVersion | None = None) -> RangeFile:
        if self.local:
            return _LocalFile(file, path, expected)
        return _FsspecFile(file, self.fs, path, self.retry, expected)


def as_backend(fs: Backend | AbstractFileSystem) -> Backend:
    """``fs`` if it is a :class:`Backend`, else the backend of that fsspec filesystem."""
    if isinstance(fs, Backend):
        return fs
    from hp_dcp_hf.storage import remote

    return remote.backend_for_filesystem(fs)


# -- public entry points --------------------------------------------------------------------------


def filesystem(
    path: str | os.PathLike,
    storage_options: Mapping[str, Any] | None = None,
    *,
    retry: RetryPolicy | Mapping[str, Any] | None = None,
) -> tuple[Backend, str]:
    """The backend of ``path`` and the path in its terms; no network I/O.

    ``path`` is a local path, any fsspec URL (``s3://``, ``gs://``, ``memory://``, ...), an
    ``http(s)://`` URL, ``hf://[datasets/|spaces/]org/repo[@revision][/subdir]`` or a bare Hub
    repo id ``org/repo[@revision]`` that is not an existing local path. A path starting with
    ``./``, ``../``, ``/`` or ``~``, or ending in ``.safetensors``, is always local (never a Hub
    repo id), so a missing one fails as "does not exist locally". ``storage_options`` go to
    the backend (see :mod:`hp_dcp_hf.storage.remote` for the http and Hub ones); ``retry`` is the
    :class:`~hp_dcp_hf.storage.remote.RetryPolicy` (or its fields as a dict) of remote reads.
    """
    from hp_dcp_hf.storage import remote

    text = os.fspath(path)
    options = dict(storage_options or {})
    policy = remote.RetryPolicy.of(retry)
    found = None if _always_local(text) else remote.resolve(text, options, policy)
    if found is not None:
        return found
    try:
        fs, fspath = fsspec.core.url_to_fs(text, **options)
    except ImportError as e:
        raise CheckpointNotFoundError(
            f"no filesystem for this path: {e} (remote stores need pip install 'hp-dcp-hf[remote]')", file=text
        ) from e
    except ValueError as e:
        raise CheckpointNotFoundError(f"no filesystem for this path: {e}", file=text) from e
    return remote.backend_for_filesystem(fs, policy), fspath.rstrip("/") or fspath


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

    Remote backends may pin the location here (a Hub revision is resolved to its commit). A bare
    ``org/repo`` that was no local path and that the Hub does not answer for fails naming both.
    """
    backend = as_backend(fs)
    try:
        root, single_file = backend.locate(fspath)
    except HPDCPHFError as e:
        # remote.resolve gives a Hub backend its hint only for a bare repo id that is no local path
        if not getattr(backend, "hint", ""):
            raise
        raise type(e)(f"no local directory {fspath!r}, and the Hub answered: {e.reason}", file=e.file, key=e.key) from e
    return CheckpointLocation(backend, root), single_file
