"""What a checkpoint holds: its safetensors files, every tensor and where it lives.

A checkpoint is a single ``.safetensors`` file, a directory with ``model.safetensors`` (read first,
as transformers does), a directory with ``model.safetensors.index.json`` (its ``weight_map`` says
which file holds which key), or a directory of ``*.safetensors`` files.
Passing the index file itself names its directory (the same checkpoint, read by the same rules).
The index is not trusted: the files it names must stay inside the directory and exist, and after
the headers are read every key must sit in the file the index says, and nothing else may. A key in
two files is an error, since either choice would be a silent guess, except where torch's
``HuggingFaceStorageWriter(save_distributed=True)`` wrote it: one file per rank
(``shard-0000r-model-0000k-of-0000n.safetensors``, no index), each chunk placed by the file's
``DCP_SHARDING_INFO``. Such a key is one :class:`CheckpointTensor` of several parts, as torch's own
reader rebuilds it (its shape the furthest chunk end in every dim), and its chunks must tile that
shape exactly, in one dtype. Pickle checkpoints are refused.
Files written by hp-dcp-hf carry their save's id (:mod:`hp_dcp_hf.storage.format.journal`): every file
read must carry the index's, so a mix of two saves is an error naming the odd files, not a load.

A :class:`Catalog` round-trips through JSON so that one rank can read every header and hand the
result to the others (never pickle: the bytes cross process boundaries). With the headers go the
files' versions (size and the backend's version tag, recorded when each header was read), against
which every rank's data reads are checked, so a file changed after its header was read raises
instead of loading bytes its header does not describe.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from hp_dcp_hf.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    InterruptedSaveError,
    MixedCheckpointError,
    UnsafeCheckpointError,
)
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.storage.format.dtypes import lookup_dtype
from hp_dcp_hf.storage.format.header import (
    MAX_HEADER_BYTES,
    SHARDING_INFO_KEY,
    FileHeader,
    TensorEntry,
    read_header,
)
from hp_dcp_hf.storage.format.journal import INDEX_FILE, JOURNAL_FILE, SAVE_ID_KEY, SINGLE_FILE
from hp_dcp_hf.storage.format.json_file import loads_json_object, read_json
from hp_dcp_hf.storage.transport.location import CheckpointLocation, FileVersion
from hp_dcp_hf.storage.transport.stats import ReadStats

CONFIG_FILE = "config.json"
QUANTIZATION_CONFIG = "hp_dcp_hf.quantization_config"
"""The key of ``Metadata.planner_data`` under which the reader hands ``config.json``'s
``quantization_config`` to the planner (see :mod:`hp_dcp_hf.quant.decode`)."""
SAFETENSORS_SUFFIX = ".safetensors"
_UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_CONVERT_HINT = (
    "pickle checkpoints are never loaded (unpickling runs arbitrary code); convert it to safetensors: "
    "load it once with transformers' from_pretrained and save it with save_pretrained(dir) (safetensors "
    "is all it writes), or use the Hub's safetensors convert space"
)


def _is_unsafe(name: str) -> bool:
    return name.endswith(_UNSAFE_SUFFIXES) or name.startswith("pytorch_model")


@dataclass(frozen=True)
class CheckpointTensor:
    """One key of a checkpoint: its tensor's dtype and shape, and the ``parts`` that hold its bytes.

    A tensor is stored whole in one file (one part), or in chunks across files, each part placed at
    its :attr:`TensorEntry.offsets`; the parts tile :attr:`shape` exactly (:func:`assemble` checks
    it). Readers split a box of the tensor by part (:meth:`pieces`); ``file`` and ``data_start``
    exist only for a tensor stored whole, so code that reads whole tensors fails clearly on chunks.
    """

    key: str
    dtype_name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: tuple[TensorEntry, ...]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @property
    def chunked(self) -> bool:
        """Stored in several chunks (a single part tiles the tensor alone: it is the whole tensor)."""
        return len(self.parts) > 1

    @property
    def whole(self) -> TensorEntry:
        """The one part of a tensor stored whole in one file (:class:`ValueError` for chunks)."""
        if self.chunked:
            raise ValueError(
                f"checkpoint tensor {self.key!r} is stored in {len(self.parts)} chunks "
                f"({self.parts[0].file!r}, ...: torch's distributed HF files), not whole in one file: "
                "read it through its parts"
            )
        return self.parts[0]

    @property
    def file(self) -> str:
        return self.whole.file

    @property
    def data_start(self) -> int:
        return self.whole.data_start

    @property
    def data_end(self) -> int:
        return self.whole.data_end

    def pieces(self, box: Box) -> list[tuple[TensorEntry, Box]]:
        """The parts ``box`` (in the tensor's coordinates) touches, each with the piece of it it holds."""
        if not self.chunked:
            return [(self.parts[0], box)]
        found = []
        for part in self.parts:
            piece = part.box.intersect(box)
            if piece is not None:
                found.append((part, piece))
        return found


def assemble(key: str, parts: Sequence[TensorEntry]) -> CheckpointTensor:
    """The tensor of ``key`` from its parts: one whole tensor, or chunks that tile their tensor.

    As torch's reader rebuilds it, the shape is the furthest chunk end in every dim; unlike it, the
    chunks are checked: one dtype, one rank, no overlap, no gap. Raises :class:`CheckpointFormatError`
    naming a file of the key and the reason.
    """
    first = parts[0]
    if len(parts) == 1 and first.offsets is None:
        return CheckpointTensor(key, first.dtype_name, first.dtype, first.shape, (first,))
    for part in parts[1:]:
        if part.dtype_name != first.dtype_name or len(part.shape) != len(first.shape):
            raise CheckpointFormatError(
                f"chunk {part.dtype_name} {list(part.shape)} does not match the chunk in {first.file!r} "
                f"({first.dtype_name} {list(first.shape)}): the chunks of one tensor share its dtype and "
                "rank",
                file=part.file, key=key,
            )
    shape = tuple(max(p.box.ends[d] for p in parts) for d in range(len(first.shape)))
    _check_tiling(key, parts, shape)
    return CheckpointTensor(key, first.dtype_name, first.dtype, shape, tuple(parts))


def _check_tiling(key: str, parts: Sequence[TensorEntry], shape: tuple[int, ...]) -> None:
    """The parts tile ``shape``: no two share an element and together they hold every one.

    Every part lies inside ``shape`` (it is their bounding box), so no overlap plus the element
    count is exact tiling. Overlaps are found by a sweep along the dim with the most distinct chunk
    starts (a 1-D split of n chunks costs n checks, a grid of rows x cols about n x cols), not by
    comparing every pair.
    """
    filled = [p for p in parts if math.prod(p.shape)]
    # 0-d: any second part is the same element again (no dim to sweep, every pair overlaps)
    dim = max(range(len(shape)), key=lambda d: len({p.box.offsets[d] for p in filled})) if shape else None
    active: list[TensorEntry] = []
    for part in sorted(filled, key=lambda p: 0 if dim is None else p.box.offsets[dim]):
        box = part.box
        if dim is not None:
            active = [a for a in active if a.box.ends[dim] > box.offsets[dim]]
        other = next((a for a in active if dim is None or a.box.intersect(box) is not None), None)
        if other is not None:
            raise CheckpointFormatError(
                f"chunk at offsets {list(box.offsets)} of shape {list(box.sizes)} overlaps the chunk in "
                f"{other.file!r} at {list(other.box.offsets)} of shape {list(other.box.sizes)}",
                file=part.file, key=key,
            )
        active.append(part)
    held, total = sum(math.prod(p.shape) for p in filled), math.prod(shape)
    if held != total:
        raise CheckpointFormatError(
            f"its {len(parts)} chunk(s) hold {held} of the {total} elements of shape {list(shape)}: a gap "
            "(is a file with a chunk of it missing?)",
            file=parts[0].file, key=key,
        )


@dataclass(frozen=True)
class Catalog:
    """Every tensor of a checkpoint by key; file names are relative to ``root``.

    ``versions``: each file as it was when its header was read (size and version tag); a
    :class:`~hp_dcp_hf.storage.transport.location.CheckpointLocation` given them checks data reads against them.
    ``quantization_config``: the ``quantization_config`` of the directory's ``config.json``, if any
    (a quantized checkpoint's tensors only mean something with it). ``shared``: whether ``root``
    lies on storage other machines read too (``Backend.shared``), as the rank that scanned saw it:
    every rank decides on cooperating from this one observation.
    """

    root: str
    files: tuple[str, ...]
    entries: Mapping[str, CheckpointTensor]
    versions: Mapping[str, FileVersion] = field(default_factory=dict)
    quantization_config: Mapping[str, Any] | None = None
    shared: bool = False

    def to_json(self) -> bytes:
        """Every tensor as ``[key, dtype, shape, parts]``, a part as ``[file, data_start, nbytes]``
        plus, for a chunk, ``shape, offsets`` (a whole tensor's part repeats nothing: the payload of
        an ordinary checkpoint stays as small as it was)."""

        def part(p: TensorEntry) -> list[Any]:
            placed = [] if p.offsets is None else [list(p.shape), list(p.offsets)]
            return [p.file, p.data_start, p.nbytes, *placed]

        entries = [
            [t.key, t.dtype_name, list(t.shape), [part(p) for p in t.parts]] for t in self.entries.values()
        ]
        versions = {file: version.to_json() for file, version in self.versions.items()}
        return json.dumps(
            {"root": self.root, "files": list(self.files), "entries": entries, "versions": versions,
             "quantization_config": self.quantization_config, "shared": self.shared}
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Catalog:
        """The catalog :meth:`to_json` wrote (on the rank that read and checked the headers)."""
        data = json.loads(raw)
        entries = {}
        for key, name, shape, parts in data["entries"]:
            dtype = lookup_dtype(name, key=key).torch_dtype
            stored = []
            for file, start, nbytes, *placed in parts:
                size, offsets = placed or (shape, None)
                at = None if offsets is None else tuple(offsets)
                stored.append(TensorEntry(key, file, name, dtype, tuple(size), start, nbytes, at))
            entries[key] = CheckpointTensor(key, name, dtype, tuple(shape), tuple(stored))
        versions = {file: FileVersion.from_json(value) for file, value in data.get("versions", {}).items()}
        return cls(data["root"], tuple(data["files"]), entries, versions, data.get("quantization_config"),
                   bool(data.get("shared", False)))


def _check_index_file_name(name: object, key: str) -> str:
    """``name`` if it is a plain relative path of a ``.safetensors`` file inside the directory."""
    if not isinstance(name, str):
        raise CheckpointFormatError(f"weight_map value {name!r} is not a string", file=INDEX_FILE, key=key)
    parts = name.split("/")
    # "", ".", ".." parts catch absolute paths, "a//b" and any way up; ":" catches URLs and drives.
    if "\\" in name or any(part in ("", ".", "..") or ":" in part for part in parts):
        raise CheckpointFormatError(
            f"weight_map names {name!r}, which is not a plain path inside the checkpoint directory",
            file=INDEX_FILE,
            key=key,
        )
    if _is_unsafe(name):
        raise UnsafeCheckpointError(f"weight_map names {name!r}: {_CONVERT_HINT}", file=INDEX_FILE, key=key)
    if not name.endswith(SAFETENSORS_SUFFIX):
        raise CheckpointFormatError(
            f"weight_map names {name!r}, not a .safetensors file", file=INDEX_FILE, key=key
        )
    return name


def parse_index(raw: bytes) -> dict[str, str]:
    """The ``weight_map`` of an index file's bytes: key -> file name, every name checked."""
    return _parse_index(loads_json_object(raw, file=INDEX_FILE))[0]


def _parse_index(index: dict[str, Any]) -> tuple[dict[str, str], str | None]:
    """The index object's ``weight_map``, every name checked, and the save id in its ``metadata``
    (None: not written by us)."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError("index has no weight_map object", file=INDEX_FILE)
    metadata = index.get("metadata")
    save_id = metadata.get(SAVE_ID_KEY) if isinstance(metadata, dict) else None
    return {key: _check_index_file_name(name, key) for key, name in weight_map.items()}, save_id


def _read_index(location: CheckpointLocation, stats: ReadStats) -> tuple[dict[str, str], str | None]:
    return _parse_index(read_json(location, INDEX_FILE, cap=MAX_HEADER_BYTES, file=INDEX_FILE, stats=stats))


def find_files(
    location: CheckpointLocation, single_file: str | None, stats: ReadStats
) -> tuple[tuple[str, ...], dict[str, str] | None]:
    """The safetensors files of the checkpoint and, when it has an index, its weight_map."""
    files, weight_map, _, _ = _find(location, single_file, stats)
    return files, weight_map


def _find(
    location: CheckpointLocation, single_file: str | None, stats: ReadStats
) -> tuple[tuple[str, ...], dict[str, str] | None, list[str], str | None]:
    """:func:`find_files`, plus the names of every file of the directory (none for a single file)
    and the index's save id."""
    if single_file is not None:
        if single_file.endswith(SAFETENSORS_SUFFIX):
            return (single_file,), None, [], None
        if _is_unsafe(single_file):
            raise UnsafeCheckpointError(_CONVERT_HINT, file=location.url(single_file))
        raise CheckpointFormatError(
            "not a .safetensors file: pass a .safetensors file or the checkpoint's directory",
            file=location.url(single_file),
        )
    names = location.list_files()
    if SINGLE_FILE in names:  # transformers reads it first, whatever else the directory holds
        return (SINGLE_FILE,), None, names, None
    if INDEX_FILE in names:
        weight_map, save_id = _read_index(location, stats)
        files = tuple(sorted(set(weight_map.values())))
        for file in files:
            if not location.exists(file):
                key = next(k for k, f in weight_map.items() if f == file)
                raise CheckpointNotFoundError(f"{INDEX_FILE} maps keys to a missing file", file=file, key=key)
        return files, weight_map, names, save_id
    if JOURNAL_FILE in names:
        raise InterruptedSaveError("a save into this path was interrupted while it published; the next save "
                                   "into it or `hp-dcp-hf repair PATH` completes it", file=location.url())
    files = tuple(name for name in names if name.endswith(SAFETENSORS_SUFFIX))
    if files:
        return files, None, names, None
    if any(_is_unsafe(name) for name in names):
        raise UnsafeCheckpointError(_CONVERT_HINT, file=location.url())
    raise CheckpointNotFoundError("directory holds no .safetensors files", file=location.url())


def _check_one_save(headers: list[FileHeader], index_save_id: str | None) -> None:
    """Every file an index names belongs to the save that wrote the index (or, without an id in the
    index, all of them to one save or none): a shard copied in from another save is an error naming it."""
    ids = {header.file: header.metadata.get(SAVE_ID_KEY) for header in headers}
    expected = index_save_id if index_save_id is not None else next(iter(ids.values()), None)
    odd = sorted(file for file, save_id in ids.items() if save_id != expected)
    if odd:
        described = ", ".join(f"{file!r} (save {ids[file] or 'none: not written by hp-dcp-hf'})" for file in odd)
        raise MixedCheckpointError(
            f"files of another save: {described}; the {'index' if index_save_id else 'other files'} belong to save "
            f"{expected or 'none'}", file=odd[0])


def _collect(headers: list[FileHeader], weight_map: Mapping[str, str] | None) -> dict[str, CheckpointTensor]:
    """key -> tensor over all files, refusing keys in several files that no ``DCP_SHARDING_INFO``
    places, chunks that do not tile, and disagreements with the index (which names one file a key)."""
    parts: dict[str, list[TensorEntry]] = {}
    for header in headers:
        for entry in header.entries:
            found = parts.setdefault(entry.key, [])
            if found and (found[0].offsets is None or entry.offsets is None):
                unplaced = [e.file for e in (found[0], entry) if e.offsets is None]
                which = "neither file places" if len(unplaced) == 2 else f"{unplaced[0]!r} does not place"
                raise CheckpointFormatError(
                    f"key is in both {found[0].file!r} and {entry.file!r}, and {which} it as a chunk of one "
                    f"tensor ({SHARDING_INFO_KEY}, as torch's distributed HF files do)",
                    file=entry.file,
                    key=entry.key,
                )
            if weight_map is not None and entry.key not in weight_map:
                raise CheckpointFormatError(
                    f"file holds a key {INDEX_FILE} does not list", file=entry.file, key=entry.key
                )
            found.append(entry)
    for key, file in (weight_map or {}).items():
        held = {part.file for part in parts.get(key, ())}
        if held != {file}:
            where = f"it is in {', '.join(map(repr, sorted(held)))}" if held else "no file holds it"
            raise CheckpointFormatError(
                f"{INDEX_FILE} maps the key to this file but {where}", file=file, key=key
            )
    return {key: assemble(key, found) for key, found in parts.items()}


def scan(
    location: CheckpointLocation, single_file: str | None, stats: ReadStats, num_threads: int = 8
) -> Catalog:
    """Find the files, read every header (``num_threads`` at a time) and cross-check them.

    Each file's version is the one recorded when its size was asked for the header read (no
    request of its own), and that header read is itself checked against it.
    """
    files, weight_map, names, save_id = _find(location, single_file, stats)
    with ThreadPoolExecutor(max(1, min(num_threads, len(files)))) as pool:
        headers = list(pool.map(lambda file: read_header(location, file, stats), files))
    if weight_map is not None:
        _check_one_save(headers, save_id)
    versions = {file: location.version(file) for file in files}
    quantization = _read_quantization_config(location, stats) if CONFIG_FILE in names else None
    return Catalog(location.root, files, _collect(headers, weight_map), versions, quantization,
                   location.backend.shared(location.root))


def _read_quantization_config(location: CheckpointLocation, stats: ReadStats) -> dict[str, Any] | None:
    """The ``quantization_config`` object of the directory's ``config.json`` (None without one)."""
    config = read_json(location, CONFIG_FILE, cap=MAX_HEADER_BYTES, file=CONFIG_FILE, stats=stats)
    quantization = config.get("quantization_config")
    if quantization is not None and not isinstance(quantization, dict):
        raise CheckpointFormatError("quantization_config is not an object", file=CONFIG_FILE)
    return quantization
