"""What a checkpoint holds: its safetensors files, every tensor and where it lives.

A checkpoint is a single ``.safetensors`` file, a directory with ``model.safetensors`` (read first,
as transformers does), a directory with ``model.safetensors.index.json`` (its ``weight_map`` says
which file holds which key), or a directory of ``*.safetensors`` files.
Passing the index file itself names its directory (the same checkpoint, read by the same rules).
The index is not trusted: the files it names must stay inside the directory and exist, and after
the headers are read every key must sit in the file the index says, and nothing else may. A key in
two files is an error, since either choice would be a silent guess. Pickle checkpoints are refused.
Files written by hp-dcp-hf carry their save's id (:mod:`hp_dcp_hf.storage.journal`): every file
read must carry the index's, so a mix of two saves is an error naming the odd files, not a load.

A :class:`Catalog` round-trips through JSON so that one rank can read every header and hand the
result to the others (never pickle: the bytes cross process boundaries). With the headers go the
files' versions (size and the backend's version tag, recorded when each header was read), against
which every rank's data reads are checked, so a file changed after its header was read raises
instead of loading bytes its header does not describe.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hp_dcp_hf.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    InterruptedSaveError,
    MixedCheckpointError,
    UnsafeCheckpointError,
)
from hp_dcp_hf.storage.dtypes import lookup_dtype
from hp_dcp_hf.storage.header import MAX_HEADER_BYTES, FileHeader, TensorEntry, loads_json_object, read_header
from hp_dcp_hf.storage.journal import INDEX_FILE, JOURNAL_FILE, SAVE_ID_KEY, SINGLE_FILE
from hp_dcp_hf.storage.location import CheckpointLocation, FileVersion
from hp_dcp_hf.storage.stats import ReadStats

CONFIG_FILE = "config.json"
QUANTIZATION_CONFIG = "hp_dcp_hf.quantization_config"
"""The key of ``Metadata.planner_data`` under which the reader hands ``config.json``'s
``quantization_config`` to the planner (see :mod:`hp_dcp_hf.mapping.quantized`)."""
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
class Catalog:
    """Every tensor of a checkpoint by key; file names are relative to ``root``.

    ``versions``: each file as it was when its header was read (size and version tag); a
    :class:`~hp_dcp_hf.storage.location.CheckpointLocation` given them checks data reads against them.
    ``quantization_config``: the ``quantization_config`` of the directory's ``config.json``, if any
    (a quantized checkpoint's tensors only mean something with it).
    """

    root: str
    files: tuple[str, ...]
    entries: Mapping[str, TensorEntry]
    versions: Mapping[str, FileVersion] = field(default_factory=dict)
    quantization_config: Mapping[str, Any] | None = None

    def to_json(self) -> bytes:
        entries = [
            [e.key, e.file, e.dtype_name, list(e.shape), e.data_start, e.nbytes]
            for e in self.entries.values()
        ]
        versions = {file: version.to_json() for file, version in self.versions.items()}
        return json.dumps(
            {"root": self.root, "files": list(self.files), "entries": entries, "versions": versions,
             "quantization_config": self.quantization_config}
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Catalog:
        data = json.loads(raw)
        entries = {
            key: TensorEntry(
                key, file, name, lookup_dtype(name, file=file, key=key).torch_dtype, tuple(shape), start, n
            )
            for key, file, name, shape, start, n in data["entries"]
        }
        versions = {file: FileVersion.from_json(value) for file, value in data.get("versions", {}).items()}
        return cls(data["root"], tuple(data["files"]), entries, versions, data.get("quantization_config"))


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
    return _parse_index(raw)[0]


def _parse_index(raw: bytes) -> tuple[dict[str, str], str | None]:
    """:func:`parse_index`, and the save id in the index's ``metadata`` (None: not written by us)."""
    index = loads_json_object(raw, file=INDEX_FILE)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError("index has no weight_map object", file=INDEX_FILE)
    metadata = index.get("metadata")
    save_id = metadata.get(SAVE_ID_KEY) if isinstance(metadata, dict) else None
    return {key: _check_index_file_name(name, key) for key, name in weight_map.items()}, save_id


def _read_index(location: CheckpointLocation, stats: ReadStats) -> tuple[dict[str, str], str | None]:
    size = location.size(INDEX_FILE)
    if size > MAX_HEADER_BYTES:
        raise CheckpointFormatError(f"{size} bytes exceeds the {MAX_HEADER_BYTES}-byte cap", file=INDEX_FILE)
    with location.open(INDEX_FILE) as handle:
        raw = handle.read(0, size)
    stats.add(INDEX_FILE, header_bytes=size, header_requests=1)
    return _parse_index(raw)


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


def _collect(headers: list[FileHeader], weight_map: Mapping[str, str] | None) -> dict[str, TensorEntry]:
    """key -> entry over all files, refusing duplicates and disagreements with the index."""
    entries: dict[str, TensorEntry] = {}
    for header in headers:
        for entry in header.entries:
            if entry.key in entries:
                raise CheckpointFormatError(
                    f"key is in both {entries[entry.key].file!r} and {entry.file!r}",
                    file=entry.file,
                    key=entry.key,
                )
            if weight_map is not None and entry.key not in weight_map:
                raise CheckpointFormatError(
                    f"file holds a key {INDEX_FILE} does not list", file=entry.file, key=entry.key
                )
            entries[entry.key] = entry
    for key, file in (weight_map or {}).items():
        found = entries.get(key)
        if found is None or found.file != file:
            where = f"it is in {found.file!r}" if found else "no file holds it"
            raise CheckpointFormatError(
                f"{INDEX_FILE} maps the key to this file but {where}", file=file, key=key
            )
    return entries


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
    return Catalog(location.root, files, _collect(headers, weight_map), versions, quantization)


def _read_quantization_config(location: CheckpointLocation, stats: ReadStats) -> dict[str, Any] | None:
    """The ``quantization_config`` object of the directory's ``config.json`` (None without one)."""
    size = location.size(CONFIG_FILE)
    if size > MAX_HEADER_BYTES:
        raise CheckpointFormatError(f"{size} bytes exceeds the {MAX_HEADER_BYTES}-byte cap", file=CONFIG_FILE)
    with location.open(CONFIG_FILE) as handle:
        raw = handle.read(0, size)
    stats.add(CONFIG_FILE, header_bytes=size, header_requests=1)
    quantization = loads_json_object(raw, file=CONFIG_FILE).get("quantization_config")
    if quantization is not None and not isinstance(quantization, dict):
        raise CheckpointFormatError("quantization_config is not an object", file=CONFIG_FILE)
    return quantization
