"""Bytes of safetensors checkpoints: locate files, validate headers, read exact byte ranges, write
new checkpoints in place.

Four layers, each importing only the ones before it:

* :mod:`~hp_dcp_hf.storage.transport`: where a checkpoint lives (local path, fsspec URL, S3, HTTP)
  and how its bytes travel: ranged reads, retries, byte and request counts.
* :mod:`~hp_dcp_hf.storage.format`: the safetensors format: headers, dtypes, the catalog of a
  checkpoint's files, the byte ranges of a box, the save journal.
* :mod:`~hp_dcp_hf.storage.read`: the DCP ``StorageReader`` (:class:`HFStorageReader`), its copies
  and staging ring, span ownership and the exchange that shares read bytes between ranks.
* :mod:`~hp_dcp_hf.storage.write`: the DCP ``StorageWriter`` (:class:`HFStorageWriter`), its
  destinations (local files, multipart uploads) and the parts each rank writes.

:class:`HFStorageReader` and :class:`HFStorageWriter` are imported on first use (module
``__getattr__``), as every name here: they are torch's DCP ``StorageReader`` / ``StorageWriter``,
and importing DCP costs seconds that reading headers (``hp-dcp-hf inspect``) does not need; the
format layer imports torch, which checking storage options (the CLI, before it starts ranks) does
not need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hp_dcp_hf.util.lazy import lazy_exports

if TYPE_CHECKING:
    from hp_dcp_hf.storage.format.catalog import (
        INDEX_FILE,
        Catalog,
        CheckpointTensor,
        find_files,
        parse_index,
        scan,
    )
    from hp_dcp_hf.storage.format.dtypes import SAFETENSORS_DTYPES, SafetensorsDtype, lookup_dtype
    from hp_dcp_hf.storage.format.header import (
        MAX_HEADER_BYTES,
        FileHeader,
        TensorEntry,
        parse_header,
        read_header,
    )
    from hp_dcp_hf.storage.format.ranges import Piece, Request, box_byte_ranges, coalesce, split_box
    from hp_dcp_hf.storage.read.reader import HFStorageReader
    from hp_dcp_hf.storage.transport.backend import RetryPolicy
    from hp_dcp_hf.storage.transport.location import CheckpointLocation, RangeFile, filesystem, locate
    from hp_dcp_hf.storage.transport.stats import FileStats, ReadStats
    from hp_dcp_hf.storage.write.writer import HFStorageWriter

__all__ = [
    "INDEX_FILE",
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "Catalog",
    "CheckpointLocation",
    "CheckpointTensor",
    "FileHeader",
    "FileStats",
    "HFStorageReader",
    "HFStorageWriter",
    "Piece",
    "RangeFile",
    "ReadStats",
    "Request",
    "RetryPolicy",
    "SafetensorsDtype",
    "TensorEntry",
    "box_byte_ranges",
    "coalesce",
    "filesystem",
    "find_files",
    "locate",
    "lookup_dtype",
    "parse_header",
    "parse_index",
    "read_header",
    "scan",
    "split_box",
]

_LAZY = {
    "INDEX_FILE": "hp_dcp_hf.storage.format.catalog",
    "Catalog": "hp_dcp_hf.storage.format.catalog",
    "CheckpointTensor": "hp_dcp_hf.storage.format.catalog",
    "find_files": "hp_dcp_hf.storage.format.catalog",
    "parse_index": "hp_dcp_hf.storage.format.catalog",
    "scan": "hp_dcp_hf.storage.format.catalog",
    "SAFETENSORS_DTYPES": "hp_dcp_hf.storage.format.dtypes",
    "SafetensorsDtype": "hp_dcp_hf.storage.format.dtypes",
    "lookup_dtype": "hp_dcp_hf.storage.format.dtypes",
    "MAX_HEADER_BYTES": "hp_dcp_hf.storage.format.header",
    "FileHeader": "hp_dcp_hf.storage.format.header",
    "TensorEntry": "hp_dcp_hf.storage.format.header",
    "parse_header": "hp_dcp_hf.storage.format.header",
    "read_header": "hp_dcp_hf.storage.format.header",
    "Piece": "hp_dcp_hf.storage.format.ranges",
    "Request": "hp_dcp_hf.storage.format.ranges",
    "box_byte_ranges": "hp_dcp_hf.storage.format.ranges",
    "coalesce": "hp_dcp_hf.storage.format.ranges",
    "split_box": "hp_dcp_hf.storage.format.ranges",
    "CheckpointLocation": "hp_dcp_hf.storage.transport.location",
    "RangeFile": "hp_dcp_hf.storage.transport.location",
    "filesystem": "hp_dcp_hf.storage.transport.location",
    "locate": "hp_dcp_hf.storage.transport.location",
    "RetryPolicy": "hp_dcp_hf.storage.transport.backend",
    "FileStats": "hp_dcp_hf.storage.transport.stats",
    "ReadStats": "hp_dcp_hf.storage.transport.stats",
    "HFStorageReader": "hp_dcp_hf.storage.read.reader",
    "HFStorageWriter": "hp_dcp_hf.storage.write.writer",
}
"""Where each public name lives: imported on first use."""


__getattr__ = lazy_exports(__name__, globals(), _LAZY)
