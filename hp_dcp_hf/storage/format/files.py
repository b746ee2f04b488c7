"""The files a save writes, decided before any byte is: names, headers, where each tensor's bytes go.

Every rank computes the same :class:`SavedFile` s from the same tensor specs (no data exchanged):
the split into files follows ``save_pretrained`` (``huggingface_hub``'s shard splitting with the same
``max_shard_size``, storage grouping, file names),
and each file is laid out as the safetensors format wants it: an 8-byte little-endian header
length, the JSON header (``__metadata__: {"format": "pt"}``, every tensor's dtype, shape and
``data_offsets``) padded with spaces to a multiple of 8, then the tensors' bytes, largest element
size first so every tensor starts aligned to its dtype.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.storage.format.dtypes import SAFETENSORS_DTYPES
from hp_dcp_hf.storage.format.header import METADATA_KEY

if TYPE_CHECKING:
    from hp_dcp_hf.storage.format.catalog import CheckpointTensor

FILE_PATTERN = "model{suffix}.safetensors"
_NAMES = {d.torch_dtype: name for name, d in SAFETENSORS_DTYPES.items() if d.pack == 1 and name != "F8_E8M0"}


@dataclass(frozen=True)
class SavedTensor:
    """A tensor of a file being written: its bytes are ``[start, start + nbytes)`` of the file."""

    key: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class SavedFile:
    """One safetensors file: its header bytes (length prefix included), its tensors, its size."""

    name: str
    header: bytes
    tensors: tuple[SavedTensor, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


def save_pretrained_max_shard_size() -> int | str:
    """``save_pretrained``'s default ``max_shard_size`` in the installed transformers ("50GB" in 5.x)."""
    import inspect

    from transformers import PreTrainedModel

    return inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default


def source_shard_size(entries: Iterable[CheckpointTensor], dtype: torch.dtype | None = None) -> int | None:
    """The ``max_shard_size`` that saves a checkpoint's tensors (``entries``, its catalog's) into the
    files it has: its largest file's tensor bytes, each floating-point tensor counted in ``dtype``
    (the one the save writes; None: its own). ``save_pretrained``'s split is greedy (a file closes
    when the next tensor would pass the limit), so with the limit that wrote the source, or this one
    (no larger, and every source file fits), it closes each file where the source's closed, for the
    same tensors in the same order. None for one file (the default keeps it one)."""
    file_bytes: dict[str, int] = {}
    for entry in entries:
        itemsize = dtype.itemsize if dtype is not None and entry.dtype.is_floating_point else entry.dtype.itemsize
        for part in entry.parts:
            file_bytes[part.file] = file_bytes.get(part.file, 0) + part.nbytes // entry.dtype.itemsize * itemsize
    return max(file_bytes.values()) if len(file_bytes) > 1 else None


def layout_file(name: str, specs: Mapping[str, tuple[torch.dtype, Sequence[int]]],
                metadata: Mapping[str, str] | None = None) -> SavedFile:
    """File ``name`` holding ``specs`` (key -> (dtype, shape)), laid out as safetensors does;
    ``metadata`` joins ``{"format": "pt"}`` in the header's ``__metadata__``, a name no tensor may
    take (:class:`MappingError` naming it)."""
    if METADATA_KEY in specs:
        raise MappingError(f"a tensor cannot be named {METADATA_KEY!r} in a safetensors file: the header's "
                           "metadata has that name (rename the parameter, or map it to another key)",
                           file=name, key=METADATA_KEY)
    order = sorted(specs, key=lambda key: (-specs[key][0].itemsize, key))
    header: dict[str, object] = {METADATA_KEY: {"format": "pt", **(metadata or {})}}
    offset = 0
    for key in order:
        dtype, shape = specs[key]
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    tensors, start = [], len(prefix)
    for key in order:
        dtype, shape = specs[key]
        tensors.append(SavedTensor(key, name, dtype, tuple(int(s) for s in shape), start))
        start += tensors[-1].nbytes
    return SavedFile(name, prefix, tuple(tensors))


def layout_files(
    specs: Mapping[str, tuple[torch.dtype, Sequence[int]]],
    max_shard_size: int | str | None,
    storage: Mapping[str, tuple[int, int]] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> tuple[list[SavedFile], dict | None]:
    """The files ``save_pretrained`` would write for ``specs`` (in its order), and the index it would
    write next to them (None for a single file).

    ``storage``: key -> (storage group, elements of that storage). ``save_pretrained`` splits by
    storage, not by tensor: tensors that are views of one storage (the per-expert weights
    ``revert_weight_conversion`` cuts out of a stacked experts parameter) count that storage once,
    at the first of them, and go to that one's file. By default every tensor is its own storage.
    ``metadata``: more ``__metadata__`` for every file (the save id).
    """
    from huggingface_hub import split_state_dict_into_shards_factory

    if max_shard_size is None:
        max_shard_size = save_pretrained_max_shard_size()

    storage = storage or {key: (i, math.prod(shape)) for i, (key, (_, shape)) in enumerate(specs.items())}
    split = split_state_dict_into_shards_factory(
        {key: key.encode() for key in specs},  # (bytes: the factory skips str values)
        get_storage_size=lambda key: storage[key.decode()][1] * specs[key.decode()][0].itemsize,
        get_storage_id=lambda key: storage[key.decode()][0],
        filename_pattern=FILE_PATTERN,
        max_shard_size=max_shard_size,
    )
    files = [layout_file(name, {k: specs[k] for k in keys}, metadata) for name, keys in split.filename_to_tensors.items()]
    if not split.is_sharded:
        return files, None
    return files, {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
