"""Where the stages of a model's weight mapping come from, where rewrites record theirs, and where a
load records the checkpoint mapping it applied (for the save to invert)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightTransform

from hp_dcp_hf.errors import MappingError

_STAGES = "_hp_weight_mapping_stages"
_SHAPES = "_hp_weight_mapping_source_shapes"
_CHECKPOINT = "_hp_checkpoint_mapping"


def add_weight_mapping(
    model: nn.Module,
    transforms: Sequence[WeightTransform],
    *,
    source_shapes: Mapping[str, Sequence[int]] | None = None,
) -> None:
    """Record one stage of model rewrites, already applied to ``model``.

    ``transforms`` are transformers ``WeightRenaming`` / ``WeightConverter`` whose source names are
    the names before the rewrite and target names the names after it. Stages compose in the
    order recorded, after the checkpoint's own mapping. ``source_shapes`` gives the shapes of the
    tensors the rewrite replaced (full names before it): earlier conversions that ask the model for
    a parameter's shape (``Split``, ``Transpose(check_dims=True)``) find them there.
    """
    transforms = list(transforms)
    if not all(isinstance(t, WeightTransform) for t in transforms):
        raise MappingError(f"a weight mapping stage holds WeightRenaming/WeightConverter only, got {transforms}")
    shapes = {name: tuple(int(s) for s in shape) for name, shape in (source_shapes or {}).items()}
    setattr(model, _STAGES, [*recorded_stages(model), transforms])
    setattr(model, _SHAPES, [*recorded_source_shapes(model), shapes])


def recorded_stages(model: nn.Module) -> list[list[WeightTransform]]:
    """The rewrite stages recorded on ``model``, oldest first."""
    return list(getattr(model, _STAGES, []))


def recorded_source_shapes(model: nn.Module) -> list[dict[str, tuple[int, ...]]]:
    """For each recorded stage, the shapes of the tensors it replaced."""
    return list(getattr(model, _SHAPES, []))


def record_checkpoint_mapping(model: nn.Module, transforms: Sequence[WeightTransform]) -> None:
    """Record the checkpoint -> canonical transforms a load applied to ``model`` (those that matched
    a checkpoint key, as transformers keeps them in ``_weight_conversions``): a later save inverts
    them, so the model goes back to the checkpoint it came from."""
    setattr(model, _CHECKPOINT, list(transforms))


def recorded_checkpoint_mapping(model: nn.Module) -> list[WeightTransform] | None:
    """The checkpoint mapping the last load into ``model`` applied; None when none was recorded."""
    mapping = getattr(model, _CHECKPOINT, None)
    return None if mapping is None else list(mapping)


def _is_transformers_model(model: nn.Module) -> bool:
    """``model`` is a transformers ``PreTrainedModel``. Asked of ``sys.modules``: no model is one
    unless transformers' modeling stack is imported, and importing it here would cost a model of
    one's own (torchtitan, plain torch) seconds of transformers and its FP8 kernels (``torch._dynamo``)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def model_stages(model: nn.Module, weights_mapping: Sequence[WeightTransform] | None) -> list[list[WeightTransform]]:
    """The checkpoint mapping (given, or transformers' for the model type) followed by the rewrites.

    A given mapping is copied: composing marks the transforms that match (``was_used``), and a
    mapping reused for another checkpoint must not carry the marks of the last one.
    """
    if weights_mapping is None:
        if _is_transformers_model(model):
            with _original_classes(model):
                weights_mapping = get_model_conversion_mapping(model, key_mapping=None, hf_quantizer=None)
        else:
            weights_mapping = []
    else:
        weights_mapping = copy.deepcopy(list(weights_mapping))
    return [list(weights_mapping), *recorded_stages(model)]


def original_class(model: nn.Module) -> type:
    """``model``'s class before FSDP2 wrapped it (``FSDPLlamaForCausalLM`` -> ``LlamaForCausalLM``)."""
    cls = type(model)
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule)) if isinstance(model, FSDPModule) else cls


@contextmanager
def _original_classes(model: nn.Module) -> Iterator[None]:
    """Show transformers the classes FSDP2 wrapped.

    ``fully_shard`` swaps a module's class for ``FSDP<Name>(FSDPModule, <Name>)``, and transformers
    looks some conversion mappings up by class name: without this, a model sharded before planning
    would lose them.
    """
    wrapped = [(m, type(m)) for m in model.modules() if isinstance(m, FSDPModule)]
    try:
        for module, _ in wrapped:
            module.__class__ = original_class(module)
        yield
    finally:
        for module, cls in wrapped:
            module.__class__ = cls
