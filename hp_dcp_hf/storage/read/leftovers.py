"""What a running or dead save left next to a checkpoint, seen by readers (its own module, free of
torch's DCP, so that ``inspect`` asks it without importing the reader)."""

from __future__ import annotations

import contextlib
import os

from hp_dcp_hf.storage.format.journal import leftovers
from hp_dcp_hf.storage.transport.fsspec_backend import FsspecBackend
from hp_dcp_hf.storage.transport.location import CheckpointLocation
from hp_dcp_hf.storage.transport.s3 import S3Backend


def unfinished_save(location: CheckpointLocation) -> list[str]:
    """What a running or dead save left in the checkpoint's directory (its journal, lock, staging),
    by name; seen in a listing that costs no request: the local directory's, or on S3 the one
    s3fs cached when the scan listed the prefix (read from its cache, never asked for). Saves go
    to local directories and S3 only."""
    backend = location.backend
    with contextlib.suppress(OSError, ValueError):
        if isinstance(backend, FsspecBackend) and backend.local:
            return leftovers(os.listdir(location.root))
        if isinstance(backend, S3Backend):  # never a request: without s3fs's listings cache, no check
            listed = backend.fs.dircache.get(location.root.rstrip("/")) or []
            return leftovers(entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in listed)
    return []
