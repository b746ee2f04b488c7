"""HFWeightSource: a trainer's weights as the Hugging Face checkpoint's tensors, per rank and
without gathering.

The save's inversion (:class:`~hp_dcp_hf.save.planner.HFSavePlanner`) already knows, for every model
it can save (recorded rewrites, transformers' conversions, torchtitan's mapping, PEFT), which box of
which checkpoint tensor each rank's local shard holds, and gives each byte to exactly one rank
(replicas share the work). A weight source is that plan kept alive: the boxes this rank holds, each
with the strided view of the local shard that holds it, read afresh at every update.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import WeightTransform

from hp_dcp_hf.errors import ArgumentError
from hp_dcp_hf.geometry.box import Box
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
        weights_mapping, hf_config: as :class:`~hp_dcp_hf.save.planner.HFSavePlanner` takes them (a
            model that is not a transformers model: torchtitan's, a plain module with a mapping).

    ``metadata()`` describes the whole checkpoint on every rank, ``slices()`` this rank's part;
    together the ranks' slices cover every checkpoint element exactly once (the save's own check).
    """

    def __init__(self, model: nn.Module, *, dtype: torch.dtype | None = None,
                 weights_mapping: Sequence[WeightTransform] | None = None, hf_config: Any = None) -> None:
        if dtype is not None and not dtype.is_floating_point:
            raise ArgumentError(f"dtype={dtype}: the wire dtype of floating-point weights must be floating-point")
        self.model = model
        self.dtype = dtype
        planner = HFSavePlanner(model, weights_mapping=weights_mapping, hf_config=hf_config)
        state_dict = model.state_dict()
        planner.set_up_planner(state_dict, is_coordinator=False)
        items, request = planner.plan_writes(state_dict)
        self._metadata = [TensorMeta(name, self._wire_dtype(dtype_), tuple(shape))
                          for name, (dtype_, shape) in request.tensors.items()]
        self._by_name = {meta.name: meta for meta in self._metadata}
        self._slices: list[tuple[HeldSlice, Any]] = []
        for item in items:
            chunk = item.tensor_data.chunk
            box = Box(tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes))
            self._slices.append((HeldSlice(item.index.fqn, box), planner._views[item.index]))

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def snapshot(self) -> None:
        """Called by every rank at the start of each update (a collective where values need one)."""

    def metadata(self) -> list[TensorMeta]:
        """Every checkpoint tensor, in the checkpoint's order, the same on every rank."""
        return list(self._metadata)

    def meta(self, name: str) -> TensorMeta:
        return self._by_name[name]

    def held_names(self) -> list[str]:
        """The checkpoint tensors this rank holds a part of, in metadata order."""
        held = {s.name for s, _ in self._slices}
        return [m.name for m in self._metadata if m.name in held]

    def slices(self) -> list[HeldSlice]:
        """This rank's slices, in planning order."""
        return [s for s, _ in self._slices]

    def read(self, index: int, box: Box | None = None) -> torch.Tensor:
        """The current values of slice ``index`` (or of ``box``, a part of it), in the wire dtype,
        as a tensor shaped like the box. Reads the live parameters: call it after the step."""
        held, view = self._slices[index]
        values = view.view().detach()
        if box is not None and box != held.box:
            values = values[box.relative_to(held.box.offsets).slices()]
        return values.to(self._by_name[held.name].dtype)

    def __iter__(self) -> Iterator[tuple[HeldSlice, torch.Tensor]]:
        """``(slice, values)`` for every slice this rank holds."""
        for index, (held, _) in enumerate(self._slices):
            yield held, self.read(index)

    @property
    def held_bytes(self) -> int:
        return sum(s.numel * self._by_name[s.name].dtype.itemsize for s, _ in self._slices)
