"""Facts of a model's state dict both flows need: which keys name one tensor (tied weights), and
which ties the model declares."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from hp_dcp_hf.mapping.families import dot_natural_key


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` by name, a tied tensor under each of its names."""
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def declared_ties(model: nn.Module) -> list[tuple[str, str]]:
    """``(tied, source)`` name pairs transformers declares (``all_tied_weights_keys``): what
    ``tie_weights`` makes one tensor, whether or not it is one now."""
    pairs = getattr(model, "all_tied_weights_keys", None) or {}
    return [(a, b) for a, b in pairs.items() if isinstance(a, str) and isinstance(b, str)]


def alias_groups(model: Any, names: Collection[str]) -> list[tuple[str, ...]]:
    """State dict keys ``names`` grouped by the tensor they share (tied weights), each group sorted."""
    ids: dict[str, int] = {}
    if isinstance(model, nn.Module):
        ids = {name: id(tensor) for name, tensor in named_tensors(model)}
    groups: dict[Any, list[str]] = defaultdict(list)
    for name in names:
        groups[ids.get(name, name)].append(name)
    return [tuple(g) if len(g) == 1 else tuple(sorted(g, key=dot_natural_key)) for g in groups.values()]
