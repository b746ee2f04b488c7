"""The one-call load: ``load_hf_checkpoint(model, path)``, every rank reading only what its shards need."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection, Sequence
from typing import Any, Literal

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
)
from hp_dcp_hf.load.planner import HFMappingPlanner, LoadReport, Unexpected, describe_keys
from hp_dcp_hf.load.written import (
    WriteCheck,
    finish_through_load_state_dict,
    hook_made_entries,
    own_state_dict,
)
from hp_dcp_hf.model.config import CONFIG_FILE, check_architecture, read_config
from hp_dcp_hf.storage import HFStorageReader
from hp_dcp_hf.util.collectives import agree_on_failure, should_broadcast
from hp_dcp_hf.util.dcp import is_rank0, quiet_dcp, unwrap_checkpoint_exception
from hp_dcp_hf.util.perf import paused_gc

Loader = Literal["dcp", "legacy"]

logger = logging.getLogger(__name__)


@paused_gc()  # once over the whole load: a pause per phase let the collector in at each phase's end
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
    module's ``load_state_dict`` (:mod:`hp_dcp_hf.load.written`). ``config`` is where conversion ops
    read model facts (default ``model.config``). ``check_written=True`` is a debug mode: the
    model is filled with NaN first, and a tensor the load should have written but did not is a
    :class:`~hp_dcp_hf.errors.PlanningError` (a checkpoint holding NaN trips it too).

    ``reader`` and ``planner`` may be built by the caller, to read their statistics afterwards;
    a given planner brings its own mapping options and ``loader`` choice (its ``trace``).
    ``state_dict``: the tensors to load into, in place (default ``model.state_dict()``), e.g. the
    model's own parameters where its ``state_dict()`` gathers (:func:`hp_dcp_hf.load.written.own_state_dict`).
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
        with quiet_dcp():
            # Each rank plans its own reads from the metadata rank 0 broadcast: nothing to
            # coordinate, so DCP's gather and scatter of every rank's plan through rank 0 (O(world)
            # pickled plans there) is skipped; the ranks agree on the outcome below instead.
            dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
        finishing = time.perf_counter()
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
        # committed targets, and those a read that failed midway had begun writing in place
        touched = planner.touched_targets | planner.written_targets(reader.written_items)
        error.touched_keys = tuple(sorted(touched))  # type: ignore[attr-defined]
        raise error from None
    assert planner.report is not None
    if planner.unexpected == "warn" and planner.reported_unexpected and is_rank0():
        unused = planner.reported_unexpected
        logger.warning("%d tensors of %s make no model tensor (UNEXPECTED; unexpected='ignore' silences "
                       "this, 'raise' refuses such loads): %s", len(unused), reader.path, describe_keys(unused))
    phases = {"plan": planner.plan_seconds, **reader.seconds, "finish": time.perf_counter() - finishing}
    seconds = {k: phases[k] for k in PHASES if k in phases}
    return dataclasses.replace(planner.report, seconds=seconds)


PHASES = ("metadata", "plan", "spans", "first_byte", "read", "convert", "copy", "exchange", "finish")
"""The phases of ``LoadReport.seconds``, in load order (see there which add up to the load)."""


def _architecture_mismatch(model: nn.Module, reader: HFStorageReader,
                           error: MissingKeysError | MappingError) -> ArchitectureMismatchError | None:
    """Missing keys or shapes that disagree, explained first: the checkpoint's ``config.json``
    names another model type than the model's (what ``from_pretrained`` refuses up front). None
    when it does not, or has no readable config."""
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


