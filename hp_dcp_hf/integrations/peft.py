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

import copy
import dataclasses
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem, SavePlan
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

from hp_dcp_hf.errors import (
    ArchitectureMismatchError,
    ArgumentError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    LayoutError,
    MappingError,
    MissingKeysError,
    PlanningError,
    UnexpectedKeysError,
)
from hp_dcp_hf.load.api import load_hf_checkpoint
from hp_dcp_hf.load.planner import HFMappingPlanner, LoadReport, describe_keys
from hp_dcp_hf.mapping.families import natural_sorted
from hp_dcp_hf.save.api import save_hf_checkpoint
from hp_dcp_hf.save.planner import HFSavePlanner
from hp_dcp_hf.storage import HFStorageReader, filesystem, locate
from hp_dcp_hf.storage.format.header import MAX_HEADER_BYTES
from hp_dcp_hf.storage.format.journal import Journal, Step
from hp_dcp_hf.storage.format.json_file import read_json
from hp_dcp_hf.storage.write.writer import HFStorageWriter

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

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft.utils.constants.SAFETENSORS_WEIGHTS_NAME
ADAPTER_CONFIG = "adapter_config.json"  # peft.utils.constants.CONFIG_NAME
_ONE_FILE = 2**62  # max_shard_size: peft writes every adapter into one file


def _peft():
    """``peft``, imported on use: the rest of the package does not depend on it."""
    try:
        import peft
    except ImportError as e:  # pragma: no cover - the dev install has it
        raise ArgumentError("PEFT adapters need the peft package (pip install peft)") from e
    return peft


# -- names ---------------------------------------------------------------------------------------


def _peft_config(model: nn.Module, adapter_name: str) -> Any:
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


@contextmanager
def _tp_marker_hidden(model: nn.Module) -> Iterator[None]:
    """For the block, no module of ``model`` carries transformers' ``_tp_size`` (set by
    ``distributed_config=``): with it, peft's ``get_peft_model_state_dict`` gathers every tensor
    of the state dict it is given (transformers' ``gather_state_dict_for_save``), and the names are
    all it is asked for here."""
    marked = [(module, module.__dict__["_tp_size"]) for module in model.modules()
              if module.__dict__.get("_tp_size")]
    for module, _ in marked:
        module.__dict__["_tp_size"] = None
    try:
        yield
    finally:
        for module, size in marked:
            module.__dict__["_tp_size"] = size


def _adapter_names(model: nn.Module, adapter_name: str,
                   save_embedding_layers: bool | str) -> tuple[dict[str, str], frozenset[str]]:
    """peft's file names of the adapter's tensors -> the model keys they are saved from, and the
    file names peft's load drops (it loads them into no tensor of the model)."""
    peft = _peft()
    _peft_config(model, adapter_name)
    state = model.state_dict()
    placeholders = {key: torch.empty(0, device="meta") for key in state}
    by_id = {id(t): key for key, t in placeholders.items()}
    with _tp_marker_hidden(model):
        selected = peft.get_peft_model_state_dict(model, state_dict=placeholders, adapter_name=adapter_name,
                                                  save_embedding_layers=save_embedding_layers)
    names = {}
    for file_key, tensor in selected.items():
        model_key = by_id.get(id(tensor))
        if model_key is None:  # a tensor peft made rather than selected: no byte range of the model holds it
            raise PlanningError("peft's adapter state dict holds a tensor that is none of the model's",
                                key=file_key)
        names[file_key] = model_key
    loaded = _peft_load_keys(model, list(names), adapter_name)
    dropped = frozenset(f for f in names if loaded.get(f) not in state)
    wrong = [(f, names[f], loaded[f]) for f in names if f not in dropped and loaded[f] != names[f]]
    if wrong:
        file_key, saved_from, loaded_into = wrong[0]
        raise PlanningError(f"peft saves {saved_from!r} under this name but loads the name into {loaded_into!r}",
                            key=file_key)
    return {key: names[key] for key in natural_sorted(names)}, dropped


def adapter_keys(model: nn.Module, adapter_name: str = "default", *,
                 save_embedding_layers: bool | str = "auto") -> dict[str, str]:
    """The adapter's tensors as ``peft`` names them in ``adapter_model.safetensors``, each mapped to
    the key of the model's state dict that holds it, in the file's natural order.

    The names are peft's own: ``get_peft_model_state_dict`` (what ``save_pretrained`` writes) runs
    over placeholders of the model's state dict, so no tensor is touched or gathered (also not on a
    model that ``distributed_config=`` marked tensor-parallel), and every name is checked against
    what ``set_peft_model_state_dict`` maps it back to. A disagreement is a :class:`PlanningError`:
    loading and saving would not be inverses. A name peft's load puts into no tensor of the model is
    kept (``save_pretrained`` writes it): with ``save_embedding_layers=True`` and an embedding in
    ``modules_to_save``, peft also writes ``lm_head.modules_to_save.weight``, which its load drops.
    """
    return _adapter_names(model, adapter_name, save_embedding_layers)[0]


def _peft_load_keys(model: nn.Module, file_keys: list[str], adapter_name: str) -> dict[str, str]:
    """Where ``set_peft_model_state_dict`` puts each of ``file_keys`` (its key steps only: the
    auxiliary wrappers' load maps, then the tuner's remap, then the prefix rule)."""
    _peft()
    from peft.utils.other import AuxiliaryTrainingWrapper
    from peft.utils.save_and_load import PEFT_TYPE_TO_TUNER_MAPPING

    config = model.peft_config[adapter_name]
    state = {key: key for key in file_keys}
    for name, module in model.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper):
            key_map = module.adapter_state_dict_load_map(adapter_name)
            for k, stored in key_map.items():
                lookup = f"{name}.{k}"
                if lookup in state:
                    state[f"{name}.{stored}"] = state.pop(lookup)
    tuner = PEFT_TYPE_TO_TUNER_MAPPING[config.peft_type]
    placeholders = {key: torch.empty(0, device="meta") for key in state}
    remapped = tuner._remap_adapter_state_dict_for_load(model=model, config=config, adapter_name=adapter_name,
                                                        state_dict=placeholders)
    by_id = {id(t): key for key, t in placeholders.items()}
    prefix = "base_model.model."
    requires_prefix = any(n.startswith(prefix) for n, _ in model.named_parameters())
    out = {}
    for model_key, tensor in remapped.items():
        if not requires_prefix:
            model_key = model_key.removeprefix(prefix)
        out[state[by_id[id(tensor)]]] = model_key
    return out


class AdapterTensors(nn.Module):
    """The adapter's tensors of ``model`` under their ``adapter_model.safetensors`` names: what the
    planners load into and save from, so that their checkpoint mapping is the identity.

    Not a copy: ``state_dict()`` hands out the model's own tensors (its DTensors, as sharded), and
    ``named_parameters()`` its parameters, under the file's names.
    """

    def __init__(self, model: nn.Module, names: Mapping[str, str]) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a submodule: its state is not this module's
        self.names = dict(names)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        full = self._model.state_dict()
        return {file_key: full[model_key] for file_key, model_key in self.names.items()}

    def _own(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        # Each tensor under its first name only: peft writes tied tensors (a tied lm_head saved with
        # the embeddings) under every name, so here they are not aliases of one another, and each
        # name is a tensor of the file of its own.
        by_key, seen = dict(tensors), set()
        for file_key, model_key in self.names.items():
            if model_key in by_key and id(by_key[model_key]) not in seen:
                seen.add(id(by_key[model_key]))
                yield file_key, by_key[model_key]

    def named_parameters(self, prefix: str = "", recurse: bool = True,  # type: ignore[override]
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self._own(self._model.named_parameters(remove_duplicate=False))

    def named_buffers(self, prefix: str = "", recurse: bool = True,  # type: ignore[override]
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._own(self._model.named_buffers(remove_duplicate=False))


# -- adapter_config.json -------------------------------------------------------------------------


def _join(path: str, name: str) -> str:
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
    peft = _peft()
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


def _base_model_class(model: nn.Module, config: Any) -> type:
    """The base model's class as ``save_pretrained`` names it in ``auto_mapping`` (the class
    before FSDP2 wrapped it)."""
    from torch.distributed.fsdp import FSDPModule

    cls = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule)) if issubclass(cls, FSDPModule) else cls


def adapter_config_text(model: nn.Module, adapter_name: str = "default") -> str:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it for ``model``: the adapter's
    config in inference mode, the base model's ``name_or_path`` when the config has none, the
    ``auto_mapping`` of the base class (the unsharded one), through ``PeftConfig.save_pretrained``."""
    config = copy.deepcopy(_peft_config(model, adapter_name))
    if config.base_model_name_or_path is None:
        base = model.base_model if config.is_prompt_learning else model.base_model.model
        config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    auto_mapping = None
    if config.task_type is None:
        cls = _base_model_class(model, config)
        auto_mapping = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    with tempfile.TemporaryDirectory() as directory:
        config.save_pretrained(directory, auto_mapping_dict=auto_mapping)
        with open(os.path.join(directory, ADAPTER_CONFIG), encoding="utf-8") as handle:
            return handle.read()


def _check_config(model: nn.Module, adapter_name: str, stored: Any, file: str) -> None:
    """The adapter at ``file`` is for this model: a LoRA adapter, for its base class."""
    if str(stored.peft_type) not in ("LORA", "PeftType.LORA"):
        raise CheckpointFormatError(f"a {stored.peft_type} adapter: only LoRA adapters are supported", file=file,
                                    key="peft_type")
    mine = _peft_config(model, adapter_name)
    named = (getattr(stored, "auto_mapping", None) or {}).get("base_model_class")
    base = _base_model_class(model, mine).__name__
    if named and named != base:
        raise ArchitectureMismatchError(f"the adapter is for a {named}, the model's base is a {base}", file=file,
                                        key="auto_mapping.base_model_class")


# -- load ----------------------------------------------------------------------------------------


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
    names, dropped = _adapter_names(model, adapter_name, save_embedding_layers=True)
    names = {key: value for key, value in names.items() if key not in dropped}  # as peft's load: into nothing
    required = frozenset(adapter_keys(model, adapter_name, save_embedding_layers=False)) - dropped
    if not required:
        raise ArgumentError(f"adapter {adapter_name!r} of the model has no tensors to load")
    _check_fsdp_manages(model, names)
    location, single = locate(*filesystem(path, storage_options))
    if single is not None:
        raise ArgumentError(f"pass the adapter's directory, not the file {single!r}", file=path)
    stored = read_adapter_config(path, storage_options)
    _check_config(model, adapter_name, stored, location.url(ADAPTER_CONFIG))
    if not location.exists(ADAPTER_WEIGHTS):
        raise CheckpointNotFoundError("the adapter has no adapter_model.safetensors", file=location.url(ADAPTER_WEIGHTS))
    weights = _join(path, ADAPTER_WEIGHTS)
    view = AdapterTensors(model, names)
    planner = _AdapterLoadPlanner(view, location.url(ADAPTER_WEIGHTS), frozenset(names) - required,
                                  claimed_source_keys=dropped)
    reader = reader if reader is not None else HFStorageReader(weights, storage_options=storage_options)
    report = load_hf_checkpoint(view, weights, reader=reader, planner=planner, **load_options)
    if _peft_config(model, adapter_name).inference_mode:
        model.eval()  # as peft's load_adapter(is_trainable=False): a frozen adapter is for inference
    return report


# -- save ----------------------------------------------------------------------------------------


class AdapterStorageWriter(HFStorageWriter):
    """:class:`~hp_dcp_hf.storage.HFStorageWriter` laying out the one file ``peft`` writes,
    ``adapter_model.safetensors`` (no index), and publishing it with ``adapter_config.json``
    through the same journaled switch as every save (:mod:`hp_dcp_hf.storage.format.journal`): the
    weights file is the entry, committed last; when the config changes, the old weights file is
    removed before the new config is written, so no reader pairs a new config with old weights."""

    def __init__(self, path: str | os.PathLike, *, config_text: str, **options: Any) -> None:
        options.setdefault("max_shard_size", _ONE_FILE)
        super().__init__(path, **options)
        self.config_text = config_text

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        plan = super().prepare_local_plan(plan)
        if self.index is not None or len(self.files) != 1:
            raise PlanningError(f"an adapter is one file, the layout has {len(self.files)}", file=self.path)
        file = self.files[0]
        self.files = [dataclasses.replace(file, name=ADAPTER_WEIGHTS, tensors=tuple(
            dataclasses.replace(t, file=ADAPTER_WEIGHTS) for t in file.tensors))]
        self.tensors = {t.key: t for t in self.files[0].tensors}
        self.extra_files = {ADAPTER_CONFIG: self.config_text}
        return plan

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        """Coordinator, once every rank wrote: publish the adapter (one journaled switch)."""
        self.check_all_written(results)
        assert self.staged is not None
        staged, destination = self.staged, self.destination
        destination.check_staged(staged, self.files)
        existing = destination.list_names()
        texts = destination.published_texts(self.extra_files, existing)
        changed = {name: text for name, text in sorted(self.extra_files.items()) if texts.get(name) != text}
        steps = [Step("remove", ADAPTER_WEIGHTS)] if changed and ADAPTER_WEIGHTS in existing else []
        steps += [Step("write", name, text) for name, text in changed.items()]
        steps.append(Step("commit", staged.names[ADAPTER_WEIGHTS]))
        destination.carry_out(staged, Journal(staged.save_id, tuple(steps), staged.published_handles()))
        self.staged = None

    def saved(self) -> bool:
        return self.save_id is not None and self.destination.save_id_of(ADAPTER_WEIGHTS) == self.save_id


def save_peft_adapter(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    adapter_name: str = "default",
    save_embedding_layers: bool | str = "auto",
    writer: AdapterStorageWriter | None = None,
    planner: HFSavePlanner | None = None,
    **storage_options: Any,
) -> None:
    """Write adapter ``adapter_name`` of the (sharded) PEFT model ``model`` as ``peft``'s
    ``save_pretrained`` writes it for the unsharded adapter: ``adapter_model.safetensors`` (the
    same keys, dtypes and bits) and ``adapter_config.json``, into ``path`` (or ``path/<adapter_name>``
    for another adapter than ``"default"``, as peft does); every rank calls it.

    Every rank writes the bytes of its own shards at their final offsets (a replicated tensor by one
    of its replicas), nothing is gathered, and the files appear together only once every rank has
    written (:class:`AdapterStorageWriter`). The safetensors header carries the save's id next to
    ``"format": "pt"``; peft's README.md model card is not written.
    """
    names = adapter_keys(model, adapter_name, save_embedding_layers=save_embedding_layers)
    if not names:
        raise ArgumentError(f"adapter {adapter_name!r} of the model has no tensors to save")
    directory = os.fspath(path) if adapter_name == "default" else _join(os.fspath(path), adapter_name)
    view = AdapterTensors(model, names)
    planner = planner or HFSavePlanner(view, weights_mapping=[])
    writer = writer or AdapterStorageWriter(directory, config_text=adapter_config_text(model, adapter_name),
                                            **storage_options)
    save_hf_checkpoint(view, directory, weights_mapping=[], writer=writer, planner=planner)


# -- tensor parallelism --------------------------------------------------------------------------


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


# -- an adapter inside the parallelization (from_pretrained's adapter=) ----------------------------


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

    peft = _peft()
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
    _peft()
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
    _peft()
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
