"""``fuse_qkv``: one ``qkv_proj`` matmul per attention instead of three."""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from hp_dcp_hf.transforms._fusion import fuse_sibling_linears
from hp_dcp_hf.transforms.tp import ConcatenateByRank, FusedLayout, retarget_tp_plans

ModelT = TypeVar("ModelT", bound=nn.Module)

QKV = ("q_proj", "k_proj", "v_proj")


def _layout(attention: nn.Module, linears: list[nn.Linear]) -> FusedLayout:
    rows = tuple(lin.out_features for lin in linears)
    head_dim = getattr(attention, "head_dim", None)
    heads = None
    if isinstance(head_dim, int) and head_dim > 0 and not any(r % head_dim for r in rows):
        heads = tuple(r // head_dim for r in rows)
    return FusedLayout(parts=QKV, rows=rows, units=heads,
                       nouns=("{} query heads", "{} key/value heads", "{} key/value heads"))


def fuse_qkv(model: ModelT) -> ModelT:
    """Fuse ``q_proj`` / ``k_proj`` / ``v_proj`` of every attention module into one ``qkv_proj``.

    Works in place, on the meta device too (before parallelization, before weights exist); real
    values are carried over. ``qkv_proj.weight`` holds the rows of q, then k, then v (GQA sizes
    kept), biases alike; the attention's own transformers forward runs unchanged on the slices of
    one matmul. Modules that do not fit (e.g. a k projection of another input size) are left
    alone. Records one stage, per attention module scope (its name, or more of its path where the
    name alone would also match modules left alone)::

        WeightConverter(["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                        "self_attn.qkv_proj.weight", [ConcatenateByRank(dim=0)])

    plus the same for ``.bias`` when the projections have biases. ``ConcatenateByRank`` is
    ``Concatenate(dim=0)`` until tensor parallelism lays the rows out by rank (below).

    Tensor parallelism: the model's TP plan (``model._tp_plan``, transformers') gets one rule
    ``*.self_attn.qkv_proj: "hp_fused_colwise"`` instead of the three ``colwise`` rules of q/k/v,
    and ``o_proj``'s ``rowwise`` becomes ``"hp_rowwise_after_fused"`` (see
    :mod:`hp_dcp_hf.transforms.tp`). When transformers applies them on a mesh of ``tp`` ranks that
    divides both head counts, each of q, k and v is split by whole heads, rank ``r``
    holding the query heads of its key/value heads: the global rows become rank-major
    ``[q_0|k_0|v_0 | q_1|k_1|v_1 | ...]`` (the recorded stage follows, so loads stay exact), the
    weight is ``Shard(0)`` and each rank's matmul gives ``[q_r | k_r | v_r]``, which the forward
    splits by local sizes. Otherwise the projection (and ``o_proj``) stays whole, listed by
    :func:`hp_dcp_hf.transforms.tp.fused_without_tp_layout`. Other layouts of the whole
    ``[q | k | v]`` (FSDP2's ``Shard(0)``, ...) load exactly too; a colwise split of it by other
    means (its local rows are not whole heads) makes the forward raise rather than mix heads.

    Raises:
        MappingError: no attention module with plain ``nn.Linear`` q/k/v over one input, or they
            are DTensors already.
    """
    owners = fuse_sibling_linears(model, QKV, "qkv_proj", "fuse_qkv", layout=_layout,
                                  operations=lambda layouts: [ConcatenateByRank(0, layouts)])
    retarget_tp_plans(model, owners, QKV, "qkv_proj")
    return model
