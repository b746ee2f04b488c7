"""HFSavePlanner: a DCP ``SavePlanner`` that writes a (parallelized, rewritten) model back as the
Hugging Face checkpoint ``save_pretrained`` would write for it, each rank its own bytes.

The save is the load run backwards through the same composition. The checkpoint's tensors are
those ``save_pretrained`` writes for the model's class and config (transformers' own
``remove_tied_weights_from_state_dict`` and ``revert_weight_conversion``, run on a meta skeleton:
names, shapes, dtypes, no data). Tracing the load composition from them (checkpoint mapping, then
every recorded rewrite) tells, for every model tensor, which box of which checkpoint tensor each
of its elements is; a rank's shard pieces cut against it give its :class:`WriteItem` s, each a box
of a checkpoint tensor and the strided view of the local shard that holds it. No reverse op is
needed (a fused ``qkv_proj`` laid out in rank order writes back into q, k and v as it was read from
them), and a conversion that does not map elements one to one cannot be inverted: that is a
:class:`MappingError` before any byte is written.

Each byte is written by one rank: a piece held by several ranks (``Replicate`` dims, the parallel
copies of a submesh, plain tensors in a process group) is written by one of its replicas, the
``i``-th tensor's by replica ``i mod replicas``, so replicas share the writing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from transformers.core_model_loading import WeightTransform, dot_natural_key

from hp_dcp_hf.errors import MappingError, PlanningError
from hp_dcp_hf.layout import local_shard_pieces, local_tensor
from hp_dcp_hf.mapping.blocks import LocalView, read_blocks
from hp_dcp_hf.mapping.compose import Composition, Opaque, TensorSpec
from hp_dcp_hf.mapping.stages import model_stages, original_class, recorded_source_shapes
from hp_dcp_hf.parallel.replicas import ReplicaGroups
from hp_dcp_hf.perf import paused_gc
from hp_dcp_hf.planner import alias_groups


@dataclass(frozen=True)
class SaveRequest:
    """What every rank's writer needs to lay the files out (it travels in ``SavePlan.planner_data``
    of the rank's own plan, and the writer drops it before plans are gathered)."""

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]  # checkpoint key -> (dtype, shape)
    storage: dict[str, tuple[int, int]]  # checkpoint key -> (storage group, elements of that storage)
    extra_files: dict[str, str] = field(default_factory=dict)  # config.json, generation_config.json
    index_metadata: dict[str, Any] = field(default_factory=dict)  # total_parameters


def saved_tensors(model: nn.Module) -> tuple[dict[str, TensorSpec], dict[str, tuple[int, int]], nn.Module]:
    """The tensors ``save_pretrained`` writes for ``model``'s class and config, which of them are
    views of one storage (key -> (storage group, its elements): ``save_pretrained`` splits files by
    storage), and the meta skeleton they come from (in the dtype of the model's floating-point
    parameters)."""
    config = getattr(model, "config", None)
    if config is None:
        raise PlanningError("saving in Hugging Face format needs a transformers model (its config and class)")
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
    with torch.device("meta"):
        skeleton = original_class(model)._from_config(config, dtype=dtype)
    skeleton.tie_weights()
    state = skeleton.state_dict()
    for key in getattr(skeleton, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = revert_weight_conversion(skeleton, remove_tied_weights_from_state_dict(state, skeleton))
    groups: dict[int, int] = {}
    storage = {}
    for key, t in state.items():
        handle = t.untyped_storage()._cdata  # meta storages are told apart by their handle alone
        storage[key] = (groups.setdefault(handle, len(groups)), t.untyped_storage().nbytes() // t.element_size())
    return {key: TensorSpec(tuple(t.shape), t.dtype) for key, t in state.items()}, storage, skeleton


def _extra_files(model: nn.Module) -> dict[str, str]:
    """``config.json`` (and ``generation_config.json`` for generative models), as ``save_pretrained`` writes them."""
    files = {"config.json": model.config.to_json_string(use_diff=True)}
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation is not None and can_generate():
        files["generation_config.json"] = generation.to_json_string(use_diff=True)
    return files


class HFSavePlanner(SavePlanner):
    """Plan every rank's writes of ``model`` as a Hugging Face checkpoint (see the module docstring).

    Args:
        model: the model whose ``state_dict()`` is saved (its class and config say what
            ``save_pretrained`` would write).
        weights_mapping: the checkpoint -> canonical model mapping, instead of transformers' own.

    Tensors are planned in the model's dtypes; :class:`~hp_dcp_hf.storage.HFStorageWriter` casts
    them on write when given a ``dtype``.
    """

    def __init__(self, model: nn.Module, *, weights_mapping: Sequence[WeightTransform] | None = None) -> None:
        self.model = model
        self.weights_mapping = weights_mapping
        self.bytes_planned = 0  # the bytes of this rank's items, in the model's dtypes
        self._views: dict[MetadataIndex, LocalView] = {}

    # -- DCP protocol -------------------------------------------------------------------------
    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        with paused_gc():
            items, request = self.plan_writes(self.state_dict)
        return SavePlan(items, planner_data=request)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return all_plans, Metadata(state_dict_metadata={})

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        """The strided view of the local shard holding ``write_item``'s box (the writer casts it)."""
        return self._views[write_item.index].view().detach()

    # -- planning -----------------------------------------------------------------------------
    def plan_writes(self, state_dict: Mapping[str, Any]) -> tuple[list[WriteItem], SaveRequest]:
        """Validate everything and return this rank's WriteItems and what its writer needs."""
        specs, storage, skeleton = saved_tensors(self.model)
        composition = Composition(
            model_stages(self.model, self.weights_mapping),
            specs,
            set(state_dict),
            stage_shapes=[{}, *recorded_source_shapes(self.model)],
            model=self.model,
            config=getattr(self.model, "config", None),
            base_model_prefix=getattr(self.model, "base_model_prefix", None),
        )
        # One name per tied group, the one the checkpoint makes (embed_tokens, not its lm_head alias)
        groups = alias_groups(self.model, list(state_dict))
        fill = sorted((next((n for n in g if n in composition.traced), g[0]) for g in groups), key=dot_natural_key)
        self._check_inverse(composition, state_dict, fill, specs)
        items: list[WriteItem] = []
        self._views.clear()
        self.bytes_planned = 0
        replicas = ReplicaGroups.gather([state_dict[target] for target in fill])
        for ordinal, target in enumerate(fill):
            tensor = state_dict[target]
            if not replicas.writes(tensor, ordinal, target):
                continue
            local = local_tensor(tensor)
            for piece in local_shard_pieces(tensor, key=target):
                for block in read_blocks(composition.traced[target], piece.global_box, piece.local_offsets):
                    spec = specs[block.key]
                    index = MetadataIndex(block.key, torch.Size(block.source_box.offsets))
                    items.append(WriteItem(index=index, type=WriteItemType.TENSOR, tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(block.source_box.offsets), torch.Size(block.source_box.sizes)),
                        properties=TensorProperties(dtype=spec.dtype), size=torch.Size(spec.shape))))
                    self._views[index] = LocalView.of(local, block)
                    self.bytes_planned += block.numel * tensor.dtype.itemsize
        request = SaveRequest(
            {key: (spec.dtype, spec.shape) for key, spec in specs.items()},
            storage,
            _extra_files(self.model) if self.is_coordinator else {},
            {"total_parameters": skeleton.num_parameters()} if hasattr(skeleton, "num_parameters") else {},
        )
        return items, request

    @staticmethod
    def _check_inverse(composition: Composition, state_dict, fill: Sequence[str], specs) -> None:
        """Every checkpoint element is one element of one model tensor, and shapes agree."""
        problems = []
        covered = dict.fromkeys(specs, 0)
        for target in fill:
            traced = composition.traced.get(target)
            if traced is None:
                problems.append(f"{target}: no checkpoint tensor of save_pretrained's maps to it")
            elif isinstance(traced, Opaque):
                problems.append(f"{target}: made by a conversion that cannot be traced, so it cannot be inverted "
                                f"exactly (from {sorted(traced.sources)})")
            elif tuple(traced.shape) != tuple(state_dict[target].shape):
                problems.append(f"{target}: the model holds {tuple(state_dict[target].shape)}, the checkpoint "
                                f"makes {tuple(traced.shape)}")
            else:
                for piece in traced.pieces:
                    covered[piece.key] += piece.numel
        problems += [f"{key}: {n} of its {math.prod(specs[key].shape)} elements come from the model"
                     for key, n in covered.items() if n != math.prod(specs[key].shape)]
        if problems:
            raise MappingError(f"{len(problems)} tensors cannot be written back exactly:\n  " + "\n  ".join(problems))
