"""Conversion ops transformers lacks, written as transformers writes its own (plain ``chunk`` /
``cat`` / ``view`` / ``transpose``), so the planner traces them like any transformers op.

They carry the model facts they need (group counts, head counts) instead of reading a
transformers config: the models they serve (torchtitan's, fused rewrites under TP) have none, and
transformers' ``PermuteForRope`` silently permutes as one head when the config lacks a head count.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from transformers.core_model_loading import ConversionOps, PermuteForRope


def concatenate_in_groups(tensors: Sequence[torch.Tensor], groups: int, dim: int = 0) -> torch.Tensor:
    """``[a | b | ...]`` along ``dim`` with every part cut into ``groups`` equal chunks, chunk by
    chunk: ``[a_0 | b_0 | ... | a_1 | b_1 | ...]``. One group is plain concatenation."""
    if groups == 1:
        return torch.cat(list(tensors), dim)
    pieces = [t.chunk(groups, dim) for t in tensors]
    return torch.cat([chunks[g] for g in range(groups) for chunks in pieces], dim)


def _sources(input_dict: dict[str, Any], source_patterns: Sequence[str]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for pattern in source_patterns:
        if pattern in input_dict:
            value = input_dict.pop(pattern)
            tensors.extend(value if isinstance(value, list) else [value])
    return tensors


class ConcatenateInGroups(ConversionOps):
    """transformers' ``Concatenate`` by groups (:func:`concatenate_in_groups`).

    torchtitan's fused ``wqkv`` is this of q, k and v with one group per key/value head: each KV
    group's query heads, then its key head, then its value head, so that a plain ``Shard(0)`` of
    the rows (ColwiseParallel) gives every rank whole groups.
    """

    def __init__(self, dim: int = 0, groups: int = 1) -> None:
        if groups < 1:
            raise ValueError(f"groups must be positive, got {groups}")
        self.dim = dim
        self.groups = groups

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, torch.Tensor]:
        if len(target_patterns) != 1:
            raise ValueError(f"{self} makes one tensor, got targets {target_patterns}")
        return {target_patterns[0]: concatenate_in_groups(_sources(input_dict, source_patterns), self.groups,
                                                          self.dim)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim}, groups={self.groups})"


class PermuteHeadsForRope(PermuteForRope):
    """transformers' ``PermuteForRope`` (its math, its direction flag) with the head count given.

    ``inverse=True`` turns a Hugging Face q/k projection (rotary halves) into the interleaved
    pairs of complex RoPE (torchtitan's llama3), as torchtitan's own ``_reverse_permute`` does.
    """

    def __init__(self, num_heads: int, *, inverse: bool = False) -> None:
        if num_heads < 1:
            raise ValueError(f"num_heads must be positive, got {num_heads}")
        super().__init__(inverse=inverse)
        self.num_heads = num_heads

    def _permute_for_rope(self, tensor: torch.Tensor, config: Any) -> torch.Tensor:
        return super()._permute_for_rope(tensor, SimpleNamespace(num_attention_heads=self.num_heads))

    @property
    def reverse_op(self) -> PermuteHeadsForRope:
        return PermuteHeadsForRope(self.num_heads, inverse=not self.inverse)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_heads={self.num_heads}, inverse={self.inverse})"
