"""Shared machinery of the rewrites: fuse sibling Linears under an unchanged transformers forward.

transformers' attention and MLP forwards call ``self.q_proj(x)``, ``self.k_proj(x)``, ... on one
input ``x``. Copying those forwards per architecture would fork transformers; instead the owner
module's class is swapped for a subclass (per instance, as FSDP2's ``fully_shard`` does; the
transformers class itself is untouched) whose ``forward`` runs the fused Linear once on ``x``,
splits the result, hands each slice to the :class:`FusedSlice` that stands where the old Linear
was, and then runs the original forward. The slices hold no parameters, so the state dict names
only the fused Linear; they hold their value for one call only, so nothing is kept between calls.
(Like FSDP2's classes, the swapped classes are made at run time: whole-model pickling does not
work; ``deepcopy`` and ``state_dict`` do.) Under tensor parallelism the fused Linear's local output
is this rank's rows of each part (``[q_r | k_r | v_r]``, :mod:`hp_dcp_hf.transforms.tp`), split
by the local sizes its layout gives.

Also here: the checks every rewrite shares (before any module is touched) and the choice of
pattern scopes, verified with transformers' own matcher to rename exactly the rewritten keys.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import (
    Concatenate,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
    rename_source_key,
)

from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.mapping.stages import add_weight_mapping


class FusedSlice(nn.Module):
    """Stands where one fused projection was; returns its slice of the fused output.

    Only its owner's forward feeds it (one call at a time). Called with any tensor other than the
    one its owner projected (e.g. cross-attention keys), it raises rather than return a wrong slice.
    """

    def __init__(self, fused_name: str, start: int, stop: int) -> None:
        super().__init__()
        self.fused_name = fused_name
        self.start = start
        self.stop = stop
        self._fed: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fed = self._fed
        if fed is None or fed[0] is not x:
            raise RuntimeError(
                f"this projection is rows {self.start}:{self.stop} of the fused {self.fused_name!r}; it only "
                "answers inside its owner's forward, for the owner's own input"
            )
        return fed[1]

    def extra_repr(self) -> str:
        return f"{self.fused_name}[{self.start}:{self.stop}]"


class _FusedForward:
    """Mixin of the swapped owner classes: one matmul per fused Linear, then the original forward."""

    _hp_fusions: dict[str, tuple[str, ...]]  # fused Linear name -> the slice names, in row order
    _hp_input_name: str  # name of the original forward's first parameter (the projected input)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else kwargs[self._hp_input_name]
        slices: list[FusedSlice] = []
        try:
            for fused_name, names in self._hp_fusions.items():
                parts = [getattr(self, name) for name in names]
                fused = getattr(self, fused_name)
                projected = fused(x)
                layout = getattr(fused, "_hp_layout", None)
                sizes = ([p.stop - p.start for p in parts] if layout is None
                         else layout.local_rows(projected.shape[-1]))  # under TP: this rank's rows of each part
                outputs = projected.split(sizes, dim=-1)
                for part, out in zip(parts, outputs, strict=True):
                    part._fed = (x, out)
                    slices.append(part)
            return super().forward(*args, **kwargs)
        finally:
            for part in slices:
                part._fed = None


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The per-class subclass whose forward feeds the slices (one per original class)."""
    if cls not in _FUSED_CLASSES:
        params = list(inspect.signature(cls.forward).parameters)
        _FUSED_CLASSES[cls] = type(
            f"Fused{cls.__name__}", (_FusedForward, cls), {"_hp_input_name": params[1], "__module__": __name__}
        )
    return _FUSED_CLASSES[cls]


def fuse_linears(owner: nn.Module, names: Sequence[str], fused_name: str, layout: Any = None) -> None:
    """Replace the Linears ``owner.<names>`` by one ``owner.<fused_name>`` (rows in that order).

    The fused Linear takes the place of the first one among ``owner``'s children (state dict order
    follows) and holds the old values when they exist (nothing is materialized on ``meta``).
    ``layout`` (a :class:`hp_dcp_hf.transforms.tp.FusedLayout`) goes on the fused Linear as
    ``_hp_layout``: its TP styles read and settle it, and the owner's forward splits the output by
    it (this rank's rows of each part under TP).
    """
    linears: list[nn.Linear] = [getattr(owner, name) for name in names]
    first = linears[0]
    has_bias = first.bias is not None
    fused = nn.Linear(first.in_features, sum(lin.out_features for lin in linears), bias=has_bias, device="meta")
    with torch.no_grad():  # the old values (or meta tensors), concatenated; nothing to initialize
        fused.weight = nn.Parameter(torch.cat([lin.weight for lin in linears]),
                                    requires_grad=first.weight.requires_grad)
        if has_bias:
            fused.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]),
                                      requires_grad=first.bias.requires_grad)
    if layout is not None:
        fused._hp_layout = layout
    stops = list(itertools.accumulate(lin.out_features for lin in linears))
    slices = {name: FusedSlice(fused_name, stop - lin.out_features, stop)
              for name, lin, stop in zip(names, linears, stops, strict=True)}
    # Rebuild the children in order: the fused Linear where the first part was, then the slices.
    children = list(owner._modules.items())
    owner._modules.clear()
    for name, child in children:
        if name == names[0]:
            owner._modules[fused_name] = fused
        owner._modules[name] = slices.get(name, child)
    if not isinstance(owner, _FusedForward):
        owner.__class__ = _fused_class(type(owner))
        owner._hp_fusions = {}
    owner._hp_fusions = {**owner._hp_fusions, fused_name: tuple(names)}


def check_rewritable(path: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Rewrites run before parallelization: their tensors are plain, on one device, of one dtype."""
    sharded = [name for name, t in tensors.items() if isinstance(t, DTensor)]
    if sharded:
        raise MappingError(f"{path}: {sharded} are already DTensors; apply the rewrite before parallelizing")
    if len({(t.device, t.dtype) for t in tensors.values()}) > 1:
        raise MappingError(f"{path}: {sorted(tensors)} differ in device or dtype: "
                           f"{sorted({(str(t.device), str(t.dtype)) for t in tensors.values()})}")


def same_linears(owner: nn.Module, names: Sequence[str]) -> bool:
    """Whether ``owner.<names>`` are plain ``nn.Linear`` s over one input, all with or all without bias."""
    linears = [getattr(owner, name, None) for name in names]
    if not all(type(lin) is nn.Linear for lin in linears):
        return False
    return len({(lin.in_features, lin.bias is not None) for lin in linears}) == 1


def misrenamed(names: Sequence[str], stage: Sequence[WeightTransform], renamed: Mapping[str, str]) -> list[str]:
    """The ``names`` that ``stage`` does not rename as ``renamed`` says (others must stay), each
    as ``"name -> got (expected ...)"``; decided by transformers' own matcher."""
    renamings = copy.deepcopy([t for t in stage if isinstance(t, WeightRenaming)])
    converters = copy.deepcopy([t for t in stage if isinstance(t, WeightConverter)])
    wrong = []
    for name in names:
        got, _ = rename_source_key(name, renamings, converters)
        if got != renamed.get(name, name):
            wrong.append(f"{name} -> {got} (expected {renamed.get(name, name)})")
    return wrong


def scoped_stage(
    model: nn.Module,
    owners: Mapping[str, nn.Module],
    converters: Callable[[str, list[nn.Module]], list[WeightTransform]],
    renamed: Mapping[str, str],
) -> list[WeightTransform]:
    """The stage for ``owners``, with the shortest pattern scopes that rename exactly ``renamed``.

    Patterns match anywhere in a key, so ``self_attn.q_proj.weight`` serves every layer, but
    ``experts.gate_up_proj`` would also match ``shared_experts.gate_up_proj``. Scopes are the last
    1, 2, ... names of each owner's path (never starting at a layer index); the first depth whose
    stage leaves every other tensor of ``model`` alone wins. ``converters(scope, modules)`` makes
    the transforms of one scope.
    """
    names = list(model.state_dict(keep_vars=True))
    wrong: list[str] = []
    for depth in range(1, max(path.count(".") for path in owners) + 2):
        scopes: dict[str, list[nn.Module]] = {}
        for path, module in owners.items():
            scopes.setdefault(".".join(path.split(".")[-depth:]), []).append(module)
        if any(scope.split(".")[0].isdigit() and scope not in owners for scope in scopes):
            continue  # `0.self_attn` would match `10.self_attn` too; a whole path may start with one
        stage = [t for scope, modules in scopes.items() for t in converters(scope, modules)]
        wrong = misrenamed(names, stage, renamed)
        if not wrong:
            return stage
    raise MappingError("no pattern scope renames exactly the rewritten tensors; e.g.\n  " + "\n  ".join(wrong[:10]))


def find_modules(model: nn.Module, accept: Callable[[nn.Module], bool]) -> dict[str, nn.Module]:
    """``{path: module}`` of every module ``accept`` takes, in model order."""
    return {path: module for path, module in model.named_modules() if path and accept(module)}


def fuse_sibling_linears(
    model: nn.Module,
    names: Sequence[str],
    fused_name: str,
    rewrite: str,
    *,
    layout: Callable[[nn.Module, list[nn.Linear]], Any] | None = None,
    operations: Callable[[dict[str, Any]], list[Any]] | None = None,
) -> dict[str, nn.Module]:
    """Fuse ``names`` into ``fused_name`` in every module that has them; record the one stage.

    ``layout(owner, linears)`` makes each fused Linear's layout (see :func:`fuse_linears`);
    ``operations(layouts)`` the converter's ops, given the layout of each target name of its scope
    (default ``[Concatenate(dim=0)]``). Returns ``{path: module}`` of the modules rewritten.
    Everything is checked before anything changes: a model with no such module, or tensors already
    sharded, raise :class:`MappingError`.
    """
    owners = find_modules(model, lambda m: same_linears(m, names) and not hasattr(m, fused_name))
    if not owners:
        raise MappingError(f"{rewrite}: {type(model).__name__} has no module with plain nn.Linear "
                           f"{'/'.join(names)} over one input (already rewritten?)")
    renamed: dict[str, str] = {}
    for path, owner in owners.items():
        tensors = {f"{n}.{kind}": t for n in names for kind, t in getattr(owner, n).named_parameters()}
        check_rewritable(path, tensors)
        renamed |= {f"{path}.{key}": f"{path}.{fused_name}.{key.rsplit('.', 1)[1]}" for key in tensors}
    layouts = {path: layout(owner, [getattr(owner, n) for n in names]) if layout else None
               for path, owner in owners.items()}
    paths = {id(owner): path for path, owner in owners.items()}

    def converters(scope: str, modules: list[nn.Module]) -> list[WeightTransform]:
        biased = any(getattr(m, names[0]).bias is not None for m in modules)
        out: list[WeightTransform] = []
        for kind in ("weight", "bias")[: 1 + biased]:
            targets = {f"{paths[id(m)]}.{fused_name}.{kind}": layouts[paths[id(m)]] for m in modules}
            ops = operations(targets) if operations else [Concatenate(dim=0)]
            out.append(WeightConverter([f"{scope}.{n}.{kind}" for n in names], f"{scope}.{fused_name}.{kind}", ops))
        return out

    stage = scoped_stage(model, owners, converters, renamed)
    replaced = {name: tuple(model.get_parameter(name).shape) for name in renamed}
    for path, owner in owners.items():
        fuse_linears(owner, names, fused_name, layouts[path])
    add_weight_mapping(model, stage, source_shapes=replaced)
    return owners
