"""Facts of a model's state dict both flows need: which keys name one tensor (tied weights)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from typing import Any

from torch import nn

from hp_dcp_hf.mapping.families import dot_natural_key


def alias_groups(model: Any, names: Collection[str]) -> list[tuple[str, ...]]:
    """State dict keys ``names`` grouped by the tensor they share (tied weights), each group sorted."""
    ids: dict[str, int] = {}
    if isinstance(model, nn.Module):
        for name, tensor in (*model.named_parameters(remove_duplicate=False),
                             *model.named_buffers(remove_duplicate=False)):
            ids[name] = id(tensor)
    groups: dict[Any, list[str]] = defaultdict(list)
    for name in names:
        groups[ids.get(name, name)].append(name)
    return [tuple(g) if len(g) == 1 else tuple(sorted(g, key=dot_natural_key)) for g in groups.values()]
