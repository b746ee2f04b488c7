"""Local files and any other fsspec filesystem: the backend every store without one of its own uses.

Local files get ``os.preadv`` straight into the caller's buffers (no intermediate copy), or are
mapped into memory (:meth:`RangeFile.mapped`) so that a box is one strided copy instead of one read
per row; other fsspec filesystems (``memory://``, ``gs://``, ...) get exact ranged ``cat_file``
calls (never ``open()``, whose read-ahead fetches far past the range), retried on transient
errors. The S3 backend (:mod:`hp_dcp_hf.storage.transport.s3`) builds on :class:`FsspecBackend` for its
metadata.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import posixpath
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from hp_dcp_hf.errors import CheckpointNotFoundError, HPDCPHFError, StorageReadError
from hp_dcp_hf.storage.transport.backend import (
    REMOTE_COALESCE_GAP,
    Backend,
    FileVersion,
    FirstAnswer,
    RangeFile,
    RetryPolicy,
    changed_error,
    fill_views,
    host_name,
    transferred,
)
from hp_dcp_hf.storage.transport.mounts import filesystem_type, is_shared

T = TypeVar("T")

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

REMOTE_BLOCK_BYTES = 16 * 2**20
"""Largest single ``cat_file`` request: bounds the temporary ``bytes`` a remote read holds at once."""

DIRECT_IO_ALIGN = 4096
"""Alignment of ``O_DIRECT`` reads (offset, length, buffer address): a page, a multiple of every
logical block size in use."""

_bounce = threading.local()


def _bounce_buffer(nbytes: int) -> memoryview:
    """This thread's page-aligned buffer of at least ``nbytes`` (an anonymous mapping, kept for the
    thread's next ``O_DIRECT`` read)."""
    buffer = getattr(_bounce, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _bounce.buffer = mmap.mmap(-1, nbytes)
    return memoryview(buffer)[:nbytes]


# -- local files ----------------------------------------------------------------------------------


def local_version(st: os.stat_result) -> FileVersion:
    """The version of a local file from its ``stat``: size, and mtime + inode on this host."""
    return FileVersion(st.st_size, f"mtime_ns={st.st_mtime_ns} inode={st.st_ino}", host_name())


class _LocalFile(RangeFile):
    """A local file: one descriptor, ``os.preadv`` scatter reads straight into the caller's buffers,
    or private read-only mappings of the ranges asked (:meth:`mapped`).

    With an ``expected`` version, ``os.fstat`` of the descriptor is checked against it before the
    first read or mapping (so a file changed before the load reads nothing) and when the handle
    closes, before the reader commits anything it read (so one changed while it was read raises
    instead of leaving mixed bytes unreported: bytes read straight into a destination are there
    already, and the load's error names it, see ``transferred``); not after every read, which
    would double the syscalls of a layout that reads one range per row. A mapped file truncated
    during the copy is the exception: the kernel answers the access past its end with SIGBUS, as
    for every reader that maps files.

    :meth:`advise` hands ranges to the kernel's readahead (``posix_fadvise(WILLNEED)``);
    after :meth:`use_direct_io`, reads go around the page cache (``O_DIRECT``): each one reads the
    page-aligned envelope of its range into a page-aligned buffer of the thread, then copies the
    range out of it.
    """

    def __init__(self, file: str, path: str, expected: FileVersion | None = None) -> None:
        super().__init__(file)
        self._expected = expected
        self._checked = False
        self._size: int | None = None
        self._path = path
        self._direct_fd: int | None = None
        self._advised = False
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
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
        end = start + sum(v.nbytes for v in views)
        pos, first = start, 0
        try:
            if not self._checked:
                self._check_unchanged()
            if self._direct_fd is not None:  # fills the views only once the whole read is in
                self._read_direct(start, end, views)
                return
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
        except StorageReadError as e:
            transferred(e, pos - start)
            raise

    def _read_direct(self, start: int, end: int, views: list[memoryview]) -> None:
        """``[start, end)`` through an aligned ``O_DIRECT`` read of its envelope into the bounce buffer."""
        low = start - start % DIRECT_IO_ALIGN
        bounce = _bounce_buffer(-(-end // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN - low)
        pos = low
        while pos < end:  # a read stops short only at the end of the file (then pos is past it)
            try:
                got = os.preadv(self._direct_fd, [bounce[pos - low :]], pos)
            except OSError as e:
                raise StorageReadError(f"O_DIRECT read at {pos} failed: {e}", file=self.file) from e
            if got == 0:
                self._check_unchanged()
                raise self._short(start, end, max(0, pos - start))
            pos += got
        fill_views(views, (0, 0), bounce[start - low : end - low])

    def advise(self, start: int, end: int) -> None:
        """``WILLNEED`` of the range; the first advice also turns the kernel's own readahead off for
        this handle (``FADV_RANDOM``, and ``MADV_RANDOM`` on its mappings): a reader that says what it
        reads gains nothing from the guesses, which fetch bytes around the ranges that no one asked for."""
        if not hasattr(os, "posix_fadvise"):  # macOS: no advice to give
            return
        if not self._advised:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._advised = True
        if end > start:
            os.posix_fadvise(self._fd, start, end - start, os.POSIX_FADV_WILLNEED)

    def use_direct_io(self) -> bool:
        if self._direct_fd is None and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(self._path, os.O_RDONLY | os.O_DIRECT)
            except OSError:  # a file system without O_DIRECT (tmpfs): buffered reads
                return False
        return self._direct_fd is not None

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
        if self._advised and hasattr(mmap, "MADV_RANDOM"):
            mapping.madvise(mmap.MADV_RANDOM)
        return memoryview(mapping)[start - offset :]

    def close(self) -> None:
        try:
            if self._checked:
                self._check_unchanged()
        finally:
            os.close(self._fd)
            if self._direct_fd is not None:
                os.close(self._direct_fd)


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

    Transient errors are retried under ``retry`` (see :class:`~hp_dcp_hf.storage.transport.backend.RetryPolicy`);
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


class FsspecBackend(Backend):
    """Any fsspec filesystem; local files are read with ``preadv`` or mapped, others with retried
    ``cat_file``."""

    def __init__(self, fs: AbstractFileSystem, retry: RetryPolicy | None = None) -> None:
        self.fs = fs
        self.local = self.mappable = isinstance(fs, LocalFileSystem)
        self.coalesce_gap = 0 if self.local else REMOTE_COALESCE_GAP
        if retry is None and not self.local:
            retry = RetryPolicy()
        self.retry = None if self.local else retry
        self.first_answer: FirstAnswer | None = None
        """The first-answer rule of metadata calls, for stores that have one (S3)."""

    def is_transient(self, error: BaseException) -> bool:
        """Whether a failed metadata call is worth another try."""
        return fsspec_error_is_transient(error)

    def __repr__(self) -> str:
        return f"FsspecBackend({type(self.fs).__name__})"

    def shared(self, root: str) -> bool:
        """Local files are shared when their file system is a network, cluster or FUSE one."""
        return is_shared(filesystem_type(root)) if self.local else True

    def url(self, path: str) -> str:
        """A remote path with its scheme (``s3://bucket/key``: s3fs paths drop it, and then read like
        local ones); a local path as it is."""
        return path if self.local else self.fs.unstrip_protocol(path)

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        if self.retry is None:
            return fn()
        try:
            if self.first_answer is None:
                return self.retry.run(fn, what=what, file=self.url(path), is_transient=self.is_transient)
            return self.first_answer.run(self.retry, fn, what=what, file=self.url(path), is_transient=self.is_transient)
        except (HPDCPHFError, FileNotFoundError):
            raise
        except Exception as e:  # credentials, permissions, ...: one typed error on every rank
            raise StorageReadError(f"{what} failed: {type(e).__name__}: {e}", file=self.url(path)) from e

    def isfile(self, path: str) -> bool:
        if self.local:
            return self.fs.isfile(path)
        return self._kind("isfile", path) == "file"

    def isdir(self, path: str) -> bool:
        if self.local:
            return self.fs.isdir(path)
        return self._kind("isdir", path) == "directory"

    def _kind(self, what: str, path: str) -> str | None:
        """``info``'s type of ``path`` (``None``: it does not exist). Not fsspec's ``isfile``, which
        answers ``False`` for every error (an unreachable store, missing credentials) instead of raising."""

        def kind() -> str | None:
            try:
                return self.fs.info(path).get("type")
            except FileNotFoundError:
                return None

        return self._call(what, path, kind)

    def size(self, path: str) -> int:
        return int(self._call("size", path, lambda: self.fs.size(path)))

    def stat(self, path: str) -> FileVersion:
        if self.local:
            return local_version(os.stat(path))
        return super().stat(path)

    def list_files(self, root: str) -> list[str]:
        if not self.local:  # a listing cached by an earlier load in this process may predate a save since
            self.fs.invalidate_cache(root)
        entries = self._call("list", root, lambda: self.fs.ls(root, detail=True))
        return sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file")

    def open(self, path: str, file: str, expected: FileVersion | None = None) -> RangeFile:
        if self.local:
            return _LocalFile(file, path, expected)
        return _FsspecFile(file, self.fs, path, self.retry, expected)
