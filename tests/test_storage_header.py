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
from hp_dcp_hf.storage import location as location_module
from hp_dcp_hf.storage.dtypes import SAFETENSORS_DTYPES, lookup_dtype
from hp_dcp_hf.storage.header import MAX_HEADER_BYTES, read_header
from hp_dcp_hf.storage.location import CheckpointLocation
from hp_dcp_hf.storage.stats import ReadStats

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
    expected |= {"U16", "U32", "U64", "C64", "F4", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}
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


# (id, header, data bytes, length override, error type, key named, words of the reason)
INVALID = [
    ("header_cap", b"{}", b"", 2**63, CheckpointFormatError, None, "cap"),
    ("header_cap_plus_one", b"{}", b"", MAX_HEADER_BYTES + 1, CheckpointFormatError, None, "cap"),
    ("header_past_eof", b"{}", b"", 1000, CheckpointFormatError, None, "past the end"),
    ("not_utf8", b'{"\xff": 1}', b"", None, CheckpointFormatError, None, "UTF-8"),
    ("not_json", b'{"a": ', b"", None, CheckpointFormatError, None, "JSON"),
    ("not_object", b"[1, 2]", b"", None, CheckpointFormatError, None, "not an object"),
    ("duplicate_key", b'{"a": {}, "a": {}}', b"", None, CheckpointFormatError, "a", "duplicate"),
    ("metadata_not_str", {"__metadata__": {"x": 1}}, b"", None, CheckpointFormatError, "__metadata__", "strings"),
    ("metadata_not_object", {"__metadata__": "x"}, b"", None, CheckpointFormatError, "__metadata__", "strings"),
    ("info_not_object", {"a": 3}, b"", None, CheckpointFormatError, "a", "object"),
    ("missing_dtype", {"a": {"shape": [], "data_offsets": [0, 4]}}, b"", None, CheckpointFormatError, "a", "dtype"),
    ("missing_shape", {"a": {"dtype": "F32", "data_offsets": [0, 4]}}, b"", None, CheckpointFormatError, "a", "shape"),
    ("missing_offsets", {"a": {"dtype": "F32", "shape": []}}, b"", None, CheckpointFormatError, "a", "data_offsets"),
    ("shape_negative", {"a": _f32([0, 8], [-2])}, b"", None, CheckpointFormatError, "a", "shape"),
    ("shape_bool", {"a": _f32([0, 4], [True])}, b"", None, CheckpointFormatError, "a", "shape"),
    ("shape_float", {"a": _f32([0, 8], [2.0])}, b"", None, CheckpointFormatError, "a", "shape"),
    ("shape_not_list", {"a": _f32([0, 8], 2)}, b"", None, CheckpointFormatError, "a", "shape"),
    ("offsets_three", {"a": _f32([0, 8, 8])}, bytes(8), None, CheckpointFormatError, "a", "two"),
    ("offsets_negative", {"a": _f32([-8, 0])}, bytes(8), None, CheckpointFormatError, "a", "non-negative"),
    ("offsets_bool", {"a": _f32([False, 8])}, bytes(8), None, CheckpointFormatError, "a", "non-negative"),
    ("unknown_dtype", {"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), None,
     UnsupportedDtypeError, "a", "unknown"),
    ("dtype_not_str", {"a": {"dtype": 4, "shape": [2], "data_offsets": [0, 8]}}, bytes(8), None,
     UnsupportedDtypeError, "a", "unknown"),
    ("dtype_without_torch", {"a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}, bytes(3), None,
     UnsupportedDtypeError, "a", "no torch"),
    ("byte_length", {"a": _f32([0, 4])}, bytes(4), None, CheckpointFormatError, "a", "needs 8"),
    ("end_before_begin", {"a": _f32([8, 0])}, bytes(8), None, CheckpointFormatError, "a", "end before"),
    ("overlap", {"a": _f32([0, 8]), "b": _f32([4, 12])}, bytes(12), None, CheckpointFormatError, "b", "overlaps"),
    ("gap", {"a": _f32([0, 8]), "b": _f32([12, 20])}, bytes(20), None, CheckpointFormatError, "b", "gap"),
    ("first_not_at_zero", {"a": _f32([4, 12])}, bytes(12), None, CheckpointFormatError, "a", "begin at 0"),
    ("trailing_bytes", {"a": _f32([0, 8])}, bytes(12), None, CheckpointFormatError, None, "file has"),
    ("data_past_eof", {"a": _f32([0, 8])}, bytes(4), None, CheckpointFormatError, None, "file has"),
    ("not_whole_bytes", {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2), None,
     CheckpointFormatError, "a", "whole bytes"),
    ("f4_odd_last_dim", {"a": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}, bytes(3), None,
     CheckpointFormatError, "a", "pack"),
]


@pytest.mark.parametrize(("header", "data", "length", "error", "key", "words"), [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
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
