"""Bytes of safetensors checkpoints: locate files, validate headers, read exact byte ranges, write
new checkpoints in place."""

from hp_dcp_hf.storage.catalog import INDEX_FILE, Catalog, CheckpointTensor, find_files, parse_index, scan
from hp_dcp_hf.storage.dtypes import SAFETENSORS_DTYPES, SafetensorsDtype, lookup_dtype
from hp_dcp_hf.storage.header import MAX_HEADER_BYTES, FileHeader, TensorEntry, parse_header, read_header
from hp_dcp_hf.storage.location import CheckpointLocation, RangeFile, filesystem, locate
from hp_dcp_hf.storage.ranges import Piece, Request, box_byte_ranges, coalesce, split_box
from hp_dcp_hf.storage.reader import HFStorageReader
from hp_dcp_hf.storage.remote import RetryPolicy
from hp_dcp_hf.storage.stats import FileStats, ReadStats
from hp_dcp_hf.storage.writer import HFStorageWriter

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
