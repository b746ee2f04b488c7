"""HOOK, not built yet: the remote-storage row (S3, and later HTTP / the Hub).

Another engineer is building S3 support in :mod:`hp_dcp_hf.storage`. When it lands, this row
should load the same generated checkpoint from ``s3://bucket/prefix`` (a local ``moto`` server on
127.0.0.1 here; a real bucket on a cluster) with ``HFStorageReader(url, storage_options=...)`` and
report, per rank, what matters remotely: bytes fetched, ranged GET requests (``reader.stats``, and
moto's request recorder as the independent count), header requests (rank 0 only, with metadata
broadcast) and wall time, next to the legacy loader reading whole tensors over the same link.
``python -m bench --remote URL`` is the switch; until then it records that the row was not run.
"""

from __future__ import annotations

from typing import Any


def run_remote(url: str, **_: Any) -> dict[str, Any]:
    """The remote row for the checkpoint at ``url``: not implemented yet (see the module doc)."""
    return {"skipped": f"remote row for {url}: hook only (bench/remote.py), S3 support is being built separately"}
