"""LoRA under tensor parallelism: the layout each LoRA layer's base layer implies
(:func:`lora_placements`, :func:`lora_tp_plan`) and :func:`parallelize_lora`, which applies it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from hp_dcp_hf.errors import LayoutError


@dataclass(frozen=True)
class LoraLayout:
    """How one LoRA layer is sharded over its base layer's TP mesh: ``base`` is ``"colwise"``
    (base weight ``Shard(0)``), ``"rowwise"`` (``Shard(1)``) or ``"replicated"``."""

    base: str
    lora_A: Placement
    lora_B: Placement


def lora_placements(base_weight: tuple[Placement, ...]) -> LoraLayout:
    """The placements of ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` that a base weight
    ``[out, in]`` laid out as ``base_weight`` (over a 1-D TP mesh) implies, so that the LoRA path
    computes the same shard of the output as the base layer:

    - colwise base (``Shard(0)``: each rank holds some outputs, from the whole input): ``lora_A``
      replicated, ``lora_B`` ``Shard(0)`` (its rows are those outputs);
    - rowwise base (``Shard(1)``: each rank holds some inputs, outputs summed over ranks):
      ``lora_A`` ``Shard(1)`` (its columns are those inputs; the ``[.., r]`` product is summed),
      ``lora_B`` replicated;
    - replicated base: both replicated.
    """
    if len(base_weight) != 1:
        raise LayoutError(f"the base weight is laid out over {len(base_weight)} mesh dims {base_weight}: "
                          "call parallelize_lora after TP and before fully_shard")
    placement = base_weight[0]
    if placement == Shard(0):
        return LoraLayout("colwise", Replicate(), Shard(0))
    if placement == Shard(1):
        return LoraLayout("rowwise", Shard(1), Replicate())
    if placement == Replicate():
        return LoraLayout("replicated", Replicate(), Replicate())
    raise LayoutError(f"no LoRA layout follows a base weight placed {placement}")


def _lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def lora_tp_plan(model: nn.Module) -> dict[str, LoraLayout]:
    """Every LoRA layer of ``model`` whose base layer is tensor-parallel, with the layout
    :func:`lora_placements` derives from its base weight; base layers without a DTensor weight
    are left out (their LoRA stays as it is), and so are LoRA layers laid out already (peft does it
    itself when ``get_peft_model`` wraps a model that transformers' ``distributed_config=`` made
    tensor-parallel). A sharded base this cannot follow (an embedding,
    a LoRA on a parameter such as stacked experts, a model sharded by FSDP2 already) is a
    :class:`LayoutError` naming the module."""
    from peft.tuners.lora import Linear as LoraLinear
    from torch.distributed.fsdp import FSDPModule

    plan: dict[str, LoraLayout] = {}
    for name, module in _lora_layers(model):
        base = module.get_base_layer()
        params = list(base.parameters(recurse=False))
        if not any(isinstance(p, DTensor) for p in params):
            continue
        if any(isinstance(m, FSDPModule) for m in model.modules()):
            raise LayoutError("the model is sharded by fully_shard already: call parallelize_lora after TP and "
                              "before fully_shard (a model of distributed_config=: pass the adapter to "
                              "hp_dcp_hf.from_pretrained(..., adapter=path), which adds it in between)", key=name)
        if any(isinstance(p, DTensor) for role in ("lora_A", "lora_B") for linear in getattr(module, role).values()
               for p in linear.parameters(recurse=False)):
            continue  # laid out already: by peft itself (over transformers' TP) or an earlier parallelize_lora
        if not isinstance(module, LoraLinear) or not isinstance(base, nn.Linear):
            raise LayoutError(f"a LoRA {type(module).__name__} over a tensor-parallel {type(base).__name__}: only "
                              "LoRA on nn.Linear follows a TP layout", key=name)
        try:
            plan[name] = lora_placements(tuple(base.weight.placements))
        except LayoutError as e:
            raise LayoutError(e.reason, key=name) from None
    return plan


class _ReplicateParallel(ParallelStyle):
    """A module replicated over the TP mesh: parameters ``Replicate`` DTensors, inputs and outputs
    plain local tensors (the same on every rank), like the base layer's own."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: Any) -> None:
            for param_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()]),
                                                                requires_grad=param.requires_grad))

        def inputs(mod: nn.Module, args: tuple, mesh: Any) -> tuple:
            return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

        def outputs(mod: nn.Module, out: Any, mesh: Any) -> Any:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, inputs, outputs)


def _style(placement: Placement, role: str) -> ParallelStyle:
    if placement == Replicate():
        return _ReplicateParallel()
    if role == "lora_B" and placement == Shard(0):
        return ColwiseParallel()
    if role == "lora_A" and placement == Shard(1):
        return RowwiseParallel()
    raise LayoutError(f"no parallel style places {role} as {placement}")  # pragma: no cover - lora_placements' own


def _as_dtensor(param: torch.Tensor, mesh: Any, placement: Placement, shape: tuple[int, ...], key: str) -> nn.Parameter:
    """``param`` of a LoRA layer as a DTensor of global ``shape`` laid out as ``placement``.

    peft sizes a LoRA layer from its base: over a whole base weight the LoRA tensors are whole
    (they are distributed, a sharded one from rank 0's values as torch's styles do); over a
    DTensor base under TP it takes the *local* shape of the base weight, so each rank's tensor is
    its shard already (it is wrapped as it is: each rank keeps its own slice). A replicated tensor
    is broadcast from the mesh's first rank either way: ranks that initialized it apart agree."""
    if isinstance(param, DTensor):
        return param if isinstance(param, nn.Parameter) else nn.Parameter(param)
    data = param.detach()
    if tuple(data.shape) == tuple(shape) or placement == Replicate():
        if tuple(data.shape) != tuple(shape):
            raise LayoutError(f"the LoRA tensor is {list(data.shape)}, its base layer implies {list(shape)}", key=key)
        value = distribute_tensor(data, mesh, [placement])
    else:
        dim = placement.dim  # type: ignore[attr-defined]
        size = mesh.size()
        expected = [min(-(-shape[dim] // size), max(0, shape[dim] - i * -(-shape[dim] // size))) for i in range(size)]
        if data.shape[dim] != expected[mesh.get_local_rank()] or any(
                a != b for d, (a, b) in enumerate(zip(data.shape, shape)) if d != dim):
            raise LayoutError(f"the LoRA tensor is {list(data.shape)}: neither its base layer's global shape "
                              f"{list(shape)} nor this rank's shard of it", key=key)
        stride = torch.empty(shape, device="meta").stride()
        value = DTensor.from_local(data, mesh, [placement], run_check=False, shape=torch.Size(shape), stride=stride)
    return nn.Parameter(value, requires_grad=param.requires_grad)


def parallelize_lora(model: nn.Module) -> dict[str, LoraLayout]:
    """Shard the LoRA layers of a tensor-parallel PEFT model as their base layers are sharded
    (:func:`lora_tp_plan`), with torch's ``parallelize_module``: a colwise base gets its ``lora_B``
    ``ColwiseParallel`` and its ``lora_A`` replicated, a rowwise base its ``lora_A``
    ``RowwiseParallel`` and its ``lora_B`` replicated, so ``base(x) + B(A(x))`` adds two shards of
    the same outputs, and the LoRA tensors are DTensors of the adapter's global shapes (what the
    file holds, what a load reads boxes of and a save writes).

    Call it after TP of the base and ``get_peft_model`` (in either order: peft sizes LoRA from a TP
    base's local shards, and those shards are kept), before ``fully_shard``. Returns the plan
    applied (module name -> :class:`LoraLayout`)."""
    plan = lora_tp_plan(model)
    for name, layout in plan.items():
        module = model.get_submodule(name)
        base = module.get_base_layer()
        mesh = base.weight.device_mesh
        for role, placement in (("lora_A", layout.lora_A), ("lora_B", layout.lora_B)):
            for adapter, linear in getattr(module, role).items():
                rank = linear.weight.shape[0 if role == "lora_A" else 1]
                shapes = {"weight": (rank, base.in_features) if role == "lora_A" else (base.out_features, rank),
                          "bias": (rank,) if role == "lora_A" else (base.out_features,)}
                for param_name, param in list(linear.named_parameters(recurse=False)):
                    where = Replicate() if param_name == "bias" and placement == Shard(1) else placement
                    linear.register_parameter(param_name, _as_dtensor(
                        param, mesh, where, shapes[param_name], f"{name}.{role}.{adapter}.{param_name}"))
                linear.in_features, linear.out_features = shapes["weight"][1], shapes["weight"][0]
                parallelize_module(linear, mesh, _style(placement, role))
    return plan
