"""The canonical model on the meta device (stage 1 of ``from_pretrained``), and the checkpoint
mapping taken from it before rewrites and parallelization rename it."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def checkpoint_mapping(model: nn.Module) -> list:
    """Stage 1.5: the checkpoint -> canonical-model mapping (transformers' conversion mapping for
    the model type), taken from the skeleton *before* rewrites and parallelization change it:
    FSDP2 renames the class (``FSDPGteModel``), which hides transformers' class-keyed mappings."""
    from hp_dcp_hf.mapping.stages import model_stages

    return list(model_stages(model, None)[0])


def build_skeleton(
    config,
    model_cls: type[nn.Module],
    *,
    dtype: torch.dtype = torch.float32,
    model_kwargs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Stage 1: the canonical, unparallelized model on the meta device, tied weights tied.

    A ``quantization_config`` describes the checkpoint, not this model (its parameters are
    ``dtype``; the planner dequantizes on load): the model's config goes without it.
    """
    kwargs = dict(model_kwargs or {})
    if getattr(config, "quantization_config", None) is not None:
        config = copy.deepcopy(config)
        del config.quantization_config
    with torch.device("meta"):
        if hasattr(model_cls, "_from_config"):
            model = model_cls._from_config(config, dtype=dtype, **kwargs)
        else:
            model = model_cls(config, **kwargs).to(dtype)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model
