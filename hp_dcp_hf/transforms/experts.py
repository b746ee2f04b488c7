"""``grouped_gemm_experts``: stacked MoE experts in the layout grouped-GEMM kernels take.

transformers 5 keeps MoE experts stacked as ``gate_up_proj [E, 2I, H]`` and ``down_proj
[E, H, I]`` (``nn.Linear`` layout: out x in), so every expert matmul reads a transposed weight.
Grouped-GEMM kernels (``torch.nn.functional.grouped_mm``) take ``[E, K, N]``: input features
first. The rewrite stores ``w13 [E, H, 2I]`` (gate columns, then up) and ``w2 [E, I, H]``, sorts
the routed (token, expert) pairs by expert and runs one grouped matmul per projection.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.core_model_loading import Transpose, WeightConverter, WeightTransform

from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.mapping.stages import add_weight_mapping
from hp_dcp_hf.transforms._fusion import check_rewritable, find_modules, scoped_stage

ModelT = TypeVar("ModelT", bound=nn.Module)

_ALIGN = 16  # bytes: grouped_mm kernels need 16-byte aligned pointers and strides


def _kernel_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` takes these operands here: it rejects misaligned strides (odd
    sizes such as an intermediate of 23), and on CUDA supports bf16 on SM80+ only."""
    if not hasattr(F, "grouped_mm") or x.dtype != w.dtype or x.device != w.device or x.shape[0] == 0:
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
    elif x.device.type != "cpu":
        return False
    return all(
        t.data_ptr() % _ALIGN == 0 and all(s * t.element_size() % _ALIGN == 0 for s in t.stride() if s != 1)
        for t in (x, w)
    )


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x [S, K]`` (rows sorted by group, ``counts[e]`` rows for group ``e``) times ``w [E, K, N]``.

    One ``F.grouped_mm`` call where the kernel fits, else a loop of per-expert matmuls (same math,
    same result; what CPUs and odd sizes get).
    """
    if _kernel_fits(x, w):
        return F.grouped_mm(x, w, offs=counts.cumsum(0, dtype=torch.int32))
    pieces, start = [], 0
    for expert, rows in enumerate(counts.tolist()):
        if rows:
            pieces.append(x[start:start + rows] @ w[expert])
            start += rows
    return torch.cat(pieces) if pieces else x.new_empty(0, w.shape[-1])


class GroupedGemmExperts(nn.Module):
    """MoE experts with ``w13 [E, H, 2I]`` (gate | up columns) and ``w2 [E, I, H]``.

    A drop-in for transformers' experts modules: same call ``(hidden_states [T, H], top_k_index
    [T, k], top_k_weights [T, k]) -> [T, H]``; expert ids ``>= E`` (expert-parallel sentinels)
    pick no expert here, as in transformers.
    """

    def __init__(self, w13: nn.Parameter, w2: nn.Parameter, act_fn: nn.Module) -> None:
        super().__init__()
        self.num_experts = w13.shape[0]
        self.w13 = w13
        self.w2 = w2
        self.act_fn = act_fn

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_top_k = top_k_index.shape[-1]
        with torch.no_grad():
            expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
            counts = torch.bincount(expert_ids, minlength=self.num_experts)[: self.num_experts]
            routed = order[: int(counts.sum())]  # (token, slot) pairs by expert; sentinels sort last
            tokens = routed // num_top_k
        gate, up = grouped_mm(hidden_states[tokens], self.w13, counts).chunk(2, dim=-1)
        out = grouped_mm(self.act_fn(gate) * up, self.w2, counts)
        out = out * top_k_weights.reshape(-1)[routed, None]
        return torch.zeros_like(hidden_states).index_add_(0, tokens, out.to(hidden_states.dtype))

    def extra_repr(self) -> str:
        experts, hidden, gate_up = self.w13.shape
        return f"num_experts={experts}, hidden={hidden}, intermediate={gate_up // 2}"


def _stacked_experts(module: nn.Module) -> bool:
    """transformers' stacked experts in the plain layout: concatenated gate|up, no bias, not
    transposed, no post-expert norm; ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""
    gate_up = module._parameters.get("gate_up_proj")
    down = module._parameters.get("down_proj")
    if gate_up is None or down is None or set(module._parameters) != {"gate_up_proj", "down_proj"}:
        return False
    if not isinstance(getattr(module, "act_fn", None), nn.Module) or set(module._modules) != {"act_fn"}:
        return False
    flags = {"has_gate": True, "is_concatenated": True, "has_bias": False, "is_transposed": False,
             "has_post_expert_norm": False}
    if any(getattr(module, name, default) != default for name, default in flags.items()):
        return False
    if gate_up.dim() != 3 or down.dim() != 3:
        return False
    experts, gate_up_rows, hidden = gate_up.shape
    return gate_up_rows % 2 == 0 and tuple(down.shape) == (experts, hidden, gate_up_rows // 2)


#: transformers' parallel styles of the stacked experts' parameters, for the transposed ones:
#: ``gate_up_proj [E, 2I, H]`` packed on dim 1 -> ``w13 [E, H, 2I]`` packed on the last dim;
#: ``down_proj [E, H, I]`` sharded on the last dim -> ``w2 [E, I, H]`` on dim 1 (``colwise``
#: shards dim -2). Expert-parallel styles (dim 0) are the same for both layouts.
_TRANSPOSED_STYLES = {"packed_colwise": "packed_rowwise", "rowwise": "colwise", "colwise": "rowwise"}
_RENAMED = {"gate_up_proj": "w13", "down_proj": "w2"}


def _retarget_plans(model: nn.Module, paths: list[str]) -> None:
    """Point the TP and EP plans on ``model`` (every module's own ``_tp_plan`` / ``_ep_plan``,
    keys relative to it) at ``w13`` / ``w2`` of the rewritten experts at ``paths``, with the
    styles that shard the transposed layout as the originals were sharded; the experts module's
    own rule (``moe_tp_experts``, ``ep_dispatch_experts``: local compute, partial sums, token
    routing) stays, since the module takes the same call."""
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    for prefix, holder in model.named_modules():
        base = f"{prefix}." if prefix else ""
        patterns = {replace_layer_number_by_wildcard(p[len(base):]) for p in paths if p.startswith(base)}
        for attribute, styles in (("_tp_plan", _TRANSPOSED_STYLES), ("_ep_plan", {})):
            plan = holder.__dict__.get(attribute)
            if not isinstance(plan, dict) or not patterns:
                continue
            renamed = {}
            for key, style in plan.items():
                pattern, _, name = key.rpartition(".")
                if pattern in patterns and name in _RENAMED:
                    key, style = f"{pattern}.{_RENAMED[name]}", styles.get(style, style)
                renamed[key] = style
            setattr(holder, attribute, renamed)


def grouped_gemm_experts(model: ModelT) -> ModelT:
    """Replace every stacked experts module by a :class:`GroupedGemmExperts` (in place).

    Works on the meta device too; real values are carried over (transposed). Records one stage,
    per experts module scope (its name, or more of its path where that alone would also match
    other tensors, e.g. ``mlp.experts`` next to a fused ``shared_experts.gate_up_proj``)::

        WeightConverter("experts.gate_up_proj", "experts.w13", [Transpose(1, 2)])
        WeightConverter("experts.down_proj", "experts.w2", [Transpose(1, 2)])

    The model's TP and EP plans (transformers') follow the rename: tensor parallelism splits the
    intermediate dim (gate and up halves of ``w13``'s last dim each, ``Shard(1)`` of ``w2``),
    expert parallelism dim 0 of both.

    Raises:
        MappingError: no experts module of transformers' plain stacked layout (e.g. a dense model,
            or one rewritten already), or its weights are DTensors already.
    """
    owners = find_modules(model, _stacked_experts)
    if not owners:
        raise MappingError(f"grouped_gemm_experts: {type(model).__name__} has no stacked experts module "
                           "(3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I], no bias; already rewritten?)")
    renamed = {}
    for path, experts in owners.items():
        check_rewritable(path, dict(experts.named_parameters()))
        renamed |= {f"{path}.gate_up_proj": f"{path}.w13", f"{path}.down_proj": f"{path}.w2"}

    def converters(scope: str, _: list[nn.Module]) -> list[WeightTransform]:
        return [WeightConverter(f"{scope}.gate_up_proj", f"{scope}.w13", [Transpose(1, 2)]),
                WeightConverter(f"{scope}.down_proj", f"{scope}.w2", [Transpose(1, 2)])]

    stage = scoped_stage(model, owners, converters, renamed)
    replaced = {name: tuple(model.get_parameter(name).shape) for name in renamed}
    for path, experts in owners.items():
        parent_path, _, name = path.rpartition(".")
        with torch.no_grad():
            w13, w2 = (nn.Parameter(p.transpose(1, 2).contiguous(), requires_grad=p.requires_grad)
                       for p in (experts.gate_up_proj, experts.down_proj))
        model.get_submodule(parent_path).register_module(name, GroupedGemmExperts(w13, w2, experts.act_fn))
    add_weight_mapping(model, stage, source_shapes=replaced)
    _retarget_plans(model, list(owners))
    return model
