"""That a load writes into the model's own tensors, whatever its ``state_dict()`` hands out.

DCP loads into the tensors of the state dict it is given. For most modules those are the
parameters and buffers themselves (detached views of the same storage), but a module may hand out
fresh tensors made by a ``state_dict`` hook (torchtitan's fused attention splits its ``wqkv`` into
new ``wq`` / ``wk`` / ``wv``) that only its ``load_state_dict`` hook merges back: a load into them
alone leaves the model as it was while reporting every key loaded. :func:`hook_made_entries` finds
such entries and :func:`finish_through_load_state_dict` hands them to the module's own
``load_state_dict``. :class:`WriteCheck` is the debug mode that proves it: the model filled with a
sentinel first, every tensor the load should have written checked after.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hp_dcp_hf.errors import PlanningError
from hp_dcp_hf.geometry.shards import held_views, local_tensor
from hp_dcp_hf.mapping.families import natural_sorted


def _storage(tensor: torch.Tensor) -> tuple[str, int]:
    local = local_tensor(tensor)
    return str(local.device), local.untyped_storage().data_ptr()


def hook_made_entries(model: nn.Module, state_dict: Mapping[str, Any], exclude: Collection[str] = ()) -> list[str]:
    """Keys of ``state_dict`` whose tensors share storage with no parameter or buffer of ``model``."""
    owned = {_storage(t) for t in (*model.parameters(), *model.buffers()) if t.numel()}
    return [key for key, value in state_dict.items()
            if key not in exclude and isinstance(value, torch.Tensor) and value.numel()
            and value.device.type != "meta" and _storage(value) not in owned]


def finish_through_load_state_dict(model: nn.Module, state_dict: Mapping[str, Any], keys: Collection[str]) -> None:
    """Hand the hook-made entries ``keys``, loaded, to ``model.load_state_dict`` (its hooks merge
    them into the model's tensors); an entry nothing takes is a :class:`PlanningError`, as its
    values would be lost."""
    try:
        result = model.load_state_dict({key: state_dict[key] for key in keys}, strict=False)
    except Exception as error:  # noqa: BLE001 - reported typed, with the keys
        raise PlanningError(f"state_dict() hands out {len(keys)} tensors that are not the model's own "
                            f"({list(natural_sorted(keys))[:5]}), and load_state_dict refused them: {error}") from error
    lost = list(natural_sorted(set(keys).intersection(result.unexpected_keys)))
    if lost:
        raise PlanningError(f"state_dict() hands out tensors that are not the model's own and load_state_dict "
                            f"does not take back: {lost[:5]} ({len(lost)} in all); a load into them would be lost")


def _own_tensors(model: nn.Module) -> Iterator[tuple[torch.Tensor, list[str], bool]]:
    """Each parameter and buffer once: ``(tensor, its names, persistent)``."""
    seen: dict[int, tuple[torch.Tensor, list[str], bool]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(param), (param, [], True))[1].append(name)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None:
                persistent = name not in module._non_persistent_buffers_set
                seen.setdefault(id(buffer), (buffer, [], persistent))[1].append(f"{prefix}.{name}" if prefix else name)
    yield from seen.values()


def own_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own parameters and persistent buffers by name, one name per tied group: a state
    dict of no hook's making, that DCP loads into and saves from in place."""
    return {names[0]: tensor for tensor, names, persistent in _own_tensors(model) if persistent}


class WriteCheck:
    """Debug mode of a load: every floating parameter and persistent buffer filled with NaN before,
    and after it each one must hold no NaN unless the report lists it missing (or another reader
    fills it). What the load did not write (missing keys) gets its value back, and on a failure
    every tensor does. Only elements that hold values are checked: a plain local shard's padding
    (``CheckpointableTensor``) is no load's to write."""

    def __init__(self, model: nn.Module) -> None:
        self._tensors = [(t, names, local_tensor(t).detach().clone()) for t, names, persistent in _own_tensors(model)
                         if persistent and t.is_floating_point() and t.numel()]
        with torch.no_grad():
            for tensor, _, _ in self._tensors:
                local_tensor(tensor).fill_(float("nan"))

    def check(self, missing: Collection[str]) -> None:
        """Raise :class:`PlanningError` naming the tensors the load left at the sentinel."""
        skipped = set(missing)
        unwritten = [names[0] for tensor, names, _ in self._tensors
                     if not skipped.intersection(names) and any(bool(torch.isnan(v).any()) for v in held_views(tensor))]
        if unwritten:
            raise PlanningError(f"the load reported success but left {len(unwritten)} model tensors unwritten: "
                                f"{list(natural_sorted(unwritten))[:5]}")
        self.restore(everything=False)

    @torch.no_grad()
    def restore(self, *, everything: bool = True) -> None:
        """Put back the values from before the load: of every tensor, or of those still all NaN."""
        for tensor, _, original in self._tensors:
            if everything or all(bool(torch.isnan(v).all()) for v in held_views(tensor)):
                local_tensor(tensor).copy_(original)
