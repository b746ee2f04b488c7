"""safetensors headers: read with two ranged requests, validated like the reference implementation.

Layout: 8 bytes little-endian header length N, N bytes of UTF-8 JSON, then the tensor data. The
header is the only part of a file read without a plan, so it is fetched as exactly ``8 + N`` bytes
(never the whole file, never an mmap) and checked before anything trusts it: the size cap before
allocating, offsets contiguous from 0 to the end of the file, byte lengths equal to
``numel * itemsize``. A header that breaks a rule raises :class:`CheckpointFormatError` (or
:class:`UnsupportedDtypeError`) naming the file, the key and the rule.

Files torch's ``HuggingFaceStorageWriter`` writes (one per rank with ``save_distributed=True``)
hold chunks of tensors: their ``__metadata__`` has ``DCP_SHARDING_INFO``, a JSON object mapping
every key of the file to ``{"saved_offsets": [...]}``, where the chunk starts in the whole tensor.
Those offsets are checked here as strictly as the rest of the header; whether the chunks of a key
tile its tensor is the catalog's business, once every header is read.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from hp_dcp_hf.errors import CheckpointFormatError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.storage.format.dtypes import lookup_dtype
from hp_dcp_hf.storage.format.json_file import loads_json_object
from hp_dcp_hf.storage.transport.location import CheckpointLocation
from hp_dcp_hf.storage.transport.stats import ReadStats

HEADER_LEN_BYTES = 8
MAX_HEADER_BYTES = 100_000_000
"""The reference implementation's cap on N, checked before anything is allocated for the header."""

METADATA_KEY = "__metadata__"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
"""The ``__metadata__`` entry torch's ``HuggingFaceStorageWriter`` places chunks with (``_hf_utils``)."""
SAVED_OFFSETS_KEY = "saved_offsets"


@dataclass(frozen=True)
class TensorEntry:
    """Where one checkpoint tensor lives: enough to turn any box of it into absolute byte ranges.

    ``shape`` and ``dtype`` are the torch tensor's (for F4, two values per ``float4_e2m1fn_x2``
    element, so the last dim is half the header's); ``data_start`` is absolute in the file.
    ``offsets``: where this tensor starts in the tensor of its key when the file's
    ``DCP_SHARDING_INFO`` places it (a chunk of a tensor torch's writer split across files);
    ``None`` when the file holds the key's tensor whole, with nothing to place it.
    """

    key: str
    file: str
    dtype_name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data_start: int
    nbytes: int
    offsets: tuple[int, ...] | None = None

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @cached_property
    def box(self) -> Box:
        """The elements this entry holds, in the coordinates of its key's whole tensor."""
        return Box(self.offsets or (0,) * len(self.shape), self.shape)

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


def _is_count(value: object) -> bool:
    # JSON true/false parse as Python bools, which are ints: refuse them explicitly.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_metadata(value: object, file: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise CheckpointFormatError("__metadata__ must map strings to strings", file=file, key=METADATA_KEY)
    return value


def _parse_sharding_info(metadata: Mapping[str, str], file: str) -> dict[str, tuple[int, ...]] | None:
    """``DCP_SHARDING_INFO`` as key -> saved offsets (``None`` without it), every field checked."""
    raw = metadata.get(SHARDING_INFO_KEY)
    if raw is None:
        return None
    try:
        info = loads_json_object(raw.encode(), file=file)
    except CheckpointFormatError as e:
        reason = f"{SHARDING_INFO_KEY} in __metadata__: {e.reason}"
        raise CheckpointFormatError(reason, file=file, key=e.key) from e
    offsets = {}
    for key, value in info.items():
        saved = value.get(SAVED_OFFSETS_KEY) if isinstance(value, dict) else None
        if not isinstance(saved, list) or not all(_is_count(o) for o in saved):
            raise CheckpointFormatError(
                f"{SHARDING_INFO_KEY} must give each key {{{SAVED_OFFSETS_KEY!r}: [non-negative ints]}}, "
                f"got {value!r}",
                file=file,
                key=key,
            )
        offsets[key] = tuple(saved)
    return offsets


def _place(entry: TensorEntry, sharding: Mapping[str, tuple[int, ...]]) -> TensorEntry:
    """``entry`` with the offsets ``DCP_SHARDING_INFO`` gives it, which must have one per dim."""
    offsets = sharding.get(entry.key)
    if offsets is None:
        raise CheckpointFormatError(
            f"the file's {SHARDING_INFO_KEY} places other keys but not this one",
            file=entry.file,
            key=entry.key,
        )
    if len(offsets) != len(entry.shape):
        raise CheckpointFormatError(
            f"{SHARDING_INFO_KEY} gives {SAVED_OFFSETS_KEY} {list(offsets)} to a tensor of shape "
            f"{list(entry.shape)}",
            file=entry.file,
            key=entry.key,
        )
    return replace(entry, offsets=offsets)


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
    entries = tuple(entry for entry, _, _ in parsed)
    sharding = _parse_sharding_info(metadata, file)
    if sharding is not None:
        stray = sorted(set(sharding) - {entry.key for entry in entries})
        if stray:
            raise CheckpointFormatError(
                f"{SHARDING_INFO_KEY} places a key the file does not hold", file=file, key=", ".join(stray)
            )
        entries = tuple(_place(entry, sharding) for entry in entries)
    return FileHeader(file, len(raw), metadata, entries)


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
