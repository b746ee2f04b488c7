"""Finding a checkpoint's files and keys (single file, index, plain directory, URLs) and ranged reads."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors.torch import save_file

from hp_dcp_hf.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    StorageReadError,
    UnsafeCheckpointError,
)
from hp_dcp_hf.storage.format.catalog import INDEX_FILE, Catalog, scan
from hp_dcp_hf.storage.read.reader import HFStorageReader
from hp_dcp_hf.storage.transport import fsspec_backend
from hp_dcp_hf.storage.transport import location as location_module
from hp_dcp_hf.storage.transport.location import CheckpointLocation, filesystem, locate
from hp_dcp_hf.storage.transport.stats import ReadStats

A = {"a.w": torch.arange(6.0).reshape(2, 3), "a.b": torch.ones(3, dtype=torch.bfloat16)}
B = {"b.w": torch.arange(4, dtype=torch.int64)}


def _scan(path: str | Path, stats: ReadStats | None = None) -> Catalog:
    return scan(*locate(*filesystem(path)), stats or ReadStats())


def _sharded(tmp_path: Path, weight_map: dict | None = None, sub: str = "") -> Path:
    (tmp_path / sub).mkdir(exist_ok=True)
    save_file(A, str(tmp_path / sub / "model-1.safetensors"))
    save_file(B, str(tmp_path / sub / "model-2.safetensors"))
    if weight_map is None:
        weight_map = {k: f"{sub}model-1.safetensors" for k in A} | {k: f"{sub}model-2.safetensors" for k in B}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    return tmp_path


def test_single_file(tmp_path: Path) -> None:
    save_file(A, str(tmp_path / "model.safetensors"))
    stats = ReadStats()
    catalog = _scan(tmp_path / "model.safetensors", stats)
    assert catalog.root == str(tmp_path) and catalog.files == ("model.safetensors",)
    assert set(catalog.entries) == set(A)
    assert catalog.entries["a.b"].dtype == torch.bfloat16 and catalog.entries["a.w"].shape == (2, 3)
    assert stats.per_file["model.safetensors"].header_requests == 2


def test_file_url_of_a_directory(tmp_path: Path) -> None:
    save_file(A, str(tmp_path / "model.safetensors"))
    catalog = _scan(f"file://{tmp_path}")
    assert catalog.files == ("model.safetensors",) and set(catalog.entries) == set(A)


def test_index_directory_in_a_subfolder(tmp_path: Path) -> None:
    _sharded(tmp_path, sub="weights/")
    (tmp_path / "stray.safetensors").write_bytes(b"not read: the index does not name it")
    stats = ReadStats()
    catalog = _scan(tmp_path, stats)
    assert catalog.files == ("weights/model-1.safetensors", "weights/model-2.safetensors")
    assert catalog.entries["b.w"].file == "weights/model-2.safetensors"
    assert INDEX_FILE in stats.per_file and "stray.safetensors" not in stats.per_file


def test_directory_without_index(tmp_path: Path) -> None:
    save_file(A, str(tmp_path / "x.safetensors"))
    save_file(B, str(tmp_path / "y.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    catalog = _scan(tmp_path)
    assert catalog.files == ("x.safetensors", "y.safetensors")
    assert {k: e.file for k, e in catalog.entries.items()} == {
        "a.w": "x.safetensors",
        "a.b": "x.safetensors",
        "b.w": "y.safetensors",
    }


@pytest.mark.parametrize(
    "name",
    [
        "../model-1.safetensors",
        "/etc/model-1.safetensors",
        "a/../model-1.safetensors",
        "s3://bucket/model-1.safetensors",
        "./model-1.safetensors",
        "a\\b.safetensors",
        "model-1.json",
    ],
)
def test_index_names_outside_or_odd_paths(tmp_path: Path, name: str) -> None:
    _sharded(tmp_path, {"a.w": name})
    with pytest.raises(CheckpointFormatError) as info:
        _scan(tmp_path)
    assert (info.value.file, info.value.key) == (INDEX_FILE, "a.w")


def test_index_names_a_pickle_file(tmp_path: Path) -> None:
    _sharded(tmp_path, {"a.w": "pytorch_model.bin"})
    with pytest.raises(UnsafeCheckpointError, match="safetensors"):
        _scan(tmp_path)


def test_index_names_a_missing_file(tmp_path: Path) -> None:
    weight_map = {"a.w": "model-1.safetensors", "a.b": "model-1.safetensors", "b.w": "model-3.safetensors"}
    _sharded(tmp_path, weight_map)
    with pytest.raises(CheckpointNotFoundError) as info:
        _scan(tmp_path)
    assert (info.value.file, info.value.key) == ("model-3.safetensors", "b.w")


def test_index_key_not_in_its_file(tmp_path: Path) -> None:
    _sharded(
        tmp_path, {"a.w": "model-2.safetensors", "a.b": "model-1.safetensors", "b.w": "model-2.safetensors"}
    )
    with pytest.raises(CheckpointFormatError, match="model-1") as info:
        _scan(tmp_path)
    assert (info.value.file, info.value.key) == ("model-2.safetensors", "a.w")


def test_index_key_absent_from_every_file(tmp_path: Path) -> None:
    weight_map = {k: "model-1.safetensors" for k in A} | {
        "b.w": "model-2.safetensors",
        "ghost": "model-2.safetensors",
    }
    _sharded(tmp_path, weight_map)
    with pytest.raises(CheckpointFormatError, match="no file holds it") as info:
        _scan(tmp_path)
    assert info.value.key == "ghost"


def test_file_holds_key_the_index_does_not_list(tmp_path: Path) -> None:
    _sharded(tmp_path, {"a.w": "model-1.safetensors", "b.w": "model-2.safetensors"})
    with pytest.raises(CheckpointFormatError, match="does not list") as info:
        _scan(tmp_path)
    assert (info.value.file, info.value.key) == ("model-1.safetensors", "a.b")


@pytest.mark.parametrize("index", [{"weight_map": []}, {"no_map": {}}, [1]])
def test_index_without_weight_map(tmp_path: Path, index: object) -> None:
    _sharded(tmp_path)
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError) as info:
        _scan(tmp_path)
    assert info.value.file == INDEX_FILE


def test_duplicate_key_across_files(tmp_path: Path) -> None:
    save_file(A, str(tmp_path / "x.safetensors"))
    save_file({"a.b": torch.zeros(1)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(CheckpointFormatError, match="x.safetensors") as info:
        _scan(tmp_path)
    assert (info.value.file, info.value.key) == ("y.safetensors", "a.b")


@pytest.mark.parametrize(
    "names",
    [["pytorch_model.bin"], ["model.pt", "config.json"], ["weights.pth"], ["pytorch_model.bin.index.json"]],
)
def test_pickle_only_directory_is_refused(tmp_path: Path, names: list[str]) -> None:
    for name in names:
        (tmp_path / name).write_bytes(b"\x80\x04 pickle")
    with pytest.raises(UnsafeCheckpointError, match="safetensors"):
        _scan(tmp_path)
    with pytest.raises(UnsafeCheckpointError):
        _scan(tmp_path / names[0])


def test_missing_and_empty_paths(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        _scan(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match="no .safetensors"):
        _scan(tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointFormatError, match="not a .safetensors"):
        _scan(tmp_path / "notes.txt")


def test_catalog_json_round_trip(tmp_path: Path) -> None:
    _sharded(tmp_path)
    save_file(
        {"f4": torch.zeros(2, 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)},
        str(tmp_path / "model-1.safetensors"),
    )
    (tmp_path / INDEX_FILE).unlink()
    catalog = _scan(tmp_path)
    assert Catalog.from_json(catalog.to_json()) == catalog


def test_validate_checkpoint_id(tmp_path: Path) -> None:
    save_file(A, str(tmp_path / "model.safetensors"))
    assert HFStorageReader.validate_checkpoint_id(tmp_path)
    assert HFStorageReader.validate_checkpoint_id(f"file://{tmp_path}/model.safetensors")
    assert not HFStorageReader.validate_checkpoint_id(tmp_path / "nope")
    (tmp_path / "pkl").mkdir()
    (tmp_path / "pkl" / "pytorch_model.bin").write_bytes(b"x")
    assert not HFStorageReader.validate_checkpoint_id(tmp_path / "pkl")


@pytest.fixture
def local_and_memory(tmp_path: Path):
    """The same bytes on the local filesystem (preadv path) and fsspec's memory filesystem (cat_file)."""
    data = bytes(range(256)) * 4
    (tmp_path / "f.bin").write_bytes(data)
    memory = fsspec.filesystem("memory")
    memory.pipe("/ckpt/f.bin", data)
    yield (
        data,
        [CheckpointLocation(fsspec.filesystem("file"), str(tmp_path)), CheckpointLocation(memory, "/ckpt")],
    )
    memory.rm("/ckpt", recursive=True)


def test_scatter_reads_on_both_backends(local_and_memory, monkeypatch: pytest.MonkeyPatch) -> None:
    data, locations = local_and_memory
    monkeypatch.setattr(fsspec_backend, "REMOTE_BLOCK_BYTES", 7)  # many blocks across buffer edges
    for location in locations:
        buffers = [bytearray(5), bytearray(0), bytearray(20), memoryview(bytearray(3))]
        with location.open("f.bin") as handle:
            handle.read_into(100, buffers)
            assert b"".join(bytes(b) for b in buffers) == data[100:128]
            assert handle.read(1000, 1024) == data[1000:1024]
            with pytest.raises(StorageReadError, match="short read") as info:
                handle.read_into(1020, [bytearray(8)])
            assert info.value.file == "f.bin"
        assert location.size("f.bin") == len(data)
        with pytest.raises(CheckpointNotFoundError):
            location.size("missing.bin")


def test_local_reads_survive_partial_preadv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """preadv may return fewer bytes than asked (signals, > 2 GiB): the loop must continue correctly."""
    data = bytes(range(200))
    (tmp_path / "f.bin").write_bytes(data)
    real = location_module.os.preadv

    def stingy(fd, views, offset):
        return real(fd, [views[0][:3]], offset)

    monkeypatch.setattr(location_module.os, "preadv", stingy)
    buffers = [bytearray(5), bytearray(11), bytearray(1)]
    with CheckpointLocation(fsspec.filesystem("file"), str(tmp_path)).open("f.bin") as handle:
        handle.read_into(50, buffers)
    assert b"".join(buffers) == data[50:67]


def test_memory_filesystem_checkpoint(tmp_path: Path) -> None:
    save_file(A, str(tmp_path / "model.safetensors"))
    fsspec.filesystem("memory").pipe(
        "/mem-ckpt/model.safetensors", (tmp_path / "model.safetensors").read_bytes()
    )
    try:
        catalog = _scan("memory://mem-ckpt")
        assert set(catalog.entries) == set(A) and catalog.files == ("model.safetensors",)
    finally:
        fsspec.filesystem("memory").rm("/mem-ckpt", recursive=True)
