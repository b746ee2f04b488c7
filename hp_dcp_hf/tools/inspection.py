"""``hp-dcp-hf inspect``'s report of a checkpoint: files, tensors, dtypes, bytes, index consistency,
quantization and what an unfinished save left, from the index and headers alone (no tensor data).

It imports the storage layer's reading side and no torch DCP nor transformers, so that
``hp-dcp-hf inspect`` stays light (``tests/test_startup.py`` checks it).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from hp_dcp_hf.errors import QuantizationError
from hp_dcp_hf.mapping.families import natural_sorted
from hp_dcp_hf.storage import INDEX_FILE, ReadStats, filesystem, locate, scan
from hp_dcp_hf.storage.format.catalog import Catalog
from hp_dcp_hf.storage.format.journal import SINGLE_FILE, leftovers_warning
from hp_dcp_hf.storage.read.leftovers import unfinished_save
from hp_dcp_hf.storage.transport.stats import FileStats
from hp_dcp_hf.tools.formatting import describe_quantization


def inspect_checkpoint(path: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Files, tensors, dtypes, bytes and index consistency of the checkpoint at ``path``, from its
    index and headers alone (no tensor data is read). ``tensor_list``: every tensor, naturally sorted
    by name, with its dtype, shape, bytes, file and byte range there (``chunks`` instead of a file
    for a tensor stored in chunks across files). ``storage_options`` go to the store (s3fs, HTTP, Hub)."""
    location, single = locate(*filesystem(path, storage_options))
    stats = ReadStats()
    catalog = scan(location, single, stats)  # raises on any index / header inconsistency
    unfinished = unfinished_save_report(location.url(), storage_options) \
        if single is None and unfinished_save(location) else None
    files: dict[str, dict[str, Any]] = {
        f: {"tensors": 0, "tensor_bytes": 0, "file_bytes": location.size(f),
            "header_bytes": stats.per_file.get(f, FileStats()).header_bytes} for f in catalog.files
    }
    dtypes: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    for entry in catalog.entries.values():
        for part in entry.parts:
            files[part.file]["tensors"] += 1
            files[part.file]["tensor_bytes"] += part.nbytes
        dtypes[entry.dtype_name]["tensors"] += 1
        dtypes[entry.dtype_name]["bytes"] += entry.nbytes
    tensor_list = []
    for key in natural_sorted(catalog.entries):
        entry = catalog.entries[key]
        row: dict[str, Any] = {"name": key, "dtype": entry.dtype_name, "shape": list(entry.shape), "bytes": entry.nbytes}
        places = [{"file": p.file, "file_offsets": [p.data_start, p.data_end]} for p in entry.parts]
        if entry.chunked:
            row["chunks"] = [{"offsets": list(p.offsets or ()), "shape": list(p.shape), **place}
                             for p, place in zip(entry.parts, places)]
        else:
            row.update(places[0])
        tensor_list.append(row)
    quantized = _quantized_tensors(catalog)
    model_alone = single is None and catalog.files == (SINGLE_FILE,)  # read first, as transformers does: no index
    has_index = single is None and not model_alone and location.exists(INDEX_FILE)
    listed = set(catalog.files)
    stray = sorted(n for n in location.list_files() if n.endswith(".safetensors") and n not in listed) \
        if has_index else []
    config = None
    if location.exists("config.json"):
        with location.open("config.json") as handle:
            try:
                raw = json.loads(handle.read(0, location.size("config.json")))
                config = {k: raw.get(k) for k in ("model_type", "architectures", "torch_dtype", "dtype")
                          if raw.get(k) is not None}
            except (json.JSONDecodeError, UnicodeDecodeError):
                config = {"error": "config.json is not JSON"}
    return {
        "path": path,
        "root": location.root,
        "files": files,
        "tensors": len(catalog.entries),
        "tensor_bytes": sum(e.nbytes for e in catalog.entries.values()),
        "dtypes": dict(sorted(dtypes.items())),
        "index": {
            "file": INDEX_FILE if has_index else None,
            "consistent": True,  # scan() refuses any disagreement between the index and the headers
            "keys": len(catalog.entries) if has_index else None,
            "unlisted_files": stray,
            # what is read without an index: the one file PATH names (when its directory has an
            # index, the directory is the checkpoint), model.safetensors alone, or every
            # .safetensors file of the directory
            "single_file": single,
            "directory_has_index": single is not None and location.exists(INDEX_FILE),
            "model_safetensors_alone": model_alone,
        },
        "config": config,
        "quantization": quantized,
        "unfinished_save": unfinished,
        "tensor_list": tensor_list,
    }


def unfinished_save_report(url: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a running or dead save left at ``url`` (a directory or S3 prefix that saves write to),
    each with its size, and what ``hp-dcp-hf repair PATH`` would do about it; warned in one line."""
    import warnings

    from hp_dcp_hf.storage.write.writer import destination_for

    destination = destination_for(url, dict(storage_options or {}))
    items = destination.leftovers()
    warnings.warn(leftovers_warning(url, [item.name for item in items if item.kind != "upload"]), stacklevel=3)
    return {"items": [item.to_json() for item in items], "repair": destination.repair(dry_run=True)}


def _quantized_tensors(catalog: Catalog) -> dict[str, Any] | None:
    """The checkpoint's quantization, and how many weights and bytes are quantized (or why the
    loader cannot read them as values)."""
    if not catalog.quantization_config:
        return None
    from hp_dcp_hf.geometry.box import Box
    from hp_dcp_hf.mapping.compose import TensorSpec
    from hp_dcp_hf.quant.decode import quantized_tensors

    out: dict[str, Any] = {"format": describe_quantization(catalog.quantization_config)}
    specs = {key: TensorSpec(e.shape, e.dtype) for key, e in catalog.entries.items()}
    try:
        tensors, _ = quantized_tensors(catalog.quantization_config, specs)
    except QuantizationError as e:
        return out | {"error": str(e)}
    whole = [t.reads(Box.full(t.shape(specs))) for t in tensors.values()]
    return out | {
        "weights": len(tensors),
        "weight_bytes": sum(catalog.entries[data].nbytes for (data, _), *_ in whole),
        "scale_bytes": sum(catalog.entries[key].nbytes for _, *scales in whole for key, _ in scales),
    }
