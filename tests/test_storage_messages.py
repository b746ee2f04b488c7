"""What the storage layer's errors say to someone new to it (a newcomer's first-hour trial).

- the index file's own path names its directory; other non-safetensors files say what to pass;
- remote paths are named as URLs (``s3://bucket/key``), never as scheme-less paths that read as local;
- a Hub that nothing answered for "could not be reached", naming the endpoint, never "answered";
- the pickle hint names a conversion that works with transformers 5 (whose ``save_pretrained``
  writes safetensors whatever ``safe_serialization`` says).
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import huggingface_hub
import pytest
import torch
from safetensors.torch import save_file

from hp_dcp_hf import HFStorageReader
from hp_dcp_hf.errors import CheckpointFormatError, CheckpointNotFoundError, UnsafeCheckpointError
from hp_dcp_hf.storage.format.catalog import INDEX_FILE
from hp_dcp_hf.storage.transport.backend import UnreachableError
from hp_dcp_hf.tools.launch import free_port
from tests.support.servers.s3 import MotoS3

FAST = {"attempts": 2, "backoff_s": 0.01, "max_backoff_s": 0.02, "deadline_s": 5.0, "connect_timeout_s": 2.0}


def _checkpoint(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    save_file({"a": torch.arange(4.0)}, str(root / "model-00001-of-00001.safetensors"))
    (root / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    (root / "config.json").write_text("{}")
    return root


def test_the_index_file_names_its_directory(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path)
    reader = HFStorageReader(root / INDEX_FILE)
    assert list(reader.read_metadata().state_dict_metadata) == ["a"]
    assert reader.resolved_root == str(root) and HFStorageReader.validate_checkpoint_id(root / INDEX_FILE)
    with pytest.raises(CheckpointFormatError) as info:
        HFStorageReader(root / "config.json").read_metadata()
    assert (
        info.value.reason == "not a .safetensors file: pass a .safetensors file or the checkpoint's directory"
    )
    assert info.value.file == str(root / "config.json")


def test_the_pickle_hint_works_with_transformers_5(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 pickle")
    with pytest.raises(UnsafeCheckpointError) as info:
        HFStorageReader(tmp_path).read_metadata()
    assert "safe_serialization" not in info.value.reason
    assert (
        "load it once with transformers' from_pretrained and save it with save_pretrained(dir)"
        in info.value.reason
    )


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("s3")
    server = MotoS3(root / "recording.jsonl")
    try:
        server.create_bucket("hp-messages")
        server.upload_dir(_checkpoint(root / "ckpt"), "hp-messages", "ckpt")
        (root / "pickle").mkdir()
        (root / "pickle" / "pytorch_model.bin").write_bytes(b"\x80\x04 pickle")
        server.upload_dir(root / "pickle", "hp-messages", "pickle")
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("path", "error", "reason"),
    [
        ("s3://hp-messages/nothing/here", CheckpointNotFoundError, "no such file or directory"),
        ("s3://hp-no-such-bucket/x", CheckpointNotFoundError, "no such file or directory"),
        ("s3://hp-messages/pickle", UnsafeCheckpointError, "pickle checkpoints are never loaded"),
        ("s3://hp-messages/ckpt/config.json", CheckpointFormatError, "not a .safetensors file"),
        ("s3://hp-messages", CheckpointNotFoundError, "directory holds no .safetensors files"),
    ],
)
def test_s3_errors_name_the_url(s3, path: str, error: type, reason: str) -> None:
    with pytest.raises(error) as info:
        HFStorageReader(path, storage_options=s3.storage_options(), retry=FAST).read_metadata()
    assert info.value.file == path and info.value.reason.startswith(reason)
    assert str(info.value).startswith(f"file {path!r}: ")


def test_s3_index_file_names_its_directory(s3) -> None:
    reader = HFStorageReader(f"s3://hp-messages/ckpt/{INDEX_FILE}", storage_options=s3.storage_options())
    assert list(reader.read_metadata().state_dict_metadata) == ["a"]


@pytest.mark.parametrize(
    ("path", "prefix"), [("org/repo", "no local directory 'org/repo', and "), ("hf://org/repo", "")]
)
def test_a_hub_nothing_answered_for_could_not_be_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, prefix: str
) -> None:
    monkeypatch.chdir(tmp_path)  # "org/repo" is no local path here
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    endpoint = f"http://127.0.0.1:{free_port()}"  # bound, released: nothing listens there
    with pytest.raises(UnreachableError) as info:
        HFStorageReader(path, endpoint=endpoint, token=False, retry=FAST).read_metadata()
    assert info.value.reason.startswith(f"{prefix}the Hub could not be reached at {endpoint}: "), (
        info.value.reason
    )
    # nothing ever answered: refused at once, not retried (the first-answer rule)
    assert f"resolve got no answer from {endpoint} (ConnectError" in info.value.reason
    assert "not retried as it never answered" in info.value.reason and "Hub answered" not in info.value.reason
    assert info.value.file == "hf://org/repo"


def test_metadata_is_read_with_collection_paused(tmp_path: Path) -> None:
    """The catalog's entries are built with the cyclic collector paused: in a process holding a
    model, full collections cost several times the work (see ``HFStorageReader.read_metadata``)."""
    tensors = {f"layers.{i}.w": torch.zeros(2) for i in range(2000)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = HFStorageReader(tmp_path)
    collections: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    threshold = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(200)
    try:
        [{} for _ in range(2000)]  # fewer objects than the read builds, outside it: collections
        assert len(collections) >= 5
        collections.clear()
        metadata = reader.read_metadata()
        # at most one, set off by entering the pause itself
        assert len(collections) <= 1 and len(metadata.state_dict_metadata) == 2000 and gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
