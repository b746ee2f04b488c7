"""``from_pretrained``: build, rewrite, parallelize and load a Hugging Face model in three stages.

1. **skeleton**: the config comes from the checkpoint's ``config.json``, read through the storage
   layer (so any path the reader takes works here too); the model class from ``model_cls`` or the
   config's ``architectures`` (else transformers' ``AutoModelForCausalLM`` / ``AutoModel``
   mappings); the model is built on the ``meta`` device, weights tied. The checkpoint mapping
   (transformers' conversion mapping) is taken from this skeleton, before anything renames it.
2. **rewrite + parallelize**: every transform rewrites the model in place and records its
   weight-mapping stage (:mod:`hp_dcp_hf.transforms`); then the user's ``parallelize(model)``
   (tensor parallelism with ``parallelize_module``, FSDP2 ``fully_shard``, ...) leaves its layout
   on every parameter. ``distributed_config=`` applies the TP / EP / FSDP / HSDP plans transformers
   ships for the model's class (:class:`hp_dcp_hf.parallel.TransformersPlans`).
3. **materialize + load + finalize**: ``model.to_empty(device=...)`` allocates the local shards,
   :func:`hp_dcp_hf.load_hf_checkpoint` fills them (each rank reads only what its shards need),
   and what the checkpoint did not fill is initialized by the model's own init, exactly as
   transformers does in its ``from_pretrained``: loaded tensors are marked ``_is_hf_initialized``
   and ``model.initialize_weights()`` runs, which recomputes non-persistent buffers (rotary
   ``inv_freq`` / ``original_inv_freq`` through the rotary class' rope init function,
   ``position_ids``, ...) and initializes missing keys (``strict=False``). Before that every such
   floating tensor is filled with NaN, so a tensor the init does not reach is an error, not garbage.
   Finally ties are checked (re-tied if materialization broke them) and the model is put in
   ``eval()`` mode.

With ``adapter=`` (a PEFT LoRA adapter) the model is wrapped by peft after TP and EP and before
FSDP, the base checkpoint loads into the base's tensors (through the module tree it had before
peft, :func:`hp_dcp_hf.integrations.peft.base_model_tree`) and the adapter into the adapter's: the
result is ``PeftModel.from_pretrained(base, adapter, is_trainable=...)``, sharded.

``from_pretrained`` returns ``(model, report)``; ``report`` is a :class:`PretrainedLoadReport`, a
:class:`~hp_dcp_hf.LoadReport` with what finalization initialized, this rank's plan and read
statistics and the time of every stage.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hp_dcp_hf.api import Loader, load_hf_checkpoint
from hp_dcp_hf.errors import (
    ArchitectureMismatchError,
    ArgumentError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    HPDCPHFError,
    PlanningError,
)
from hp_dcp_hf.layout import local_tensor
from hp_dcp_hf.model_dtype import AUTO, DtypeSpec, resolve_dtype
from hp_dcp_hf.planner import HFMappingPlanner, LoadReport, PlanStats, Unexpected
from hp_dcp_hf.storage import HFStorageReader, filesystem, locate
from hp_dcp_hf.storage.format.header import MAX_HEADER_BYTES
from hp_dcp_hf.storage.transport.stats import FileStats

__all__ = [
    "CONFIG_FILE",
    "PipelineError",
    "PretrainedLoadReport",
    "apply_transforms",
    "build_skeleton",
    "check_architecture",
    "checkpoint_mapping",
    "finalize",
    "from_pretrained",
    "materialize",
    "read_config",
    "resolve_model_class",
    "resolve_transform",
]

CONFIG_FILE = "config.json"

logger = logging.getLogger(__name__)

Transform = Callable[[nn.Module], "nn.Module | None"] | str


class PipelineError(HPDCPHFError):
    """A stage of :func:`from_pretrained` cannot run: no config, no model class, a bad transform."""


@dataclass(frozen=True)
class PretrainedLoadReport(LoadReport):
    """What :func:`from_pretrained` did on this rank; a :class:`~hp_dcp_hf.LoadReport` plus more.

    ``seconds`` has the wall time of each stage: ``skeleton``, ``transforms``, ``parallelize``,
    ``materialize``, ``load`` (with its phases ``metadata``, ``plan``, ``read``, ``copy``, ``exchange``), then
    ``finalize`` and, with ``adapter=``, ``adapter``."""

    initialized_keys: tuple[str, ...] = ()
    """Model tensors the model's own init filled: missing keys and non-persistent buffers."""
    loader: str = "dcp"
    plan: PlanStats = field(default_factory=PlanStats)
    """This rank's plan: targets, read items, bytes needed, deferred groups."""
    read: FileStats = field(default_factory=FileStats)
    """What this rank's reader read, over all files (header traffic included)."""
    layout: tuple[str, ...] = ()
    """What the parallelization did (its ``applied`` lines, when it has them)."""
    unsharded: tuple[Any, ...] = ()
    """What a requested mesh dim left whole, and why (:class:`hp_dcp_hf.parallel.Unsharded`)."""
    adapter: LoadReport | None = None
    """The load of ``adapter=`` (its ``adapter_model.safetensors`` keys), when one was given."""


# -- stage 1 -----------------------------------------------------------------------------------


def read_config(path: str, storage_options: Mapping[str, Any] | None = None):
    """The ``PretrainedConfig`` of the checkpoint at ``path`` (its directory's ``config.json``).

    Read through :mod:`hp_dcp_hf.storage`, so local paths and fsspec URLs work alike.
    """
    from transformers import CONFIG_MAPPING

    location, _ = locate(*filesystem(path, storage_options))
    if not location.exists(CONFIG_FILE):
        raise CheckpointNotFoundError(
            "the checkpoint has no config.json; pass from_pretrained(..., config=<a PretrainedConfig>)", file=location.path(CONFIG_FILE)
        )
    size = location.size(CONFIG_FILE)
    if size > MAX_HEADER_BYTES:
        raise CheckpointFormatError(f"{size} bytes exceeds the {MAX_HEADER_BYTES}-byte cap", file=CONFIG_FILE)
    with location.open(CONFIG_FILE) as handle:
        raw = handle.read(0, size)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"not JSON: {e}", file=CONFIG_FILE) from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise CheckpointFormatError("config.json has no model_type", file=CONFIG_FILE)
    if data["model_type"] not in CONFIG_MAPPING:
        raise CheckpointFormatError(
            f"model_type {data['model_type']!r} is unknown to transformers", file=CONFIG_FILE
        )
    config_class = CONFIG_MAPPING[data["model_type"]]
    # As AutoConfig reads it: floats JSON cannot hold are stored as {"__float__": "Infinity"}.
    config = config_class.from_dict(config_class._decode_special_floats(data))
    config.name_or_path = path  # as from_pretrained names it (model.name_or_path; peft's base_model_name_or_path)
    return config


def resolve_model_class(config, model_cls: type[nn.Module] | None = None) -> type[nn.Module]:
    """``model_cls``, else the first of ``config.architectures`` transformers has, else the
    ``AutoModelForCausalLM`` then ``AutoModel`` class of the config."""
    if model_cls is not None:
        return model_cls
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            return auto._model_mapping[type(config)]
        except (KeyError, ValueError):
            continue
    raise PipelineError(
        f"no model class for {type(config).__name__} (architectures={getattr(config, 'architectures', None)}); "
        "pass model_cls="
    )


def check_architecture(config, model_cls: type[nn.Module]) -> None:
    """Refuse a class of another model type than ``config``'s (a Llama class for a Mixtral
    checkpoint), naming both, instead of failing later in the constructor or as missing keys."""
    expected = getattr(getattr(model_cls, "config_class", None), "model_type", "")
    types = {config.model_type} | {getattr(getattr(config, name, None), "model_type", None)
                                   for name in getattr(config, "sub_configs", {})}
    if expected and expected not in types and model_cls.__name__ not in _classes_for(config):
        raise ArchitectureMismatchError(
            f"the checkpoint is a {config.model_type!r} model (architectures "
            f"{getattr(config, 'architectures', None)}), {model_cls.__name__} a {expected!r} one; pass a "
            f"{config.model_type!r} class as model_cls=, or none to use the config's",
            file=CONFIG_FILE,
        )


def _classes_for(config) -> set[str]:
    """The class names transformers itself builds for ``config``: its ``architectures`` and the
    auto mappings' classes for its model type (``exaone`` is served by ``LlamaForCausalLM``)."""
    from transformers.models.auto import modeling_auto

    names = set(getattr(config, "architectures", None) or ())
    for attribute in dir(modeling_auto):
        if attribute.startswith("MODEL_") and attribute.endswith("_MAPPING_NAMES"):
            served = getattr(modeling_auto, attribute).get(config.model_type, ())
            names.update((served,) if isinstance(served, str) else served)
    return names


def _checkpoint_dtypes(reader: HFStorageReader) -> Iterable[torch.dtype]:
    return (md.properties.dtype for md in reader.read_metadata().state_dict_metadata.values())


def checkpoint_mapping(model: nn.Module) -> list:
    """Stage 1.5: the checkpoint -> canonical-model mapping (transformers' conversion mapping for
    the model type), taken from the skeleton *before* rewrites and parallelization change it:
    FSDP2 renames the class (``FSDPGteModel``), which hides transformers' class-keyed mappings."""
    from hp_dcp_hf.mapping.stages import model_stages

    return list(model_stages(model, None)[0])


def build_skeleton(
    config,
    model_cls: type[nn.Module],
    *,
    dtype: torch.dtype = torch.float32,
    model_kwargs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Stage 1: the canonical, unparallelized model on the meta device, tied weights tied.

    A ``quantization_config`` describes the checkpoint, not this model (its parameters are
    ``dtype``; the planner dequantizes on load): the model's config goes without it.
    """
    kwargs = dict(model_kwargs or {})
    if getattr(config, "quantization_config", None) is not None:
        config = copy.deepcopy(config)
        del config.quantization_config
    with torch.device("meta"):
        if hasattr(model_cls, "_from_config"):
            model = model_cls._from_config(config, dtype=dtype, **kwargs)
        else:
            model = model_cls(config, **kwargs).to(dtype)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


# -- stage 2 -----------------------------------------------------------------------------------


def resolve_transform(transform: Transform) -> Callable[[nn.Module], nn.Module | None]:
    """A rewrite: a callable, or the name of one in :mod:`hp_dcp_hf.transforms` (``"fuse_qkv"``)."""
    if callable(transform):
        return transform
    from hp_dcp_hf import transforms

    fn = getattr(transforms, str(transform), None)
    if not callable(fn) or str(transform).startswith("_") or isinstance(fn, type):
        known = ", ".join(n for n in getattr(transforms, "__all__", ()) if n[:1].islower())
        raise PipelineError(f"unknown transform {transform!r}; known: {known}")
    return fn


def apply_transforms(model: nn.Module, transforms: Iterable[Transform]) -> nn.Module:
    """Stage 2a: run every rewrite in order (each records its weight-mapping stage)."""
    for transform in transforms:
        out = resolve_transform(transform)(model)
        model = out if isinstance(out, nn.Module) else model
    return model


# -- stage 3 -----------------------------------------------------------------------------------


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def _tie_groups(model: nn.Module) -> list[tuple[str, str]]:
    """``(tied, source)`` name pairs transformers declares (``all_tied_weights_keys``)."""
    pairs = getattr(model, "all_tied_weights_keys", None) or {}
    return [(a, b) for a, b in pairs.items() if isinstance(a, str) and isinstance(b, str)]


def materialize(model: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """Stage 3a: allocate every local shard on ``device`` (values undefined until loaded)."""
    model.to_empty(device=device)
    retie(model)
    return model


def retie(model: nn.Module) -> bool:
    """Re-tie declared tied weights that are no longer the same tensor; True when it had to."""
    broken = False
    for tied, source in _tie_groups(model):
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
def finalize(model: nn.Module, report: LoadReport, *, seed: int | None = None) -> tuple[str, ...]:
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
    from hp_dcp_hf.layout import local_shard_pieces

    loaded = set(report.loaded_keys)
    by_id: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, tensor in _named_tensors(model):
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


def from_pretrained(
    path_or_repo: str,
    *,
    model_cls: type[nn.Module] | None = None,
    config=None,
    dtype: DtypeSpec = AUTO,
    transforms: Sequence[Transform] = (),
    distributed_config: Any = None,
    parallelize: Callable[[nn.Module], nn.Module | None] | None = None,
    loader: Loader = "dcp",
    strict: bool = True,
    unexpected: Unexpected = "warn",
    device: str | torch.device = "cpu",
    model_kwargs: Mapping[str, Any] | None = None,
    reader: HFStorageReader | None = None,
    planner_cls: type[HFMappingPlanner] = HFMappingPlanner,
    weights_mapping: Sequence[Any] | None = None,
    init_seed: int | None = None,
    adapter: str | os.PathLike | None = None,
    is_trainable: bool = False,
    **reader_options: Any,
) -> tuple[nn.Module, PretrainedLoadReport]:
    """Build, rewrite, parallelize and load a Hugging Face checkpoint; every rank calls it.

    Args:
        path_or_repo: the checkpoint (anything :class:`HFStorageReader` takes); its directory holds
            ``config.json`` unless ``config`` is given.
        model_cls: the class to build; default from the config's ``architectures``.
        config: a ``PretrainedConfig`` instead of the checkpoint's ``config.json``.
        dtype: the model's dtype (checkpoint tensors are cast on load): a ``torch.dtype``, its name, or
            ``"auto"`` (the default, as in transformers 5): the config's ``dtype``, else the
            checkpoint's first floating-point dtype (:mod:`hp_dcp_hf.model_dtype`).
        transforms: rewrites, callables or names in :mod:`hp_dcp_hf.transforms`, applied in order.
        distributed_config: a transformers ``DistributedConfig`` (``tp_size``, ``ep_size``,
            ``fsdp_size``, ``dp_replicate_size``, ``tp_plan`` / ``ep_plan`` / ``fsdp_plan``
            overrides) or a mesh spec (``"dp=2,tp=2"``, see :mod:`hp_dcp_hf.parallel.mesh`): the
            model is parallelized with the plans transformers ships for its class
            (:class:`hp_dcp_hf.parallel.TransformersPlans`); what a dim left whole is warned about
            and listed in ``report.unsharded``.
        parallelize: ``fn(model)`` that shards the model in place, a framework's own recipe
            (instead of ``distributed_config``).
        loader: ``"dcp"`` reads only the bytes this rank's shards need; ``"legacy"`` whole tensors.
        strict: raise when the checkpoint does not make a model tensor; with ``False`` those
            tensors get the model's own init (``report.missing_keys``, ``report.initialized_keys``).
        unexpected: checkpoint tensors no model tensor is made from (``report.unexpected_keys``):
            ``"warn"`` once on rank 0, ``"raise"`` :class:`~hp_dcp_hf.errors.UnexpectedKeysError`
            before any read, ``"ignore"`` (a pipeline stage). Those the class declares ignorable
            (``_keys_to_ignore_on_load_unexpected``) are never warned about.
        device: where local shards are allocated.
        model_kwargs: extra arguments of the model constructor (``attn_implementation=`` ...).
        reader: a ready :class:`HFStorageReader` (``reader_options`` must then be empty).
        planner_cls: the planner class (a subclass can observe the load, e.g. a progress bar).
        weights_mapping: the checkpoint -> canonical mapping (transformers ``WeightRenaming`` /
            ``WeightConverter``); default: transformers' own for the skeleton, taken in stage 1.
        init_seed: seed of the init of missing keys (``strict=False``); default: drawn from the
            global RNG (seed every rank alike). Sharded ones are initialized whole, so replicas agree.
        adapter: a PEFT LoRA adapter (a directory with ``adapter_config.json`` and
            ``adapter_model.safetensors``; local, S3, HTTP, the Hub, read with the checkpoint's
            ``storage_options``) to apply and load, as
            ``PeftModel.from_pretrained(model, adapter)`` does: the model is wrapped with peft's
            ``get_peft_model`` after TP and EP and before FSDP (the LoRA layers sharded as their
            base layers, :func:`~hp_dcp_hf.integrations.peft.parallelize_lora`, and then by FSDP2
            with the rest), the base checkpoint loads into the base tensors and the adapter into
            the adapter's; the returned model is the ``PeftModel``, ``report.adapter`` the adapter's
            load. With ``parallelize=`` the adapter is added after it, so the recipe must not call
            ``fully_shard`` (a :class:`~hp_dcp_hf.errors.LayoutError`).
        is_trainable: ``PeftModel.from_pretrained``'s: ``False`` (the default) freezes every
            tensor, the adapter's too; ``True`` trains the adapter's (LoRA, ``modules_to_save``),
            the base frozen.
        **reader_options: :class:`HFStorageReader` options (``storage_options``,
            ``coalesce_gap``, ``num_threads``, ...).

    Returns:
        ``(model, report)``: the loaded model in ``eval()`` mode and a :class:`PretrainedLoadReport`.
    """
    if reader is not None and reader_options:
        raise ValueError(f"pass reader= or reader options, not both (got {sorted(reader_options)})")
    adapted: list[nn.Module] = []  # the PEFT model, once the adapter is added

    def add_adapter(base: nn.Module) -> None:
        from hp_dcp_hf.integrations.peft import wrap_with_adapter

        adapted.append(wrap_with_adapter(base, adapter_config))

    if adapter is not None:
        from hp_dcp_hf.integrations.peft import read_adapter_config

        adapter_options = reader_options.get("storage_options")  # the adapter's store is the checkpoint's
        adapter_config = read_adapter_config(adapter, adapter_options, is_trainable=is_trainable)
    elif is_trainable:
        raise ArgumentError("is_trainable= says whether the adapter trains: pass adapter= too")
    if distributed_config is not None:
        if parallelize is not None:
            raise ValueError("pass distributed_config= or parallelize=, not both")
        from hp_dcp_hf.parallel import TransformersPlans

        parallelize = TransformersPlans(distributed_config, before_fsdp=add_adapter if adapter is not None else None)
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[stage] = now - clock
        clock = now

    reader = reader if reader is not None else HFStorageReader(path_or_repo, **reader_options)
    if config is None:
        logger.info("reading the config of %s", path_or_repo)
        config = read_config(path_or_repo, reader.storage_options)
    model_cls = resolve_model_class(config, model_cls)
    check_architecture(config, model_cls)
    dtype = resolve_dtype(dtype, config, lambda: _checkpoint_dtypes(reader))
    logger.info("building %s (%s) on the meta device", model_cls.__name__, dtype)
    model = build_skeleton(config, model_cls, dtype=dtype, model_kwargs=model_kwargs)
    mapping = list(weights_mapping) if weights_mapping is not None else checkpoint_mapping(model)
    lap("skeleton")
    if transforms:
        logger.info("rewriting: %s", ", ".join(getattr(t, "__name__", str(t)) for t in transforms))
    model = apply_transforms(model, transforms)
    lap("transforms")
    if parallelize is not None:
        logger.info("parallelizing")
        out = parallelize(model)
        model = out if isinstance(out, nn.Module) else model
    if adapter is not None and not adapted:
        add_adapter(model)  # after parallelize= (or none): refused on a model fully_shard sharded already
    lap("parallelize")
    logger.info("allocating the local shards on %s", device)
    materialize(adapted[0] if adapted else model, device)
    lap("materialize")
    if adapted:
        from hp_dcp_hf.integrations.peft import base_model_tree
    with base_model_tree(adapted[0]) if adapted else contextlib.nullcontext(model) as model:
        retie(model)  # the base's tied names: the PEFT model's tree hides them
        planner = planner_cls(model, weights_mapping=mapping, strict=strict, unexpected=unexpected,
                              trace=loader == "dcp")
        base = load_hf_checkpoint(model, path_or_repo, loader=loader, reader=reader, planner=planner)
        lap("load")
        seconds.update(base.seconds)
        initialized = finalize(model, base, seed=init_seed)
        retie(model)
        model.eval()  # the base; the adapter's layers as peft leaves them
    lap("finalize")
    adapter_report = None
    if adapted:
        from hp_dcp_hf.integrations.peft import load_peft_adapter

        logger.info("loading the adapter %s", adapter)
        model = adapted[0]
        adapter_report = load_peft_adapter(model, adapter, storage_options=adapter_options)  # a frozen one puts the model in eval(), as peft's
        lap("adapter")
    report = PretrainedLoadReport(
        base.loaded_keys,
        base.missing_keys,
        base.unexpected_keys,
        initialized_keys=initialized,
        loader=loader,
        plan=planner.stats,
        read=reader.stats.total(),
        seconds=seconds,
        layout=tuple(getattr(parallelize, "applied", ())),
        unsharded=tuple(getattr(parallelize, "unsharded", ())),
        adapter=adapter_report,
    )
    return model, report
