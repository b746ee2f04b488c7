"""Which model tensors a plan moves, and whether each is what the composition makes of the
checkpoint: the same choice and the same checks on load and on save."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.geometry.shards import global_shape
from hp_dcp_hf.mapping.families import natural_sorted
from hp_dcp_hf.model.state import alias_groups


@dataclass(frozen=True)
class Targets:
    """A state dict's names by the tensor they share (tied weights), one to move per group: reading
    it on load fills every alias, writing it on save writes the tensor once."""

    names: tuple[str, ...]
    """Per group that the composition makes, its first name it makes (``embed_tokens``, not its
    ``lm_head`` alias); naturally sorted."""
    covered: tuple[str, ...]
    """Every name of those groups, naturally sorted."""
    unmade: tuple[tuple[str, ...], ...]
    """The groups of which the composition makes no name."""


def tied_targets(model: Any, names: Collection[str], made: Collection[str]) -> Targets:
    """The :class:`Targets` of state dict keys ``names`` of ``model``, of which the composition
    makes ``made`` (its ``traced``)."""
    chosen, covered, unmade = [], [], []
    for group in alias_groups(model, names):
        first = next((name for name in group if name in made), None)
        if first is None:
            unmade.append(group)
        else:
            chosen.append(first)
            covered.extend(group)
    return Targets(natural_sorted(chosen), natural_sorted(covered), tuple(unmade))


def shape_problem(tensor: torch.Tensor, traced: Any) -> str | None:
    """Why what the composition makes (``traced``) cannot be model tensor ``tensor``: another
    global shape; None when the shapes agree."""
    if tuple(traced.shape) == global_shape(tensor):
        return None
    return (f"model expects {global_shape(tensor)}, checkpoint makes {tuple(traced.shape)} "
            f"from {sorted(traced.source_keys())}")


def refuse(problems: Sequence[tuple[str, str]], what: str, *, file: str | None = None) -> None:
    """One :class:`MappingError` listing every ``(name, why)`` of ``problems`` (none: nothing
    raised), ``what`` saying what they are, keyed by the first name; ``file``: the checkpoint file
    the first problem comes from, where known."""
    if problems:
        raise MappingError(f"{len(problems)} {what}:\n  " + "\n  ".join(f"{name}: {why}" for name, why in problems),
                           file=file, key=problems[0][0])
