"""safetensors headers: read with two ranged requests, validated like the reference implementation.

Layout: 8 bytes little-endian header length N, N bytes of UTF-8 JSON, then the tensor data. The
header is the only part of a file read without a plan, so it is fetched as exactly ``8 + N`` bytes
(never the whole file, never an mmap) and checked before anything trusts it: the size cap before
allocating, offsets contiguous from 0 to the end of the file, byte lengths equal to
``numel * itemsize``. A header that breaks a rule raises :class:`CheckpointFormatError` (or
:class:`UnsupportedDtypeError`) naming the file, the key and the rule.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hp_dcp_hf.errors import CheckpointFormatError
from hp_dcp_hf.storage.dtypes import lookup_dtype
from hp_dcp_hf.storage.location import CheckpointLocation
from hp_dcp_hf.storage.stats import ReadStats

HEADER_LEN_BYTES = 8
MAX_HEADER_BYTES = 100_000_000
"""The reference implementation's cap on N, checked before anything is allocated for the header."""

METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class TensorEntry:
    """Where one checkpoint tensor lives: enough to turn any box of it into absolute byte ranges.

    ``shape`` and ``dtype`` are the torch tensor's (for F4, two values per ``float4_e2m1fn_x2``
    element, so the last dim is half the header's); ``data_start`` is absolute in the file.
    """

    key: str
    file: str
    dtype_name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data_start: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def data_end(self) -> int:
        return self.data_start + self.nbytes


@dataclass(frozen=True)
class FileHeader:
    """A parsed header: its ``__metadata__`` and its tensors in file order."""

    file: str
    header_len: int
    metadata: Mapping[str, str]
    entries: tuple[TensorEntry, ...]


def _reject_duplicates(file: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise CheckpointFormatError("duplicate JSON key", file=file, key=key)
            seen[key] = value
        return seen

    return hook


def loads_json_object(raw: bytes, *, file: str) -> dict[str, Any]:
    """``raw`` as a JSON object: UTF-8, no duplicate keys at any level, an object at the top."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"not valid UTF-8: {e}", file=file) from e
    try:
        value = json.loads(text, object_pairs_hook=_reject_duplicates(file))
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"not valid JSON: {e}", file=file) from e
    if not isinstance(value, dict):
        raise CheckpointFormatError(f"JSON is a {type(value).__name__}, not an object", file=file)
    return value


def _is_count(value: object) -> bool:
    # JSON true/false parse as Python bools, which are ints: refuse them explicitly.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_metadata(value: object, file: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise CheckpointFormatError("__metadata__ must map strings to strings", file=file, key=METADATA_KEY)
    return value


def _parse_entry(key: str, info: object, file: str, data_base: int) -> tuple[TensorEntry, int, int]:
    """The entry and its relative ``data_offsets``; every field checked for type and consistency."""
    if not isinstance(info, dict):
        raise CheckpointFormatError("tensor info must be an object", file=file, key=key)
    missing = [field for field in ("dtype", "shape", "data_offsets") if field not in info]
    if missing:
        raise CheckpointFormatError(f"tensor info lacks {', '.join(missing)}", file=file, key=key)
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointFormatError(
            f"shape must be a list of non-negative ints, got {shape!r}", file=file, key=key
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise CheckpointFormatError(
            f"data_offsets must be two non-negative ints, got {offsets!r}", file=file, key=key
        )
    dtype = lookup_dtype(info["dtype"], file=file, key=key)
    begin, end = offsets
    if end < begin:
        raise CheckpointFormatError(f"data_offsets {offsets} end before they begin", file=file, key=key)
    nbytes = dtype.nbytes(shape)
    if nbytes is None:
        raise CheckpointFormatError(
            f"{dtype.name} tensor of shape {shape} is not whole bytes", file=file, key=key
        )
    if end - begin != nbytes:
        raise CheckpointFormatError(
            f"data_offsets {offsets} span {end - begin} bytes but {dtype.name} {shape} needs {nbytes}",
            file=file,
            key=key,
        )
    torch_shape = dtype.torch_shape(shape)
    if torch_shape is None:
        raise CheckpointFormatError(
            f"{dtype.name} shape {shape} does not pack into {dtype.torch_dtype}", file=file, key=key
        )
    entry = TensorEntry(key, file, dtype.name, dtype.torch_dtype, torch_shape, data_base + begin, nbytes)
    return entry, begin, end


def parse_header(raw: bytes, *, file: str, file_size: int) -> FileHeader:
    """Validate the JSON header ``raw`` of ``file`` (``file_size`` bytes in all) and locate its tensors."""
    if not raw.startswith(b"{"):
        raise CheckpointFormatError("header does not start with '{'", file=file)
    header = loads_json_object(raw, file=file)
    data_base = HEADER_LEN_BYTES + len(raw)
    metadata = _parse_metadata(header.pop(METADATA_KEY, {}), file)
    parsed = sorted(
        (_parse_entry(key, info, file, data_base) for key, info in header.items()),
        key=lambda item: (item[1], item[2]),
    )
    # The reference rule: sorted by offsets, each tensor begins where the previous one ended,
    # the first at 0, and the last ends exactly at the end of the file.
    expected = 0
    for entry, begin, end in parsed:
        if begin != expected:
            what = (
                "overlaps the previous tensor"
                if begin < expected
                else "leaves a gap after the previous tensor"
            )
            raise CheckpointFormatError(
                f"data_offsets [{begin}, {end}] {what} (expected to begin at {expected})",
                file=file,
                key=entry.key,
            )
        expected = end
    if data_base + expected != file_size:
        raise CheckpointFormatError(
            f"tensor data ends at byte {data_base + expected} but the file has {file_size} bytes", file=file
        )
    return FileHeader(file, len(raw), metadata, tuple(entry for entry, _, _ in parsed))


def read_header(location: CheckpointLocation, file: str, stats: ReadStats) -> FileHeader:
    """Read and validate ``file``'s header with two ranged reads (8 bytes, then N bytes)."""
    file_size = location.size(file)
    if file_size < HEADER_LEN_BYTES:
        raise CheckpointFormatError(f"{file_size} bytes is too short for a safetensors file", file=file)
    with location.open(file) as handle:
        (header_len,) = struct.unpack("<Q", handle.read(0, HEADER_LEN_BYTES))
        stats.add(file, header_bytes=HEADER_LEN_BYTES, header_requests=1)
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointFormatError(
                f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte cap", file=file
            )
        if header_len > file_size - HEADER_LEN_BYTES:
            raise CheckpointFormatError(
                f"header length {header_len} runs past the end of the {file_size}-byte file", file=file
            )
        raw = handle.read(HEADER_LEN_BYTES, HEADER_LEN_BYTES + header_len)
        stats.add(file, header_bytes=header_len, header_requests=1)
    return parse_header(raw, file=file, file_size=file_size)
