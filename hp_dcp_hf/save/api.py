"""The one-call save: ``save_hf_checkpoint(model, path)``, every rank writing its own shards once."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from transformers.core_model_loading import WeightTransform

from hp_dcp_hf.errors import ArgumentError, HPDCPHFError, StorageWriteError
from hp_dcp_hf.quant.encode import Quantize
from hp_dcp_hf.save.planner import HFSavePlanner
from hp_dcp_hf.storage.write.writer import HFStorageWriter
from hp_dcp_hf.util.collectives import should_broadcast
from hp_dcp_hf.util.dcp import quiet_dcp, unwrap_checkpoint_exception


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
    on its amax first; :mod:`hp_dcp_hf.quant.encode`). A weight whose last two dims are not multiples
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
        with quiet_dcp():
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
