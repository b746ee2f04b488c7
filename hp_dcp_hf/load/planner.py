"""HFMappingPlanner: a DCP ``LoadPlanner`` that composes conversions with shard layouts.

For every tensor of the model's state dict, the planner knows (from :class:`Composition`) which
regions of which checkpoint tensors make it, and (from :mod:`hp_dcp_hf.geometry.shards`) which global boxes
this rank holds. Their intersection is a list of :class:`ReadBlock` s, each one ``ReadItem`` whose
storage side is a box of a checkpoint tensor and whose destination is a strided view of the local
shard. Everything is validated in ``create_local_plan``, before the reader writes a byte.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from transformers.core_model_loading import WeightTransform

from hp_dcp_hf.errors import (
    ArgumentError,
    LayoutError,
    MissingKeysError,
    PlanningError,
    UnexpectedKeysError,
)
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.geometry.shards import ShardPiece, global_numel, local_shard_pieces, local_tensor
from hp_dcp_hf.mapping.blocks import LocalView, ReadBlock, local_blocks
from hp_dcp_hf.mapping.compose import Composition, Opaque, TensorSpec
from hp_dcp_hf.mapping.families import natural_sorted
from hp_dcp_hf.mapping.stages import record_checkpoint_mapping
from hp_dcp_hf.planning.composition import compose
from hp_dcp_hf.planning.targets import refuse, shape_problem, tied_targets
from hp_dcp_hf.quant.decode import (
    BlockScaled,
    QuantizedTensor,
    dequantized_sources,
    quantized_tensors,
    uncovered_weight_boxes,
)
from hp_dcp_hf.storage.format.catalog import QUANTIZATION_CONFIG
from hp_dcp_hf.util.perf import paused_gc

logger = logging.getLogger(__name__)

_STAGING_PREFIX = "hp_dcp_hf.staging/"
_QUANTIZED_PREFIX = "hp_dcp_hf.quantized/"

Unexpected = Literal["warn", "raise", "ignore"]
"""What a load does about checkpoint tensors no model tensor is made from."""


def reportable_unexpected(model: Any, keys: Collection[str]) -> tuple[str, ...]:
    """``keys`` less those transformers itself ignores for the model's class (its
    ``_keys_to_ignore_on_load_unexpected`` patterns, and old ``rotary_emb.inv_freq`` /
    ``position_ids`` buffers), through transformers' own rule."""
    adjust = getattr(model, "_adjust_missing_and_unexpected_keys", None)
    if adjust is None:
        return natural_sorted(keys)
    info = SimpleNamespace(missing_keys=set(), unexpected_keys=set(keys))
    adjust(info)
    return natural_sorted(info.unexpected_keys)


def model_state_dict(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """The model's flat state dict, also when nested under one key as DCP users write it
    (``{"model": model.state_dict()}``, or a ``Stateful`` wrapper's); other shapes are refused with
    what to pass."""
    nested = [key for key, value in state_dict.items() if isinstance(value, Mapping)]
    if not nested:
        return state_dict
    if len(state_dict) == 1:
        inner = state_dict[nested[0]]
        if not any(isinstance(value, Mapping) for value in inner.values()):
            return inner
    raise PlanningError(
        f"the state dict holds {sorted(state_dict)[:5]} with nested dicts under {nested[:5]}: pass the model's "
        "state dict, flat (model.state_dict()) or under one key ({'model': model.state_dict()})"
    )


def describe_keys(keys: Sequence[str], first: int = 5) -> str:
    """``"['a', 'b', 'c']"``, or the first ``first`` names and how many more."""
    shown = ", ".join(repr(k) for k in keys[:first])
    more = f", ... ({len(keys) - first} more)" if len(keys) > first else ""
    return f"[{shown}{more}]"


@dataclass(frozen=True)
class LoadReport:
    """What a load filled: tied aliases count as loaded when their shared tensor is."""

    loaded_keys: tuple[str, ...]
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    seconds: Mapping[str, float] = field(default_factory=dict)
    """Wall time of each phase on this rank: ``metadata`` (headers read, or received from rank 0),
    ``plan``, ``read`` (reads, casts and copies into the shards), with CUDA destinations ``copy``
    (of ``read``, the time the reads waited for copies to the device: the part they did not hide)
    and, cooperating, ``spans`` (gathering every rank's needs and planning the spans) and ``exchange``
    (what the exchange of span bytes took after this rank's reads); then ``finish`` (after the reads:
    the copies into hook-made tensors, and the ranks agreeing on the outcome, where a rank waits for
    the slowest). Those add up to the load, less its set-up (the state dict, DCP's own steps). Two are
    parts of others: ``first_byte`` (from the start of the reads, ``spans`` included, to the first
    bytes read from storage in memory) and ``convert`` (of ``read``, summed over its threads: copies
    out of staging slots and the commits after them, dequantization and conversions of whole tensors;
    a copy out of a mapping, casting or not, is the read itself)."""


@dataclass
class PlanStats:
    """Deterministic counts of one rank's plan."""

    targets: int = 0
    read_items: int = 0
    bytes_needed: int = 0
    deferred_targets: int = 0
    deferred_bytes: int = 0
    bytes_by_key: dict[str, int] = field(default_factory=dict)
    quantized_bytes: int = 0  # of bytes_needed: quantized weights, as stored
    scale_bytes: int = 0  # of bytes_needed: the scale blocks that dequantize them


@dataclass
class _Dequantization:
    """One box of a quantized tensor: its quantized bytes and its scales are read apart (an item
    each), and once all are in, their values go to ``destination``."""

    target: str  # a state dict key, or the quantized tensor's key when staged whole
    destination: LocalView
    tensor: QuantizedTensor
    box: Box
    expected: int
    staged: bool = False  # values of the whole tensor, for a deferred (untraceable) conversion
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # checkpoint key -> bytes as read
    committed: int = 0


def _castable(source: torch.dtype, target: torch.dtype) -> bool:
    """Float to float casts are normal (bf16 checkpoint into fp32 model); others must match kind."""
    if source == target:
        return True
    if source.is_floating_point and target.is_floating_point:
        return True
    return not (source.is_floating_point or target.is_floating_point or torch.bool in (source, target))


def _file_of(metadata: Metadata, key: str) -> str | None:
    """The checkpoint file holding ``key`` (its first, where it is stored in chunks), for errors;
    None where the reader's metadata does not say (an :class:`HFStorageReader`'s does)."""
    spec = metadata.state_dict_metadata.get(key)
    if not isinstance(spec, TensorStorageMetadata) or not isinstance(metadata.storage_data, Mapping):
        return None
    parts = getattr(metadata.storage_data.get(MetadataIndex(key, spec.chunks[0].offsets)), "parts", None)
    return parts[0].file if parts else None


def _tensor_specs(metadata: Metadata, claimed: Collection[str]) -> dict[str, TensorSpec]:
    """Every checkpoint tensor's shape and dtype, less the ``claimed`` keys; one spec per metadata
    entry object (``HFStorageReader``'s keys of one dtype and shape share theirs: 45,395 keys of
    DeepSeek-V3 for a few dozen objects)."""
    specs: dict[int, TensorSpec] = {}
    stored = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and key not in claimed:
            spec = specs.get(id(md))
            if spec is None:
                spec = specs[id(md)] = TensorSpec(tuple(md.size), md.properties.dtype)
            stored[key] = spec
    return stored


class HFMappingPlanner(LoadPlanner):
    """Plan DCP reads of a Hugging Face checkpoint into a (parallelized, rewritten) model.

    Args:
        model: the model whose ``state_dict()`` is loaded. Its conversion mapping comes from
            transformers (for a ``PreTrainedModel``) unless ``weights_mapping`` is given; the
            stages recorded with :func:`hp_dcp_hf.add_weight_mapping` follow.
        weights_mapping: the checkpoint -> canonical model mapping, instead of transformers' own.
        config: where conversion ops read model facts (``PermuteForRope``'s ``num_attention_heads``);
            default ``model.config``. A model without one (a framework's own class) passes it here:
            an op that needs a fact the config lacks raises :class:`MappingError`, never guesses.
        strict: raise :class:`MissingKeysError` during planning when a model tensor is not made.
        unexpected: checkpoint tensors no model tensor is made from, less those the model's class
            ignores (:func:`reportable_unexpected`): ``"warn"`` (by :func:`~hp_dcp_hf.load_hf_checkpoint`,
            once on rank 0), ``"raise"`` :class:`UnexpectedKeysError` during planning, or ``"ignore"``.
        external_target_fqns: state dict keys another reader fills (neither loaded nor missing).
        claimed_source_keys: checkpoint keys another reader consumes (never unexpected).
        composition: the mapping traced already for this model and checkpoint (one process planning
            many ranks of the same model traces it once); by default each plan traces its own.
        trace: read exactly the needed boxes (default). ``False`` is the legacy pattern: read whole
            checkpoint tensors, convert in memory, keep the local part; the reference to compare with.
        share_structure: trace each structurally identical group once (see :class:`Composition`);
            ``False`` traces every group, the reference the shared plan is tested against.

    Planning records on the model the transforms of the checkpoint mapping that matched a
    checkpoint key (:func:`~hp_dcp_hf.mapping.stages.recorded_checkpoint_mapping`): a later
    :func:`~hp_dcp_hf.save_hf_checkpoint` inverts them and writes the checkpoint's own keys.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        weights_mapping: Sequence[WeightTransform] | None = None,
        config: Any = None,
        strict: bool = True,
        unexpected: Unexpected = "warn",
        external_target_fqns: Collection[str] = (),
        claimed_source_keys: Collection[str] = (),
        trace: bool = True,
        composition: Composition | None = None,
        share_structure: bool = True,
    ) -> None:
        self.model = model
        self.share_structure = share_structure
        self.trace = trace
        self.weights_mapping = weights_mapping
        self.config = config if config is not None else getattr(model, "config", None)
        self.strict = strict
        if unexpected not in get_args(Unexpected):
            raise ArgumentError(f"unexpected must be one of {get_args(Unexpected)}, got {unexpected!r}")
        self.unexpected = unexpected
        self.reported_unexpected: tuple[str, ...] = ()  # the last plan's unexpected keys worth a word
        self.external_target_fqns = frozenset(external_target_fqns)
        self.claimed_source_keys = frozenset(claimed_source_keys)
        self.report: LoadReport | None = None
        self.plan_seconds = 0.0  # the last create_local_plan's wall time
        self.stats = PlanStats()
        self.composition = composition
        self.filled: tuple[str, ...] = ()  # the state dict keys written (one per tied group)
        self.quantized: dict[str, QuantizedTensor] = {}  # quantized checkpoint tensors read as values
        self._destinations: dict[ReadItem, LocalView] = {}
        self._dequantizations: dict[ReadItem, _Dequantization] = {}
        self._staging: dict[str, torch.Tensor] = {}
        self._waiting: dict[str, set[str]] = {}  # deferred target -> checkpoint keys still being read
        self._deferred: dict[str, tuple[torch.Tensor, tuple[ShardPiece, ...], frozenset[str]]] = {}
        self._lock = threading.Lock()
        # State dict keys into which at least one read was written: after a read that failed midway,
        # exactly these may hold new values (all others are as they were).
        self.touched_targets: set[str] = set()

    # -- DCP protocol -------------------------------------------------------------------------
    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if metadata is None:
            raise PlanningError("HFMappingPlanner needs the checkpoint metadata (use HFStorageReader)")
        self.state_dict = model_state_dict(state_dict)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        start = time.perf_counter()
        plan = LoadPlan(self.plan_reads(self.state_dict, self.metadata))
        self.plan_seconds = time.perf_counter() - start
        return plan

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise PlanningError("a safetensors checkpoint holds no byte items", key=read_item.storage_index.fqn)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dequantization = self._dequantizations.get(read_item)
        if dequantization is not None:
            key = read_item.storage_index.fqn
            raw = torch.empty(tuple(read_item.lengths), dtype=self.metadata.state_dict_metadata[key].properties.dtype)
            with self._lock:
                dequantization.parts[key] = raw
            return raw
        staging_key = read_item.dest_index.fqn.removeprefix(_STAGING_PREFIX)
        if staging_key != read_item.dest_index.fqn:
            with self._lock:
                if staging_key not in self._staging:
                    spec = self.metadata.state_dict_metadata[staging_key]
                    self._staging[staging_key] = torch.empty(tuple(spec.size), dtype=spec.properties.dtype)
                return self._staging[staging_key]
        return self._destinations[read_item].view()

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        dequantization = self._dequantizations.get(read_item)
        if dequantization is not None:
            with self._lock:
                dequantization.committed += 1
                ready = dequantization.committed == dequantization.expected
            if ready:
                self._dequantize(dequantization)
            return
        staging_key = read_item.dest_index.fqn.removeprefix(_STAGING_PREFIX)
        if staging_key == read_item.dest_index.fqn:
            with self._lock:
                self.touched_targets.add(read_item.dest_index.fqn)
            return
        self._staged(staging_key)

    def written_targets(self, items: Collection[ReadItem]) -> set[str]:
        """The state dict keys that ``items`` (a reader's, written into whether or not committed)
        write in place: those read straight into a model tensor. Staged and quantized items reach
        the model only when they are committed, which ``touched_targets`` counts."""
        return {item.dest_index.fqn for item in items if item in self._destinations}

    def _staged(self, staging_key: str) -> None:
        """Checkpoint tensor ``staging_key`` is whole in staging: finish the deferred targets that
        waited for it last."""
        with self._lock:
            ready = []
            for target, waiting in self._waiting.items():
                waiting.discard(staging_key)
                if not waiting:
                    ready.append(target)
            for target in ready:
                del self._waiting[target]
        for target in ready:
            self._finish_deferred(target)

    # -- planning -----------------------------------------------------------------------------
    @torch.no_grad()  # local shards are taken as they are, not through autograd
    @paused_gc()
    def plan_reads(self, state_dict: Mapping[str, Any], metadata: Metadata) -> list[ReadItem]:
        """Validate everything and return this rank's ReadItems (no byte is read or written)."""
        stored = _tensor_specs(metadata, self.claimed_source_keys)
        self.quantized, consumed = self._quantized(stored, state_dict, metadata)
        sources = dequantized_sources(stored, self.quantized, consumed)
        unknown = self.external_target_fqns - set(state_dict)
        if unknown:
            raise PlanningError(f"external targets absent from the model: {natural_sorted(unknown)}")
        wanted = [name for name in state_dict if name not in self.external_target_fqns]
        composition = self.composition or compose(
            self.model, sources, set(wanted), weights_mapping=self.weights_mapping, config=self.config,
            trace=self.trace, share_structure=self.share_structure,
        )
        self.composition = composition
        targets = tied_targets(self.model, wanted, composition.traced)
        fill = self.filled = targets.names  # writing one name of a tied group writes every alias
        missing = {name for group in targets.unmade for name in group}
        self._validate(composition, state_dict, fill, sources, metadata)
        if missing and self.strict:
            raise MissingKeysError(f"the checkpoint makes no value for {len(missing)} model tensors: "
                                   f"{list(natural_sorted(missing))}")
        used = set().union(*(composition.source_keys(n) for n in fill))
        unused = natural_sorted(set(sources) - used)
        self.reported_unexpected = () if self.unexpected == "ignore" else reportable_unexpected(self.model, unused)
        if self.reported_unexpected and self.unexpected == "raise":
            raise UnexpectedKeysError(f"{len(self.reported_unexpected)} checkpoint tensors make no model tensor "
                                      f"(unexpected='raise'): {describe_keys(self.reported_unexpected)}")
        self.report = LoadReport(targets.covered, natural_sorted(missing), unused)
        items = self._make_items(composition, state_dict, fill, stored, sources)
        if isinstance(self.model, nn.Module):
            self.model._weight_conversions = composition.used_transforms
            record_checkpoint_mapping(self.model, [t for t in composition.stages[0] if t.was_used()])
        return items

    def _quantized(
        self, stored: Mapping[str, TensorSpec], state_dict: Mapping[str, Any], metadata: Metadata
    ) -> tuple[dict[str, QuantizedTensor], frozenset[str]]:
        """The checkpoint's quantized tensors to read as values, and the companions that consumes.

        None when the checkpoint is not quantized, or when the model keeps quantized parameters
        with their scales (it then loads them as stored).
        """
        planner_data = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
        quantization_config = planner_data.get(QUANTIZATION_CONFIG)
        if not quantization_config:
            return {}, frozenset()
        model_type = getattr(getattr(self.model, "config", None), "model_type", None)
        quantized, consumed = quantized_tensors(quantization_config, stored, model_type=model_type)
        companions = {key.rpartition(".")[2] for key in consumed}
        if any(name.rpartition(".")[2] in companions for name in state_dict):
            self._check_stored_scales(state_dict, quantized)
            return {}, frozenset()
        return quantized, consumed

    @staticmethod
    def _check_stored_scales(state_dict: Mapping[str, Any], quantized: Mapping[str, QuantizedTensor]) -> None:
        """A model that keeps block-scaled weights with their scale parameters loads both as stored:
        each rank must then hold the scale blocks covering the weight rows and columns it holds."""
        # Every block-scaled weight of a checkpoint has one block size and one scale suffix.
        tensor = next((t for t in quantized.values() if isinstance(t, BlockScaled)), None)
        if tensor is None:
            return
        param, suffix = tensor.weight.rpartition(".")[2], tensor.scale.removeprefix(tensor.weight)
        for name in state_dict:
            scale = name + suffix
            if not name.endswith(param) or scale not in state_dict:
                continue
            weight_boxes = [p.global_box for p in local_shard_pieces(state_dict[name], key=name)]
            scale_boxes = [p.global_box for p in local_shard_pieces(state_dict[scale], key=scale)]
            uncovered = uncovered_weight_boxes(weight_boxes, scale_boxes, tensor.block)
            if uncovered:
                raise LayoutError(
                    f"this rank holds {uncovered[0]} of the weight but not every {tensor.block} scale block "
                    f"covering it ({scale} holds {scale_boxes}): shard the scales with the weight's "
                    "block borders, or replicate them", key=name)

    @staticmethod
    def _validate(composition: Composition, state_dict, fill: Sequence[str], sources, metadata: Metadata) -> None:
        problems = []
        culprits: list[str | None] = []  # per problem, the checkpoint key it is about (its file is named)
        for target in fill:
            tensor = state_dict[target]
            traced = composition.traced[target]
            keys = traced.source_keys()
            shape = shape_problem(tensor, traced)
            if shape is not None:
                problems.append((target, shape))
                culprits.append(min(keys, default=None))
                continue
            for dtype in {sources[key].dtype for key in keys}:  # per dtype: an MoE layer has thousands of keys
                if not _castable(dtype, tensor.dtype):
                    key = min(k for k in keys if sources[k].dtype == dtype)
                    problems.append((target, f"cannot cast {key} ({dtype}) to {tensor.dtype}"))
                    culprits.append(key)
            if not isinstance(traced, Opaque) and traced.structure.covered != global_numel(tensor):
                problems.append((target, f"the conversion covers {traced.structure.covered} "
                                         f"of {global_numel(tensor)} elements"))
                culprits.append(min(keys, default=None))
        first = culprits[0] if culprits else None
        refuse(problems, "model tensors do not match the checkpoint",
               file=None if first is None else _file_of(metadata, first))

    def _make_items(self, composition: Composition, state_dict, fill, stored, sources) -> list[ReadItem]:
        """This rank's items. ``sources`` are the tensors the conversions see (quantized ones as
        values), ``stored`` the checkpoint's tensors as stored: bytes are counted in their dtypes (a
        quantized box costs its quantized bytes plus its scales)."""
        items: list[ReadItem] = []
        staged: set[str] = set()
        stats = PlanStats()
        for target in self.filled:
            tensor = state_dict[target]
            pieces = local_shard_pieces(tensor, key=target)
            if not any(p.global_box.numel for p in pieces):
                continue
            stats.targets += 1
            traced = composition.traced[target]
            if isinstance(traced, Opaque):
                self._waiting[target] = set(traced.sources)
                self._deferred[target] = (tensor, pieces, traced.sources)
                stats.deferred_targets += 1
                for key in sorted(traced.sources - staged):
                    staged.add(key)
                    if key in self.quantized:  # its values, whole: every part of it, dequantized
                        whole = self._staging_dequantization_items(key, sources[key], tensor.dtype)
                    else:
                        shape = torch.Size(stored[key].shape)
                        whole = [self._item(_STAGING_PREFIX + key, (0,) * len(shape), key, (0,) * len(shape), shape)]
                    for item in whole:
                        items.append(item)
                        part = item.storage_index.fqn
                        nbytes = math.prod(item.lengths) * stored[part].dtype.itemsize
                        stats.deferred_bytes += nbytes
                        stats.bytes_by_key[part] = stats.bytes_by_key.get(part, 0) + nbytes
                continue
            for block, view in local_blocks(traced, local_tensor(tensor), pieces):
                if block.key in self.quantized:
                    data, *scales = self._dequantization_items(target, view, block)
                    for item in (data, *scales):
                        key = item.storage_index.fqn
                        nbytes = math.prod(item.lengths) * stored[key].dtype.itemsize
                        stats.bytes_by_key[key] = stats.bytes_by_key.get(key, 0) + nbytes
                        if item is data:
                            stats.quantized_bytes += nbytes
                        else:
                            stats.scale_bytes += nbytes
                        items.append(item)
                    continue
                item = self._item(target, block.origin, block.key, block.source_box.offsets,
                                  torch.Size(block.source_box.sizes))
                self._destinations[item] = view
                items.append(item)
                nbytes = block.numel * stored[block.key].dtype.itemsize
                stats.bytes_by_key[block.key] = stats.bytes_by_key.get(block.key, 0) + nbytes
        stats.read_items = len(items)
        stats.bytes_needed = sum(stats.bytes_by_key.values())
        self.stats = stats
        if stats.deferred_targets and self.trace:
            logger.warning("%d targets need conversions that cannot be traced; %d bytes are read whole "
                           "and converted in memory", stats.deferred_targets, stats.deferred_bytes)
        return items

    def _dequantization_items(self, target: str, destination: LocalView, block: ReadBlock) -> list[ReadItem]:
        """The checkpoint boxes that make ``block`` of a quantized tensor (its quantized bytes
        first), items of one :class:`_Dequantization` (their destinations are raw buffers, see
        ``resolve_tensor``)."""
        tensor = self.quantized[block.key]
        reads = tensor.reads(block.source_box)
        items = [self._item(_QUANTIZED_PREFIX + target, block.origin, key, box.offsets, torch.Size(box.sizes))
                 for key, box in reads]
        dequantization = _Dequantization(target, destination, tensor, block.source_box, len(items))
        for item in items:
            self._dequantizations[item] = dequantization
        return items

    def _staging_dequantization_items(self, key: str, spec: TensorSpec, dtype: torch.dtype) -> list[ReadItem]:
        """Every part of quantized tensor ``key``, to dequantize whole (in ``dtype``, the model's)
        into staging for a deferred conversion."""
        values = torch.empty(spec.shape, dtype=dtype)
        self._staging[key] = values
        box = Box.full(spec.shape)
        destination = LocalView(values, tuple(values.shape), tuple(values.stride()), 0)
        items = [self._item(_STAGING_PREFIX + key, box.offsets, part, part_box.offsets, torch.Size(part_box.sizes))
                 for part, part_box in self.quantized[key].reads(box)]
        dequantization = _Dequantization(key, destination, self.quantized[key], box, len(items), staged=True)
        for item in items:
            self._dequantizations[item] = dequantization
        return items

    def _dequantize(self, dequantization: _Dequantization) -> None:
        destination = dequantization.destination.view()
        values = dequantization.tensor.values(dequantization.parts, dequantization.box, destination.dtype)
        if not dequantization.staged:
            with self._lock:  # before the copy: one that fails midway has written part of it
                self.touched_targets.add(dequantization.target)
        with torch.no_grad():
            destination.copy_(values)
        with self._lock:
            dequantization.parts.clear()
        if dequantization.staged:
            self._staged(dequantization.target)

    @staticmethod
    def _item(dest: str, dest_offsets, key: str, offsets, lengths: torch.Size) -> ReadItem:
        return ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(dest, dest_offsets),
            dest_offsets=torch.Size(dest_offsets),
            storage_index=MetadataIndex(key, offsets),
            storage_offsets=torch.Size(offsets),
            lengths=lengths,
        )

    def _finish_deferred(self, target: str) -> None:
        """All sources of a deferred target are staged: run the real conversion, keep the local part."""
        assert self.composition is not None
        value = self.composition.evaluate([target], self._staging.__getitem__)[target]
        tensor, pieces, _ = self._deferred[target]
        local = local_tensor(tensor)
        with self._lock:  # before the copies: one that fails midway has written part of it
            self.touched_targets.add(target)
        with torch.no_grad():
            for piece in pieces:
                dest = local[tuple(slice(o, o + s) for o, s in zip(piece.local_offsets, piece.global_box.sizes))]
                dest.copy_(value[piece.global_box.slices()])
        with self._lock:
            del self._deferred[target]
            still_needed = set().union(*(sources for _, _, sources in self._deferred.values()))
            for key in list(self._staging):
                if key not in still_needed:
                    del self._staging[key]
