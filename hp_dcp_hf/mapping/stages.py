"""Where the stages of a model's weight mapping come from and where rewrites record theirs."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightTransform

from hp_dcp_hf.errors import MappingError

_STAGES = "_hp_weight_mapping_stages"


def add_weight_mapping(model: nn.Module, transforms: Sequence[WeightTransform]) -> None:
    """Record one stage of model rewrites, already applied to ``model``.

    ``transforms`` are transformers ``WeightRenaming`` / ``WeightConverter`` whose source names are
    the names before the rewrite and target names the names after it. Stages compose in the
    order recorded, after the checkpoint's own mapping.
    """
    transforms = list(transforms)
    if not all(isinstance(t, WeightTransform) for t in transforms):
        raise MappingError(f"a weight mapping stage holds WeightRenaming/WeightConverter only, got {transforms}")
    setattr(model, _STAGES, [*recorded_stages(model), transforms])


def recorded_stages(model: nn.Module) -> list[list[WeightTransform]]:
    """The rewrite stages recorded on ``model``, oldest first."""
    return list(getattr(model, _STAGES, []))


def model_stages(model: nn.Module, weights_mapping: Sequence[WeightTransform] | None) -> list[list[WeightTransform]]:
    """The checkpoint mapping (given, or transformers' for the model type) followed by the rewrites."""
    if weights_mapping is None:
        weights_mapping = (
            get_model_conversion_mapping(model, key_mapping=None, hf_quantizer=None)
            if isinstance(model, PreTrainedModel)
            else []
        )
    return [list(weights_mapping), *recorded_stages(model)]
