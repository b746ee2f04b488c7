"""Saving to S3: one multipart upload per file, each part assembled by one rank.

The coordinator creates every file's upload (invisible until completed) and shares the upload ids
through the plan. The files are cut into fixed parts (:mod:`hp_dcp_hf.storage.parts`), taken
``world`` at a time: in each round every rank cuts the runs of its boxes that fall in the round's
parts, sends each run to the part's owner (three ``all_to_all`` s on a CPU group: counts, then
``(offset, length)`` rows, then the bytes), and uploads the part it received while the next round
is exchanged. Network: each rank sends its tensor bytes less those in its own parts, so about
``(world - 1) / world`` of the checkpoint crosses the process group once, and every byte is
uploaded once; the local path moves nothing between ranks.

A failure anywhere travels with the next exchange (a flag in the counts), so every rank stops at
the same round and raises the failing rank's error; the coordinator then aborts the uploads, and an older checkpoint at the
path is untouched. Publishing checks each upload's parts with the server (``ListParts``: every
part present with its planned size) before completing it, then writes ``config.json`` and the
index last.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from hp_dcp_hf.errors import HPDCPHFError, StorageWriteError
from hp_dcp_hf.storage.broadcast import agree_on_failure, should_broadcast
from hp_dcp_hf.storage.catalog import INDEX_FILE
from hp_dcp_hf.storage.destination import SHARD_NAME, BoxWrite, Destination, box_runs, index_text
from hp_dcp_hf.storage.files import SavedFile
from hp_dcp_hf.storage.parts import Part, file_parts, part_size, rounds

DEFAULT_PART_BYTES = 16 * 2**20
"""Part size: large enough for S3's per-request cost, small enough that a rank's memory stays near
the staging budget (one part assembling, :data:`UPLOADS_IN_FLIGHT` uploading)."""

UPLOADS_IN_FLIGHT = 2

Run = tuple[int, memoryview]  # (offset in its part, bytes)


class MultipartUploads(Destination):
    """The files of a save as S3 objects under ``root`` of s3fs filesystem ``fs``; ``part_bytes``
    per part (at least 5 MiB; more for a file that would need over 10,000 parts)."""

    def __init__(self, fs: Any, root: str, url: str, part_bytes: int = DEFAULT_PART_BYTES) -> None:
        part_size(0, part_bytes)  # validates
        self.fs, self.root, self.url, self.part_bytes = fs, root.rstrip("/"), url, part_bytes
        self.bytes_sent = 0
        """Tensor bytes this rank sent to other ranks' parts (the network cost of the last save)."""
        self.bytes_uploaded = 0
        """Bytes of the parts this rank uploaded, headers included."""
        self._gloo: Any = None

    # -- requests ---------------------------------------------------------------------------------
    def _url(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    def _call(self, what: str, name: str, **kwargs: Any) -> Any:
        bucket, key, _ = self.fs.split_path(f"{self.root}/{name}")
        try:
            return self.fs.call_s3(what, Bucket=bucket, Key=key, **kwargs)
        except Exception as e:  # noqa: BLE001 - s3fs raises OSError subclasses and botocore errors
            raise StorageWriteError(f"{what} failed: {type(e).__name__}: {e}", file=self._url(name)) from e

    # -- stage ------------------------------------------------------------------------------------
    def stage(self, files: Sequence[SavedFile], extra_files: Mapping[str, str]) -> dict[str, str]:
        """Create every file's upload; ``{file: upload id}``. ``extra_files`` are put when publishing."""
        uploads: dict[str, str] = {}
        try:
            for file in files:
                uploads[file.name] = self._call("create_multipart_upload", file.name)["UploadId"]
        except BaseException:
            self.abort(uploads)
            raise
        return uploads

    # -- write ------------------------------------------------------------------------------------
    def _group(self) -> tuple[Any, int, int]:
        """The CPU process group the parts' bytes travel on, this rank, the world size."""
        if not should_broadcast():
            return None, 0, 1
        if "gloo" in str(dist.get_backend()):
            return dist.group.WORLD, dist.get_rank(), dist.get_world_size()
        if self._gloo is None:  # NCCL moves CUDA tensors only; every rank creates it, here
            self._gloo = dist.new_group(backend="gloo")
        return self._gloo, dist.get_rank(), dist.get_world_size()

    def write(self, token: dict[str, str], files: Sequence[SavedFile], writes: Sequence[BoxWrite],
              staging_bytes: int, failure: BaseException | None = None) -> list[int]:
        group, rank, world = self._group()
        headers = {f.name: f.header for f in files}
        spans = [w.span() for w in writes]
        written = [0] * len(writes)
        self.bytes_sent = self.bytes_uploaded = 0
        uploader = _Uploader(self, token)
        error = failure  # the rounds still run, carrying it to every rank
        try:
            for owned in rounds(file_parts([(f.name, f.size) for f in files], self.part_bytes), world):
                sends: list[list[Run]] = [[] for _ in range(world)]
                if error is None:
                    try:
                        self._route(owned, writes, spans, written, sends, staging_bytes)
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
               written: list[int], sends: list[list[Run]], staging_bytes: int) -> None:
        """Cut the runs of ``writes`` inside this round's parts into ``sends[owner]``."""
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
            for offset, run in box_runs(write, staging_bytes, window):
                written[i] += len(run)
                k = bisect.bisect_right(starts, offset) - 1
                while run:  # a run across parts goes to each part's owner
                    owner, part = in_file[k]
                    take = min(len(run), part.end - offset)
                    sends[owner].append((offset - part.start, run[:take]))
                    run, offset, k = run[take:], offset + take, k + 1

    def upload(self, upload_id: str, part: Part, data: torch.Tensor) -> None:
        self._call("upload_part", part.file, UploadId=upload_id, PartNumber=part.number, Body=data.numpy().tobytes())

    # -- publish ----------------------------------------------------------------------------------
    def publish(self, token: dict[str, str], files: Sequence[SavedFile], extra_files: Mapping[str, str],
                index: Mapping[str, Any] | None) -> None:
        for file in files:
            planned = file_parts([(file.name, file.size)], self.part_bytes)
            listed = self._listed_parts(file.name, token[file.name])
            if [(p["PartNumber"], p["Size"]) for p in listed] != [(p.number, p.nbytes) for p in planned]:
                raise StorageWriteError(
                    f"the upload holds parts {[(p['PartNumber'], p['Size']) for p in listed]}, the file needs "
                    f"{[(p.number, p.nbytes) for p in planned]}", file=self._url(file.name))
            self._call("complete_multipart_upload", file.name, UploadId=token[file.name], MultipartUpload={
                "Parts": [{"PartNumber": p["PartNumber"], "ETag": p["ETag"]} for p in listed]})
        for name, text in sorted(extra_files.items()):
            self._call("put_object", name, Body=text.encode())
        if index is not None:
            self._call("put_object", INDEX_FILE, Body=index_text(index).encode())
        keep = {f.name for f in files} | ({INDEX_FILE} if index is not None else set())
        self.fs.invalidate_cache(self.root)
        stale = [path for path in self.fs.ls(self.root, detail=False)
                 if (SHARD_NAME.fullmatch(name := path.rsplit("/", 1)[-1]) or name == INDEX_FILE) and name not in keep]
        if stale:
            self.fs.rm(stale)

    def _listed_parts(self, name: str, upload_id: str) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        marker = 0
        while True:
            page = self._call("list_parts", name, UploadId=upload_id, PartNumberMarker=marker)
            parts.extend(page.get("Parts", []))
            if not page.get("IsTruncated"):
                return parts
            marker = int(page["NextPartNumberMarker"])

    def abort(self, token: dict[str, str] | None) -> None:
        for name, upload_id in (token or {}).items():
            with contextlib.suppress(StorageWriteError):  # completed already, or the server is gone
                self._call("abort_multipart_upload", name, UploadId=upload_id)


class _Uploader:
    """Uploads assembled parts in the background, at most :data:`UPLOADS_IN_FLIGHT` at once."""

    def __init__(self, destination: MultipartUploads, uploads: Mapping[str, str]) -> None:
        self.destination, self.uploads = destination, uploads
        self.pool = ThreadPoolExecutor(UPLOADS_IN_FLIGHT, thread_name_prefix="hp-dcp-hf-upload")
        self.pending: deque[Future[None]] = deque()
        self.error: BaseException | None = None

    def submit(self, part: Part, data: torch.Tensor) -> None:
        while len(self.pending) >= UPLOADS_IN_FLIGHT:
            self._reap(self.pending.popleft())
        self.destination.bytes_uploaded += part.nbytes
        self.pending.append(self.pool.submit(self.destination.upload, self.uploads[part.file], part, data))

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
