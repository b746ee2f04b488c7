"""``fuse_qkv``: one ``qkv_proj`` matmul per attention instead of three."""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from hp_dcp_hf.transforms._fusion import fuse_sibling_linears

ModelT = TypeVar("ModelT", bound=nn.Module)

QKV = ("q_proj", "k_proj", "v_proj")


def fuse_qkv(model: ModelT) -> ModelT:
    """Fuse ``q_proj`` / ``k_proj`` / ``v_proj`` of every attention module into one ``qkv_proj``.

    Works in place, on the meta device too (before parallelization, before weights exist); real
    values are carried over. ``qkv_proj.weight`` holds the rows of q, then k, then v (GQA sizes
    kept), biases alike; the attention's own transformers forward runs unchanged on the slices of
    one matmul. Modules that do not fit (e.g. a k projection of another input size) are left
    alone. Records one stage, per attention module scope (its name, or more of its path where the
    name alone would also match modules left alone)::

        WeightConverter(["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                        "self_attn.qkv_proj.weight", [Concatenate(dim=0)])

    plus the same for ``.bias`` when the projections have biases.

    Only self-attention fits (q, k and v projected from the same input). Under tensor parallelism
    a ``Shard(0)`` ``qkv_proj`` loads correctly, but its local rows are not whole q/k/v heads:
    that layout is for loading and FSDP, not for colwise TP of this forward.

    Raises:
        MappingError: no attention module with plain ``nn.Linear`` q/k/v over one input, or they
            are DTensors already.
    """
    fuse_sibling_linears(model, QKV, "qkv_proj", "fuse_qkv")
    return model
