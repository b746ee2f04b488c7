"""HFWeightSource: a trainer's weights as the Hugging Face checkpoint's tensors, per rank and
without gathering.

The save's inversion (:class:`~hp_dcp_hf.save.planner.HFSavePlanner`) already knows, for every model
it can save (recorded rewrites, transformers' conversions, torchtitan's mapping, PEFT), which box of
which checkpoint tensor each rank's local shard holds, and gives each byte to exactly one rank
(replicas share the work). A weight source is that plan kept alive: the boxes this rank holds, each
with the strided view of the local shard that holds it, read afresh at every update.

``quantize="fp8"`` sends what the FP8 save writes (:mod:`hp_dcp_hf.quant.encode`): the weights it
quantizes as ``float8_e4m3fn`` and their ``weight_scale_inv``, each scale block by the rank whose
box holds its first element. A block's scale needs the amax of the whole block, which several
ranks may hold parts of, so every update starts with the collective :meth:`HFWeightSource.snapshot`:
the save's amax agreement (one ``all_reduce(MAX)`` of the split blocks only), after which each rank
reads its FP8 bytes and scales alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import WeightTransform

from hp_dcp_hf.errors import ArgumentError, SyncError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.mapping.blocks import LocalView
from hp_dcp_hf.quant.encode import Fp8Layout, Quantize, quantize_box
from hp_dcp_hf.save.planner import HFSavePlanner


@dataclass(frozen=True)
class TensorMeta:
    """One checkpoint tensor as the engine sees it: its Hugging Face name, wire dtype and full shape
    (the fields of vLLM's ``ParamMeta``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class HeldSlice:
    """Box ``box`` of checkpoint tensor ``name``, which this rank holds (and alone sends)."""

    name: str
    box: Box

    @property
    def numel(self) -> int:
        return self.box.numel


class HFWeightSource:
    """The checkpoint tensors ``save_hf_checkpoint(model, ...)`` would write, as slices each trainer
    rank holds; every rank constructs it (planning is collective, as a save's is).

    Args:
        model: the (parallelized, rewritten) model, whose parameters are read at every update.
        dtype: the wire dtype of floating-point tensors; default: the checkpoint's (the model's).
            With ``quantize``, the FP8 weights are quantized from their values in ``dtype``, as
            ``save_hf_checkpoint(dtype=, quantize=)`` quantizes them; they and their scales keep
            their own dtypes.
        quantize: ``"fp8"``, an FP8 ``quantization_config`` dict or a ``FineGrainedFP8Config``: the
            tensors of ``save_hf_checkpoint(quantize=)``, FP8 weights and their ``weight_scale_inv``
            (its files' tensors exactly). Each update then starts with :meth:`snapshot` on every rank.
        weights_mapping, hf_config: as :class:`~hp_dcp_hf.save.planner.HFSavePlanner` takes them (a
            model that is not a transformers model: torchtitan's, a plain module with a mapping).
        state_dict: the model's tensors to send, as ``save_hf_checkpoint(state_dict=)`` takes them;
            default ``model.state_dict()``. They must be the live tensors (each update reads them):
            torchtitan's are its own parameters, whose ``state_dict()`` hands out gathered copies.
        lowest_replica_holds: a piece several ranks hold is this source's slice on the lowest of
            them (default: replicas take turns, as a save's writing does); then each rank's slices
            are exactly the bytes no lower rank holds (what
            :class:`~hp_dcp_hf.integrations.vllm.source.VLLMWeightSource` moves to rank 0).

    ``metadata()`` describes the whole checkpoint on every rank, ``slices()`` this rank's part;
    together the ranks' slices cover every checkpoint element exactly once (the save's own check).
    """

    def __init__(self, model: nn.Module, *, dtype: torch.dtype | None = None, quantize: Quantize | None = None,
                 weights_mapping: Sequence[WeightTransform] | None = None, hf_config: Any = None,
                 state_dict: Mapping[str, torch.Tensor] | None = None, lowest_replica_holds: bool = False) -> None:
        if dtype is not None and not dtype.is_floating_point:
            raise ArgumentError(f"dtype={dtype}: the wire dtype of floating-point weights must be floating-point")
        self.model = model
        self.dtype = dtype
        self.lowest_replica_holds = lowest_replica_holds
        planner = HFSavePlanner(model, weights_mapping=weights_mapping, hf_config=hf_config, quantize=quantize,
                                lowest_replica_writes=lowest_replica_holds)
        # Planned without autograd: a DTensor's local shard is then the tensor itself, not a view made
        # by an autograd Function, which a training step's in-place update would make unreadable.
        with torch.no_grad():
            state_dict = dict(model.state_dict() if state_dict is None else state_dict)
            planner.set_up_planner(state_dict, is_coordinator=False)
            items, request = planner.plan_writes(state_dict)
        self._layout: Fp8Layout | None = request.quantization
        self._stored = set() if self._layout is None else {*self._layout.shapes, *self._layout.scales}
        self._metadata = [TensorMeta(name, dtype_ if name in self._stored else self._wire_dtype(dtype_), tuple(shape))
                          for name, (dtype_, shape) in request.tensors.items()]
        self._by_name = {meta.name: meta for meta in self._metadata}
        self._slices: list[tuple[HeldSlice, LocalView | None]] = []  # a scale has no view: snapshot() computes it
        for item in items:
            chunk = item.tensor_data.chunk
            box = Box(tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes))
            self._slices.append((HeldSlice(item.index.fqn, box), planner.local_view(item.index)))
        self._quantized: dict[int, torch.Tensor] = {}  # FP8 and scale slices' values, by snapshot()

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def snapshot(self) -> None:
        """Collective, on every rank at the start of each update (a no-op unquantized): the scales
        of this rank's FP8 slices from the live parameters, the amax of blocks several ranks hold
        parts of agreed as the FP8 save agrees it, and the FP8 values by those scales (a copy:
        1 byte per element this rank holds of FP8 weights), which :meth:`read` returns until the
        next one."""
        if self._layout is None:
            return
        layout, scales = self._layout, self._layout.scales
        weights = [(index, held, view.view().detach()) for index, (held, view) in enumerate(self._slices)
                   if held.name in layout.shapes]
        self._quantized = {}
        amax, failure = layout.agreed_amax([(held.name, held.box, values) for _, held, values in weights], self.dtype)
        if failure is not None:  # every rank met in the reduction; this one's scales are not the save's
            raise SyncError(f"computing the FP8 scales failed: {type(failure).__name__}: {failure}") from failure
        for index, held, values in weights:
            scale, _ = amax.scales(held.name, layout.scale_box(held.box))
            self._quantized[index] = quantize_box(values, held.box, layout.block, scale, self.dtype)
        for index, (held, _) in enumerate(self._slices):
            if held.name in scales:
                self._quantized[index] = amax.scales(scales[held.name], held.box)[1].contiguous()

    def metadata(self) -> list[TensorMeta]:
        """Every checkpoint tensor, in the checkpoint's order, the same on every rank."""
        return list(self._metadata)

    def meta(self, name: str) -> TensorMeta:
        return self._by_name[name]

    def slices(self) -> list[HeldSlice]:
        """This rank's slices, in planning order."""
        return [s for s, _ in self._slices]

    def read(self, index: int, box: Box | None = None) -> torch.Tensor:
        """The current values of slice ``index`` (or of ``box``, a part of it), in the wire dtype,
        as a tensor shaped like the box. Reads the live parameters: call it after the step. FP8
        weights and their scales are the last :meth:`snapshot`'s (a host copy)."""
        held, view = self._slices[index]
        within = None if box is None or box == held.box else box.relative_to(held.box.offsets).slices()
        if held.name in self._stored:
            return self._read_quantized(index, held, within)
        values = view.view().detach()
        if within is not None:
            values = values[within]
        return values.to(self._by_name[held.name].dtype)

    def _read_quantized(self, index: int, held: HeldSlice, within: tuple[slice, ...] | None) -> torch.Tensor:
        """An FP8 or scale slice as the last :meth:`snapshot` computed it."""
        values = self._quantized.get(index)
        if values is None:
            raise SyncError("FP8 weights and scales are read after snapshot(), which every rank calls at the start "
                            "of each update", key=held.name)
        return values if within is None else values[within]

    def __iter__(self) -> Iterator[tuple[HeldSlice, torch.Tensor]]:
        """``(slice, values)`` for every slice this rank holds."""
        for index, (held, _) in enumerate(self._slices):
            yield held, self.read(index)

    @property
    def held_bytes(self) -> int:
        return sum(s.numel * self._by_name[s.name].dtype.itemsize for s, _ in self._slices)
