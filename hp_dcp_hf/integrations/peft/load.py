"""Loading an adapter: :func:`load_peft_adapter` reads each rank's shards of the LoRA tensors by
byte ranges, after every check of the file against the model (:class:`_AdapterLoadPlanner`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor

from hp_dcp_hf.errors import (
    ArgumentError,
    CheckpointNotFoundError,
    LayoutError,
    MappingError,
    MissingKeysError,
    UnexpectedKeysError,
)
from hp_dcp_hf.integrations.peft.config import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_file,
    check_adapter_config,
    lora_config,
    read_adapter_config,
)
from hp_dcp_hf.integrations.peft.names import AdapterTensors, adapter_keys, adapter_names_and_dropped
from hp_dcp_hf.load.api import load_hf_checkpoint
from hp_dcp_hf.load.planner import HFMappingPlanner, LoadReport, describe_keys
from hp_dcp_hf.mapping.families import natural_sorted
from hp_dcp_hf.storage import HFStorageReader, filesystem, locate


class _AdapterLoadPlanner(HFMappingPlanner):
    """The planner of an adapter load: before anything else, the file's tensors must be exactly the
    model's adapter tensors, in its shapes (each error names the file and its first key)."""

    def __init__(self, view: AdapterTensors, file: str, optional: frozenset[str] = frozenset(), **kwargs: Any) -> None:
        super().__init__(view, weights_mapping=[], strict=True, unexpected="raise", **kwargs)
        self.file = file
        self.optional = optional  # saved by peft only sometimes (embedding layers): loaded when the file has them

    def plan_reads(self, state_dict: Mapping[str, Any], metadata: Metadata) -> list[ReadItem]:
        stored = {key: md for key, md in metadata.state_dict_metadata.items()
                  if isinstance(md, TensorStorageMetadata) and key not in self.claimed_source_keys}
        self.external_target_fqns = frozenset(key for key in self.optional if key not in stored)
        state_dict = {key: value for key, value in state_dict.items() if key not in self.external_target_fqns}
        extra = natural_sorted(set(stored) - set(state_dict))
        if extra:
            per_expert = any(".experts." in key and key.split(".experts.", 1)[1][:1].isdigit() for key in extra)
            hint = (" (per-expert keys: a transformers-4 MoE adapter, which peft converts with a block-diagonal op; "
                    "convert it once with peft's PeftModel.from_pretrained + save_pretrained)" if per_expert else
                    " (an adapter for another model, or other target_modules than the model was wrapped with)")
            raise UnexpectedKeysError(f"{len(extra)} tensors of the adapter are no LoRA tensor of the model{hint}: "
                                      f"{describe_keys(extra)}", file=self.file, key=extra[0])
        absent = natural_sorted(set(state_dict) - set(stored))
        if absent:
            raise MissingKeysError(f"the adapter has no value for {len(absent)} LoRA tensors of the model (it was "
                                   f"wrapped with other target_modules, or the file is cut): {describe_keys(absent)}",
                                   file=self.file, key=absent[0])
        shapes = [(key, tuple(stored[key].size), tuple(state_dict[key].shape)) for key in state_dict
                  if tuple(stored[key].size) != tuple(state_dict[key].shape)]
        if shapes:
            key, file_shape, model_shape = sorted(shapes)[0]
            raise MappingError(f"{len(shapes)} tensors differ in shape: the file holds {list(file_shape)}, the model "
                               f"{list(model_shape)} (an adapter for another base model, or another rank r)",
                               file=self.file, key=key)
        return super().plan_reads(self.state_dict, metadata)


def _check_fsdp_manages(model: nn.Module, names: Mapping[str, str]) -> None:
    """A trainable adapter tensor of a model sharded by ``fully_shard`` is one FSDP2 manages (a
    DTensor): one added after ``fully_shard`` is a plain tensor whose gradients no collective
    reduces over the data-parallel ranks, so every rank would train an adapter of its own."""
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(module, FSDPModule) for module in model.modules()):
        return
    params = dict(model.named_parameters())
    unmanaged = [key for key in names.values()
                 if key in params and params[key].requires_grad and not isinstance(params[key], DTensor)]
    if unmanaged:
        raise LayoutError(f"{len(unmanaged)} trainable adapter tensors are not sharded by fully_shard (the adapter "
                          "was added after it): their gradients would not be reduced over the data-parallel ranks; "
                          "add it before fully_shard (get_peft_model + parallelize_lora, then fully_shard), or "
                          "load with hp_dcp_hf.from_pretrained(..., adapter=path, is_trainable=True)",
                          key=unmanaged[0])


def load_peft_adapter(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    adapter_name: str = "default",
    reader: HFStorageReader | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **load_options: Any,
) -> LoadReport:
    """Load the LoRA adapter at ``path`` (a directory with ``adapter_model.safetensors`` and
    ``adapter_config.json``, as ``peft`` writes them; local, S3, HTTP or the Hub) into adapter
    ``adapter_name`` of the PEFT model ``model``, in place; every rank calls it.

    ``model`` is wrapped already (``get_peft_model(base, read_adapter_config(path))``) and sharded
    as it will train (FSDP2, TP through :func:`parallelize_lora`): each rank reads only the byte
    ranges of its own shards of ``lora_A`` / ``lora_B``. The values are bit for bit those of
    ``PeftModel.from_pretrained`` (cast to the parameters' dtypes as ``load_state_dict`` would).

    Every check runs before a byte is written, so a refused adapter leaves the model as it was:
    a missing ``adapter_config.json`` (:class:`CheckpointNotFoundError`), another ``peft_type``
    (:class:`CheckpointFormatError`), an adapter for another base class
    (:class:`ArchitectureMismatchError`), file tensors the model lacks (:class:`UnexpectedKeysError`),
    LoRA tensors the file lacks (:class:`MissingKeysError`), other shapes (:class:`MappingError`);
    each names the file, the key and why. So is a trainable adapter tensor that ``fully_shard``
    does not shard (:class:`LayoutError`: the adapter was added after FSDP2, which would not reduce
    its gradients). ``reader`` may be given to read its statistics afterwards; ``load_options`` go
    to :func:`~hp_dcp_hf.load_hf_checkpoint`. As peft's ``load_adapter``, a frozen adapter (its
    config's ``inference_mode``, ``read_adapter_config``'s default) puts the model in ``eval()``.
    """
    path = os.fspath(path)
    names, dropped = adapter_names_and_dropped(model, adapter_name, save_embedding_layers=True)
    names = {key: value for key, value in names.items() if key not in dropped}  # as peft's load: into nothing
    required = frozenset(adapter_keys(model, adapter_name, save_embedding_layers=False)) - dropped
    if not required:
        raise ArgumentError(f"adapter {adapter_name!r} of the model has no tensors to load")
    _check_fsdp_manages(model, names)
    location, single = locate(*filesystem(path, storage_options))
    if single is not None:
        raise ArgumentError(f"pass the adapter's directory, not the file {single!r}", file=path)
    stored = read_adapter_config(path, storage_options)
    check_adapter_config(model, adapter_name, stored, location.url(ADAPTER_CONFIG))
    if not location.exists(ADAPTER_WEIGHTS):
        raise CheckpointNotFoundError("the adapter has no adapter_model.safetensors", file=location.url(ADAPTER_WEIGHTS))
    weights = adapter_file(path, ADAPTER_WEIGHTS)
    view = AdapterTensors(model, names)
    planner = _AdapterLoadPlanner(view, location.url(ADAPTER_WEIGHTS), frozenset(names) - required,
                                  claimed_source_keys=dropped)
    reader = reader if reader is not None else HFStorageReader(weights, storage_options=storage_options)
    report = load_hf_checkpoint(view, weights, reader=reader, planner=planner, **load_options)
    if lora_config(model, adapter_name).inference_mode:
        model.eval()  # as peft's load_adapter(is_trainable=False): a frozen adapter is for inference
    return report
