"""Performance rewrites of transformers models, each recording how its new weights are made.

Each rewrite ``fn(model) -> model`` changes the model in place (on the meta device too, before
parallelization) and records exactly one stage with :func:`hp_dcp_hf.add_weight_mapping`, so
:class:`hp_dcp_hf.HFMappingPlanner` loads the original checkpoint straight into the rewritten
layout; no loader code per rewrite. They compose in any order.

* :func:`fuse_qkv`: attention ``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj`` (``ConcatenateByRank``).
* :func:`fuse_gate_up`: dense MLP ``gate_proj``/``up_proj`` -> ``gate_up_proj`` (``ConcatenateByRank``).
* :func:`grouped_gemm_experts`: stacked experts ``gate_up_proj``/``down_proj`` -> ``w13``/``w2``
  transposed for grouped GEMM (``Transpose(1, 2)``).

The fusions also retarget the model's transformers TP plan (``model._tp_plan``) to the fused
Linears, so transformers' ``maybe_distribute_model`` shards them by whole heads; see
:mod:`hp_dcp_hf.transforms.tp` (styles, the rank-major row order, and
:func:`~hp_dcp_hf.transforms.tp.fused_without_tp_layout` for the fused projections left whole).
"""

from hp_dcp_hf.transforms._fusion import FusedSlice
from hp_dcp_hf.transforms.experts import GroupedGemmExperts, grouped_gemm_experts
from hp_dcp_hf.transforms.gate_up import fuse_gate_up
from hp_dcp_hf.transforms.qkv import fuse_qkv

__all__ = ["FusedSlice", "GroupedGemmExperts", "fuse_gate_up", "fuse_qkv", "grouped_gemm_experts"]
