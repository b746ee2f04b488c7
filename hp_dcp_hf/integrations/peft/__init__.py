"""PEFT LoRA adapters: load ``adapter_model.safetensors`` into a sharded PEFT model by byte ranges,
and save the sharded adapter back as the one file ``peft``'s ``save_pretrained`` writes.

Why: a LoRA adapter of a sharded model (FSDP2, TP) is itself sharded. Gathering it to rank 0 to save
it (what accelerate does, keeping rank 0's slice only under FSDP2: accelerate #4206) or reading the
whole file on every rank to load it is what the planners of this package exist to avoid.

The names. ``peft`` writes ``base_model.model.<module>.lora_A.weight``; the wrapped model holds
``base_model.model.<module>.lora_A.<adapter name>.weight``. The correspondence is ``peft``'s own:
:func:`adapter_keys` runs ``get_peft_model_state_dict`` (the key function of ``save_pretrained``)
over the model's state dict, and checks it against the load side of ``set_peft_model_state_dict``
(auxiliary wrappers' load maps, then the tuner's ``_remap_adapter_state_dict_for_load``). The
planners then see only the adapter's tensors, under their file names (:class:`AdapterTensors`), so
the checkpoint mapping is the identity and the rest is the package's ordinary load and save:
:class:`~hp_dcp_hf.load.planner.HFMappingPlanner` reads each rank's boxes, and
:class:`~hp_dcp_hf.save.planner.HFSavePlanner` with :class:`AdapterStorageWriter` writes them, each
byte once, published atomically next to ``adapter_config.json``.

Tensor parallelism: :func:`parallelize_lora` shards every LoRA layer the way its base layer's TP
layout implies (:func:`lora_placements`).

Training: ``read_adapter_config(path, is_trainable=True)`` is peft's ``is_trainable`` (the default
``False`` freezes everything, as ``PeftModel.from_pretrained`` does). On a model of transformers'
plans, :func:`hp_dcp_hf.from_pretrained`'s ``adapter=`` adds the adapter between TP and FSDP
(:func:`wrap_with_adapter`) and loads the base through :func:`base_model_tree`, so FSDP2 shards the
adapter with the rest.

Only LoRA is supported (``peft_type: "LORA"``); a transformers-4 MoE adapter (per-expert keys that
``peft`` converts with a block-diagonal op on load) is refused by name rather than converted.
"""

from __future__ import annotations

from hp_dcp_hf.integrations.peft.config import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_config_text,
    read_adapter_config,
)
from hp_dcp_hf.integrations.peft.layout import LoraLayout, lora_placements, lora_tp_plan, parallelize_lora
from hp_dcp_hf.integrations.peft.load import load_peft_adapter
from hp_dcp_hf.integrations.peft.names import AdapterTensors, adapter_keys
from hp_dcp_hf.integrations.peft.save import AdapterStorageWriter, save_peft_adapter
from hp_dcp_hf.integrations.peft.wrapping import base_model_tree, wrap_with_adapter

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AdapterStorageWriter",
    "AdapterTensors",
    "LoraLayout",
    "adapter_config_text",
    "adapter_keys",
    "base_model_tree",
    "load_peft_adapter",
    "lora_placements",
    "lora_tp_plan",
    "parallelize_lora",
    "read_adapter_config",
    "save_peft_adapter",
    "wrap_with_adapter",
]
