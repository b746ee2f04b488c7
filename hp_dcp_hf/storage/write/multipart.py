"""Saving to S3: one multipart upload per file, each part assembled by one rank.

The coordinator creates every file's upload (invisible until completed) and shares the upload ids
through the plan. The files are cut into fixed parts (:mod:`hp_dcp_hf.storage.write.parts`), taken
``world`` at a time: in each round every rank cuts the runs of its boxes that fall in the round's
parts, sends each run to the part's owner (three ``all_to_all`` s on a CPU group: counts, then
``(offset, length)`` rows, then the bytes), and uploads the part it received while the next round
is exchanged. Network: each rank sends its tensor bytes less those in its own parts, so about
``(world - 1) / world`` of the checkpoint crosses the process group once, and every byte is
uploaded once; the local path moves nothing between ranks.

A failure anywhere travels with the next exchange (a flag in the counts), so every rank stops at
the same round and raises the failing rank's error; the coordinator then aborts the uploads, and an
older checkpoint at the path is untouched. Publishing checks each upload's parts with the server
(``ListParts``: every part present with its planned size), then journals the switch
(:mod:`hp_dcp_hf.storage.format.journal`): uploads are completed, ``config.json`` and the index put as
its steps say. A save holds a lease object under the prefix (created with ``If-None-Match``,
renewed in the background); a dead save's lease (expired, or of a process gone on this host) is
taken over with ``If-Match``, and the uploads it left are aborted (``ListMultipartUploads``).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import socket
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from hp_dcp_hf.errors import HPDCPHFError, StorageWriteError
from hp_dcp_hf.storage.format.files import SavedFile
from hp_dcp_hf.storage.format.journal import LOCK_FILE, WEIGHT_FILE, Journal, leftovers
from hp_dcp_hf.storage.write.destination import (
    BoxWrite,
    Destination,
    Leftover,
    Staged,
    box_runs,
    leftover_kind,
    owner_text,
)
from hp_dcp_hf.storage.write.parts import Part, file_parts, part_size, rounds
from hp_dcp_hf.util.collectives import agree_on_failure, should_broadcast
from hp_dcp_hf.util.groups import gloo_group

DEFAULT_PART_BYTES = 16 * 2**20
"""Part size: large enough for S3's per-request cost, small enough that a rank's memory stays near
the staging budget (one part assembling, :data:`UPLOADS_IN_FLIGHT` uploading)."""

UPLOADS_IN_FLIGHT = 2
COPY_PART_BYTES = 512 * 2**20
"""Part size of the server-side copies that give a save over a checkpoint of the same names
``save_pretrained``'s names back (S3 allows 5 MiB to 5 GiB)."""
COPIES_IN_FLIGHT = 8
LEASE_SECONDS = 120.0
"""How long a save's lease lasts unrenewed: a save killed on another host blocks the next save
into its prefix this long (on the same host, a dead process's lease is taken over at once)."""

Run = tuple[int, memoryview]  # (offset in its part, bytes)


class MultipartUploads(Destination):
    """The files of a save as S3 objects under ``root`` of s3fs filesystem ``fs``; ``part_bytes``
    per part (at least 5 MiB; more for a file that would need over 10,000 parts)."""

    def __init__(self, fs: Any, root: str, url: str, part_bytes: int = DEFAULT_PART_BYTES,
                 lease_seconds: float = LEASE_SECONDS) -> None:
        part_size(0, part_bytes)  # validates
        self.fs, self.root, self.url, self.part_bytes = fs, root.rstrip("/"), url, part_bytes
        self.lease_seconds = lease_seconds
        self._lease: _Lease | None = None
        self.bytes_sent = 0
        """Tensor bytes this rank sent to other ranks' parts (the network cost of the last save)."""
        self.bytes_uploaded = 0
        """Bytes of the parts this rank uploaded, headers included."""

    # -- requests ---------------------------------------------------------------------------------
    def _call(self, what: str, name: str, **kwargs: Any) -> Any:
        bucket, key, _ = self.fs.split_path(f"{self.root}/{name}")
        try:
            return self.fs.call_s3(what, Bucket=bucket, Key=key, **kwargs)
        except Exception as e:  # noqa: BLE001 - s3fs raises OSError subclasses and botocore errors
            raise StorageWriteError(f"{what} failed: {type(e).__name__}: {e}", file=self._url(name)) from e

    def _missing(self, error: StorageWriteError) -> bool:
        return any(code in error.reason for code in ("NoSuchKey", "NoSuchUpload", "404", "FileNotFoundError"))

    # -- primitives -------------------------------------------------------------------------------
    def lock(self, save_id: str) -> None:
        self._lease = _Lease.take(self, save_id)

    def unlock(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def list_names(self) -> set[str]:
        self.fs.invalidate_cache(self.root)
        try:
            return {path.rsplit("/", 1)[-1] for path in self.fs.ls(self.root, detail=False)}
        except FileNotFoundError:
            return set()

    def read_bytes(self, name: str, start: int = 0, end: int | None = None) -> bytes | None:
        try:
            return self.fs.cat_file(f"{self.root}/{name}", start=start, end=end)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - s3fs raises OSError subclasses and botocore errors
            raise StorageWriteError(f"reading failed: {type(e).__name__}: {e}", file=self._url(name)) from e

    def write_text(self, name: str, text: str) -> None:
        self._call("put_object", name, Body=text.encode())

    def remove(self, name: str) -> None:
        self._call("delete_object", name)

    def stage_files(self, files: Sequence[SavedFile], names: Mapping[str, str], save_id: str) -> dict[str, str]:
        """Create every file's upload at its final key (invisible until completed); ``{file: upload id}``."""
        uploads: dict[str, str] = {}
        try:
            for file in files:
                uploads[file.name] = self._call("create_multipart_upload", names[file.name])["UploadId"]
        except BaseException:
            self.drop_staged(Staged(save_id, dict(names), uploads))
            raise
        return uploads

    def check_staged(self, staged: Staged, files: Sequence[SavedFile]) -> None:
        """Every upload holds every planned part with its planned size (the server says so)."""
        if self._lease is not None:
            self._lease.check()
        for file in files:
            planned = [(p.number, p.nbytes) for p in file_parts([(file.name, file.size)], self.part_bytes)]
            listed = [(p["PartNumber"], p["Size"]) for p in self._listed_parts(staged.names[file.name],
                                                                                 staged.handles[file.name])]
            if listed != planned:
                raise StorageWriteError(f"the upload holds parts {listed}, the file needs {planned}",
                                        file=self._url(staged.names[file.name]))

    def commit(self, journal: Journal, name: str) -> None:
        listed = self._listed_parts(name, journal.staged[name])
        self._call("complete_multipart_upload", name, UploadId=journal.staged[name], MultipartUpload={
            "Parts": [{"PartNumber": p["PartNumber"], "ETag": p["ETag"]} for p in listed]})

    def copy(self, journal: Journal, name: str, source: str) -> None:
        """A server-side copy of ``source`` to ``name``: one multipart upload whose parts
        (:data:`COPY_PART_BYTES` each, :data:`COPIES_IN_FLIGHT` at once) S3 copies itself, so no
        byte travels through this host; completed at once (a kill leaves a pending upload, aborted
        by the next save or repair)."""
        size = int(self._call("head_object", source)["ContentLength"])
        bucket, key, _ = self.fs.split_path(f"{self.root}/{source}")
        upload = self._call("create_multipart_upload", name)["UploadId"]
        ranges = [(start, min(size, start + COPY_PART_BYTES) - 1) for start in range(0, size, COPY_PART_BYTES)]

        def copy_part(number: int) -> dict[str, Any]:
            start, end = ranges[number - 1]
            answer = self._call("upload_part_copy", name, UploadId=upload, PartNumber=number,
                                CopySource={"Bucket": bucket, "Key": key}, CopySourceRange=f"bytes={start}-{end}")
            return {"PartNumber": number, "ETag": answer["CopyPartResult"]["ETag"]}

        try:
            with ThreadPoolExecutor(COPIES_IN_FLIGHT, thread_name_prefix="hp-dcp-hf-copy") as pool:
                parts = list(pool.map(copy_part, range(1, len(ranges) + 1)))
            self._call("complete_multipart_upload", name, UploadId=upload, MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(StorageWriteError):
                self._call("abort_multipart_upload", name, UploadId=upload)
            raise

    def is_staged(self, journal: Journal, name: str) -> bool:
        if name not in journal.staged:
            return False
        try:
            self._call("list_parts", name, UploadId=journal.staged[name], MaxParts=1)
        except StorageWriteError as e:
            if self._missing(e):
                return False
            raise
        return True

    def after_publish(self, journal: Journal) -> None:
        """A completed upload leaves nothing staged; s3fs's listings of the prefix are stale now."""
        self.fs.invalidate_cache(self.root)

    def drop_staged(self, staged: Staged) -> None:
        for layout_name, upload_id in staged.handles.items():
            with contextlib.suppress(StorageWriteError):  # completed already, or the server is gone
                self._call("abort_multipart_upload", staged.names[layout_name], UploadId=upload_id)

    def pending_uploads(self) -> list[tuple[str, str]]:
        """``(name, upload id)`` of every pending upload a save makes (of a weight file directly
        under the prefix); none when the policy lacks ListBucketMultipartUploads (warned)."""
        bucket, prefix, _ = self.fs.split_path(f"{self.root}/")
        found: list[tuple[str, str]] = []
        marks: dict[str, str] = {}
        while True:
            try:
                page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marks)
            except Exception as e:  # noqa: BLE001 - a policy without ListBucketMultipartUploads
                warnings.warn(f"{self.url}: cannot list the pending uploads dead saves left "
                              f"({type(e).__name__}: {e})", stacklevel=3)
                return found
            found += [(upload["Key"][len(prefix):], upload["UploadId"]) for upload in page.get("Uploads", [])
                      if WEIGHT_FILE.fullmatch(upload["Key"][len(prefix):])]
            if not page.get("IsTruncated"):
                return found
            marks = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def leftovers(self) -> list[Leftover]:
        self.fs.invalidate_cache(self.root)
        try:
            listed = {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
                      for e in self.fs.ls(self.root, detail=True)}
        except FileNotFoundError:
            listed = {}
        found = [Leftover(name, leftover_kind(name), listed[name]) for name in leftovers(listed)]
        for name, upload_id in self.pending_uploads():
            size = sum(int(p["Size"]) for p in self._listed_parts(name, upload_id))
            found.append(Leftover(f"pending upload of {name}", "upload", size, upload_id))
        return found

    def drop_abandoned(self) -> int:
        """Abort every pending upload a save makes (of a weight file directly under the prefix)."""
        dropped = 0
        for name, upload_id in self.pending_uploads():
            with contextlib.suppress(StorageWriteError):
                self._call("abort_multipart_upload", name, UploadId=upload_id)
                dropped += 1
        return dropped

    # -- write ------------------------------------------------------------------------------------
    def _group(self) -> tuple[Any, int, int]:
        """The CPU process group the parts' bytes travel on, this rank, the world size."""
        if not should_broadcast():
            return None, 0, 1
        return gloo_group(), dist.get_rank(), dist.get_world_size()

    def write(self, staged: Staged, files: Sequence[SavedFile], writes: Sequence[BoxWrite],
              staging_bytes: int, failure: BaseException | None = None, *,
              progress: Callable[[int], None] | None = None) -> list[int]:
        group, rank, world = self._group()
        headers = {f.name: f.header for f in files}
        spans = [w.span() for w in writes]
        written = [0] * len(writes)
        self.bytes_sent = self.bytes_uploaded = 0
        uploader = _Uploader(self, staged)
        error = failure  # the rounds still run, carrying it to every rank
        try:
            for owned in rounds(file_parts([(f.name, f.size) for f in files], self.part_bytes), world):
                sends: list[list[Run]] = [[] for _ in range(world)]
                if error is None:
                    try:
                        self._route(owned, writes, spans, written, sends, staging_bytes, progress)
                    except Exception as e:  # noqa: BLE001 - every failure reaches every rank
                        error, sends = e, [[] for _ in range(world)]
                self.bytes_sent += sum(len(r) for owner, runs in enumerate(sends) if owner != rank for _, r in runs)
                received = _exchange(group, sends, error is not None or uploader.failed())
                if received is None:
                    break
                mine = next((part for owner, part in owned if owner == rank), None)
                if error is None and mine is not None:
                    try:
                        uploader.submit(mine, _assemble(mine, headers[mine.file], *received))
                    except Exception as e:  # noqa: BLE001
                        error = e
            error = error or uploader.finish()
        finally:
            uploader.close()
        if error is not None and not isinstance(error, HPDCPHFError):
            error = StorageWriteError(f"writing failed: {type(error).__name__}: {error}", file=self.url)
        error = agree_on_failure(error) if group is not None else error
        if error is not None:
            raise error
        return written

    def _route(self, owned: Sequence[tuple[int, Part]], writes: Sequence[BoxWrite], spans: Sequence[tuple[int, int]],
               written: list[int], sends: list[list[Run]], staging_bytes: int,
               progress: Callable[[int], None] | None = None) -> None:
        """Cut the runs of ``writes`` inside this round's parts into ``sends[owner]``; ``progress`` is
        told the bytes of each box routed (the part owners upload them as the rounds go)."""
        by_file: dict[str, list[tuple[int, Part]]] = {}
        for owner, part in owned:
            by_file.setdefault(part.file, []).append((owner, part))
        for i, write in enumerate(writes):
            in_file = by_file.get(write.tensor.file)
            if not in_file:
                continue
            window = (in_file[0][1].start, in_file[-1][1].end)
            if spans[i][1] <= window[0] or spans[i][0] >= window[1]:
                continue
            starts = [part.start for _, part in in_file]
            before = written[i]
            for offset, run in box_runs(write, staging_bytes, window):
                written[i] += len(run)
                k = bisect.bisect_right(starts, offset) - 1
                while run:  # a run across parts goes to each part's owner
                    owner, part = in_file[k]
                    take = min(len(run), part.end - offset)
                    sends[owner].append((offset - part.start, run[:take]))
                    run, offset, k = run[take:], offset + take, k + 1
            if progress is not None and written[i] > before:
                progress(written[i] - before)

    def upload(self, staged: Staged, part: Part, data: torch.Tensor) -> None:
        self._call("upload_part", staged.names[part.file], UploadId=staged.handles[part.file], PartNumber=part.number,
                   Body=data.numpy().tobytes())

    def _listed_parts(self, name: str, upload_id: str) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        marker = 0
        while True:
            page = self._call("list_parts", name, UploadId=upload_id, PartNumberMarker=marker)
            parts.extend(page.get("Parts", []))
            if not page.get("IsTruncated"):
                return parts
            marker = int(page["NextPartNumberMarker"])



class _Lease:
    """The lock of an S3 prefix: an object that exists while a save runs there, created only if
    absent, renewed every third of its term, taken over only from a dead holder."""

    def __init__(self, destination: MultipartUploads, save_id: str, etag: str) -> None:
        self.destination, self.save_id, self.etag = destination, save_id, etag
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="hp-dcp-hf-lease", daemon=True)
        self._thread.start()

    @staticmethod
    def _body(destination: MultipartUploads, save_id: str) -> bytes:
        return owner_text(save_id, expires=time.time() + destination.lease_seconds).encode()

    @classmethod
    def take(cls, destination: MultipartUploads, save_id: str) -> _Lease:
        body = cls._body(destination, save_id)
        try:
            answer = destination._call("put_object", LOCK_FILE, Body=body, IfNoneMatch="*")
        except StorageWriteError as e:
            if not _precondition_failed(e):
                raise
            answer = cls._take_over(destination, save_id, body)
        return cls(destination, save_id, answer["ETag"])

    @staticmethod
    def _take_over(destination: MultipartUploads, save_id: str, body: bytes) -> dict[str, Any]:
        etag = destination._call("head_object", LOCK_FILE)["ETag"]  # then the body: a newer one fails If-Match
        raw = destination.read_bytes(LOCK_FILE) or b""
        try:
            holder = json.loads(raw)
            expired = float(holder["expires"]) < time.time()
            gone = holder.get("host") == socket.gethostname() and not _alive(int(holder["pid"]))
        except (ValueError, KeyError, TypeError):
            holder, expired, gone = raw.decode(errors="replace"), True, True
        if not (expired or gone):
            raise StorageWriteError(f"another save into this prefix is running ({raw.decode(errors='replace')}); "
                                    "wait for it to end", file=destination.url)
        try:  # only if nobody renewed or took it since it was read
            return destination._call("put_object", LOCK_FILE, Body=body, IfMatch=etag)
        except StorageWriteError as e:
            raise StorageWriteError(f"another save took the prefix's lease first ({e.reason})",
                                    file=destination.url) from e

    def _renew(self) -> None:
        """Renew every third of the term; a transient failure is retried each second while two
        thirds of the term remain, a refused condition (someone took the lease over) is final."""
        term = self.destination.lease_seconds
        renewed = time.monotonic()
        while not self._stop.wait(term / 3 if time.monotonic() - renewed < term / 3 else 1.0):
            try:
                body = self._body(self.destination, self.save_id)
                self.etag = self.destination._call("put_object", LOCK_FILE, Body=body, IfMatch=self.etag)["ETag"]
                renewed = time.monotonic()
            except StorageWriteError as e:
                if _precondition_failed(e) or time.monotonic() - renewed > 2 * term / 3:
                    self.lost = e.reason
                    return

    def check(self) -> None:
        """Raise if the lease was lost (another save may have taken the prefix over)."""
        if self.lost is not None:
            raise StorageWriteError(f"the save lost its lease on the prefix: {self.lost}", file=self.destination.url)

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.lost is None:  # a lost lease may be another save's by now
            with contextlib.suppress(StorageWriteError):
                self.destination._call("delete_object", LOCK_FILE)


def _precondition_failed(error: StorageWriteError) -> bool:
    """A conditional put refused (s3fs turns S3's 412 into ``FileExistsError``)."""
    return isinstance(error.__cause__, FileExistsError) or any(
        code in error.reason for code in ("PreconditionFailed", "412", "ConditionalRequestConflict"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Uploader:
    """Uploads assembled parts in the background, at most :data:`UPLOADS_IN_FLIGHT` at once."""

    def __init__(self, destination: MultipartUploads, staged: Staged) -> None:
        self.destination, self.staged = destination, staged
        self.pool = ThreadPoolExecutor(UPLOADS_IN_FLIGHT, thread_name_prefix="hp-dcp-hf-upload")
        self.pending: deque[Future[None]] = deque()
        self.error: BaseException | None = None

    def submit(self, part: Part, data: torch.Tensor) -> None:
        while len(self.pending) >= UPLOADS_IN_FLIGHT:
            self._reap(self.pending.popleft())
        self.destination.bytes_uploaded += part.nbytes
        self.pending.append(self.pool.submit(self.destination.upload, self.staged, part, data))

    def _reap(self, future: Future[None]) -> None:
        try:
            future.result()
        except BaseException as e:  # noqa: BLE001 - reported to every rank by the next exchange
            self.error = self.error or e

    def failed(self) -> bool:
        return self.error is not None or any(f.done() and f.exception() is not None for f in self.pending)

    def finish(self) -> BaseException | None:
        while self.pending:
            self._reap(self.pending.popleft())
        return self.error

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _all_to_all(group: Any, tensor: torch.Tensor, sent: list[int], received: list[int]) -> torch.Tensor:
    if group is None:
        return tensor
    out = tensor.new_empty((sum(received), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor, output_split_sizes=received, input_split_sizes=sent, group=group)
    return out


def _exchange(group: Any, sends: Sequence[Sequence[Run]], failed: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every rank's runs for this rank's part: ``(rows of (offset, length), bytes)``; ``None`` when
    any rank reported a failure."""
    world = len(sends)
    counts = torch.tensor([[len(runs), sum(len(r) for _, r in runs), failed] for runs in sends], dtype=torch.int64)
    got = _all_to_all(group, counts, [1] * world, [1] * world)
    if bool(got[:, 2].any()):
        return None
    rows = torch.tensor([(offset, len(run)) for runs in sends for offset, run in runs], dtype=torch.int64)
    data = torch.empty(int(counts[:, 1].sum()), dtype=torch.uint8)
    view, position = memoryview(data.numpy()), 0
    for runs in sends:
        for _, run in runs:
            view[position : position + len(run)] = run
            position += len(run)
    return (_all_to_all(group, rows.reshape(-1, 2), counts[:, 0].tolist(), got[:, 0].tolist()),
            _all_to_all(group, data, counts[:, 1].tolist(), got[:, 1].tolist()))


def _assemble(part: Part, header: bytes, rows: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """Part ``part`` from the header's bytes in it and the runs received; every byte exactly once."""
    buffer = torch.empty(part.nbytes, dtype=torch.uint8)
    view, source = memoryview(buffer.numpy()), memoryview(data.numpy())
    covered: list[tuple[int, int]] = []
    if part.start < len(header):
        end = min(len(header), part.end) - part.start
        view[:end] = header[part.start : part.start + end]
        covered.append((0, end))
    position = 0
    for offset, length in rows.tolist():
        if offset < 0 or offset + length > part.nbytes:
            break
        view[offset : offset + length] = source[position : position + length]
        covered.append((offset, offset + length))
        position += length
    covered.sort()
    ends = [0] + [end for _, end in covered]
    if len(covered) != len(rows) + (part.start < len(header)) or any(s != e for (s, _), e in zip(covered, ends)) \
            or ends[-1] != part.nbytes:
        raise StorageWriteError(
            f"part {part.number} (bytes [{part.start}, {part.end})): the ranks sent {position} bytes that do not "
            "cover it exactly once", file=part.file)
    return buffer
