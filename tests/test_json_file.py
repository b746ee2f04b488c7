"""The one size-capped JSON read (index, config.json, adapter_config.json): every refusal names the file."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest

from hp_dcp_hf.errors import CheckpointFormatError, CheckpointNotFoundError
from hp_dcp_hf.storage import ReadStats, filesystem, locate
from hp_dcp_hf.storage.format.json_file import read_json
from tests.support.servers.range_server import StaticRangeServer

NAME = "config.json"


def _location(root: Path):
    location, _ = locate(*filesystem(str(root)))
    return location


def _refusal(root: Path, raw: bytes, error: type[Exception], *, cap: int = 1000) -> Exception:
    (root / NAME).write_bytes(raw)
    with pytest.raises(error) as info:
        read_json(_location(root), NAME, cap=cap)
    return info.value


def test_reads_the_object_and_counts_its_bytes(tmp_path: Path) -> None:
    raw = json.dumps({"model_type": "llama", "nested": {"a": [1, 2.5, None]}}).encode()
    (tmp_path / NAME).write_bytes(raw)
    stats = ReadStats()
    assert read_json(_location(tmp_path), NAME, cap=len(raw), stats=stats) == json.loads(raw)
    assert (stats.per_file[NAME].header_bytes, stats.per_file[NAME].header_requests) == (len(raw), 1)


def test_over_the_cap_is_refused_before_it_is_read(tmp_path: Path) -> None:
    error = _refusal(tmp_path, b'{"a": 1}' + b" " * 100, CheckpointFormatError, cap=100)
    assert error.file == str(tmp_path / NAME)
    assert error.reason == "108 bytes exceeds the 100-byte cap"


@pytest.mark.parametrize(("raw", "reason"), [
    (b'{"a": ', "not valid JSON"),
    (b'{"a": "\xff"}', "not valid UTF-8"),
    (b"[1, 2]", "JSON is a list, not an object"),
    (b'"text"', "JSON is a str, not an object"),
])
def test_not_a_json_object_is_refused(tmp_path: Path, raw: bytes, reason: str) -> None:
    error = _refusal(tmp_path, raw, CheckpointFormatError)
    assert error.file == str(tmp_path / NAME) and error.reason.startswith(reason), error


def test_a_duplicate_key_is_refused_naming_it(tmp_path: Path) -> None:
    error = _refusal(tmp_path, b'{"a": 1, "b": {"c": 1, "c": 2}}', CheckpointFormatError)
    assert (error.file, error.key, error.reason) == (str(tmp_path / NAME), "c", "duplicate JSON key")


def test_a_missing_file_gives_the_callers_reason(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError) as info:
        read_json(_location(tmp_path), NAME, cap=1000)
    assert (info.value.file, info.value.reason) == (str(tmp_path / NAME), "file does not exist")
    with pytest.raises(CheckpointNotFoundError) as info:
        read_json(_location(tmp_path), NAME, cap=1000, missing="no config.json; pass config=")
    assert str(info.value) == f"file {str(tmp_path / NAME)!r}: no config.json; pass config="


def test_errors_name_the_file_as_asked(tmp_path: Path) -> None:
    """``file=`` names it as the caller's other errors do (the catalog: relative to the checkpoint)."""
    (tmp_path / NAME).write_bytes(b"[]")
    with pytest.raises(CheckpointFormatError) as info:
        read_json(_location(tmp_path), NAME, cap=1000, file=NAME)
    assert info.value.file == NAME


def test_a_remote_file_is_named_by_its_url() -> None:
    root = f"memory:///json-file-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{root}/{NAME}", b"[]")
    location, _ = locate(*filesystem(root))
    with pytest.raises(CheckpointFormatError) as info:
        read_json(location, NAME, cap=1000)
    assert info.value.file == f"{root}/{NAME}"
    with pytest.raises(CheckpointNotFoundError) as info:
        read_json(location, "adapter_config.json", cap=1000)
    assert info.value.file == f"{root}/adapter_config.json"


def test_over_http_one_head_and_one_ranged_get_and_errors_name_the_url(tmp_path: Path) -> None:
    """Each caller's file (config.json, adapter_config.json) costs a HEAD (its size) and one ranged
    GET; a missing one is one HEAD and names its URL with the caller's reason."""
    from hp_dcp_hf.integrations.peft import read_adapter_config
    from hp_dcp_hf.model.config import read_config
    from tests.support.models import tiny_config

    tiny_config("llama").save_pretrained(tmp_path / "base")
    (tmp_path / "adapter").mkdir()
    with StaticRangeServer(tmp_path) as server:
        assert read_config(f"{server.url}/base").model_type == "llama"
        assert [(r.method, r.path) for r in server.log] == [("HEAD", "/base/config.json"), ("GET", "/base/config.json")]
        server.reset()
        with pytest.raises(CheckpointNotFoundError) as info:
            read_adapter_config(f"{server.url}/adapter")
        assert info.value.file == f"{server.url}/adapter/adapter_config.json"
        assert "peft's save_pretrained writes it" in info.value.reason
        assert [(r.method, r.path) for r in server.log] == [("HEAD", "/adapter/adapter_config.json")]
