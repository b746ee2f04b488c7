"""HFSavePlanner: a DCP ``SavePlanner`` that writes a (parallelized, rewritten) model back as the
Hugging Face checkpoint ``save_pretrained`` would write for it, each rank its own bytes.

The save is the load run backwards through the same composition. The checkpoint mapping it
inverts is the one given to it, else the one the model was loaded with (the load records the
transforms that matched a checkpoint key, as transformers' ``from_pretrained`` does), else
transformers' own for the model's class. The checkpoint's tensors are what transformers'
``revert_weight_conversion`` makes of that mapping on a meta skeleton of the model's class and
config, after ``remove_tied_weights_from_state_dict`` (names, shapes, dtypes, no data): with the
same mapping, what ``save_pretrained`` writes. Tracing the load composition from them (checkpoint
mapping, then every recorded rewrite) tells, for every model tensor, which box of which checkpoint
tensor each of its elements is; a rank's shard pieces cut against it give its :class:`WriteItem` s,
each a box of a checkpoint tensor and the strided view of the local shard that holds it. No reverse
op runs on data (a fused ``qkv_proj`` laid out in rank order writes back into q, k and v as it was
read from them), and a conversion that does not map elements one to one cannot be inverted: that is
a :class:`MappingError` before any byte is written.

Each byte is written by one rank: a piece held by several ranks (``Replicate`` dims, the parallel
copies of a submesh, plain tensors in a process group) is written by one of its replicas, the
``i``-th tensor's by replica ``i mod replicas``, so replicas share the writing (or each by its
lowest rank: ``lowest_replica_writes``). Plain local shards (``CheckpointableTensor``) are written
shard by shard: a shard several ranks list, by one of them.

``quantize="fp8"`` writes the block-scaled FP8 checkpoint transformers' FP8 quantizer would
(:mod:`hp_dcp_hf.quant.encode`): the tensors it converts are planned in ``float8_e4m3fn``, each with its
``weight_scale_inv``, whose blocks each rank writes where it writes the block's first element; the
writer quantizes the values as it writes them.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import re
from collections.abc import Collection, Mapping, Sequence
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
from transformers import PreTrainedModel
from transformers.core_model_loading import WeightRenaming, WeightTransform, dot_natural_key

from hp_dcp_hf.errors import ArgumentError, LayoutError, MappingError, PlanningError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.geometry.replicas import ReplicaGroups
from hp_dcp_hf.geometry.shards import is_checkpointable, local_tensor
from hp_dcp_hf.mapping.blocks import LocalView, local_blocks
from hp_dcp_hf.mapping.compose import Composition, Opaque, TensorSpec
from hp_dcp_hf.mapping.stages import (
    original_class,
    recorded_checkpoint_mapping,
    recorded_stages,
)
from hp_dcp_hf.mapping.symbolic import Piece
from hp_dcp_hf.model.dtype import model_dtype
from hp_dcp_hf.model.skeleton import build_skeleton
from hp_dcp_hf.model.state import alias_groups
from hp_dcp_hf.planning.composition import compose
from hp_dcp_hf.planning.targets import Targets, refuse, shape_problem, tied_targets
from hp_dcp_hf.quant.encode import (
    FP8,
    SCALE_DTYPE,
    CeilGrids,
    Fp8Conversion,
    Fp8Layout,
    Quantize,
    already_quantized,
    fp8_config,
    fp8_conversion,
    scale_storage,
    split_blocks,
)
from hp_dcp_hf.quant.grid import scale_name
from hp_dcp_hf.util.collectives import should_broadcast
from hp_dcp_hf.util.perf import paused_gc


@dataclass(frozen=True)
class SaveRequest:
    """What every rank's writer needs to lay the files out (it travels in ``SavePlan.planner_data``
    of the rank's own plan, and the writer drops it before plans are gathered)."""

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]  # checkpoint key -> (dtype, shape)
    storage: dict[str, tuple[int, int]]  # checkpoint key -> (storage group, elements of that storage)
    configs: dict[str, Any] = field(default_factory=dict)  # config.json, generation_config.json (coordinator)
    dtype: torch.dtype = torch.float32  # the model's, as save_pretrained names it (its first floating parameter's)
    architectures: tuple[str, ...] = ()
    index_metadata: dict[str, Any] = field(default_factory=dict)  # total_parameters
    quantization: Fp8Layout | None = None  # the FP8 tensors of a quantize="fp8" save

    def extra_files(self, dtype: torch.dtype | None) -> dict[str, str]:
        """The JSON files ``save_pretrained`` writes beside the weights of this model saved in
        ``dtype`` (None: the model's): ``config.json`` naming that dtype and the model's class
        (and the ``quantization_config`` of a quantized save)."""
        files = {}
        for name, config in self.configs.items():
            if name == "config.json":
                config = copy.deepcopy(config)
                config.dtype = str(dtype or self.dtype).removeprefix("torch.")
                config.architectures = list(self.architectures)
                if self.quantization is not None:
                    config.quantization_config = self.quantization.config
            files[name] = config.to_json_string(use_diff=True)
        return files


def saved_tensors(
    model: nn.Module, weights_mapping: Sequence[WeightTransform] | None = None, quantize: Any = None,
    hf_config: Any = None, ceil_grids: bool = False,
) -> tuple[dict[str, TensorSpec], dict[str, tuple[int, int]], nn.Module, tuple[Fp8Conversion, frozenset[str]] | None]:
    """The checkpoint tensors that ``weights_mapping`` (checkpoint -> canonical) loads into
    ``model``, which of them are views of one storage (key -> (storage group, its elements):
    ``save_pretrained`` splits files by storage), the skeleton they come from, and, given a
    ``quantize`` config (``FineGrainedFP8Config``), what transformers' FP8 quantizer makes of the
    model and the checkpoint keys it quantizes (None without; ``ceil_grids``: :class:`CeilGrids`).

    A transformers model's canonical tensors are those of a meta skeleton of its class and config
    (tied copies and ``_keys_to_ignore_on_save`` dropped, as ``save_pretrained`` drops them), in the
    dtype of its floating-point parameters; another module's are its own state dict, one name per
    tied group, and it needs a mapping. transformers' ``revert_weight_conversion`` turns them into
    the checkpoint's names and shapes: with ``weights_mapping`` None, reversing transformers' own
    mapping for the class, as ``save_pretrained`` of a model built from scratch does.

    The quantized checkpoint keys are found by marking the canonical tensors the quantizer
    converts as FP8 before the reversal: the checkpoint tensors made of them come out in FP8 (the
    specs keep the model's dtype; the planner traces values).

    ``hf_config`` gives a module that is not a transformers model the checkpoint of transformers'
    model for that config, as ``save_pretrained`` writes it; ``weights_mapping`` then says how the
    module's tensors are made of it (it is traced, not reversed).
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    config, cls = getattr(model, "config", None), original_class(model)
    if not isinstance(model, PreTrainedModel) and hf_config is not None:
        from hp_dcp_hf.model.config import resolve_model_class

        config, cls = hf_config, resolve_model_class(hf_config)
        weights_mapping = None  # the checkpoint is transformers' for the class: reverse its own mapping
    dtype = model_dtype(model)
    conversion = None
    if issubclass(cls, PreTrainedModel) and config is not None:
        skeleton = build_skeleton(config, cls, dtype=dtype)
        state = skeleton.state_dict()
        for key in getattr(skeleton, "_keys_to_ignore_on_save", None) or ():
            state.pop(key, None)
        state = remove_tied_weights_from_state_dict(state, skeleton)
        if quantize is not None:
            conversion = fp8_conversion(build_skeleton(config, cls, dtype=dtype), quantize, ceil_grids)
            state.update({key: state[key].to(FP8) for key in conversion.canonical if key in state})
        converting: Any = skeleton
    elif weights_mapping is None:
        raise PlanningError("saving in Hugging Face format needs a transformers model (its config and class), or "
                            "the checkpoint mapping the model was loaded with (weights_mapping=)")
    elif recorded_stages(model):
        raise PlanningError("a rewritten model that is not a transformers model has no known canonical form to "
                            "save: save it before the rewrites, or as a transformers model")
    else:
        skeleton, full = model, model.state_dict()
        state = {group[0]: torch.empty(tuple(full[group[0]].shape), dtype=full[group[0]].dtype, device="meta")
                 for group in alias_groups(model, list(full))}
        converting = _Converting(model)
    if weights_mapping is None:
        state = revert_weight_conversion(skeleton, state)
    elif weights_mapping:
        converting._weight_conversions = list(weights_mapping)
        state = _reverted(converting, state)
    groups: dict[int, int] = {}
    storage = {}
    for key, t in state.items():
        handle = t.untyped_storage()._cdata  # meta storages are told apart by their handle alone
        storage[key] = (groups.setdefault(handle, len(groups)), t.untyped_storage().nbytes() // t.element_size())
    specs = {key: TensorSpec(tuple(t.shape), dtype if t.dtype == FP8 else t.dtype) for key, t in state.items()}
    quantized = None
    if conversion is not None:
        quantized = conversion, frozenset(key for key, t in state.items()
                                          if t.dtype == FP8 and conversion.quantizes(t.shape))
    return specs, storage, skeleton, quantized


class _Converting:
    """A module that is not a transformers model as ``revert_weight_conversion`` asks it: with the
    conversions to reverse (the module's own attributes stay as they are) and no config."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._weight_conversions: list[WeightTransform] = []
        self.config = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _reverted(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` under the checkpoint's names: transformers' ``revert_weight_conversion`` of
    ``model._weight_conversions``. A transform transformers cannot reverse is a
    :class:`MappingError` naming the first model tensor it makes."""
    from transformers.core_model_loading import revert_weight_conversion

    for transform in model._weight_conversions:
        try:
            transform.reverse_transform()
        except Exception as exc:  # an op without reverse_op, a quantized transform
            raise MappingError(f"{transform} cannot be reversed ({type(exc).__name__}: {exc}), so the model cannot "
                               "be written back in the checkpoint's format", key=_made_by(transform, state)) from exc
    try:
        return revert_weight_conversion(model, state)
    except Exception as exc:
        raise MappingError(f"reversing the checkpoint mapping fails: {type(exc).__name__}: {exc}") from exc


def _made_by(transform: WeightTransform, names: Collection[str]) -> str | None:
    """The first of ``names`` that ``transform`` makes on load (its target patterns match it)."""
    try:
        probe = WeightRenaming(list(transform._original_target_patterns), list(transform._original_source_patterns))
    except (ValueError, re.error):
        return None
    probe.scope_prefix, probe.base_model_prefix = transform.scope_prefix, transform.base_model_prefix
    return next((name for name in sorted(names, key=dot_natural_key) if probe.rename_source_key(name)[1]), None)


def _configs(model: nn.Module) -> dict[str, Any]:
    """The configs ``save_pretrained`` writes: ``config.json``, and ``generation_config.json`` for
    generative models."""
    configs = {"config.json": model.config}
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation is not None and can_generate():
        configs["generation_config.json"] = generation
    return configs


class HFSavePlanner(SavePlanner):
    """Plan every rank's writes of ``model`` as a Hugging Face checkpoint (see the module docstring).

    Args:
        model: the model whose ``state_dict()`` is saved (its class and config say what
            ``save_pretrained`` would write; a module that is not a transformers model needs a
            mapping, given or recorded by its load).
        weights_mapping: the checkpoint -> canonical model mapping to invert. Default: the one the
            model was loaded with, else transformers' own for its class.
        quantize: ``"fp8"`` (or an FP8 ``quantization_config`` dict, or a ``FineGrainedFP8Config``:
            ``weight_block_size``, ``modules_to_not_convert``) to write the block-scaled FP8
            checkpoint transformers' FP8 quantizer makes of a transformers model (weights that are
            not whole blocks kept in the model's dtype; in :class:`~hp_dcp_hf.quant.encode.CeilGrids`,
            FP8 on ceil grids). A model that is quantized already, or is not a transformers model,
            is an :class:`ArgumentError`.
        hf_config: a transformers config: save a module that is not a transformers model as the
            checkpoint of transformers' model for it (files, keys, ``config.json``), its tensors made
            of that checkpoint by ``weights_mapping`` (torchtitan's models, :mod:`hp_dcp_hf.integrations`).
        pipeline_stage: this rank's model is one pipeline stage: checkpoint tensors it holds
            nothing of are other stages' to write. Either way the coordinator checks, over every
            rank's plan, that each checkpoint element is written exactly once.
        lowest_replica_writes: a piece several ranks hold is planned on the lowest of them, not
            on each in turn (a weight source gathering to rank 0: others plan only what it lacks).

    Tensors are planned in the model's dtypes (quantized ones in FP8, with their scales);
    :class:`~hp_dcp_hf.storage.HFStorageWriter` casts them on write when given a ``dtype``, and
    quantizes the FP8 ones from the values that ``dtype`` gives.
    """

    def __init__(self, model: nn.Module, *, weights_mapping: Sequence[WeightTransform] | None = None,
                 quantize: Quantize | None = None, pipeline_stage: bool = False, hf_config: Any = None,
                 lowest_replica_writes: bool = False) -> None:
        self.model = model
        self.lowest_replica_writes = lowest_replica_writes
        self.weights_mapping = weights_mapping
        self.hf_config = hf_config
        if hf_config is not None and (isinstance(model, PreTrainedModel) or weights_mapping is None):
            raise ArgumentError("hf_config= is for a module that is not a transformers model, with the "
                                "weights_mapping= that makes its tensors from that config's checkpoint")
        self.pipeline_stage = pipeline_stage
        self._shapes: dict[str, tuple[int, ...]] = {}  # every checkpoint tensor the save writes, by key
        self.quantize = None if quantize is None else fp8_config(quantize)
        self.ceil_grids = isinstance(quantize, CeilGrids)
        if self.quantize is not None:
            if not isinstance(model, PreTrainedModel) or getattr(model, "config", None) is None:
                raise ArgumentError("quantize= needs a transformers model: transformers' FP8 quantizer decides "
                                    "which of its modules are converted")
            why = already_quantized(model)
            if why is not None:
                raise ArgumentError(f"quantize=: the model is quantized already ({why}); load it as values "
                                    "(a bf16 or float32 model) to quantize it on save")
        self.bytes_planned = 0  # the bytes of this rank's items as stored (FP8 weights and their scales too)
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
        """Coordinator: every checkpoint element is written by exactly one rank, counted over all the
        ranks' items (the per-rank checks see one rank's part; pipeline stages each hold one part)."""
        written = dict.fromkeys(self._shapes, 0)
        for plan in all_plans:
            for item in plan.items:
                if item.tensor_data is not None:
                    key = item.index.fqn
                    written[key] = written.get(key, 0) + math.prod(item.tensor_data.chunk.sizes)
        wrong = [(key, n, math.prod(self._shapes.get(key, ()))) for key, n in written.items()
                 if n != math.prod(self._shapes.get(key, ()))]
        if wrong:
            raise MappingError(f"{len(wrong)} checkpoint tensors would not be written exactly once by the ranks "
                               "together (elements written of elements): " + ", ".join(
                                   f"{key} {n} of {numel}" for key, n, numel in wrong[:5]), key=wrong[0][0])
        return all_plans, Metadata(state_dict_metadata={})

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        """The strided view of the local shard holding ``write_item``'s box (the writer casts or
        quantizes it). The values of scales are the writer's, from the amax of what it writes."""
        view = self.local_view(write_item.index)
        if view is None:
            raise PlanningError("FP8 scales are computed by HFStorageWriter as it writes their weights",
                                key=write_item.index.fqn)
        return view.view().detach()

    def local_view(self, index: MetadataIndex) -> LocalView | None:
        """The view of the local shard that holds write item ``index``'s box, once planned (None
        for an FP8 scale: the writer computes its values)."""
        return self._views.get(index)

    # -- planning -----------------------------------------------------------------------------
    def plan_writes(self, state_dict: Mapping[str, Any]) -> tuple[list[WriteItem], SaveRequest]:
        """Validate everything and return this rank's WriteItems and what its writer needs."""
        mapping = self.weights_mapping if self.weights_mapping is not None else recorded_checkpoint_mapping(self.model)
        specs, storage, skeleton, quantized = saved_tensors(self.model, mapping, self.quantize, self.hf_config,
                                                           self.ceil_grids)
        composition = compose(self.model, specs, set(state_dict), weights_mapping=mapping)
        targets = tied_targets(self.model, list(state_dict), composition.traced)
        fill = targets.names
        self._check_inverse(composition, state_dict, targets, specs, others_elsewhere=self.pipeline_stage)
        items: list[WriteItem] = []
        self._views.clear()
        self.bytes_planned = 0
        replicas = ReplicaGroups.gather({target: state_dict[target] for target in fill},
                                        lowest=self.lowest_replica_writes)
        layout = None
        if quantized is not None:
            plain = next((target for target in fill if is_checkpointable(state_dict[target])), None)
            if plain is not None:  # which ranks write parts of a scale block is computed from DTensor layouts
                raise LayoutError("quantize= does not save plain local shards (CheckpointableTensor) yet: save them "
                                  "unquantized, or as DTensors", key=plain)
            conversion, keys = quantized
            layout = Fp8Layout(conversion.config, {key: specs[key].shape for key in sorted(keys)})
            if should_broadcast():  # the blocks several ranks write parts of: the same on every rank
                layout = dataclasses.replace(layout, split=split_blocks(
                    [(state_dict[target], composition.traced[target]) for target in fill], layout))
        for ordinal, target in enumerate(fill):
            tensor = state_dict[target]
            pieces = replicas.written_pieces(tensor, ordinal, target)
            for block, view in local_blocks(composition.traced[target], local_tensor(tensor), pieces):
                fp8 = layout is not None and block.key in layout.shapes
                items.append(_write_item(block.key, block.source_box, FP8 if fp8 else specs[block.key].dtype,
                                         specs[block.key].shape))
                self._views[items[-1].index] = view
                self.bytes_planned += block.numel * (FP8.itemsize if fp8 else tensor.dtype.itemsize)
                owned = layout.owned_box(block.source_box) if fp8 else None
                if owned is not None:  # the scales of the blocks this box starts
                    items.append(_write_item(scale_name(block.key), owned, SCALE_DTYPE, layout.grid(block.key)))
                    self.bytes_planned += owned.numel * SCALE_DTYPE.itemsize
        tensors = {key: (spec.dtype, spec.shape) for key, spec in specs.items()}
        self._shapes = {key: tuple(shape) for key, (_, shape) in tensors.items()}
        if layout is not None:
            self._shapes.update({scale_name(key): tuple(layout.grid(key)) for key in layout.shapes})
        metadata = {"total_parameters": skeleton.num_parameters()} if hasattr(skeleton, "num_parameters") else {}
        if quantized is not None:  # the FP8 model's: its scales are parameters too
            metadata = {"total_parameters": quantized[0].total_parameters}
        request = SaveRequest(
            layout.ordered(tensors) if layout is not None else tensors,
            scale_storage(layout, storage) if layout is not None else storage,
            _configs(self.model if isinstance(self.model, PreTrainedModel) else skeleton)
            if self.is_coordinator and isinstance(skeleton, PreTrainedModel) else {},
            model_dtype(self.model),
            (original_class(skeleton if isinstance(skeleton, PreTrainedModel) else self.model).__name__,),
            metadata,
            layout,
        )
        return items, request

    @staticmethod
    def _check_inverse(composition: Composition, state_dict, targets: Targets, specs, *,
                       others_elsewhere: bool = False) -> None:
        """Loading the checkpoint makes every model tensor, in its shape, and every checkpoint element
        is one element of one model tensor: then writing each model element where the load reads it
        from writes every checkpoint byte once, and nothing else. ``others_elsewhere`` (a pipeline
        stage): a checkpoint tensor none of whose elements this model holds is another stage's."""
        problems = [(group[0], "no checkpoint tensor the mapping reverses to maps to it") for group in targets.unmade]
        pieces: dict[str, list[Piece]] = {key: [] for key in specs}
        for target in targets.names:
            traced = composition.traced[target]
            if isinstance(traced, Opaque):
                problems.append((target, f"made by a conversion that cannot be traced, so it cannot be inverted "
                                         f"exactly (from {sorted(traced.sources)})"))
            elif (shape := shape_problem(state_dict[target], traced)) is not None:
                problems.append((target, shape))
            else:
                for piece in traced.pieces:
                    pieces[piece.key].append(piece)
        for key, claimed in pieces.items():
            numel = math.prod(specs[key].shape)
            n = sum(p.numel for p in claimed)
            if n == 0 and others_elsewhere:
                continue
            if n != numel:
                problems.append((key, f"{n} of its {numel} elements come from the model"))
            elif _claimed_twice(claimed, specs[key].shape):
                problems.append((key, "some of its elements make several model elements, others none"))
        refuse(problems, "tensors cannot be written back exactly")


def _write_item(key: str, box: Box, dtype: torch.dtype, shape: Sequence[int]) -> WriteItem:
    """Box ``box`` of checkpoint tensor ``key`` (of ``shape``), stored in ``dtype``."""
    offsets = torch.Size(box.offsets)
    return WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.TENSOR, tensor_data=TensorWriteData(
        chunk=ChunkStorageMetadata(offsets, torch.Size(box.sizes)), properties=TensorProperties(dtype=dtype),
        size=torch.Size(shape)))


def _claimed_twice(pieces: Sequence[Piece], shape: Sequence[int]) -> bool:
    """Whether two of ``pieces`` (of one checkpoint tensor of ``shape``) share an element. Pieces
    whose bounding boxes are disjoint share none (rows chunked into q, k, v); others (interleaved
    rows, many pieces) are marked element by element."""
    pieces = [p for p in pieces if p.numel]
    if any(a.src_step == 0 and a.size > 1 for p in pieces for a in p.axes):  # one element, several times
        return True
    if len(pieces) < 2:
        return False
    hulls = [_hull(p) for p in pieces]
    if len(pieces) <= 64 and all(any(a_hi <= b_lo or b_hi <= a_lo for a_lo, a_hi, b_lo, b_hi in zip(*a, *b))
                                 for a, b in itertools.combinations(hulls, 2)):
        return False
    marked = torch.zeros(tuple(shape), dtype=torch.bool)
    strides = marked.stride()
    for piece in pieces:
        view = marked.as_strided([a.size for a in piece.axes], [a.src_step * strides[a.src_dim] for a in piece.axes],
                                 sum(o * s for o, s in zip(piece.src_origin, strides)))
        if view.any():
            return True
        view.fill_(True)
    return False


def _hull(piece: Piece) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The bounding box of ``piece`` in its checkpoint tensor: (first, past-last) index per dim."""
    ends = list(piece.src_origin)
    for axis in piece.axes:
        ends[axis.src_dim] += (axis.size - 1) * axis.src_step
    return tuple(piece.src_origin), tuple(e + 1 for e in ends)
