"""JSON in a checkpoint, parsed strictly, and the small JSON files read whole through the storage layer.

The index (``model.safetensors.index.json``), ``config.json`` and a PEFT adapter's
``adapter_config.json`` are read by :func:`read_json`: the size is asked first and checked against a
cap before a byte is read, so a huge or hostile file costs one metadata request, not its download.
Every JSON object here (those files, a safetensors header, its ``DCP_SHARDING_INFO``) is parsed by
:func:`loads_json_object`: UTF-8, no duplicate key at any level (either value would be a silent
guess), an object at the top. Errors name the file.
"""

from __future__ import annotations

import json
from typing import Any

from hp_dcp_hf.errors import CheckpointFormatError, CheckpointNotFoundError
from hp_dcp_hf.storage.transport.location import CheckpointLocation
from hp_dcp_hf.storage.transport.stats import ReadStats


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


def read_json(
    location: CheckpointLocation,
    name: str,
    *,
    cap: int,
    missing: str = "file does not exist",
    file: str | None = None,
    stats: ReadStats | None = None,
) -> dict[str, Any]:
    """The JSON object in the file ``name`` of ``location``, read whole when it is at most ``cap`` bytes.

    Raises :class:`CheckpointNotFoundError` with the reason ``missing`` when there is no such
    file, :class:`CheckpointFormatError` when it is over the cap or no JSON object
    (:func:`loads_json_object`). Errors name the file as ``file`` (default: its URL,
    ``location.url(name)``). ``stats`` counts the read as header bytes. What the object must hold
    is the caller's to check.
    """
    named = location.url(name) if file is None else file
    try:
        size = location.size(name)
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(missing, file=named) from e
    if size > cap:
        raise CheckpointFormatError(f"{size} bytes exceeds the {cap}-byte cap", file=named)
    with location.open(name) as handle:
        raw = handle.read(0, size)
    if stats is not None:
        stats.add(name, header_bytes=size, header_requests=1)
    return loads_json_object(raw, file=named)
