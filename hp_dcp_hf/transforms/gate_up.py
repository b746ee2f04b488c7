"""``fuse_gate_up``: one ``gate_up_proj`` matmul per dense gated MLP instead of two."""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from hp_dcp_hf.transforms._fusion import fuse_sibling_linears

ModelT = TypeVar("ModelT", bound=nn.Module)

GATE_UP = ("gate_proj", "up_proj")


def fuse_gate_up(model: ModelT) -> ModelT:
    """Fuse ``gate_proj`` / ``up_proj`` of every dense gated MLP into one ``gate_up_proj``.

    Works in place, on the meta device too; real values are carried over. ``gate_up_proj.weight``
    holds the gate rows, then the up rows (the layout of transformers' stacked experts); the MLP's
    own forward runs unchanged on the two halves of one matmul. Dense MLPs inside MoE blocks (e.g.
    shared experts) are fused too; stacked experts are :func:`grouped_gemm_experts`' job. Records::

        WeightConverter(["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp.gate_up_proj.weight",
                        [Concatenate(dim=0)])

    per MLP module scope (``mlp``, ``shared_experts`` ...), plus ``.bias`` when present.

    Raises:
        MappingError: no module with plain ``nn.Linear`` gate/up projections over one input (e.g.
            a Mixtral model, whose every MLP is an MoE), or they are DTensors already.
    """
    fuse_sibling_linears(model, GATE_UP, "gate_up_proj", "fuse_gate_up")
    return model
