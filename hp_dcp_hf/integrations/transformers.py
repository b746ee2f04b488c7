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
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hp_dcp_hf.errors import ArgumentError, PipelineError
from hp_dcp_hf.load.api import Loader, load_hf_checkpoint
from hp_dcp_hf.load.planner import HFMappingPlanner, LoadReport, PlanStats, Unexpected
from hp_dcp_hf.model.config import check_architecture, read_config, resolve_model_class
from hp_dcp_hf.model.dtype import AUTO, DtypeSpec, resolve_dtype
from hp_dcp_hf.model.finalize import finalize, materialize, retie
from hp_dcp_hf.model.skeleton import build_skeleton, checkpoint_mapping
from hp_dcp_hf.storage import HFStorageReader
from hp_dcp_hf.storage.transport.stats import FileStats
from hp_dcp_hf.sync.verify import VerifyReport, verify_against_checkpoint

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PretrainedLoadReport", "apply_transforms", "from_pretrained", "resolve_transform"]

logger = logging.getLogger(__name__)

Transform = Callable[[nn.Module], "nn.Module | None"] | str


@dataclass(frozen=True)
class PretrainedLoadReport(LoadReport):
    """What :func:`from_pretrained` did on this rank; a :class:`~hp_dcp_hf.LoadReport` plus more.

    ``seconds`` has the wall time of each stage: ``skeleton``, ``transforms``, ``parallelize``,
    ``materialize``, ``load`` (with its phases ``metadata``, ``plan``, ``read``, ``copy``, ``exchange``), then
    ``finalize``, with ``verify=True`` ``verify`` and, with ``adapter=``, ``adapter``."""

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
    verified: VerifyReport | None = None
    """What ``verify=True`` compared on this rank (None without it)."""


def from_pretrained(
    path_or_repo: str,
    *,
    model_cls: type[nn.Module] | None = None,
    config=None,
    dtype: DtypeSpec = AUTO,
    transforms: Sequence[Transform] = (),
    distributed_config: Any = None,
    device_mesh: DeviceMesh | None = None,
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
    verify: bool = False,
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
            checkpoint's first floating-point dtype (:mod:`hp_dcp_hf.model.dtype`).
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
        verify: after the load, check the model's shards against the checkpoint's bytes through
            the save's inversion (:func:`~hp_dcp_hf.sync.verify.verify_against_checkpoint`, each
            byte read once between the ranks, with a reader of its own);
            :class:`~hp_dcp_hf.errors.VerificationError` on every rank when any differs,
            ``report.verified`` what was compared. With ``adapter=``: the base checkpoint.
        **reader_options: :class:`HFStorageReader` options (``storage_options``,
            ``coalesce_gap``, ``num_threads``, ...).

    Returns:
        ``(model, report)``: the loaded model in ``eval()`` mode and a :class:`PretrainedLoadReport`.
    """
    if reader is not None and reader_options:
        raise ValueError(f"pass reader= or reader options, not both (got {sorted(reader_options)})")
    # the adapter's store is the checkpoint's; its config is read before anything is built
    adapter_step = _read_adapter(adapter, is_trainable, reader_options.get("storage_options"))
    parallelize = _parallelization(distributed_config, device_mesh, parallelize, adapter_step)
    watch = _Stopwatch()

    reader = reader if reader is not None else HFStorageReader(path_or_repo, **reader_options)
    model = _skeleton(path_or_repo, reader, config, model_cls, dtype, model_kwargs)
    mapping = list(weights_mapping) if weights_mapping is not None else checkpoint_mapping(model)  # before renames
    watch.lap("skeleton")

    model = _rewrite(model, transforms)
    watch.lap("transforms")
    model = _parallelize(model, parallelize, adapter_step)  # the PEFT model with adapter=
    watch.lap("parallelize")

    logger.info("allocating the local shards on %s", device)
    materialize(model, device)
    watch.lap("materialize")
    with _base_tree(model, adapter_step) as base_model:
        retie(base_model)  # the base's tied names: the PEFT model's tree hides them
        planner = planner_cls(base_model, weights_mapping=mapping, strict=strict, unexpected=unexpected,
                              trace=loader == "dcp")
        base = load_hf_checkpoint(base_model, path_or_repo, loader=loader, reader=reader, planner=planner)
        watch.lap("load")
        watch.seconds.update(base.seconds)
        initialized = _finalize(base_model, base.loaded_keys, init_seed)
        watch.lap("finalize")
        verified = None
        if verify:  # its own reader: the load's statistics stay the load's
            fresh = HFStorageReader(reader.path, **dataclasses.asdict(reader.options))
            verified = verify_against_checkpoint(base_model, path_or_repo, reader=fresh, weights_mapping=weights_mapping)
            watch.lap("verify")
    adapter_report = None
    if adapter_step is not None:
        adapter_report = adapter_step.load()
        watch.lap("adapter")

    report = _report(base, initialized, loader=loader, planner=planner, reader=reader, seconds=watch.seconds,
                     parallelize=parallelize, adapter=adapter_report)
    return model, dataclasses.replace(report, verified=verified)


# -- the stages ----------------------------------------------------------------------------------


class _Stopwatch:
    """The wall time of each stage, from the end of the one before (so the stages add up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._clock = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = now - self._clock
        self._clock = now


@dataclass
class _AdapterStep:
    """``adapter=`` through one call: the config, read before the model is built (a bad adapter
    fails first), and the PEFT model once the config is applied. Not frozen: the model appears in
    the middle of the parallelization (``TransformersPlans``' ``before_fsdp``)."""

    path: str | os.PathLike
    config: Any
    storage_options: Mapping[str, Any] | None
    model: nn.Module | None = None

    def add(self, base: nn.Module) -> None:
        from hp_dcp_hf.integrations.peft import wrap_with_adapter

        self.model = wrap_with_adapter(base, self.config)

    def load(self) -> LoadReport:
        """The adapter's load; a frozen one puts the model in ``eval()``, as peft's does."""
        from hp_dcp_hf.integrations.peft import load_peft_adapter

        logger.info("loading the adapter %s", self.path)
        return load_peft_adapter(self.model, self.path, storage_options=self.storage_options)


def _read_adapter(adapter: str | os.PathLike | None, is_trainable: bool,
                  storage_options: Mapping[str, Any] | None) -> _AdapterStep | None:
    """``adapter=``'s step, its config read first (a bad adapter fails before anything is built);
    ``None`` without one."""
    if adapter is None:
        if is_trainable:
            raise ArgumentError("is_trainable= says whether the adapter trains: pass adapter= too")
        return None
    from hp_dcp_hf.integrations.peft import read_adapter_config

    return _AdapterStep(adapter, read_adapter_config(adapter, storage_options, is_trainable=is_trainable),
                        storage_options)


def _parallelization(distributed_config: Any, device_mesh: Any,
                     parallelize: Callable[[nn.Module], nn.Module | None] | None,
                     adapter: _AdapterStep | None) -> Callable[[nn.Module], nn.Module | None] | None:
    """``parallelize=`` as given, or transformers' plans for ``distributed_config=`` and / or the
    caller's ``device_mesh=``, which add the adapter between TP / EP and FSDP. The mesh is checked
    here, before anything is read or built."""
    if distributed_config is None and device_mesh is None:
        return parallelize
    if parallelize is not None:
        given = "distributed_config=" if distributed_config is not None else "device_mesh="
        raise ArgumentError(f"pass {given} or parallelize=, not both (a recipe shards on meshes of its own)")
    from hp_dcp_hf.parallel import TransformersPlans

    return TransformersPlans(distributed_config, device_mesh=device_mesh,
                             before_fsdp=adapter.add if adapter is not None else None)


def _skeleton(path_or_repo: str, reader: HFStorageReader, config: Any, model_cls: type[nn.Module] | None,
              dtype: DtypeSpec, model_kwargs: Mapping[str, Any] | None) -> nn.Module:
    """Stage 1: the config (``config.json`` unless given), the class, the dtype; the model on meta."""
    if config is None:
        logger.info("reading the config of %s", path_or_repo)
        config = read_config(path_or_repo, reader.storage_options)
    model_cls = resolve_model_class(config, model_cls)
    check_architecture(config, model_cls)
    dtype = resolve_dtype(dtype, config, lambda: _checkpoint_dtypes(reader))
    logger.info("building %s (%s) on the meta device", model_cls.__name__, dtype)
    return build_skeleton(config, model_cls, dtype=dtype, model_kwargs=model_kwargs)


def _checkpoint_dtypes(reader: HFStorageReader) -> Iterable[torch.dtype]:
    return (md.properties.dtype for md in reader.read_metadata().state_dict_metadata.values())


def _rewrite(model: nn.Module, transforms: Sequence[Transform]) -> nn.Module:
    """Stage 2a: the transforms in order (:func:`apply_transforms`), named in the log."""
    if transforms:
        logger.info("rewriting: %s", ", ".join(getattr(t, "__name__", str(t)) for t in transforms))
    return apply_transforms(model, transforms)


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


def _parallelize(model: nn.Module, parallelize: Callable[[nn.Module], nn.Module | None] | None,
                 adapter: _AdapterStep | None) -> nn.Module:
    """Stage 2b: the parallelization, then the adapter if the parallelization did not add it (after
    ``parallelize=``, or with none: refused on a model ``fully_shard`` sharded already). Returns the
    model to load into: the PEFT model with ``adapter=``."""
    if parallelize is not None:
        logger.info("parallelizing")
        out = parallelize(model)
        model = out if isinstance(out, nn.Module) else model
    if adapter is None:
        return model
    if adapter.model is None:
        adapter.add(model)
    return adapter.model


def _base_tree(model: nn.Module, adapter: _AdapterStep | None) -> contextlib.AbstractContextManager[nn.Module]:
    """What the base checkpoint loads into: the model, or the PEFT model's base with the module tree
    it had before peft (:func:`~hp_dcp_hf.integrations.peft.base_model_tree`)."""
    if adapter is None:
        return contextlib.nullcontext(model)
    from hp_dcp_hf.integrations.peft import base_model_tree

    return base_model_tree(model)


def _finalize(model: nn.Module, loaded_keys: Iterable[str], init_seed: int | None) -> tuple[str, ...]:
    """Stage 3c: the model's own init of what the checkpoint did not fill, ties, ``eval()``; returns
    what the init filled."""
    initialized = finalize(model, loaded_keys, seed=init_seed)
    retie(model)
    model.eval()  # the base; the adapter's layers as peft leaves them
    return initialized


def _report(base: LoadReport, initialized: tuple[str, ...], *, loader: Loader, planner: HFMappingPlanner,
            reader: HFStorageReader, seconds: dict[str, float], parallelize: Any,
            adapter: LoadReport | None) -> PretrainedLoadReport:
    """The base load's report and what this call adds: what the init filled, this rank's plan and
    reads, each stage's time, the parallelization's lines, the adapter's load."""
    return PretrainedLoadReport(
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
        adapter=adapter,
    )
