"""After the load: local shards allocated, ties restored, and what the checkpoint did not fill
initialized by the model's own init, as transformers' ``from_pretrained`` does."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hp_dcp_hf.errors import PlanningError
from hp_dcp_hf.geometry.shards import local_shard_pieces, local_tensor
from hp_dcp_hf.model.state import declared_ties, named_tensors


def materialize(model: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """Stage 3a: allocate every local shard on ``device`` (values undefined until loaded)."""
    model.to_empty(device=device)
    retie(model)
    return model


def retie(model: nn.Module) -> bool:
    """Re-tie declared tied weights that are no longer the same tensor; True when it had to."""
    broken = False
    for tied, source in declared_ties(model):
        try:
            if model.get_parameter(tied) is not model.get_parameter(source):
                broken = True
        except AttributeError:
            continue
    if broken and hasattr(model, "tie_weights"):
        model.tie_weights()
    return broken


def _init_seed(seed: int | None) -> int:
    """``seed``, or one drawn from the global RNG (the same on every rank seeded alike)."""
    return seed if seed is not None else int(torch.randint(0, 2**62, ()).item())


def _swap_in_full(model: nn.Module, sharded: Mapping[int, torch.Tensor]) -> list[tuple[nn.Module, str, Any]]:
    """Replace every sharded pending parameter by a full NaN-filled plain one (ties kept); the
    ``(module, name, original)`` list restores them."""
    full: dict[int, nn.Parameter] = {}
    swapped = []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or id(param) not in sharded:
                continue
            if id(param) not in full:
                value = torch.full(param.shape, float("nan"), dtype=param.dtype, device=local_tensor(param).device)
                full[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
                full[id(param)]._is_hf_initialized = False
            swapped.append((module, name, param))
            module._parameters[name] = full[id(param)]
    return swapped


@torch.no_grad()
def finalize(model: nn.Module, loaded_keys: Iterable[str], *, seed: int | None = None) -> tuple[str, ...]:
    """Stage 3c: initialize every tensor the load did not fill with the model's own init.

    transformers' way: loaded tensors are marked ``_is_hf_initialized`` and
    ``model.initialize_weights()`` fills the rest (modules without it: ``reset_parameters()`` of
    modules whose tensors are all unfilled). Missing parameters are initialized under
    ``torch.manual_seed(seed)`` (default: a seed drawn from the global RNG, so every rank must be
    seeded alike, as DTensor random ops require anyway; no collective runs here), a *sharded* one
    as a full tensor of which each rank keeps its shards: replicas agree, and the values do not
    depend on the layout. The global RNG is otherwise left as it was.

    Returns the names initialized (missing keys and non-persistent buffers); raises
    :class:`PlanningError` for a floating tensor neither loaded nor reached by the init.
    """
    loaded = set(loaded_keys)
    by_id: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, tensor in named_tensors(model):
        by_id.setdefault(id(tensor), (tensor, []))[1].append(name)
    pending: list[tuple[torch.Tensor, list[str]]] = []
    for tensor, names in by_id.values():
        if loaded.intersection(names):
            tensor._is_hf_initialized = True
        else:
            tensor._is_hf_initialized = False
            pending.append((tensor, names))
            if tensor.is_floating_point():
                local_tensor(tensor).fill_(float("nan"))
    if not pending:
        return ()
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    sharded = {id(t): t for t, _ in pending if isinstance(t, DTensor) and isinstance(t, nn.Parameter)}
    params = {id(p) for p in model.parameters()}
    seed = _init_seed(seed) if any(id(t) in params for t, _ in pending) else 0
    swapped = _swap_in_full(model, sharded)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if hasattr(model, "initialize_weights"):
                model.initialize_weights()
            else:
                owned = {id(t) for t, _ in pending} | {id(m._parameters[n]) for m, n, _ in swapped}
                for module in model.modules():
                    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
                    if own and hasattr(module, "reset_parameters") and all(id(t) in owned for t in own):
                        module.reset_parameters()
    finally:
        values = {id(original): module._parameters[name] for module, name, original in swapped}
        for module, name, original in swapped:
            module._parameters[name] = original
    for key, original in sharded.items():
        local = original.to_local()
        for piece in local_shard_pieces(original):
            local[piece.local_box().slices()].copy_(values[key][piece.global_box.slices()])
    untouched = sorted(names[0] for tensor, names in pending
                       if tensor.is_floating_point() and bool(torch.isnan(local_tensor(tensor)).any()))
    if untouched:
        raise PlanningError(f"neither the checkpoint nor the model's own init fills {untouched}")
    for tensor, _ in pending:
        tensor._is_hf_initialized = True
    return tuple(sorted(names[0] for _, names in pending))
