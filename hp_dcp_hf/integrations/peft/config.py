"""The adapter's config: ``adapter_config.json`` read into peft's ``PeftConfig`` and written back as
``save_pretrained`` writes it, the model's LoRA config, the check that an adapter is for the model,
and ``peft`` itself, imported on use.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from torch import nn

from hp_dcp_hf.errors import (
    ArchitectureMismatchError,
    ArgumentError,
    CheckpointFormatError,
)
from hp_dcp_hf.storage import filesystem, locate
from hp_dcp_hf.storage.format.header import MAX_HEADER_BYTES
from hp_dcp_hf.storage.format.json_file import read_json

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft.utils.constants.SAFETENSORS_WEIGHTS_NAME
ADAPTER_CONFIG = "adapter_config.json"  # peft.utils.constants.CONFIG_NAME


def require_peft():
    """``peft``, imported on use: the rest of the package does not depend on it."""
    try:
        import peft
    except ImportError as e:  # pragma: no cover - the dev install has it
        raise ArgumentError("PEFT adapters need the peft package (pip install peft)") from e
    return peft


def lora_config(model: nn.Module, adapter_name: str) -> Any:
    """The config of adapter ``adapter_name`` of the PEFT model ``model``, refused unless it is LoRA."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping):
        raise ArgumentError(f"{type(model).__name__} is not a PEFT model (no peft_config): wrap it with "
                            "peft.get_peft_model(model, config) first")
    if adapter_name not in configs:
        raise ArgumentError(f"the model has no adapter {adapter_name!r} (it has {sorted(configs)})")
    config = configs[adapter_name]
    if str(getattr(config, "peft_type", "")) not in ("LORA", "PeftType.LORA"):
        raise ArgumentError(f"adapter {adapter_name!r} is {config.peft_type}: only LoRA adapters are supported")
    return config


def adapter_file(path: str | os.PathLike, name: str) -> str:
    """The file ``name`` of the adapter directory ``path`` (a local path or a URL alike)."""
    return f"{os.fspath(path).rstrip('/')}/{name}"


def read_adapter_config(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None, *,
                        is_trainable: bool = False) -> Any:
    """The ``PeftConfig`` of the adapter at ``path`` (its ``adapter_config.json``), read through
    :mod:`hp_dcp_hf.storage` (local, S3, HTTP, the Hub) and parsed by ``PeftConfig.from_pretrained``,
    so it is exactly the config ``peft`` would build. Wrap the model with it before sharding:
    ``get_peft_model(model, read_adapter_config(path, is_trainable=True))``.

    ``is_trainable`` is ``PeftModel.from_pretrained``'s: the config's ``inference_mode`` becomes
    ``not is_trainable`` (``save_pretrained`` always writes ``true``). With the default ``False``
    ``get_peft_model`` freezes every tensor, the adapter's too, as peft's own load does; with
    ``True`` the adapter's tensors (LoRA and ``modules_to_save``) train and the base stays frozen."""
    peft = require_peft()
    location, single = locate(*filesystem(os.fspath(path), storage_options))
    if single is not None:
        raise ArgumentError(f"pass the adapter's directory, not the file {single!r}", file=os.fspath(path))
    data = read_json(location, ADAPTER_CONFIG, cap=MAX_HEADER_BYTES, missing=(
        "the adapter has no adapter_config.json (peft's save_pretrained writes it next to adapter_model.safetensors)"))
    if "peft_type" not in data:
        raise CheckpointFormatError("no peft_type: not a PEFT adapter config", file=location.url(ADAPTER_CONFIG),
                                    key="peft_type")
    with tempfile.TemporaryDirectory() as directory:  # peft's own parsing (defaults, old fields)
        with open(os.path.join(directory, ADAPTER_CONFIG), "wb") as handle:
            handle.write(json.dumps(data).encode())
        try:
            config = peft.PeftConfig.from_pretrained(directory)
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointFormatError(f"peft cannot read it: {type(e).__name__}: {e}",
                                        file=location.url(ADAPTER_CONFIG)) from e
    if is_trainable and config.is_prompt_learning:  # peft's own refusal, typed
        raise ArgumentError("a prompt learning adapter cannot be loaded as trainable (peft refuses it too)",
                            file=location.url(ADAPTER_CONFIG))
    config.inference_mode = not is_trainable
    return config


def base_model_class(model: nn.Module, config: Any) -> type:
    """The base model's class as ``save_pretrained`` names it in ``auto_mapping`` (the class
    before FSDP2 wrapped it)."""
    from torch.distributed.fsdp import FSDPModule

    cls = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule)) if issubclass(cls, FSDPModule) else cls


def adapter_config_text(model: nn.Module, adapter_name: str = "default") -> str:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it for ``model``: the adapter's
    config in inference mode, the base model's ``name_or_path`` when the config has none, the
    ``auto_mapping`` of the base class (the unsharded one), through ``PeftConfig.save_pretrained``."""
    config = copy.deepcopy(lora_config(model, adapter_name))
    if config.base_model_name_or_path is None:
        base = model.base_model if config.is_prompt_learning else model.base_model.model
        config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    auto_mapping = None
    if config.task_type is None:
        cls = base_model_class(model, config)
        auto_mapping = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    with tempfile.TemporaryDirectory() as directory:
        config.save_pretrained(directory, auto_mapping_dict=auto_mapping)
        with open(os.path.join(directory, ADAPTER_CONFIG), encoding="utf-8") as handle:
            return handle.read()


def check_adapter_config(model: nn.Module, adapter_name: str, stored: Any, file: str) -> None:
    """The adapter at ``file`` is for this model: a LoRA adapter, for its base class."""
    if str(stored.peft_type) not in ("LORA", "PeftType.LORA"):
        raise CheckpointFormatError(f"a {stored.peft_type} adapter: only LoRA adapters are supported", file=file,
                                    key="peft_type")
    mine = lora_config(model, adapter_name)
    named = (getattr(stored, "auto_mapping", None) or {}).get("base_model_class")
    base = base_model_class(model, mine).__name__
    if named and named != base:
        raise ArchitectureMismatchError(f"the adapter is for a {named}, the model's base is a {base}", file=file,
                                        key="auto_mapping.base_model_class")
