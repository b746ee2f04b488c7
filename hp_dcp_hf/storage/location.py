"""Where a checkpoint lives, and byte-range reads from it, whatever the backend.

Everything above this module sees a :class:`CheckpointLocation`: a root directory on an fsspec
filesystem plus file names relative to it. Callers never branch on the backend; local files get
``os.preadv`` straight into the caller's buffers (no intermediate copy), every other filesystem gets
exact ranged ``cat_file`` calls (never ``open()``, whose read-ahead fetches far past the range).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from hp_dcp_hf.errors import CheckpointNotFoundError, StorageReadError

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

REMOTE_BLOCK_BYTES = 16 * 2**20
"""Largest single ``cat_file`` request: bounds the temporary ``bytes`` a remote read holds at once."""


def filesystem(
    path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem of ``path`` and the path in its terms; no I/O on local or object stores."""
    try:
        fs, fspath = fsspec.core.url_to_fs(os.fspath(path), **dict(storage_options or {}))
    except (ValueError, ImportError) as e:
        raise CheckpointNotFoundError(f"no filesystem for this path: {e}", file=os.fspath(path)) from e
    return fs, fspath.rstrip("/") or fspath


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


class _LocalFile(RangeFile):
    """A local file: one descriptor, ``os.preadv`` scatter reads straight into the caller's buffers."""

    def __init__(self, file: str, path: str) -> None:
        super().__init__(file)
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError("file does not exist", file=file) from e
        except OSError as e:
            raise StorageReadError(f"cannot open: {e}", file=file) from e

    def read_into(self, start: int, buffers: Sequence[Any]) -> None:
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
        end = start + sum(v.nbytes for v in views)
        pos, first = start, 0
        while first < len(views):
            try:
                got = os.preadv(self._fd, views[first : first + _IOV_MAX], pos)
            except OSError as e:
                raise StorageReadError(f"read at {pos} failed: {e}", file=self.file) from e
            if got == 0:
                raise self._short(start, end, pos - start)
            pos += got
            # preadv may stop early (signals, >2 GiB): drop what is filled, trim the partial view.
            while first < len(views) and views[first].nbytes <= got:
                got -= views[first].nbytes
                first += 1
            if got:
                views[first] = views[first][got:]

    def close(self) -> None:
        os.close(self._fd)


class _FsspecFile(RangeFile):
    """Any other fsspec filesystem: exact ranged ``cat_file`` calls of at most REMOTE_BLOCK_BYTES."""

    def __init__(self, file: str, fs: AbstractFileSystem, path: str) -> None:
        super().__init__(file)
        self._fs = fs
        self._path = path

    def read(self, start: int, end: int) -> bytes:
        try:
            data = self._fs.cat_file(self._path, start=start, end=end)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError("file does not exist", file=self.file) from e
        except OSError as e:
            raise StorageReadError(f"ranged read [{start}, {end}) failed: {e}", file=self.file) from e
        if len(data) != end - start:
            # Servers that ignore Range send the whole file; short bodies mean a truncated file.
            raise self._short(start, end, len(data))
        return data

    def read_into(self, start: int, buffers: Sequence[Any]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        end = start + sum(v.nbytes for v in views)
        pos, index, offset = start, 0, 0
        while pos < end:
            data = memoryview(self.read(pos, min(end, pos + REMOTE_BLOCK_BYTES)))
            taken = 0
            while taken < len(data):
                view = views[index]
                n = min(view.nbytes - offset, len(data) - taken)
                view[offset : offset + n] = data[taken : taken + n]
                taken += n
                offset += n
                if offset == view.nbytes:
                    index, offset = index + 1, 0
            pos += len(data)


class CheckpointLocation:
    """A directory on an fsspec filesystem holding checkpoint files, named relative to it."""

    def __init__(self, fs: AbstractFileSystem, root: str) -> None:
        self.fs = fs
        self.root = root

    def __repr__(self) -> str:
        return f"CheckpointLocation({type(self.fs).__name__}, {self.root!r})"

    def path(self, file: str) -> str:
        return posixpath.join(self.root, file) if self.root else file

    def exists(self, file: str) -> bool:
        return self.fs.isfile(self.path(file))

    def size(self, file: str) -> int:
        try:
            return int(self.fs.size(self.path(file)))
        except FileNotFoundError as e:
            raise CheckpointNotFoundError("file does not exist", file=file) from e

    def list_files(self) -> list[str]:
        """Names of the plain files directly under the root, sorted."""
        entries = self.fs.ls(self.root, detail=True)
        return sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file")

    def open(self, file: str) -> RangeFile:
        """A handle for ranged reads of ``file``; use it as a context manager."""
        if isinstance(self.fs, LocalFileSystem):
            return _LocalFile(file, self.path(file))
        return _FsspecFile(file, self.fs, self.path(file))


def locate(fs: AbstractFileSystem, fspath: str) -> tuple[CheckpointLocation, str | None]:
    """The location of ``fspath`` and, when it names a single file, that file's name."""
    if fs.isfile(fspath):
        return CheckpointLocation(fs, posixpath.dirname(fspath)), posixpath.basename(fspath)
    if fs.isdir(fspath):
        return CheckpointLocation(fs, fspath), None
    raise CheckpointNotFoundError("no such file or directory", file=fspath)
