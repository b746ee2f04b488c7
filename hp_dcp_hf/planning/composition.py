"""The one mapping composition both planners trace: the load reads along it, the save inverts it."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from torch import nn
from transformers.core_model_loading import WeightTransform

from hp_dcp_hf.mapping.compose import Composition, TensorSpec
from hp_dcp_hf.mapping.stages import model_stages, recorded_source_shapes


def compose(
    model: nn.Module,
    sources: Mapping[str, TensorSpec],
    wanted: Collection[str],
    *,
    weights_mapping: Sequence[WeightTransform] | None = None,
    config: Any = None,
    trace: bool = True,
    share_structure: bool = True,
) -> Composition:
    """The names ``wanted`` of ``model``'s state dict traced from checkpoint tensors ``sources``:
    through ``weights_mapping`` (checkpoint -> canonical; None: transformers' own for the model),
    then every rewrite recorded on ``model`` (:func:`~hp_dcp_hf.add_weight_mapping`). The load's
    ``sources`` are the checkpoint's tensors, the save's those the model's class saves.

    ``config`` is where conversion ops read model facts (default ``model.config``); ``trace`` and
    ``share_structure`` as :class:`Composition` takes them.
    """
    return Composition(
        model_stages(model, weights_mapping),
        sources,
        wanted,
        stage_shapes=[{}, *recorded_source_shapes(model)],
        model=model,
        config=config if config is not None else getattr(model, "config", None),
        base_model_prefix=getattr(model, "base_model_prefix", None),
        trace=trace,
        share_structure=share_structure,
    )
