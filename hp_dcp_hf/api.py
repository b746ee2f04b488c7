"""The one-call forms: ``load_hf_checkpoint(model, path)`` and ``save_hf_checkpoint(model, path)``."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Collection, Sequence
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from transformers.core_model_loading import WeightTransform

from hp_dcp_hf.errors import HPDCPHFError, StorageWriteError
from hp_dcp_hf.planner import HFMappingPlanner, LoadReport
from hp_dcp_hf.save_planner import HFSavePlanner
from hp_dcp_hf.storage import HFStorageReader
from hp_dcp_hf.storage.broadcast import agree_on_failure, should_broadcast
from hp_dcp_hf.storage.writer import HFStorageWriter

Loader = Literal["dcp", "legacy"]


def load_hf_checkpoint(
    model: nn.Module,
    path: str,
    *,
    loader: Loader = "dcp",
    weights_mapping: Sequence[WeightTransform] | None = None,
    strict: bool = True,
    external_target_fqns: Collection[str] = (),
    claimed_source_keys: Collection[str] = (),
    reader: HFStorageReader | None = None,
    planner: HFMappingPlanner | None = None,
    **reader_options: Any,
) -> LoadReport:
    """Load the Hugging Face checkpoint at ``path`` into ``model`` in place; every rank calls it.

    ``loader="dcp"`` reads only the checkpoint regions this rank's shards need; ``"legacy"``
    reads whole checkpoint tensors, converts them in memory and keeps the local part. Both give
    bit-identical parameters. Errors raised inside ``dcp.load`` come back unwrapped, as the
    :mod:`hp_dcp_hf.errors` type the failing rank raised.

    A planning error leaves the model untouched. A read that fails midway raises with
    ``error.touched_keys``: the state dict keys this rank had already written into.

    ``reader`` and ``planner`` may be built by the caller, to read their statistics afterwards;
    a given planner brings its own mapping options and ``loader`` choice (its ``trace``).
    """
    if loader not in ("dcp", "legacy"):
        raise ValueError(f"loader must be 'dcp' or 'legacy', got {loader!r}")
    planner = planner or HFMappingPlanner(
        model,
        weights_mapping=weights_mapping,
        strict=strict,
        external_target_fqns=external_target_fqns,
        claimed_source_keys=claimed_source_keys,
        trace=loader == "dcp",
    )
    reader = reader if reader is not None else HFStorageReader(path, **reader_options)
    error: BaseException | None = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            # Each rank plans its own reads from the metadata rank 0 broadcast: nothing to
            # coordinate, so DCP's gather and scatter of every rank's plan through rank 0 (O(world)
            # pickled plans there) is skipped; the ranks agree on the outcome below instead.
            dcp.load(model.state_dict(), storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as exc:
        # torch's dcp.load reduces an error of read_metadata to an AssertionError with its text:
        # the reader kept the error itself.
        error = reader.metadata_error or unwrap_checkpoint_exception(exc)
    if should_broadcast() and not getattr(error, "agreed", False):  # a cooperative read agreed already
        error = agree_on_failure(error)
    if error is not None:
        error.touched_keys = tuple(sorted(planner.touched_targets))  # type: ignore[attr-defined]
        raise error from None
    assert planner.report is not None
    phases = {"plan": planner.plan_seconds, **reader.seconds}
    seconds = {k: phases[k] for k in ("metadata", "plan", "read", "copy", "exchange") if k in phases}  # load order
    return dataclasses.replace(planner.report, seconds=seconds)


def unwrap_checkpoint_exception(exc: CheckpointException) -> BaseException:
    """The first rank's own error out of DCP's wrapper, preferring this package's typed errors."""
    errors = [failure[0] if isinstance(failure, tuple) else failure for _, failure in sorted(exc.failures.items())]
    return next((e for e in errors if isinstance(e, HPDCPHFError)), errors[0] if errors else exc)


def save_hf_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str | None = None,
    dtype: torch.dtype | None = None,
    weights_mapping: Sequence[WeightTransform] | None = None,
    writer: HFStorageWriter | None = None,
    planner: HFSavePlanner | None = None,
    **storage_options: Any,
) -> None:
    """Write ``model`` (parallelized, rewritten) to directory ``path`` as the Hugging Face checkpoint
    ``save_pretrained`` writes for its unsharded, unrewritten form; every rank calls it.

    One parallel pass: each rank writes its own shards' bytes at their final offsets (a replicated
    tensor by one of its replicas); nothing is gathered. The files appear at their final names only
    once every rank has written, through one atomic switch (``docs/reliability.md``). It returns
    exactly when the new checkpoint is the one at ``path``; otherwise it raises
    :class:`~hp_dcp_hf.errors.StorageWriteError` (or the planning error) on every rank that is
    still alive, and ``path`` holds the older checkpoint as it was, unless the publish was journaled
    (the error says so; the next save or ``hp-dcp-hf repair`` completes it).

    ``dtype`` casts floating-point tensors on write, and ``config.json`` names it. ``max_shard_size``
    defaults to ``save_pretrained``'s. ``path`` is a directory or an ``s3://`` prefix (multipart
    uploads; ``storage_options`` as s3fs takes them).
    """
    planner = planner or HFSavePlanner(model, weights_mapping=weights_mapping)
    writer = writer if writer is not None else HFStorageWriter(
        path, max_shard_size=max_shard_size, dtype=dtype, **storage_options)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(model.state_dict(), storage_writer=writer, planner=planner, no_dist=not should_broadcast())
    except BaseException as exc:  # noqa: BLE001 - whatever failed, the outcome is what the path holds
        writer.abort()
        error = unwrap_checkpoint_exception(exc) if isinstance(exc, CheckpointException) else exc
        if not isinstance(error, Exception):
            raise
        if writer.saved():  # published, and then a peer was lost: the save did what it promised
            warnings.warn(f"the checkpoint was saved to {os.fspath(path)}, then: {type(error).__name__}: {error}",
                          stacklevel=2)
            return
        if not isinstance(error, HPDCPHFError):  # a lost peer's gloo error, a dead server's
            journaled = writer.save_id is not None and writer.destination.journaled_save_id() == writer.save_id
            outcome = ("its publish was journaled: the next save into the path or `hp-dcp-hf repair` completes it"
                       if journaled else "the path holds the older checkpoint as it was")
            error = StorageWriteError(f"the save failed ({type(error).__name__}: {error}); {outcome}",
                                      file=os.fspath(path))
        raise error from None
