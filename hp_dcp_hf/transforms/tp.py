"""Tensor-parallel layouts of the fused projections, through transformers' own TP plans.

transformers shards a model with the plan on its instance (``model._tp_plan``: wildcard module
names -> style names of ``ALL_PARALLEL_STYLES``; ``maybe_distribute_model`` ->
``_resolve_parallel_plans`` -> ``apply_tensor_parallelism``). Its rules name ``q_proj`` /
``k_proj`` / ``v_proj`` and ``gate_proj`` / ``up_proj``; after a fusion those are parameterless
:class:`FusedSlice` modules and the fused Linear has no rule, so the rewrites retarget every plan
of the model (:func:`retarget_tp_plans`):

* ``<owner>.qkv_proj`` / ``<owner>.gate_up_proj``: :data:`FUSED_STYLE` (:class:`FusedColwise`,
  registered here) in place of the parts' ``colwise`` rules. Each part (q, k, v; gate, up) is
  split over the ``tp`` ranks by whole pieces (heads; rows), so rank ``r`` holds the query heads
  of the key/value heads it holds and its local rows are ``[q_r | k_r | v_r]`` (``[gate_r |
  up_r]``). No standard placement cuts ``[q | k | v]`` like that when q has more rows than k and v
  (GQA), so the *global* rows are put rank-major, ``[q_0|k_0|v_0 | q_1|k_1|v_1 | ...]``, and the
  parameter is a plain ``Shard(0)`` DTensor (FSDP2 on top makes it ``(_StridedShard(0), Shard(0))``,
  as for any colwise weight). The rewrite's recorded stage makes exactly that order
  (:class:`ConcatenateByRank` reads the layout the style settled on), so loads stay exact.
  gate/up take the same path rather than transformers' ``packed_colwise``
  (``_StridedShard(0, split_factor=2)`` of ``[gate | up]``): that one strides the weight but
  gives a bias ``Shard(0)`` (gate rows only on rank 0), cuts misaligned halves when ``tp`` does
  not divide the intermediate size, and under FSDP2 becomes ``(_StridedShard(0, sf=2),
  _StridedShard(0, sf=2))``, which describes no box of what each rank holds.
* the Linear reading the fused output (``o_proj`` / ``down_proj``, ``rowwise``):
  :data:`AFTER_FUSED_STYLE` (:class:`RowwiseAfterFused`), ``rowwise`` unless its producer is left
  whole, then whole too (a rowwise Linear after a whole producer would get full-width input where
  it expects its shard).

The styles decide when they run, on the mesh they get (the rewrites run before the mesh exists):
a fused projection whose heads (or intermediate size) ``tp`` does not divide stays a plain
replicated tensor with its plain forward, and the reason is kept; :func:`fused_without_tp_layout`
lists them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import ConversionOps
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard
from transformers.distributed.tensor_parallel import (
    ColwiseParallel,
    RowwiseParallel,
    TensorParallelLayer,
)

from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.mapping.ops import concatenate_in_groups
from hp_dcp_hf.transforms._fusion import FusedSlice

__all__ = [
    "AFTER_FUSED_STYLE",
    "FUSED_STYLE",
    "ConcatenateByRank",
    "FusedColwise",
    "FusedLayout",
    "RowwiseAfterFused",
    "fused_without_tp_layout",
    "rank_major",
    "retarget_tp_plans",
]

FUSED_STYLE = "hp_fused_colwise"
AFTER_FUSED_STYLE = "hp_rowwise_after_fused"
_SKIP_SLICES = "_hp_skip_fused_slices"  # suffix of a part style kept for modules left unfused

_LAYOUT = "_hp_layout"  # attribute of a fused Linear: its FusedLayout
_AFTER = "_hp_after"  # attribute of the Linear reading a fused output: the producer's FusedLayout


@dataclass(eq=False)
class FusedLayout:
    """How one fused Linear's rows are made and split; shared by its module, its TP styles and the
    recorded stage (plain data: no module references, so copies stay cheap).

    ``rows[i]`` are the rows of part ``i``, ``units[i]`` the number of whole pieces (heads; rows for
    gate/up) it must be split into (None: unknown, never split), ``nouns[i]`` a format string
    naming them (``"{} query heads"``). ``tp`` is the number of ranks the rows are split over: 1,
    the global rows are part after part (``[q | k | v]``) and the Linear is whole; more, they are
    rank-major (``[q_0|k_0|v_0 | q_1|k_1|v_1 | ...]``) and each rank holds one group. ``reason``
    says why a TP plan left it whole.
    """

    parts: tuple[str, ...]
    rows: tuple[int, ...]
    units: tuple[int, ...] | None
    nouns: tuple[str, ...]
    tp: int = 1
    reason: str | None = None
    decided_for: int | None = None  # the tp size the styles decided this layout for

    def local_rows(self, width: int) -> list[int]:
        """Rows of each part in an output ``width`` wide: the whole parts, or this rank's."""
        if width == sum(self.rows):
            return list(self.rows)
        if self.tp > 1 and width * self.tp == sum(self.rows):
            return [rows // self.tp for rows in self.rows]
        raise RuntimeError(f"a fused projection of {self.parts} ({'+'.join(map(str, self.rows))} rows, "
                           f"tp={self.tp}) returned {width} features")

    def blocker(self, tp: int) -> str | None:
        """Why this projection cannot be split over ``tp`` ranks by whole pieces (None: it can)."""
        if self.reason is not None:
            return self.reason
        if self.units is None:
            return f"the head size of {'/'.join(self.parts)} is unknown"
        for count, noun in zip(self.units, self.nouns, strict=True):
            if count % tp:
                return f"{noun.format(count)} not divisible by tp={tp}"
        return None

    def decide(self, tp: int) -> FusedLayout:
        """Settle ``tp`` (or ``reason``) for a mesh of ``tp`` ranks; once per layout, the styles of
        its Linear and of the Linear reading it all ask."""
        if self.decided_for is not None:
            if self.decided_for != tp:
                raise ValueError(f"fused projection of {self.parts}: laid out for tp={self.decided_for} already, "
                                 f"now asked for tp={tp}")
            return self
        self.decided_for = tp
        reason = self.blocker(tp) if tp > 1 else None
        if reason is not None:
            self.reason = reason
        elif tp > 1:
            self.tp = tp
        return self


def layout_of(module: nn.Module) -> FusedLayout | None:
    """The :class:`FusedLayout` of a fused Linear (None for any other module)."""
    return getattr(module, _LAYOUT, None)


def fused_without_tp_layout(model: nn.Module) -> list[tuple[str, str]]:
    """``(module path, reason)`` of every fused projection a TP plan left whole (replicated), e.g.
    ``("model.layers.0.self_attn.qkv_proj", "3 query heads not divisible by tp=2")``.

    Filled when the TP styles run (``maybe_distribute_model`` / ``apply_tensor_parallelism``), or
    at the rewrite when the plan shards the parts in a way the fusion cannot follow.
    """
    return [(path, layout.reason) for path, module in model.named_modules()
            if (layout := layout_of(module)) is not None and layout.reason is not None]


# --- the global row order --------------------------------------------------------------------------


def rank_major(tensor: torch.Tensor, rows: Sequence[int], groups: int, dim: int = 0) -> torch.Tensor:
    """``[p0 | p1 | ...]`` (parts of ``rows`` along ``dim``) -> ``[p0_0 | p1_0 | ... | p0_1 | p1_1 | ...]``,
    each part cut into ``groups`` equal chunks."""
    return tensor if groups == 1 else concatenate_in_groups(tensor.split(list(rows), dim), groups, dim)


class ConcatenateByRank(ConversionOps):
    """transformers' ``Concatenate`` in the order the fused Linear's layout asks for.

    ``layouts`` maps each target name (``model.layers.0.self_attn.qkv_proj.weight``) to its
    :class:`FusedLayout`: part after part (``[q | k | v]``, as ``Concatenate(dim)``), or, once a TP
    style grouped it by rank, ``[q_0|k_0|v_0 | q_1|k_1|v_1 | ...]``. Only ``chunk`` and ``cat``:
    the planner traces it like any transformers op.
    """

    def __init__(self, dim: int = 0, layouts: Mapping[str, FusedLayout] | None = None) -> None:
        self.dim = dim
        self.layouts = dict(layouts or {})

    @torch.no_grad()
    def convert(
        self,
        input_dict: dict[str, Any],
        source_patterns: list[str],
        target_patterns: list[str],
        full_layer_name: str | None = None,
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        if len(target_patterns) != 1:
            raise ValueError("Undefined Operation encountered!")
        tensors = []
        for pattern in source_patterns:
            if pattern in input_dict:
                value = input_dict.pop(pattern)
                tensors.extend(value if isinstance(value, list) else [value])
        layout = self.layouts.get(full_layer_name) if full_layer_name is not None else None
        if layout is None:
            raise MappingError(f"no fused layout recorded for {full_layer_name!r} (known: {sorted(self.layouts)[:4]} ...)")
        return {target_patterns[0]: concatenate_in_groups(tensors, layout.tp, self.dim)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim})"


# --- the styles -------------------------------------------------------------------------------------


def _decided(module: nn.Module, style: str, mesh: Any) -> FusedLayout:
    layout = layout_of(module)
    if layout is None:
        raise ValueError(f"{style!r} shards fused projections (hp_dcp_hf.transforms); "
                         f"{type(module).__name__} is not one")
    return layout.decide(mesh.size())


class FusedColwise(ColwiseParallel):
    """Colwise for a fused projection (``qkv_proj``, ``gate_up_proj``): every part split by whole
    pieces, global rows rank-major, ``Shard(0)``; the local output is ``[q_r | k_r | v_r]``
    (``[gate_r | up_r]``). Left whole (plain tensors, plain forward) when the pieces do not divide."""

    def __init__(self) -> None:
        super().__init__()

    def shard_param(self, module: nn.Module, param: str, mesh: Any) -> None:
        layout = _decided(module, FUSED_STYLE, mesh)
        value = module._parameters.get(param)
        if layout.tp == 1 or value is None or isinstance(value, DTensor):
            return
        with torch.no_grad():  # real values (if any) follow the global order; meta stays meta
            module._parameters[param] = nn.Parameter(rank_major(value, layout.rows, layout.tp),
                                                     requires_grad=value.requires_grad)
        super().shard_param(module, param, mesh)

    def install_forward(self, module: nn.Module, mesh: Any) -> nn.Module:
        if _decided(module, FUSED_STYLE, mesh).tp == 1:
            return module
        return super().install_forward(module, mesh)


class RowwiseAfterFused(RowwiseParallel):
    """``rowwise`` for the Linear that reads a fused projection's output (``o_proj``,
    ``down_proj``); whole when that projection is left whole. Plain ``rowwise`` elsewhere."""

    def __init__(self) -> None:
        super().__init__()

    @staticmethod
    def _whole(module: nn.Module, mesh: Any) -> bool:
        producer = getattr(module, _AFTER, None)
        return producer is not None and producer.decide(mesh.size()).tp == 1

    def shard_param(self, module: nn.Module, param: str, mesh: Any) -> None:
        if not self._whole(module, mesh):
            super().shard_param(module, param, mesh)

    def install_forward(self, module: nn.Module, mesh: Any) -> nn.Module:
        if self._whole(module, mesh):
            return module
        return super().install_forward(module, mesh)


class _SkipFusedSlices(TensorParallelLayer):
    """A part's style (``colwise`` of ``q_proj``) kept for the modules a fusion left alone, where a
    wildcard rule names both: fused slices get nothing (they hold no parameter and no forward of
    their own to hook)."""

    def __init__(self, base: TensorParallelLayer) -> None:
        self.base = base

    def shard_param(self, module: nn.Module, param: str, mesh: Any) -> None:
        self.base.shard_param(module, param, mesh)

    def validate_param(self, module: nn.Module, param: Any, mesh: Any, parameter_name: Any = None) -> None:
        self.base.validate_param(module, param, mesh, parameter_name=parameter_name)

    def install_forward(self, module: nn.Module, mesh: Any) -> nn.Module:
        if isinstance(module, FusedSlice):
            return module
        return self.base.install_forward(module, mesh)


ALL_PARALLEL_STYLES.register(FUSED_STYLE, FusedColwise())
ALL_PARALLEL_STYLES.register(AFTER_FUSED_STYLE, RowwiseAfterFused())


def _skip_fused_slices(style: str) -> str:
    name = style if style.endswith(_SKIP_SLICES) else f"{style}{_SKIP_SLICES}"
    if name not in ALL_PARALLEL_STYLES:
        ALL_PARALLEL_STYLES.register(name, _SkipFusedSlices(ALL_PARALLEL_STYLES[style]))
    return name


# --- the plans ----------------------------------------------------------------------------------------


def retarget_tp_plans(
    model: nn.Module,
    owners: Mapping[str, nn.Module],
    parts: Sequence[str],
    fused_name: str,
) -> None:
    """Point the TP plans on ``model`` (every module's own ``_tp_plan``, keys relative to it) at the
    fused Linears of ``owners`` (``{path: module}``, already fused).

    Per owner pattern (``model.layers.*.self_attn``): when every part has a ``colwise`` rule, the
    part rules become one :data:`FUSED_STYLE` rule for ``<pattern>.<fused_name>``; other part rules are
    dropped and the fused Linear stays whole, with the reason. Rules of parts that also name
    unfused modules (a wildcard covering layers the fusion left alone) stay for those modules.
    ``rowwise`` rules of the owner's other children (the Linear reading the fused output) become
    :data:`AFTER_FUSED_STYLE`. A plan without rules for the parts is left as it is.
    """
    for prefix, holder in model.named_modules():
        plan = holder.__dict__.get("_tp_plan")
        if not isinstance(plan, dict) or not plan:
            continue
        base = f"{prefix}." if prefix else ""
        patterns: dict[str, list[nn.Module]] = {}
        for path, owner in owners.items():
            if path.startswith(base):
                patterns.setdefault(replace_layer_number_by_wildcard(path[len(base):]), []).append(owner)
        if not patterns:
            continue
        unfused = {replace_layer_number_by_wildcard(name) for name, module in holder.named_modules()
                   if name.rsplit(".", 1)[-1] in parts and not isinstance(module, FusedSlice)}
        new = dict(plan)
        for pattern, fused_owners in patterns.items():
            rules = {key: new[key] for part in parts for key in
                     (f"{pattern}.{part}", f"{pattern}.{part}.weight", f"{pattern}.{part}.bias") if key in new}
            if not rules:
                continue
            layouts = [layout_of(getattr(owner, fused_name)) for owner in fused_owners]
            if set(rules) == {f"{pattern}.{part}" for part in parts} and set(rules.values()) == {"colwise"}:
                new = _replace(new, rules, {f"{pattern}.{fused_name}": FUSED_STYLE})
            else:
                for layout in layouts:
                    layout.reason = f"the TP plan shards its parts by {rules}, which the fusion cannot follow"
                new = _replace(new, rules, {})
            for key, part_style in rules.items():  # the modules the fusion left alone keep their rule
                if key.removesuffix(".weight").removesuffix(".bias") in unfused:
                    new[key] = _skip_fused_slices(part_style) if part_style in ALL_PARALLEL_STYLES else part_style
            for key, child_style in list(new.items()):
                child = key[len(pattern) + 1:] if key.startswith(f"{pattern}.") else ""
                if child_style != "rowwise" or not child or "." in child or child in parts:
                    continue
                new[key] = AFTER_FUSED_STYLE
                for owner, layout in zip(fused_owners, layouts, strict=True):
                    reader = getattr(owner, child, None)
                    if isinstance(reader, nn.Module):
                        setattr(reader, _AFTER, layout)
        holder._tp_plan = new


def _replace(plan: dict[str, str], old: Mapping[str, str], new: Mapping[str, str]) -> dict[str, str]:
    """``plan`` without the ``old`` keys, ``new`` in place of the first of them."""
    out: dict[str, str] = {}
    for key, value in plan.items():
        if key in old:
            out.update(new)
            new = {}
        else:
            out[key] = value
    return out
