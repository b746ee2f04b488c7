"""The one-call forms: ``load_hf_checkpoint(model, path)`` and ``save_hf_checkpoint(model, path)``."""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from transformers.core_model_loading import WeightTransform

from hp_dcp_hf.errors import (
    ArchitectureMismatchError,
    ArgumentError,
    HPDCPHFError,
    MappingError,
    MissingKeysError,
    StorageWriteError,
)
from hp_dcp_hf.parallel.collectives import agree_on_failure, should_broadcast
from hp_dcp_hf.planner import HFMappingPlanner, LoadReport, Unexpected, describe_keys
from hp_dcp_hf.quantize import Quantize
from hp_dcp_hf.save_planner import HFSavePlanner
from hp_dcp_hf.storage import HFStorageReader
from hp_dcp_hf.storage.write.writer import HFStorageWriter
from hp_dcp_hf.written import WriteCheck, finish_through_load_state_dict, hook_made_entries, own_state_dict

Loader = Literal["dcp", "legacy"]

logger = logging.getLogger(__name__)


class _OwnErrors(logging.Filter):
    """Drops the records torch's DCP logs, with a traceback, for an error of ours it re-raises
    anyway ("Global metadata is not found. Falling back to rank local metadata.")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], HPDCPHFError))


@contextmanager
def _quiet_dcp() -> Iterator[None]:
    """torch's DCP logs on the root logger; its records of our own errors are left out meanwhile."""
    root, own = logging.getLogger(), _OwnErrors()
    root.addFilter(own)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        root.removeFilter(own)


def _is_rank0() -> bool:
    return not should_broadcast() or torch.distributed.get_rank() == 0


def load_hf_checkpoint(
    model: nn.Module,
    path: str,
    *,
    loader: Loader = "dcp",
    weights_mapping: Sequence[WeightTransform] | None = None,
    config: Any = None,
    strict: bool = True,
    unexpected: Unexpected = "warn",
    external_target_fqns: Collection[str] = (),
    claimed_source_keys: Collection[str] = (),
    reader: HFStorageReader | None = None,
    planner: HFMappingPlanner | None = None,
    check_written: bool = False,
    state_dict: dict[str, Any] | None = None,
    **reader_options: Any,
) -> LoadReport:
    """Load the Hugging Face checkpoint at ``path`` into ``model`` in place; every rank calls it.

    ``loader="dcp"`` reads only the checkpoint regions this rank's shards need; ``"legacy"``
    reads whole checkpoint tensors, converts them in memory and keeps the local part. Both give
    bit-identical parameters. Errors raised inside ``dcp.load`` come back unwrapped, as the
    :mod:`hp_dcp_hf.errors` type the failing rank raised.

    A planning error leaves the model untouched. A read that fails midway raises with
    ``error.touched_keys``: the state dict keys this rank had already written into. Every rank
    raises the first failing rank's error, and ``error.rank`` names that rank.

    ``strict`` is about model tensors the checkpoint does not make (:class:`MissingKeysError`;
    that and shapes that disagree, :class:`MappingError`, are an :class:`ArchitectureMismatchError`
    saying so first when ``config.json`` names another model type);
    ``unexpected`` about checkpoint tensors no model tensor is made from: ``"warn"`` (once, on
    rank 0, with their number and first names), ``"raise"`` or ``"ignore"``, as in
    :class:`HFMappingPlanner`.

    The values land in the model's own parameters and buffers also when its ``state_dict()``
    hands out hook-made tensors (torchtitan's fused attention): those are finished through the
    module's ``load_state_dict`` (:mod:`hp_dcp_hf.written`). ``config`` is where conversion ops
    read model facts (default ``model.config``). ``check_written=True`` is a debug mode: the
    model is filled with NaN first, and a tensor the load should have written but did not is a
    :class:`~hp_dcp_hf.errors.PlanningError` (a checkpoint holding NaN trips it too).

    ``reader`` and ``planner`` may be built by the caller, to read their statistics afterwards;
    a given planner brings its own mapping options and ``loader`` choice (its ``trace``).
    ``state_dict``: the tensors to load into, in place (default ``model.state_dict()``), e.g. the
    model's own parameters where its ``state_dict()`` gathers (:func:`hp_dcp_hf.written.own_state_dict`).
    """
    if loader not in ("dcp", "legacy"):
        raise ArgumentError(f"loader must be 'dcp' or 'legacy', got {loader!r}")
    planner = planner or HFMappingPlanner(
        model,
        weights_mapping=weights_mapping,
        config=config,
        strict=strict,
        unexpected=unexpected,
        external_target_fqns=external_target_fqns,
        claimed_source_keys=claimed_source_keys,
        trace=loader == "dcp",
    )
    reader = reader if reader is not None else HFStorageReader(path, **reader_options)
    error: BaseException | None = None
    given = state_dict is not None
    state_dict = state_dict if given else model.state_dict()
    copies = hook_made_entries(model, state_dict, planner.external_target_fqns)
    check = WriteCheck(model) if check_written else None
    # the model's own tensors a given state dict does not ask for: the load leaves them be
    left_out = set(own_state_dict(model)) - set(state_dict) if check is not None and given else set()
    try:
        with _quiet_dcp():
            # Each rank plans its own reads from the metadata rank 0 broadcast: nothing to
            # coordinate, so DCP's gather and scatter of every rank's plan through rank 0 (O(world)
            # pickled plans there) is skipped; the ranks agree on the outcome below instead.
            dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
        if copies:
            finish_through_load_state_dict(model, state_dict, copies)
        if check is not None:
            assert planner.report is not None
            check.check({*planner.report.missing_keys, *planner.external_target_fqns, *left_out})
    except CheckpointException as exc:
        # torch's dcp.load reduces an error of read_metadata to an AssertionError with its text:
        # the reader kept the error itself.
        error = reader.metadata_error or unwrap_checkpoint_exception(exc)
    except HPDCPHFError as exc:
        error = exc
    if isinstance(error, MissingKeysError | MappingError):
        error = _architecture_mismatch(model, reader, error) or error
    if should_broadcast() and not getattr(error, "agreed", False):  # a cooperative read agreed already
        error = agree_on_failure(error)
    if error is not None:
        if check is not None:
            check.restore()
        error.touched_keys = tuple(sorted(planner.touched_targets))  # type: ignore[attr-defined]
        raise error from None
    assert planner.report is not None
    if planner.unexpected == "warn" and planner.reported_unexpected and _is_rank0():
        unused = planner.reported_unexpected
        logger.warning("%d tensors of %s make no model tensor (UNEXPECTED; unexpected='ignore' silences "
                       "this, 'raise' refuses such loads): %s", len(unused), reader.path, describe_keys(unused))
    phases = {"plan": planner.plan_seconds, **reader.seconds}
    seconds = {k: phases[k] for k in ("metadata", "plan", "spans", "read", "copy", "exchange") if k in phases}  # load order
    return dataclasses.replace(planner.report, seconds=seconds)


def _architecture_mismatch(model: nn.Module, reader: HFStorageReader,
                           error: MissingKeysError | MappingError) -> ArchitectureMismatchError | None:
    """Missing keys or shapes that disagree, explained first: the checkpoint's ``config.json``
    names another model type than the model's (what ``from_pretrained`` refuses up front). None
    when it does not, or has no readable config."""
    from hp_dcp_hf.pipeline import CONFIG_FILE, check_architecture, read_config

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        return None
    try:
        config = read_config(reader.path, reader.storage_options)
        check_architecture(config, type(model))
    except ArchitectureMismatchError:
        return ArchitectureMismatchError(
            f"config.json names model_type {config.model_type!r} (architectures "
            f"{getattr(config, 'architectures', None)}), but the model is a {model_type!r} one "
            f"({type(model).__name__}): load it into a model of the checkpoint's type (hp_dcp_hf.from_pretrained(path) "
            f"builds one from config.json); what the load found: {error.reason}", file=CONFIG_FILE)
    except HPDCPHFError:
        return None
    return None


def unwrap_checkpoint_exception(exc: CheckpointException) -> BaseException:
    """The first rank's own error out of DCP's wrapper, preferring this package's typed errors;
    ``error.rank`` is that rank when DCP gathered every rank's outcome."""
    failures = [(rank, failure[0] if isinstance(failure, tuple) else failure)
                for rank, failure in sorted(exc.failures.items())]
    if not failures:
        return exc
    rank, error = next(((r, e) for r, e in failures if isinstance(e, HPDCPHFError)), failures[0])
    if len(failures) > 1 or should_broadcast():  # every rank raises it: say whose it is
        error.rank = rank  # type: ignore[attr-defined]
    return error


def save_hf_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str | None = None,
    dtype: torch.dtype | None = None,
    weights_mapping: Sequence[WeightTransform] | None = None,
    quantize: Quantize | None = None,
    pipeline_stage: bool = False,
    hf_config: Any = None,
    state_dict: dict[str, Any] | None = None,
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

    ``quantize="fp8"`` writes the block-scaled FP8 checkpoint transformers' FP8 quantizer makes
    (``quant_method: "fp8"``, 128 x 128 blocks; a ``quantization_config`` dict or a
    ``FineGrainedFP8Config`` chooses ``weight_block_size`` and ``modules_to_not_convert``): the
    modules it converts are stored as ``float8_e4m3fn`` with their ``weight_scale_inv``, quantized
    from the values ``dtype`` gives, in the same single pass (ranks that share a scale block agree
    on its amax first; :mod:`hp_dcp_hf.quantize`). A weight whose last two dims are not multiples
    of the block keeps the model's dtype and is listed in ``modules_to_not_convert``, as
    transformers' quantizer keeps it; ``quantize=CeilGrids("fp8")`` writes those in FP8 on ceil
    scale grids instead (DeepSeek-V3's layout, which transformers' CPU load mis-reads).

    ``pipeline_stage=True``: every rank's ``model`` is one pipeline stage (its layers, under their
    names in the whole model); the stages together write one checkpoint, published once, each its
    own tensors, and the coordinator checks that every checkpoint element is written exactly once.

    ``hf_config`` (a transformers config) saves a model that is not a transformers model as the
    checkpoint of transformers' model of that config: its files, keys and ``config.json``, the values
    from ``model`` through ``weights_mapping`` (checkpoint -> model), as
    :mod:`hp_dcp_hf.integrations.torchtitan` does. ``state_dict``: the tensors to save (default
    ``model.state_dict()``).
    """
    if planner is not None and (quantize is not None or pipeline_stage or hf_config is not None):
        raise ArgumentError("quantize=, pipeline_stage= and hf_config= go to the planner given "
                            "(HFSavePlanner(model, ...))")
    planner = planner or HFSavePlanner(model, weights_mapping=weights_mapping, quantize=quantize,
                                       pipeline_stage=pipeline_stage, hf_config=hf_config)
    writer = writer if writer is not None else HFStorageWriter(
        path, max_shard_size=max_shard_size, dtype=dtype, **storage_options)
    state_dict = model.state_dict() if state_dict is None else state_dict
    try:
        with _quiet_dcp():
            dcp.save(state_dict, storage_writer=writer, planner=planner, no_dist=not should_broadcast())
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
