"""An adapter inside the parallelization (``from_pretrained``'s ``adapter=``): the model wrapped by
peft between TP and FSDP (:func:`wrap_with_adapter`), and its base seen with the module tree it had
before peft (:func:`base_model_tree`), so the base checkpoint loads under its own names.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from hp_dcp_hf.errors import LayoutError
from hp_dcp_hf.integrations.peft.config import require_peft
from hp_dcp_hf.integrations.peft.layout import parallelize_lora


def wrap_with_adapter(model: nn.Module, config: Any, *, adapter_name: str = "default") -> nn.Module:
    """``get_peft_model(model, config)`` and :func:`parallelize_lora`, for a model that is
    tensor-parallel (or whole) and not yet sharded by ``fully_shard``, on the meta device or not;
    returns the PEFT model (``model`` itself is changed in place: its target modules are peft's
    layers now). The adapter's tensors are created on the base layers' devices without peft's
    init (``low_cpu_mem_usage``): a load fills them. Which tensors train is the config's
    (``read_adapter_config(path, is_trainable=...)``).

    :func:`hp_dcp_hf.from_pretrained` calls it between TP and FSDP (``adapter=``), so that FSDP2
    shards the adapter with the base and reduces its gradients over the data-parallel ranks."""
    from torch.distributed.fsdp import FSDPModule

    peft = require_peft()
    if any(isinstance(module, FSDPModule) for module in model.modules()):
        raise LayoutError("the model is sharded by fully_shard already: an adapter added now would not be sharded "
                          "by FSDP2 (nor its gradients reduced); add it before fully_shard")
    # peft lays LoRA out over transformers' TP by itself when the model carries transformers' mesh
    # (``_device_mesh``, set by distributed_config=): its lora_B / lora_A hooks and parallelize_lora's
    # would both run. Here parallelize_lora alone does it, as on a model of a recipe of one's own.
    mesh = model.__dict__.get("_device_mesh")
    if mesh is not None:
        model.__dict__["_device_mesh"] = None
    try:
        peft_model = peft.get_peft_model(model, config, adapter_name=adapter_name, low_cpu_mem_usage=True)
    finally:
        if mesh is not None:
            model.__dict__["_device_mesh"] = mesh
    _copies_forward_themselves(model)
    parallelize_lora(peft_model)
    return peft_model


def _copies_forward_themselves(model: nn.Module) -> None:
    """Give every ``modules_to_save`` copy of a tensor-parallel module its own TP forward.

    transformers' TP (``distributed_config=``) replaces a module's ``forward`` by a closure over
    that module (``TensorParallelLayer.install_forward``); peft's copy is a ``deepcopy``, which
    keeps the closure, so the copy would compute with the original's weights, silently. The style
    and mesh are the closure's own; anything else replacing ``forward`` is refused by name."""
    require_peft()
    from peft.utils.other import ModulesToSaveWrapper
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    for name, wrapper in model.named_modules():
        if not isinstance(wrapper, ModulesToSaveWrapper):
            continue
        forward = wrapper.original_module.__dict__.get("forward")
        if forward is None:
            continue
        code, closure = getattr(forward, "__code__", None), getattr(forward, "__closure__", None) or ()
        cells = dict(zip(code.co_freevars, closure)) if code is not None else {}
        style = cells["self"].cell_contents if "self" in cells else None
        if not isinstance(style, TensorParallelLayer) or "mesh" not in cells:
            raise LayoutError("modules_to_save copies a module whose forward is replaced by something else than "
                              "transformers' tensor parallelism: the copy would run the original's forward", key=name)
        for copied in wrapper.modules_to_save.values():
            if copied.__dict__.get("forward") is forward:
                del copied.__dict__["forward"]
                style.install_forward(copied, cells["mesh"].cell_contents)


@contextmanager
def base_model_tree(model: nn.Module) -> Iterator[nn.Module]:
    """For the block, the base model of the PEFT model ``model`` with the module tree it had before
    ``get_peft_model``: every peft layer swapped for its base layer (a LoRA ``Linear`` for its
    ``nn.Linear``, nested ``ParamWrapper`` s for the experts module, a ``modules_to_save`` wrapper
    for its original module). The tensors are the same; their names are the base class' own, so
    the base checkpoint loads through the ordinary planner (transformers' mapping, ties, the
    model's init of what it lacks) and nothing of the adapter is touched."""
    require_peft()
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    base = model.get_base_model()
    swaps: list[tuple[nn.Module, str, nn.Module, nn.Module]] = []
    covered: list[str] = []
    for name, module in base.named_modules():
        if not name or any(name.startswith(prefix) for prefix in covered):
            continue
        if isinstance(module, AuxiliaryTrainingWrapper):
            original = module.original_module
        elif isinstance(module, BaseTunerLayer):
            original = module.get_base_layer()
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        swaps.append((base.get_submodule(parent_name), child, module, original))
        covered.append(name + ".")
    for parent, child, _, original in swaps:
        parent._modules[child] = original
    try:
        yield base
    finally:
        for parent, child, module, _ in swaps:
            parent._modules[child] = module
