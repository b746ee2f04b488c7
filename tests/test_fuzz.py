"""Fuzzing the parsers: mutated safetensors headers and index files only ever raise our errors.

``make test`` runs a few hundred cases per property; ``make fuzz`` runs the dedicated
10,000-case run (``HP_DCP_HF_FUZZ_EXAMPLES``). Every generated file either parses into entries that
stay inside the file, or raises an :mod:`hp_dcp_hf.errors` type: any other exception, a crash or a
huge allocation is a failure.
"""

from __future__ import annotations

import json
import os
import struct

import fsspec
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from hp_dcp_hf.errors import HPDCPHFError
from hp_dcp_hf.storage import CheckpointLocation, ReadStats, parse_index, read_header

EXAMPLES = int(os.environ.get("HP_DCP_HF_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

_VALID = save({
    "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "b": torch.ones(4, dtype=torch.bfloat16),
    "c": torch.zeros((), dtype=torch.int64),
    "d": torch.tensor([True, False]),
}, metadata={"format": "pt"})
_HEADER_LEN = struct.unpack("<Q", _VALID[:8])[0]
_HEADER = json.loads(_VALID[8 : 8 + _HEADER_LEN])
_DATA = _VALID[8 + _HEADER_LEN :]

_fs = fsspec.filesystem("memory")
_location = CheckpointLocation(_fs, "/fuzz")


def _parse(blob: bytes):
    """Parse ``blob`` as a file; return its entries or the typed error it raised."""
    _fs.pipe_file("/fuzz/model.safetensors", blob)
    try:
        header = read_header(_location, "model.safetensors", ReadStats())
    except HPDCPHFError as error:
        assert error.file == "model.safetensors"
        return error
    for entry in header.entries:
        assert 0 <= entry.data_start <= entry.data_start + entry.nbytes <= len(blob)
    return header


def _file(header: object, data: bytes = _DATA, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def test_the_unmutated_file_parses():
    header = _parse(_VALID)
    assert not isinstance(header, HPDCPHFError) and {e.key for e in header.entries} == {"a", "b", "c", "d"}


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=8,
)


@FUZZ
@given(
    key=st.sampled_from(["a", "b", "c", "d", "__metadata__"]),
    field=st.sampled_from(["dtype", "shape", "data_offsets", "extra", None]),
    value=_json_values | st.sampled_from(["F8_E4M3", "BF16", "I64", "BOOL", "F4", "F6_E2M3", "Q4", ""]),
)
def test_mutated_header_fields(key, field, value):
    header = json.loads(json.dumps(_HEADER))
    if field is None:
        header[key] = value
    elif isinstance(header.get(key), dict):
        header[key][field] = value
    _parse(_file(header))


@FUZZ
@given(position=st.integers(0, 8 + _HEADER_LEN + len(_DATA) - 1), byte=st.integers(0, 255),
       cut=st.integers(0, 8 + _HEADER_LEN + len(_DATA)))
def test_flipped_and_truncated_bytes(position, byte, cut):
    blob = bytearray(_VALID)
    blob[position] = byte
    _parse(bytes(blob[:cut]) if cut % 3 == 0 else bytes(blob))


@FUZZ
@given(length=st.integers(0, 2**64 - 1) | st.sampled_from([2**63, 2**64 - 1, 100_000_001, 0, 1, 7]))
def test_header_lengths_are_refused_before_any_allocation(length):
    parsed = _parse(_file(_HEADER, length=length))
    assert isinstance(parsed, HPDCPHFError) or length == len(json.dumps(_HEADER).encode())


@FUZZ
@given(st.binary(max_size=64), st.sampled_from([b"", b"\xff\xfe", b"{", b'{"a":1,"a":2}']))
def test_raw_header_bytes(raw, prefix):
    _parse(_file(prefix + raw))


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 64), st.integers(0, 64)), min_size=4, max_size=4))
def test_overlapping_and_out_of_file_offsets(offsets):
    header = json.loads(json.dumps(_HEADER))
    for key, (begin, end) in zip("abcd", offsets):
        header[key]["data_offsets"] = [begin, end]
    _parse(_file(header))


_names = st.sampled_from(["model.safetensors", "../x.safetensors", "/etc/passwd", "a/../b.safetensors",
                          "s3://b/x.safetensors", "C:\\x.safetensors", "pytorch_model.bin", "x.pt", "",
                          "sub/ok.safetensors", "a//b.safetensors"]) | _json_values


@FUZZ
@given(st.dictionaries(st.text(max_size=5), _names, max_size=4) | _json_values, st.booleans())
def test_index_files(weight_map, wrapped):
    raw = json.dumps({"metadata": {}, "weight_map": weight_map} if wrapped else weight_map).encode()
    try:
        parsed = parse_index(raw)
    except HPDCPHFError:
        return
    for name in parsed.values():
        parts = name.split("/")
        assert name.endswith(".safetensors") and ".." not in parts and not name.startswith("/")
