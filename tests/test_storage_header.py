"""safetensors header parsing: real files from the ``safetensors`` package, and one broken file per rule."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import save_file

from hp_dcp_hf.errors import CheckpointFormatError, UnsupportedDtypeError
from hp_dcp_hf.storage.format.dtypes import SAFETENSORS_DTYPES, lookup_dtype
from hp_dcp_hf.storage.format.header import MAX_HEADER_BYTES, read_header
from hp_dcp_hf.storage.transport import location as location_module
from hp_dcp_hf.storage.transport.location import CheckpointLocation
from hp_dcp_hf.storage.transport.stats import ReadStats

BAD = "bad.safetensors"


def _read(tmp_path: Path, name: str, stats: ReadStats | None = None):
    return read_header(CheckpointLocation(LocalFileSystem(), str(tmp_path)), name, stats or ReadStats())


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Any bit pattern of ``dtype`` (bytes are compared, not values); bools stay 0/1."""
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    numel = torch.Size(shape).numel()
    raw = torch.randint(0, 256, (max(numel, 1) * dtype.itemsize,), dtype=torch.uint8)
    return raw.view(dtype)[:numel].reshape(shape)


def _bytes_of(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _raw_header(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


def test_dtype_table_covers_what_torch_has() -> None:
    expected = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"}
    expected |= {
        "U16",
        "U32",
        "U64",
        "C64",
        "F4",
        "F8_E4M3",
        "F8_E5M2",
        "F8_E8M0",
        "F8_E4M3FNUZ",
        "F8_E5M2FNUZ",
    }
    assert set(SAFETENSORS_DTYPES) == expected
    assert lookup_dtype("F8_E4M3").torch_dtype == torch.float8_e4m3fn
    assert lookup_dtype("F4").pack == 2 and lookup_dtype("F4").torch_shape([3, 4]) == (3, 2)


@pytest.mark.parametrize("name", ["F6_E2M3", "F33", 7, None])
def test_unknown_dtype_is_never_defaulted(name: object) -> None:
    with pytest.raises(UnsupportedDtypeError) as info:
        lookup_dtype(name, file="f.safetensors", key="k")
    assert (info.value.file, info.value.key) == ("f.safetensors", "k")


def test_valid_file_every_dtype_scalar_empty_metadata(tmp_path: Path) -> None:
    tensors = {f"t.{name}": _random_tensor(d.torch_dtype, (2, 3)) for name, d in SAFETENSORS_DTYPES.items()}
    tensors["scalar"] = torch.tensor(1.5, dtype=torch.float64)
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    tensors["empty_f8"] = torch.zeros(3, 0, dtype=torch.float8_e5m2)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    n, raw = _raw_header(path)
    file_bytes = path.read_bytes()

    header = _read(tmp_path, "model.safetensors")

    assert header.metadata == {"format": "pt", "note": "x"}
    assert header.header_len == n
    assert [e.data_start for e in header.entries] == sorted(e.data_start for e in header.entries)
    entries = {e.key: e for e in header.entries}
    assert set(entries) == set(tensors)
    for key, tensor in tensors.items():
        entry = entries[key]
        assert entry.file == "model.safetensors"
        assert entry.dtype == tensor.dtype and entry.shape == tuple(tensor.shape), key
        assert entry.dtype_name == raw[key]["dtype"]
        assert entry.data_start == 8 + n + raw[key]["data_offsets"][0]
        assert file_bytes[entry.data_start : entry.data_end] == _bytes_of(tensor), key
    assert entries["t.F4"].shape == (2, 3) and raw["t.F4"]["shape"] == [2, 6]


def test_header_is_read_with_two_exact_ranged_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_file({"big": torch.zeros(256, 1024), "small": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    n, _ = _raw_header(tmp_path / "m.safetensors")
    reads: list[tuple[int, int]] = []
    original = location_module._LocalFile.read_into

    def spy(self, start, buffers):
        reads.append((start, sum(memoryview(b).nbytes for b in buffers)))
        return original(self, start, buffers)

    monkeypatch.setattr(location_module._LocalFile, "read_into", spy)
    stats = ReadStats()
    _read(tmp_path, "m.safetensors", stats)
    assert reads == [(0, 8), (8, n)]
    assert stats.total().header_bytes == 8 + n and stats.total().header_requests == 2
    assert stats.total().bytes_read == 0 and stats.total().requests == 0


def _write(tmp_path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    (tmp_path / BAD).write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def _f32(offsets: list, shape: list | None = None) -> dict:
    return {"dtype": "F32", "shape": [2] if shape is None else shape, "data_offsets": offsets}


def _case(
    name: str,
    header: dict | bytes,
    words: str,
    *,
    data: bytes = b"",
    length: int | None = None,
    key: str | None = "a",
    error: type = CheckpointFormatError,
):
    """One broken file: its header, tensor bytes, length prefix override; the error, key and words."""
    return pytest.param(header, data, length, error, key, words, id=name)


def _dtype(name: object, shape: list, offsets: list) -> dict:
    return {"a": {"dtype": name, "shape": shape, "data_offsets": offsets}}


INVALID = [
    _case("header_cap", b"{}", "cap", length=2**63, key=None),
    _case("header_cap_plus_one", b"{}", "cap", length=MAX_HEADER_BYTES + 1, key=None),
    _case("header_past_eof", b"{}", "past the end", length=1000, key=None),
    _case("not_brace_first", b' {"a": 1}', "start with", key=None),
    _case("not_utf8", b'{"\xff": 1}', "UTF-8", key=None),
    _case("not_json", b'{"a": ', "JSON", key=None),
    _case("duplicate_key", b'{"a": {}, "a": {}}', "duplicate"),
    _case("metadata_not_str", {"__metadata__": {"x": 1}}, "strings", key="__metadata__"),
    _case("metadata_not_object", {"__metadata__": "x"}, "strings", key="__metadata__"),
    _case("info_not_object", {"a": 3}, "object"),
    _case("missing_dtype", {"a": {"shape": [], "data_offsets": [0, 4]}}, "dtype"),
    _case("missing_shape", {"a": {"dtype": "F32", "data_offsets": [0, 4]}}, "shape"),
    _case("missing_offsets", {"a": {"dtype": "F32", "shape": []}}, "data_offsets"),
    _case("shape_negative", {"a": _f32([0, 8], [-2])}, "shape"),
    _case("shape_bool", {"a": _f32([0, 4], [True])}, "shape"),
    _case("shape_float", {"a": _f32([0, 8], [2.0])}, "shape"),
    _case("shape_not_list", {"a": _f32([0, 8], 2)}, "shape"),
    _case("offsets_three", {"a": _f32([0, 8, 8])}, "two", data=bytes(8)),
    _case("offsets_negative", {"a": _f32([-8, 0])}, "non-negative", data=bytes(8)),
    _case("offsets_bool", {"a": _f32([False, 8])}, "non-negative", data=bytes(8)),
    _case("unknown_dtype", _dtype("F33", [2], [0, 8]), "unknown", data=bytes(8), error=UnsupportedDtypeError),
    _case("dtype_not_str", _dtype(4, [2], [0, 8]), "unknown", data=bytes(8), error=UnsupportedDtypeError),
    _case(
        "dtype_without_torch",
        _dtype("F6_E2M3", [4], [0, 3]),
        "no torch",
        data=bytes(3),
        error=UnsupportedDtypeError,
    ),
    _case("byte_length", {"a": _f32([0, 4])}, "needs 8", data=bytes(4)),
    _case("end_before_begin", {"a": _f32([8, 0])}, "end before", data=bytes(8)),
    _case("overlap", {"a": _f32([0, 8]), "b": _f32([4, 12])}, "overlaps", data=bytes(12), key="b"),
    _case("gap", {"a": _f32([0, 8]), "b": _f32([12, 20])}, "gap", data=bytes(20), key="b"),
    _case("first_not_at_zero", {"a": _f32([4, 12])}, "begin at 0", data=bytes(12)),
    _case("trailing_bytes", {"a": _f32([0, 8])}, "file has", data=bytes(12), key=None),
    _case("data_past_eof", {"a": _f32([0, 8])}, "file has", data=bytes(4), key=None),
    _case("not_whole_bytes", _dtype("F4", [3], [0, 2]), "whole bytes", data=bytes(2)),
    _case("f4_odd_last_dim", _dtype("F4", [2, 3], [0, 3]), "pack", data=bytes(3)),
]


@pytest.mark.parametrize(("header", "data", "length", "error", "key", "words"), INVALID)
def test_invalid_header_rule(tmp_path: Path, header, data, length, error, key, words) -> None:
    _write(tmp_path, header, data, length)
    with pytest.raises(error) as info:
        _read(tmp_path, BAD)
    assert info.value.file == BAD
    assert info.value.key == key
    assert words in info.value.reason
    assert BAD in str(info.value)


def test_file_shorter_than_length_prefix(tmp_path: Path) -> None:
    (tmp_path / BAD).write_bytes(b"\x01\x00")
    with pytest.raises(CheckpointFormatError, match="too short") as info:
        _read(tmp_path, BAD)
    assert info.value.file == BAD


def test_valid_hand_made_file_with_padding_and_unknown_fields(tmp_path: Path) -> None:
    """Trailing spaces pad headers to alignment and unknown fields are ignored, as in the reference."""
    header = {"b": {**_f32([8, 16]), "extra": 1}, "a": _f32([0, 8])}
    raw = json.dumps(header).encode() + b"    "
    data = struct.pack("<4f", 1, 2, 3, 4)
    _write(tmp_path, raw, data)
    parsed = _read(tmp_path, BAD)
    assert [e.key for e in parsed.entries] == ["a", "b"]
    assert parsed.entries[1].data_start == 8 + len(raw) + 8
