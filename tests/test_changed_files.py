"""A checkpoint file that changes between ``read_metadata()`` and ``read_data()`` is detected.

Rank 0 records each file's size and version tag (local: mtime + inode; HTTP/S3: ETag; Hub: commit)
with the headers it broadcasts; every read checks them (``os.fstat`` of the descriptor, or the
``Content-Range`` total and ``ETag``/``X-Repo-Commit`` of each ranged answer). A mismatch raises
``StorageReadError`` "changed since its header was read (...)" naming the file and the keys; the
targets of a file changed before its first read keep their old values (nothing of the new bytes is
written), those of one changed while read straight into them are named by the error's
``touched_keys``, and the remote checks cost no request of their own.

Local (rewritten with the same size, truncated, extended), HTTP (a Range server whose content is
swapped), the Hub (a file changed under a pinned commit), S3 (moto: the object replaced), and two
gloo ranks where only rank 0 ever looked at the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import huggingface_hub
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save, save_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from hp_dcp_hf import load_hf_checkpoint
from hp_dcp_hf.errors import StorageReadError
from hp_dcp_hf.storage import HFStorageReader
from hp_dcp_hf.storage.format.catalog import INDEX_FILE, Catalog, scan
from hp_dcp_hf.storage.read import direct
from hp_dcp_hf.storage.read.copy import copy_into
from hp_dcp_hf.storage.transport import fsspec_backend
from hp_dcp_hf.storage.transport.location import CheckpointLocation, FileVersion, filesystem, locate
from hp_dcp_hf.storage.transport.stats import ReadStats
from hp_dcp_hf.tools.launch import run_ranks
from hp_dcp_hf.util.dcp import unwrap_checkpoint_exception
from tests.support.servers.fake_hub import FakeHub
from tests.support.servers.range_server import Error, RangeServer, Resource
from tests.support.servers.s3 import MotoS3

FAST = {"attempts": 4, "backoff_s": 0.01, "max_backoff_s": 0.05, "deadline_s": 10.0}
SENTINEL = -7
FILES = {
    "model-1.safetensors": {"a.w": ((16, 8), torch.float32), "a.b": ((8,), torch.bfloat16)},
    "model-2.safetensors": {"b.w": ((32, 4), torch.float32), "b.e": ((5,), torch.int64)},
}
CHANGED = "model-2.safetensors"
"""The file every test changes; model-1 stays as it was."""


# -- checkpoints -----------------------------------------------------------------------------------


def _tensors(file: str, version: int) -> dict[str, torch.Tensor]:
    """The tensors of ``file`` in checkpoint ``version``: same keys, shapes, dtypes, other values."""
    out = {}
    for key, (shape, dtype) in FILES[file].items():
        n = torch.Size(shape).numel()
        out[key] = (torch.arange(n, dtype=torch.float64) + 1000 * version).reshape(shape).to(dtype)
    return out


def _file_bytes(file: str, version: int = 0) -> bytes:
    return save(_tensors(file, version))


def _write(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for file in FILES:
        save_file(_tensors(file, 0), str(root / file))
    weight_map = {key: file for file, keys in FILES.items() for key in keys}
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def _destination() -> dict[str, torch.Tensor]:
    return {
        key: torch.full(shape, SENTINEL, dtype=dtype)
        for keys in FILES.values()
        for key, (shape, dtype) in keys.items()
    }


class _ChangingReader(HFStorageReader):
    """Runs ``change()`` right after ``read_metadata()``: between the headers and the data reads."""

    def __init__(self, path: str, change: Callable[[], None], **options) -> None:
        super().__init__(path, **options)
        self.change = change

    def read_metadata(self):
        metadata = super().read_metadata()
        self.change()
        return metadata


def _load(reader: HFStorageReader, state: dict[str, torch.Tensor]) -> None:
    """``dcp.load`` of ``state`` in one process; the reader's own error comes back unwrapped."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, no_dist=not dist.is_initialized())
    except CheckpointException as exc:
        raise unwrap_checkpoint_exception(exc) from None


def _assert_changed_file_untouched(state: dict[str, torch.Tensor]) -> None:
    """The changed file's targets keep their old values; the others hold version 0 or their old ones."""
    for file, keys in FILES.items():
        reference = _tensors(file, 0)
        for key in keys:
            old = torch.full_like(state[key], SENTINEL)
            if file == CHANGED:
                assert torch.equal(state[key], old), f"{key} was written from the changed file"
            else:
                assert torch.equal(state[key], old) or torch.equal(state[key], reference[key]), key


def _changed_error(info: pytest.ExceptionInfo) -> StorageReadError:
    error = info.value
    assert error.file == CHANGED, error
    assert set(error.key.split(", ")) <= set(FILES[CHANGED]), error.key
    assert "changed since its header was read" in error.reason and "short read" not in error.reason
    return error


# -- local -----------------------------------------------------------------------------------------


def _rewrite_same_size(path: Path) -> None:
    before = path.stat()
    path.write_bytes(_file_bytes(path.name, 1))  # in place: same inode, same size, new values
    after = path.stat()
    assert after.st_size == before.st_size and after.st_ino == before.st_ino
    if after.st_mtime_ns == before.st_mtime_ns:  # a coarse clock: make the new mtime visible
        os.utime(path, ns=(after.st_atime_ns, before.st_mtime_ns + 1_000_000_000))


def _replace_same_size_and_mtime(path: Path) -> None:
    """A new file renamed over the old one, its mtime copied (``cp -p``, ``rsync -a``, tar)."""
    before = path.stat()
    fresh = path.with_suffix(".tmp")
    fresh.write_bytes(_file_bytes(path.name, 1))
    os.utime(fresh, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(fresh, path)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 24)


def _extend(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 16)


LOCAL_CHANGES = {
    "rewritten": (_rewrite_same_size, r"\(version mtime_ns=\d+ inode=\d+ -> mtime_ns=\d+ inode=\d+, size \d+ unchanged\)"),
    "replaced": (_replace_same_size_and_mtime, r"\(version mtime_ns=\d+ inode=\d+ -> .*, size \d+ unchanged\)"),
    "truncated": (_truncate, r"\(size (\d+) -> (\d+)\)"),
    "extended": (_extend, r"\(size (\d+) -> (\d+)\)"),
}


@pytest.mark.parametrize("change", list(LOCAL_CHANGES))
def test_local_file_changed_after_metadata(tmp_path: Path, change: str) -> None:
    root = _write(tmp_path / "ckpt")
    size = (root / CHANGED).stat().st_size
    mutate, pattern = LOCAL_CHANGES[change]
    reader = _ChangingReader(str(root), lambda: mutate(root / CHANGED), num_threads=2)
    state = _destination()
    with pytest.raises(StorageReadError, match=pattern) as info:
        _load(reader, state)
    _changed_error(info)
    if change in ("truncated", "extended"):
        assert info.value.reason.startswith(f"changed since its header was read (size {size} -> ")
        assert f"-> {(root / CHANGED).stat().st_size})" in info.value.reason
    _assert_changed_file_untouched(state)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "ranged"])
def test_a_file_changed_while_read_names_every_target_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mapped: bool
) -> None:
    """A file that changes while its bytes go straight into the targets (out of a mapping, or by
    ranged reads) is caught when its handle closes, after some targets were written: the error's
    ``touched_keys`` name every target that no longer holds its old values, written or committed."""
    root = _write(tmp_path / "ckpt")
    model = _module()
    targets = {model.get_buffer(key).data_ptr() for key in FILES[CHANGED]}
    changes: list[Path] = []

    def change_once() -> None:  # another process rewriting the file, between two writes of the read
        if not changes:
            changes.append(root / CHANGED)
            _rewrite_same_size(root / CHANGED)

    if mapped:
        def copy_then_change(dest: torch.Tensor, source: torch.Tensor) -> None:
            copy_into(dest, source)
            if dest.data_ptr() in targets:
                change_once()

        monkeypatch.setattr(direct, "copy_into", copy_then_change)
    else:
        read_into = fsspec_backend._LocalFile.read_into
        data_start = 8 + int.from_bytes((root / CHANGED).read_bytes()[:8], "little")  # past the header

        def read_then_change(handle, start, buffers) -> None:
            read_into(handle, start, buffers)
            if handle.file == CHANGED and start >= data_start:
                change_once()

        monkeypatch.setattr(fsspec_backend._LocalFile, "read_into", read_then_change)
    with pytest.raises(StorageReadError, match="changed since its header was read") as info:
        load_hf_checkpoint(model, str(root), num_threads=1, map_local_files=mapped)
    assert changes and info.value.file == CHANGED
    state = model.state_dict()
    written = {key for key, value in state.items() if not torch.equal(value, torch.full_like(value, SENTINEL))}
    assert written & set(FILES[CHANGED]), "the read wrote nothing of the changed file before it noticed"
    assert written <= set(info.value.touched_keys), (written, info.value.touched_keys)


def test_local_unchanged_files_load_and_a_new_load_sees_the_change(tmp_path: Path) -> None:
    """No false alarm: an untouched checkpoint loads; after a change, a fresh load reads the new bytes."""
    root = _write(tmp_path / "ckpt")
    state = _destination()
    _load(HFStorageReader(str(root)), state)
    reference = _tensors("model-1.safetensors", 0) | _tensors(CHANGED, 0)
    assert all(torch.equal(state[k], v) for k, v in reference.items())
    _rewrite_same_size(root / CHANGED)
    _load(HFStorageReader(str(root)), state)
    assert all(torch.equal(state[k], v) for k, v in _tensors(CHANGED, 1).items())


def test_local_handle_checks_when_it_closes(tmp_path: Path) -> None:
    """A change while a handle is open is caught when it closes, before the reader uses its bytes."""
    root = _write(tmp_path / "ckpt")
    location, _ = locate(*filesystem(str(root)))
    size = location.size(CHANGED)  # records the version; later handles check against it
    changed = rf"changed since its header was read \(size {size} -> {size - 24}\)"
    with pytest.raises(StorageReadError, match=changed), location.open(CHANGED) as handle:
        assert len(handle.read(0, 8)) == 8
        _truncate(root / CHANGED)
        handle.read(size - 100, size - 90)  # still inside the file: preadv alone would not notice
    with location.open(CHANGED) as handle, pytest.raises(StorageReadError, match="changed since"):
        handle.read(0, 8)  # a new handle refuses before reading


def test_local_failed_read_says_how_many_bytes_it_wrote(tmp_path: Path) -> None:
    """A read into buffers that fails tells a reader writing in place whether it changed them:
    ``error.transferred`` is 0 when it failed before its first byte, else the bytes it had put in."""
    root = _write(tmp_path / "ckpt")
    location, _ = locate(*filesystem(str(root)))
    size = location.size(CHANGED)
    buffer = bytearray(100)
    with pytest.raises(StorageReadError, match="changed since"), location.open(CHANGED) as handle:  # its close too
        handle.read_into(size - 200, [buffer])  # checked, unchanged
        _truncate(root / CHANGED)  # 24 bytes gone: a read of the last 100 gets 76 of them
        with pytest.raises(StorageReadError, match="changed since") as info:
            handle.read_into(size - 100, [memoryview(buffer)[:50], memoryview(buffer)[50:]])
    assert info.value.transferred == 76
    with pytest.raises(StorageReadError, match="changed since") as info, location.open(CHANGED) as handle:
        handle.read_into(0, [bytearray(8)])  # a new handle checks before its first byte
    assert info.value.transferred == 0


def test_local_tags_are_checked_only_on_their_host(tmp_path: Path) -> None:
    """mtime and inode of another machine's copy say nothing: there, only the size is checked."""
    root = _write(tmp_path / "ckpt")
    catalog = scan(*locate(*filesystem(str(root))), ReadStats())
    version = catalog.versions[CHANGED]
    assert version.size == (root / CHANGED).stat().st_size and version.tag and version.scope
    elsewhere = {CHANGED: FileVersion(version.size, "mtime_ns=1 inode=1", "another-host")}
    here = {CHANGED: FileVersion(version.size, "mtime_ns=1 inode=1", version.scope)}
    smaller = {CHANGED: FileVersion(version.size + 1, version.tag, "another-host")}
    fs, _ = filesystem(str(root))
    with CheckpointLocation(fs, catalog.root, elsewhere).open(CHANGED) as handle:
        assert handle.read(0, 8) == (root / CHANGED).read_bytes()[:8]
    with CheckpointLocation(fs, catalog.root, here).open(CHANGED) as handle, pytest.raises(
        StorageReadError, match="version mtime_ns=1 inode=1 -> "
    ):
        handle.read(0, 8)
    with CheckpointLocation(fs, catalog.root, smaller).open(CHANGED) as handle, pytest.raises(
        StorageReadError, match=rf"size {version.size + 1} -> {version.size}"
    ):
        handle.read(0, 8)


def test_versions_travel_with_the_broadcast_catalog(tmp_path: Path) -> None:
    root = _write(tmp_path / "ckpt")
    catalog = scan(*locate(*filesystem(str(root))), ReadStats())
    assert set(catalog.versions) == set(FILES)
    raw = catalog.to_json()
    assert Catalog.from_json(raw) == catalog
    old = json.loads(raw)
    del old["versions"]  # a catalog from before versions: loads, checks nothing
    assert Catalog.from_json(json.dumps(old).encode()).versions == {}


# -- HTTP ------------------------------------------------------------------------------------------


class _SwappableServer(RangeServer):
    """Serves ``files`` (name -> bytes), which a test may replace at any time; ETags optional."""

    def __init__(self, files: dict[str, bytes], etag: bool) -> None:
        self.files = dict(files)
        self.etag = etag
        super().__init__()

    def route(self, method: str, path: str, query: str, body: bytes) -> Resource | Error:
        data = self.files.get(path.lstrip("/"))
        if data is None:
            return Error(404, "not found")
        headers = {"ETag": f'"{hashlib.sha1(data).hexdigest()}"'} if self.etag else {}
        return Resource(data, headers)


def _served_files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir()}


HTTP_CHANGES = {
    # name: (new bytes of the changed file from the old ones, ETag served, expected reason)
    "same size, new ETag": (lambda old: _file_bytes(CHANGED, 1), True, r'\(version "\w+" -> "\w+", size \d+ unchanged\)'),
    "truncated": (lambda old: old[:-24], True, r"\(size \d+ -> \d+\)"),
    "extended, no ETag": (lambda old: old + b"\0" * 16, False, r"\(size \d+ -> \d+\)"),
    "truncated, no ETag": (lambda old: old[:-24], False, r"\(size \d+ -> \d+\)"),
}


@pytest.mark.parametrize("change", list(HTTP_CHANGES))
def test_http_file_swapped_after_metadata(tmp_path: Path, change: str) -> None:
    files = _served_files(_write(tmp_path / "ckpt"))
    new_bytes, etag, pattern = HTTP_CHANGES[change]
    with _SwappableServer(files, etag) as server:

        def swap() -> None:
            server.files[CHANGED] = new_bytes(files[CHANGED])
            server.reset()  # the log from here on: the data phase

        reader = _ChangingReader(server.url, swap, retry=FAST, num_threads=2)
        state = _destination()
        with pytest.raises(StorageReadError, match=pattern) as info:
            _load(reader, state)
        _changed_error(info)
        if "size" in pattern and "version" not in pattern:
            old, new = len(files[CHANGED]), len(server.files[CHANGED])
            assert f"(size {old} -> {new})" in info.value.reason
        _assert_changed_file_untouched(state)
        # Checked from the answers the reads get anyway: no HEAD, no retry of the failed range.
        after = server.requests(faults=True)
        assert after and all(r.method == "GET" and r.range for r in after)
        changed = [r.range for r in after if r.path == f"/{CHANGED}"]
        assert changed and len(changed) == len(set(changed))


def test_http_unchanged_server_loads_with_etags(tmp_path: Path) -> None:
    files = _served_files(_write(tmp_path / "ckpt"))
    with _SwappableServer(files, etag=True) as server:
        state = _destination()
        _load(HFStorageReader(server.url, retry=FAST), state)
    reference = _tensors("model-1.safetensors", 0) | _tensors(CHANGED, 0)
    assert all(torch.equal(state[k], v) for k, v in reference.items())


# -- Hub and S3 ------------------------------------------------------------------------------------


def test_hub_file_changed_under_its_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commits never change on the Hub; a server (or proxy) answering other bytes for one is caught."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    root = _write(tmp_path / "ckpt")
    with FakeHub() as hub:
        sha = hub.add_commit("org/changing", {"": root})

        def change() -> None:
            commit = hub.repos["org/changing"]["commits"][sha]
            commit[CHANGED] = commit[CHANGED][:-24]

        reader = _ChangingReader("hf://org/changing", change, endpoint=hub.url, token=False, retry=FAST)
        state = _destination()
        with pytest.raises(StorageReadError, match=r"\(size \d+ -> \d+\)") as info:
            _load(reader, state)
        _changed_error(info)
        _assert_changed_file_untouched(state)
        assert reader.resolved_root == f"org/changing@{sha}"


S3_CHANGES = {
    "same size, new ETag": (lambda data: _file_bytes(CHANGED, 1), r'\(version "\w+" -> "\w+", size \d+ unchanged\)'),
    "truncated": (lambda data: data[:-24], r"\(size (\d+) -> (\d+)\)"),
    # Every data range now starts past the end: S3 answers 416 InvalidRange, never retried.
    "cut before its data": (lambda data: data[:8], r"\(size (\d+) -> at most (\d+)\)"),
}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    server = MotoS3(tmp_path_factory.mktemp("moto") / "recording.jsonl")
    try:
        server.create_bucket("hp-changing")
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("change", list(S3_CHANGES))
def test_s3_object_replaced_after_metadata(tmp_path: Path, s3: MotoS3, change: str) -> None:
    root = _write(tmp_path / "ckpt")
    prefix = hashlib.sha1(change.encode()).hexdigest()[:8]
    s3.upload_dir(root, "hp-changing", prefix)
    data = (root / CHANGED).read_bytes()
    new_bytes, pattern = S3_CHANGES[change]
    new = new_bytes(data)

    def replace() -> None:
        s3.client.put_object(Bucket="hp-changing", Key=f"{prefix}/{CHANGED}", Body=new)

    reader = _ChangingReader(
        f"s3://hp-changing/{prefix}", replace, storage_options=s3.storage_options(), retry=FAST
    )
    state = _destination()
    s3.start_recording()
    with pytest.raises(StorageReadError, match=pattern) as info:
        _load(reader, state)
    s3.stop_recording()
    _changed_error(info)
    if change == "truncated":
        assert f"(size {len(data)} -> {len(new)})" in info.value.reason
    # One GET per range of the changed object: a changed object is not retried.
    gets = [r.range for r in s3.recording() if r.method == "GET" and r.path.endswith(f"{prefix}/{CHANGED}")]
    assert gets and len(gets) == len(set(gets)), gets
    _assert_changed_file_untouched(state)


# -- several ranks ---------------------------------------------------------------------------------


class _RankZeroTruncates(HFStorageReader):
    """Rank 0 truncates the file once the headers are broadcast; every rank waits for it."""

    def read_metadata(self):
        metadata = super().read_metadata()
        if dist.get_rank() == 0:
            _truncate(Path(self.path) / CHANGED)
        dist.barrier()
        return metadata


def _module() -> nn.Module:
    """A plain module whose buffers are the checkpoint's keys, filled with SENTINEL."""
    root = nn.Module()
    for keys in FILES.values():
        for key, (shape, dtype) in keys.items():
            prefix, name = key.split(".")
            if not hasattr(root, prefix):
                root.add_module(prefix, nn.Module())
            getattr(root, prefix).register_buffer(name, torch.full(shape, SENTINEL, dtype=dtype))
    return root


def _untouched(state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(state[k], torch.full_like(state[k], SENTINEL)) for k in FILES[CHANGED])


def _load_on_ranks(rank: int, world: int, dcp_path: str, api_path: str) -> dict:
    out: dict = {}
    # dcp.load in the process group: DCP gathers every rank's read error.
    reader = _RankZeroTruncates(dcp_path)
    state = _destination()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore")
            dcp.load(state, storage_reader=reader)
        out["dcp"] = {"failures": {}}
    except CheckpointException as exc:
        failures = {r: (f[0] if isinstance(f, tuple) else f) for r, f in exc.failures.items()}
        stats = reader.stats.per_file
        out["dcp"] = {
            "failures": {r: (type(e).__name__, str(e)) for r, e in failures.items()},
            "header_requests": stats[CHANGED].header_requests if CHANGED in stats else 0,
            "untouched": _untouched(state),
        }
    # load_hf_checkpoint: the ranks agree on the failure; touched_keys says what this rank wrote.
    model = _module()
    try:
        load_hf_checkpoint(model, api_path, reader=_RankZeroTruncates(api_path))
        out["api"] = {"error": "no error"}
    except Exception as error:  # the test inspects what every rank raised
        out["api"] = {
            "error": type(error).__name__,
            "message": str(error),
            "touched": getattr(error, "touched_keys", None),
            "untouched": _untouched(model.state_dict()),
        }
    return out


@pytest.mark.timeout(120)
def test_every_rank_raises_when_a_file_changes(tmp_path: Path) -> None:
    """Rank 1 never looked at the file: the version it checks came with rank 0's broadcast."""
    results = run_ranks(2, _load_on_ranks, str(_write(tmp_path / "dcp")), str(_write(tmp_path / "api")), timeout=90)
    for result in (r["dcp"] for r in results):
        assert set(result["failures"]) == {0, 1}, result  # both ranks' reads failed, each on its own
        for name, message in result["failures"].values():
            assert name == "StorageReadError" and CHANGED in message
            assert "changed since its header was read (size" in message
        assert result["untouched"]
    assert [r["dcp"]["header_requests"] for r in results] == [2, 0]  # only rank 0 read (and statted) it
    for result in (r["api"] for r in results):
        assert result["error"] == "StorageReadError", result
        assert CHANGED in result["message"] and "changed since its header was read (size" in result["message"]
        assert result["untouched"] and not set(result["touched"]) & set(FILES[CHANGED]), result
