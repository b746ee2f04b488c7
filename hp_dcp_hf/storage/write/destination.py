"""Where a save's bytes go: one small interface, a backend per kind of storage.

:class:`~hp_dcp_hf.storage.write.writer.HFStorageWriter` lays the files out and drives a save through a
:class:`Destination`: the coordinator *stages* the files (it takes the path's lock, finishes or
drops what dead saves left, and makes the files where no reader looks), every rank *writes* its
boxes, and once every rank succeeded the coordinator *publishes* through a journal
(:mod:`hp_dcp_hf.storage.format.journal`: one atomic switch, rolled forward by whoever finds the journal)
or *aborts*. The steps are the base class's; a backend supplies a handful of primitives (lock,
list, read, write a small file, remove, commit a staged file). Local and shared file systems are
a :class:`Directory` (a staging directory, ``pwrite`` at final offsets, renames, ``flock``);
object stores are multipart uploads under a lease (:mod:`hp_dcp_hf.storage.write.multipart`). The
writer never branches on the backend.

:func:`box_runs` is what both write: a box of a tensor as ``(file offset, bytes)`` runs in the
file's dtype, cast and laid out a staging budget at a time.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hp_dcp_hf.errors import CheckpointFormatError, HPDCPHFError, StorageWriteError
from hp_dcp_hf.geometry.box import Box, flat_range_boxes
from hp_dcp_hf.storage.format.files import SavedFile, SavedTensor
from hp_dcp_hf.storage.format.header import MAX_HEADER_BYTES, METADATA_KEY
from hp_dcp_hf.storage.format.journal import (
    INDEX_FILE,
    JOURNAL_FILE,
    LOCK_FILE,
    SAVE_ID_KEY,
    SINGLE_FILE,
    STAGING_PREFIX,
    Journal,
    final_names,
    leftovers,
    plan_publish,
)
from hp_dcp_hf.storage.format.ranges import box_byte_ranges, box_span, split_box


@dataclass(frozen=True)
class BoxWrite:
    """The values of ``box`` of ``tensor`` (``data``, in any dtype), to be written into its file."""

    tensor: SavedTensor
    box: Box
    data: torch.Tensor

    def span(self) -> tuple[int, int]:
        """The file bytes from the box's first to its last (holes included)."""
        first, last, _ = box_span(self.tensor.shape, self.tensor.dtype.itemsize, self.box)
        return self.tensor.start + first, self.tensor.start + last


def box_runs(write: BoxWrite, staging_bytes: int, window: tuple[int, int] | None = None) -> Iterator[tuple[int, memoryview]]:
    """``(file offset, bytes)`` of ``write``'s box in ascending order, only those inside the file's
    byte ``window`` when given. Runs are views of the model's memory when it already holds the
    file's dtype contiguously, else of a fresh buffer of at most ``staging_bytes``."""
    tensor, itemsize = write.tensor, write.tensor.dtype.itemsize
    regions = [write.box]
    if window is not None:
        lo, hi = window[0] - tensor.start, window[1] - tensor.start
        elements = flat_range_boxes(tensor.shape, lo // itemsize, -(-hi // itemsize))
        regions = [r for r in (e.intersect(write.box) for e in elements) if r is not None]
    for region in regions:
        for part in split_box(region, itemsize, max(itemsize, staging_bytes), tensor.shape):
            source = write.data[part.relative_to(write.box.offsets).slices()]
            flat = source.reshape(-1) if source.dtype == tensor.dtype and source.is_contiguous() else None
            if flat is None or flat.stride() != (1,):  # strided or cast: through a row-major buffer
                flat = torch.empty(part.sizes, dtype=tensor.dtype)
                flat.copy_(source)
                flat = flat.view(-1)
            raw = memoryview(flat.view(torch.uint8).numpy())
            position = 0
            for start, end in box_byte_ranges(tensor.shape, itemsize, part):
                run = raw[position : position + end - start]
                position += end - start
                if window is not None:  # elements straddling the window's edges: their bytes inside
                    cut_lo, cut_hi = max(start, lo), min(end, hi)
                    if cut_hi <= cut_lo:
                        continue
                    run, start = run[cut_lo - start : cut_hi - start], cut_lo
                yield tensor.start + start, run


@dataclass(frozen=True)
class Leftover:
    """Something a save leaves at its path while it runs, and after it died: its ``journal``, its
    ``lock``, a ``staging`` directory or file, a pending ``upload`` (S3)."""

    name: str
    kind: Literal["journal", "lock", "staging", "upload"]
    nbytes: int
    handle: str = ""  # an upload's id

    def describe(self) -> str:
        return f"{self.name} ({self.nbytes / 2**20:.1f} MiB)" if self.nbytes >= 2**20 else f"{self.name} ({self.nbytes} B)"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "bytes": self.nbytes}


def leftover_kind(name: str) -> Literal["journal", "lock", "staging"]:
    return "journal" if name == JOURNAL_FILE else "lock" if name == LOCK_FILE else "staging"


@dataclass(frozen=True)
class Staged:
    """A save being written: its id, the name each laid-out file gets at the path, and the
    backend's handle of each staged file (an upload id; nothing for a directory)."""

    save_id: str
    names: dict[str, str]
    handles: dict[str, str]

    def published_handles(self) -> dict[str, str]:
        """Each staged file's handle by the name it is published under (what a journal records)."""
        return {self.names[name]: handle for name, handle in self.handles.items()}


def owner_text(save_id: str, **extra: Any) -> str:
    """Who holds a path's lock: the save, the host and the process (for the error of a second save)."""
    return json.dumps({"save_id": save_id, "host": socket.gethostname(), "pid": os.getpid(), **extra})


class Destination(ABC):
    """Where the files of a save go (see the module docstring). ``stage``, ``publish``, ``abort``
    and ``repair`` run on the coordinator only; ``write`` on every rank, with what ``stage`` returned."""

    url: str
    _journaled: str | None = None  # the save whose journal this destination wrote (its staging is kept)

    # -- the save ---------------------------------------------------------------------------------
    def stage(self, files: Sequence[SavedFile], save_id: str) -> Staged:
        """Take the path's lock, finish or drop what dead saves left, and stage every file where no
        reader of the path looks (under the name it will be published as)."""
        self.unlock()  # an earlier save through this destination that failed (DCP says nothing to a writer then)
        self.lock(save_id)
        try:
            self.recover(describe=False)
            names = final_names([f.name for f in files], self.list_names(), save_id)
            return Staged(save_id, names, self.stage_files(files, names, save_id))
        except BaseException:
            self.unlock()
            raise

    @abstractmethod
    def write(self, staged: Staged, files: Sequence[SavedFile], writes: Sequence[BoxWrite], staging_bytes: int,
              failure: BaseException | None = None, *, progress: Callable[[int], None] | None = None) -> list[int]:
        """Write every box of ``writes``; the tensor bytes of each. Every rank calls it, also after
        failing to prepare its writes (``failure``, raised here once the other ranks know).
        ``progress(nbytes)`` is told the bytes of each box (or part of one) as they are written."""

    def publish(self, staged: Staged, files: Sequence[SavedFile], extra_files: Mapping[str, str],
                index: Mapping[str, Any] | None) -> None:
        """Every rank's bytes are durable: journal the switch, then carry it out (see
        :mod:`hp_dcp_hf.storage.format.journal`) and release the lock."""
        self.check_staged(staged, files)
        existing = self.list_names()
        journal = plan_publish(staged.save_id, {f.name: staged.names[f.name] for f in files}, index, extra_files,
                               existing, self.published_texts(extra_files, existing), staged.published_handles())
        self.carry_out(staged, journal)

    def published_texts(self, names: Iterable[str], existing: Collection[str]) -> dict[str, str]:
        """The text of each of ``names`` the path holds now (of those in ``existing``)."""
        return {name: raw.decode() for name in names if name in existing
                and (raw := self.read_bytes(name)) is not None}

    def carry_out(self, staged: Staged, journal: Journal) -> None:
        """Write ``journal`` (the commit point: from here on the switch rolls forward), carry it out
        and release the lock."""
        self._journaled = staged.save_id  # before the write: a journal that landed and then raised needs its staging
        self.write_text(JOURNAL_FILE, journal.to_json())
        try:
            self.roll_forward(journal)
        except (HPDCPHFError, OSError) as e:
            raise StorageWriteError(f"publishing save {staged.save_id} stopped after its journal was written "
                                    f"({e}); the next save into the path or `hp-dcp-hf repair` completes it",
                                    file=self.url) from e
        self.unlock()

    def abort(self, staged: Staged | None) -> None:
        """Drop what was staged, unless its journal was written (then it is rolled forward by the
        next save or repair); an older checkpoint at the path stays as it was."""
        if staged is not None and self._journaled != staged.save_id:
            with contextlib.suppress(Exception):  # the next save drops what is left
                self.drop_staged(staged)
        self.unlock()

    def repair(self, *, dry_run: bool = False) -> str:
        """Finish an interrupted publish and drop what dead saves left; what was done (with
        ``dry_run``: what would be, changing nothing), in words."""
        if not self.list_names():
            return "nothing to repair"
        if dry_run:
            return self.recover(dry_run=True)
        stale_lock = LOCK_FILE in self.list_names()  # taking it raises when a live save holds it
        self.lock("repair")
        try:
            return self.recover(stale_lock=stale_lock)
        finally:
            self.unlock()

    def recover(self, *, dry_run: bool = False, stale_lock: bool = False, describe: bool = True) -> str:
        """With the lock held (no save runs here): roll a journaled publish forward, drop the rest.
        The journal is the commit point: a save whose journal was written is committed and completed,
        though ``save_hf_checkpoint`` never returned; a save without one published nothing.
        ``describe``: name what is dropped, with sizes (a save's own recovery skips those requests)."""
        def did(verb: str) -> str:
            return f"would {verb}" if dry_run else {"drop": "dropped", "complete": "completed"}[verb]

        found = self.leftovers() if describe else []
        raw = self.read_bytes(JOURNAL_FILE)
        done: list[str] = []
        consumed: set[str] = set()  # the staging a roll-forward publishes
        if raw is not None:
            journal = Journal.from_json(raw, file=self._url(JOURNAL_FILE))
            lost = self.lost_staging(journal)
            if lost and not self.published_any(journal):
                if not dry_run:
                    self.remove(JOURNAL_FILE)  # its staged files are gone and nothing of it is visible: void
                done.append(f"{did('drop')} the journal of save {journal.save_id}, whose staged files are gone "
                            "(nothing of it was published)")
            elif lost:
                raise CheckpointFormatError(f"the journal of save {journal.save_id} commits {lost}, but neither "
                                            "their staged copies nor files of that save exist",
                                            file=self._url(JOURNAL_FILE))
            else:
                if not dry_run:
                    self.roll_forward(journal, replay=True)
                consumed = {f"{STAGING_PREFIX}{journal.save_id}", *journal.staged.values()}
                done.append(f"{did('complete')} the publish of save {journal.save_id} ({journal.describe()}): its "
                            "journal is the commit point, so a save whose journal was written is committed even "
                            "though save_hf_checkpoint never returned")
        dropped = [item for item in found if item.kind in ("staging", "upload")
                   and item.name not in consumed and item.handle not in consumed]
        if not dry_run:
            self.drop_abandoned()
        if dropped:
            done.append(f"{did('drop')} staged data no journal publishes (a save killed before writing its journal "
                        "published nothing): " + ", ".join(item.describe() for item in dropped))
        if dry_run and any(item.kind == "lock" for item in found):
            done.append("would remove the lock, unless a save holds it (then repair refuses, naming it)")
        elif stale_lock:
            done.append("removed the lock a dead save left")
        return "; ".join(done) or "nothing to repair"

    def roll_forward(self, journal: Journal, *, replay: bool = False) -> None:
        """Carry out every step of ``journal``, then drop the journal. A ``replay`` (of a publish
        that may have run some steps) skips the steps it finds done: commits and copies whose file
        carries the journal's save id (or whose copy does), removals of such files (it never removes
        its own save's entry file, written already), and writes a later write of the same file
        superseded (the first index, once the second one is in place)."""
        for i, step in enumerate(journal.steps):
            if replay and self.done(journal, i):
                continue
            if step.op == "commit":
                self.commit(journal, step.name)
            elif step.op == "copy":
                self.copy(journal, step.name, step.source or "")
            elif step.op == "write":
                self.write_text(step.name, step.text or "")
            else:
                self.remove(step.name)
        self.after_publish(journal)
        self.remove(JOURNAL_FILE)

    def done(self, journal: Journal, i: int) -> bool:
        """Whether a replay finds step ``i`` of ``journal`` done already (see :meth:`roll_forward`)."""
        step = journal.steps[i]
        if step.op == "drop":
            return False
        if step.op == "write":
            later = {s.text for s in journal.steps[i + 1:] if s.op == "write" and s.name == step.name}
            return bool(later) and (self.read_bytes(step.name) or b"").decode(errors="replace") in later
        ours = self.save_id_of(step.name) == journal.save_id
        copy = journal.copies().get(step.name)
        return ours or (step.op == "commit" and copy is not None and self.save_id_of(copy) == journal.save_id)

    def lost_staging(self, journal: Journal) -> list[str]:
        """The files ``journal`` commits that are neither staged nor published (by its save)."""
        copies = journal.copies()
        return [s.name for s in journal.steps if s.op == "commit" and not self.is_staged(journal, s.name)
                and journal.save_id not in (self.save_id_of(s.name), self.save_id_of(copies.get(s.name, s.name)))]

    def published_any(self, journal: Journal) -> bool:
        """Whether any file of ``journal``'s save is visible at the path."""
        names = [s.name for s in journal.steps if s.op in ("commit", "copy")] + [INDEX_FILE]
        return any(self.save_id_of(name) == journal.save_id for name in names)

    def save_id_of(self, name: str) -> str | None:
        """The save id file ``name`` carries (a safetensors header's or an index's), None without one."""
        with contextlib.suppress(Exception):  # missing, or not a file of ours: no id
            if name.endswith(".json"):
                return json.loads(self.read_bytes(name) or b"{}").get("metadata", {}).get(SAVE_ID_KEY)
            head = self.read_bytes(name, 0, 8)
            if head is not None and len(head) == 8:
                raw = self.read_bytes(name, 8, 8 + min(struct.unpack("<Q", head)[0], MAX_HEADER_BYTES))
                return json.loads(raw or b"{}").get(METADATA_KEY, {}).get(SAVE_ID_KEY)
        return None

    def current_save_id(self) -> str | None:
        """The save id of the checkpoint at the path now (of its entry file, as transformers picks it)."""
        return self.save_id_of(SINGLE_FILE if self.read_bytes(SINGLE_FILE, 0, 1) is not None else INDEX_FILE)

    def journaled_save_id(self) -> str | None:
        """The save whose publish a journal at the path records, None without one."""
        with contextlib.suppress(Exception):
            raw = self.read_bytes(JOURNAL_FILE)
            return Journal.from_json(raw).save_id if raw is not None else None
        return None

    def _url(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    # -- primitives of a backend ------------------------------------------------------------------
    @abstractmethod
    def lock(self, save_id: str) -> None:
        """Take the path's lock for this save, or raise :class:`StorageWriteError` naming its holder."""

    @abstractmethod
    def unlock(self) -> None:
        """Release the lock if this object holds it."""

    @abstractmethod
    def list_names(self) -> set[str]:
        """The names of the files directly under the path."""

    @abstractmethod
    def read_bytes(self, name: str, start: int = 0, end: int | None = None) -> bytes | None:
        """Bytes ``[start, end)`` of file ``name`` (to its end by default); None when it does not exist."""

    @abstractmethod
    def write_text(self, name: str, text: str) -> None:
        """Replace small file ``name`` with ``text`` atomically and durably."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Remove file ``name``, durably; a missing one is removed already."""

    @abstractmethod
    def stage_files(self, files: Sequence[SavedFile], names: Mapping[str, str], save_id: str) -> dict[str, str]:
        """Create every file where no reader looks; the handles :meth:`commit` finds them by."""

    @abstractmethod
    def commit(self, journal: Journal, name: str) -> None:
        """Make staged file ``name`` visible at its name, atomically."""

    @abstractmethod
    def copy(self, journal: Journal, name: str, source: str) -> None:
        """Make ``name`` a copy of published file ``source`` (whose name no index will keep), atomically."""

    @abstractmethod
    def is_staged(self, journal: Journal, name: str) -> bool:
        """Whether the staged copy of ``name`` is still there to commit."""

    @abstractmethod
    def drop_staged(self, staged: Staged) -> None:
        """Drop what :meth:`stage_files` made for ``staged``."""

    @abstractmethod
    def leftovers(self) -> list[Leftover]:
        """What running or dead saves left at the path (journal, lock, staging), with their sizes."""

    @abstractmethod
    def drop_abandoned(self) -> int:
        """Drop every staged file and upload of the path (the lock is held: their saves are dead)."""

    @abstractmethod
    def check_staged(self, staged: Staged, files: Sequence[SavedFile]) -> None:
        """Raise unless every staged file is there whole (checked before the journal is written)."""

    @abstractmethod
    def after_publish(self, journal: Journal) -> None:
        """Drop what the publish of ``journal`` no longer needs."""


class Directory(Destination):
    """A local or shared (POSIX) directory: a staging directory beside the files, every file created
    there at its final size, ``pwrite`` of each box at its final offsets, then renames; a save holds
    an ``flock`` on the lock file (released by the kernel when the process dies)."""

    def __init__(self, path: str) -> None:
        self.url = path
        self._lock_fd: int | None = None

    def _path(self, name: str) -> str:
        return os.path.join(self.url, name)

    def _sync_directory(self, path: str | None = None) -> None:
        fd = os.open(path or self.url, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- lock -------------------------------------------------------------------------------------
    def lock(self, save_id: str) -> None:
        try:
            self._lock(save_id)
        except (FileExistsError, NotADirectoryError) as e:  # the path, or a directory above it, is a file
            raise StorageWriteError(f"the path is not a directory (a file is there or above it): {e}",
                                    file=self.url) from e
        except OSError as e:  # a read-only or unreachable file system
            raise StorageWriteError(f"cannot take the path's lock: {e}", file=self.url) from e

    def _lock(self, save_id: str) -> None:
        os.makedirs(self.url, exist_ok=True)
        path = self._path(LOCK_FILE)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace")
                os.close(fd)
                raise StorageWriteError(f"another save into this path is running ({holder}); wait for it to end",
                                        file=self.url) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino  # not a lock file its holder just removed
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner_text(save_id).encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path(LOCK_FILE))  # while still holding it: a waiter re-checks the inode
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- files ------------------------------------------------------------------------------------
    def list_names(self) -> set[str]:
        try:
            return set(os.listdir(self.url))
        except (FileNotFoundError, NotADirectoryError):  # no directory there (a file is not one)
            return set()

    def read_bytes(self, name: str, start: int = 0, end: int | None = None) -> bytes | None:
        try:
            with open(self._path(name), "rb") as handle:
                handle.seek(start)
                return handle.read(-1 if end is None else end - start)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_text(self, name: str, text: str) -> None:
        temporary = self._path(f"{STAGING_PREFIX}{name}")
        with open(temporary, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self._path(name))
        self._sync_directory()

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._path(name))
            self._sync_directory()

    # -- staging ----------------------------------------------------------------------------------
    def stage_files(self, files: Sequence[SavedFile], names: Mapping[str, str], save_id: str) -> dict[str, str]:
        staging = self._path(f"{STAGING_PREFIX}{save_id}")
        os.mkdir(staging)
        for file in files:
            with open(os.path.join(staging, file.name), "wb") as handle:
                handle.write(file.header)
                handle.truncate(file.size)
                handle.flush()
                os.fsync(handle.fileno())
        self._sync_directory(staging)
        return {file.name: f"{STAGING_PREFIX}{save_id}/{file.name}" for file in files}

    def write(self, staged: Staged, files: Sequence[SavedFile], writes: Sequence[BoxWrite], staging_bytes: int,
              failure: BaseException | None = None, *, progress: Callable[[int], None] | None = None) -> list[int]:
        if failure is not None:  # no other rank waits for this one's bytes
            raise failure
        handles: dict[str, int] = {}
        written = []
        try:
            for write in writes:
                name = write.tensor.file
                if name not in handles:
                    handles[name] = os.open(self._path(staged.handles[name]), os.O_WRONLY)
                total = 0
                for offset, run in box_runs(write, staging_bytes):
                    if os.pwrite(handles[name], run, offset) != len(run):
                        raise OSError(f"short write of {write.tensor.key}")
                    total += len(run)
                written.append(total)
                if progress is not None:
                    progress(total)
            for fd in handles.values():
                os.fsync(fd)
        except OSError as e:
            raise StorageWriteError(f"writing failed: {e}", file=self._path(f"{STAGING_PREFIX}{staged.save_id}")) from e
        finally:
            for fd in handles.values():
                os.close(fd)
        return written

    def check_staged(self, staged: Staged, files: Sequence[SavedFile]) -> None:
        for file in files:
            path = self._path(staged.handles[file.name])
            size = os.path.getsize(path) if os.path.exists(path) else None
            if size != file.size:
                raise StorageWriteError(f"the staged file holds {size} bytes, the file needs {file.size}", file=path)

    def _staged_path(self, journal: Journal, name: str) -> str:
        """Where ``journal`` staged ``name``: inside the save's staging directory, or refused."""
        where = journal.staged.get(name, "")
        directory, _, file = where.partition("/")
        if directory != f"{STAGING_PREFIX}{journal.save_id}" or not file or "/" in file or file in (".", ".."):
            raise CheckpointFormatError(f"the journal stages {name!r} outside the save's staging directory",
                                        file=self._path(JOURNAL_FILE))
        return self._path(where)

    def commit(self, journal: Journal, name: str) -> None:
        os.replace(self._staged_path(journal, name), self._path(name))
        self._sync_directory()

    def copy(self, journal: Journal, name: str, source: str) -> None:
        """A hard link to ``source`` renamed over ``name`` (the bytes are not copied); a copy where
        the file system has no hard links."""
        temporary = self._path(f"{STAGING_PREFIX}{name}")
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        try:
            os.link(self._path(source), temporary)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            shutil.copyfile(self._path(source), temporary)
            with open(temporary, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(temporary, self._path(name))
        self._sync_directory()

    def is_staged(self, journal: Journal, name: str) -> bool:
        return os.path.isfile(self._staged_path(journal, name))

    def drop_staged(self, staged: Staged) -> None:
        shutil.rmtree(self._path(f"{STAGING_PREFIX}{staged.save_id}"), ignore_errors=True)

    def leftovers(self) -> list[Leftover]:
        found = []
        for name in leftovers(self.list_names()):
            path = self._path(name)
            with contextlib.suppress(FileNotFoundError):
                size = os.path.getsize(path) if not os.path.isdir(path) else sum(
                    os.path.getsize(os.path.join(top, f)) for top, _, files in os.walk(path) for f in files)
                found.append(Leftover(name, leftover_kind(name), size))
        return found

    def drop_abandoned(self) -> int:
        dropped = [name for name in self.list_names() if name.startswith(STAGING_PREFIX)]
        for name in dropped:
            path = self._path(name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
        return len(dropped)

    def after_publish(self, journal: Journal) -> None:
        shutil.rmtree(self._path(f"{STAGING_PREFIX}{journal.save_id}"), ignore_errors=True)
