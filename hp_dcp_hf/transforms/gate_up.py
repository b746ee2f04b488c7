"""``fuse_gate_up``: one ``gate_up_proj`` matmul per dense gated MLP instead of two."""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from hp_dcp_hf.transforms._fusion import fuse_sibling_linears
from hp_dcp_hf.transforms.tp import ConcatenateByRank, FusedLayout, retarget_tp_plans

ModelT = TypeVar("ModelT", bound=nn.Module)

GATE_UP = ("gate_proj", "up_proj")


def _layout(mlp: nn.Module, linears: list[nn.Linear]) -> FusedLayout:
    rows = tuple(lin.out_features for lin in linears)
    return FusedLayout(parts=GATE_UP, rows=rows, units=rows[:1],
                       nouns=("intermediate size {}",))


def fuse_gate_up(model: ModelT) -> ModelT:
    """Fuse ``gate_proj`` / ``up_proj`` of every dense gated MLP into one ``gate_up_proj``.

    Works in place, on the meta device too; real values are carried over. ``gate_up_proj.weight``
    holds the gate rows, then the up rows (the layout of transformers' stacked experts); the MLP's
    own forward runs unchanged on the two halves of one matmul. Dense MLPs inside MoE blocks (e.g.
    shared experts) are fused too; stacked experts are :func:`grouped_gemm_experts`' job. Records::

        WeightConverter(["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp.gate_up_proj.weight",
                        [ConcatenateByRank(dim=0)])

    per MLP module scope (``mlp``, ``shared_experts`` ...), plus ``.bias`` when present.
    ``ConcatenateByRank`` is ``Concatenate(dim=0)`` until tensor parallelism lays the rows out by
    rank (below).

    Tensor parallelism: the model's TP plan (``model._tp_plan``, transformers') gets one rule
    ``*.mlp.gate_up_proj: "hp_fused_colwise"`` instead of the ``colwise`` rules of gate/up, and
    ``down_proj``'s ``rowwise`` becomes ``"hp_rowwise_after_fused"`` (see
    :mod:`hp_dcp_hf.transforms.tp`). On a mesh of ``tp`` ranks that divides the intermediate size,
    the global rows become rank-major ``[gate_0|up_0 | gate_1|up_1 | ...]`` (the recorded stage
    follows, so loads stay exact), weight and bias are ``Shard(0)`` and each rank's matmul gives
    ``[gate_r | up_r]``, which the forward splits in halves. Otherwise the projection (and
    ``down_proj``) stays whole, listed by :func:`hp_dcp_hf.transforms.tp.fused_without_tp_layout`.

    Raises:
        MappingError: no module with plain ``nn.Linear`` gate/up projections over one input (e.g.
            a Mixtral model, whose every MLP is an MoE), or they are DTensors already.
    """
    owners = fuse_sibling_linears(model, GATE_UP, "gate_up_proj", "fuse_gate_up", layout=_layout,
                                  operations=lambda layouts: [ConcatenateByRank(0, layouts)])
    retarget_tp_plans(model, owners, GATE_UP, "gate_up_proj")
    return model
