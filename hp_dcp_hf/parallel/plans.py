"""Parallelize a transformers model with the TP / EP / FSDP / HSDP plans its authors ship.

transformers 5 models carry ``base_model_tp_plan``, ``base_model_ep_plan`` and FSDP plans, and
``transformers.distributed`` applies them (``apply_tensor_parallelism``,
``apply_expert_parallelism`` with all-to-all token routing, ``apply_fully_sharded_data_parallelism``).
:class:`TransformersPlans` runs exactly those on the meta-device skeleton, as transformers' own
``from_pretrained(distributed_config=...)`` does before its load, with four differences, each where
transformers would stop or stay silent:

* a requested dim the model has no plan for (``tp`` on an encoder without ``base_model_tp_plan``)
  leaves the model whole on that dim, with a warning, instead of raising;
* attention whose head counts ``tp`` does not divide keeps its attention whole (its TP rules are
  dropped) instead of sharding half heads, which breaks the forward;
* scalar (0-d) parameters, which FSDP2 cannot shard, stay plain replicated tensors;
* every dim left unsharded is reported (:attr:`TransformersPlans.unsharded`, a warning on rank 0,
  a line in ``hp-dcp-hf plan``), so a model never ends up replicated without a word;
* a model whose class refuses to name its embeddings (``get_input_embeddings`` raising
  ``NotImplementedError``, as detection models without token embeddings do) is parallelized as one
  that has none, where transformers' plan resolution would stop on the question.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hp_dcp_hf.errors import HPDCPHFError
from hp_dcp_hf.parallel.mesh import (
    caller_mesh_dims,
    check_caller_mesh,
    check_world_size,
    distributed_config,
    mesh_spec,
)
from hp_dcp_hf.util.groups import reused

logger = logging.getLogger(__name__)

#: the mesh dim names that shard along each of our dims: transformers', and a caller's mesh's ``dp``.
_SHARDING_MESH_DIMS = {"tp": ("tp",), "ep": ("ep",), "dp": ("fsdp", "efsdp", "dp")}
_HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


class ParallelizeError(HPDCPHFError):
    """A model cannot be parallelized as asked (not a transformers model, pipeline stages, ...)."""


@dataclass(frozen=True)
class Unsharded:
    """Modules a requested mesh dim left whole, and why."""

    dim: str
    modules: tuple[str, ...]
    reason: str

    def __str__(self) -> str:
        return f"{self.dim}: {', '.join(self.modules)} not sharded: {self.reason}"


def _wildcard(name: str) -> str:
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    return replace_layer_number_by_wildcard(name)


def _head_counts(module: nn.Module) -> dict[str, int]:
    """The head counts an attention module splits its projections by (its own, else its config's)."""
    config = getattr(module, "config", None)
    counts = {}
    for attribute in _HEAD_ATTRIBUTES:
        value = getattr(module, attribute, None)
        if value is None and config is not None:
            value = getattr(config, attribute, None)
        if isinstance(value, int) and value > 0:
            counts[attribute] = value
    return counts


def _indivisible_attention(model: nn.Module, plan: Mapping[str, str], tp: int) -> dict[str, dict[str, int]]:
    """``{attention pattern: head counts}`` for attention modules with TP rules whose head counts
    ``tp`` does not divide."""
    found: dict[str, dict[str, int]] = {}
    for path, module in model.named_modules():
        if not type(module).__name__.endswith("Attention"):
            continue
        pattern = _wildcard(path)
        if pattern in found or not any(key == pattern or key.startswith(pattern + ".") for key in plan):
            continue
        counts = _head_counts(module)
        if any(count % tp for count in counts.values()):
            found[pattern] = counts
    return found


@contextmanager
def embeddings_answered(model: nn.Module) -> Iterator[None]:
    """For the block, ``get_input_embeddings()`` / ``get_output_embeddings()`` answer ``None`` on a
    model whose class raises ``NotImplementedError`` for them: transformers' plan resolution asks
    every model (to group tied embeddings), also those that have none."""
    refused = []
    for name in ("get_input_embeddings", "get_output_embeddings"):
        try:
            getattr(model, name, lambda: None)()
        except NotImplementedError:
            refused.append(name)
            object.__setattr__(model, name, lambda: None)  # an instance attribute shadows the method
    try:
        yield
    finally:
        for name in refused:
            object.__delattr__(model, name)


@contextmanager
def scalars_set_aside(model: nn.Module) -> Iterator[list[str]]:
    """Take every 0-d parameter out of its module for the block (FSDP2 cannot shard them) and put
    it back after, as a plain tensor every rank holds whole; yields their names."""
    taken = [(module, name, param) for path, module in model.named_modules()
             for name, param in list(module._parameters.items()) if param is not None and param.dim() == 0]
    for module, name, _ in taken:
        del module._parameters[name]
    try:
        yield [name for _, name, _ in taken]
    finally:
        for module, name, param in taken:
            module._parameters[name] = param


def _mesh_manager(cls: type, config: Any) -> Any:
    """transformers' mesh manager for ``config``'s sizes (``prepare_distribute_model``'s), made once
    per process and mesh shape and reused by every later call (:mod:`hp_dcp_hf.util.groups`);
    ``None`` when every size is 1."""
    shape = (config.pp_size, config.dp_replicate_size, config.fsdp_size, config.tp_size,
             config.efsdp_size, config.ep_size)
    return reused(("transformers mesh", *shape), lambda: cls.prepare_distribute_model(config)[2])


#: transformers' mesh dim names -> ours (a caller's mesh is read in ours, :func:`caller_mesh_dims`).
_TRANSFORMERS_DIMS = {"dp_replicate": "dp_replicate", "fsdp": "dp", "tp": "tp"}


class CallerMesh:
    """transformers' mesh manager (``TransformersDeviceMesh``) answered from the caller's
    ``DeviceMesh``: ``get_mesh(dims)`` slices it by the caller's dim names, so no group is made
    (a slice shares its parent's groups). A requested dim the mesh lacks is one of size 1
    (:func:`check_caller_mesh` made sure) and is left out: transformers asks for
    ``("pp", "fsdp", "tp")`` whatever the sizes."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.dims = caller_mesh_dims(mesh.mesh_dim_names, tuple(mesh.shape))

    def get_mesh(self, dims: str | tuple[str, ...]) -> Any:
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        ours = [_TRANSFORMERS_DIMS[dim] for dim in dims if _TRANSFORMERS_DIMS.get(dim) in self.dims]
        if not ours:
            raise ParallelizeError(f"the device_mesh has none of the dims {dims} (it has {tuple(self.dims)})")
        if len(ours) == len(self.dims):
            return self.mesh
        return self.mesh[tuple(self.dims[dim][0] for dim in ours)]


class TransformersPlans:
    """``parallelize=`` with transformers' own plans for the model's class and a
    ``DistributedConfig`` (``tp_size``, ``ep_size``, ``fsdp_size``, ``dp_replicate_size`` and the
    ``tp_plan`` / ``ep_plan`` / ``fsdp_plan`` overrides), or a mesh spec (``"dp=2,tp=2"``).

    Every rank calls it inside a process group of ``dp_replicate * fsdp * tp`` ranks. After the
    call, :attr:`applied` says what was sharded and :attr:`unsharded` what a requested dim left
    whole, and why (also a warning on rank 0 when ``warn``).

    ``before_fsdp(model)``, when given, runs once on the model after TP and EP and before FSDP
    (also when no dim is sharded), and rewrites it in place: where a PEFT adapter is added, so that
    FSDP2 shards its tensors with the rest (:func:`hp_dcp_hf.from_pretrained`'s ``adapter=``).

    ``device_mesh``, the caller's ``DeviceMesh``, is then the mesh every plan is applied on (no
    group is made, :class:`CallerMesh`); ``config`` may be ``None`` with it (the sizes are the
    mesh's) and must otherwise ask for the mesh's sizes (:func:`check_caller_mesh`).
    """

    def __init__(self, config: Any, *, warn: bool = True,
                 before_fsdp: Callable[[nn.Module], None] | None = None, device_mesh: Any = None) -> None:
        caller = CallerMesh(device_mesh) if device_mesh is not None else None
        if config is None and caller is not None:
            config = {dim: size for dim, (_, size) in caller.dims.items()}
        if isinstance(config, str | Mapping):
            config = distributed_config(config)
        if caller is not None:
            check_caller_mesh(caller.dims, mesh_spec(config))
        self.config = config
        self.warn = warn
        self.before_fsdp = before_fsdp
        self.caller_mesh = caller
        self.applied: list[str] = []
        self.unsharded: list[Unsharded] = []
        self.mesh_manager = None

    @property
    def coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate on the requested dense dims (``dp_replicate``, ``dp``, ``tp``),
        once the call has built the mesh; ``()`` before."""
        if self.mesh_manager is None:
            return ()
        names = {"dp_replicate": "dp_replicate", "dp": "fsdp", "tp": "tp"}
        dims = tuple(names[dim] for dim in self.sizes if dim in names)
        return tuple(self.mesh_manager.get_mesh(dims).get_coordinate() or ()) if dims else ()

    @property
    def sizes(self) -> dict[str, int]:
        """The requested sizes as a mesh spec (``{"dp": 2, "tp": 2}``)."""
        return mesh_spec(self.config)

    def __call__(self, model: nn.Module) -> nn.Module:
        cls = type(model)
        if not hasattr(cls, "prepare_distribute_model") or not hasattr(model, "_resolve_parallel_plans"):
            raise ParallelizeError(f"{cls.__name__} is not a transformers model with parallel plans; pass "
                                   "parallelize= a callable of your own (e.g. built on init_mesh)")
        if (self.config.pp_size or 1) > 1:
            raise ParallelizeError("pipeline parallelism (pp_size > 1) is not supported by this loader")
        check_world_size(self.sizes, dist.get_world_size() if dist.is_initialized() else 1)
        config = self.config
        if self.caller_mesh is None:
            mesh_manager = _mesh_manager(cls, config)
        else:  # none when every size is 1, as transformers answers then
            mesh_manager = self.caller_mesh if config.tp_size * config.dp_size > 1 else None
        self.applied, self.unsharded, self.mesh_manager = [], [], mesh_manager
        if mesh_manager is None:
            self.applied.append("no parallelism: every size is 1")
            if self.before_fsdp is not None:
                self.before_fsdp(model)
            return model
        with embeddings_answered(model):
            return self._apply(model, config, mesh_manager)

    def _apply(self, model: nn.Module, config: Any, mesh_manager: Any) -> nn.Module:
        from transformers.distributed.expert_parallel import apply_expert_parallelism
        from transformers.distributed.fsdp import apply_fully_sharded_data_parallelism
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        resolving = self._resolvable(model, config)
        tp_plan, ep_plan, fsdp_plan = model._resolve_parallel_plans(resolving)

        model.config.distributed_config = config
        model._mesh_manager = mesh_manager
        model._device_mesh = mesh_manager.get_mesh(("pp", "fsdp", "tp"))
        model._is_distributed_loading_by_transformers = True
        model._tp_size, model._fsdp_size = config.tp_size, config.fsdp_size
        if config.tp_size > 1 and tp_plan:
            # A tied alias (``lm_head.weight``) is listed as a parameter rule, but transformers looks
            # parameters up without aliases: shard the tensor once and tie the alias to it again.
            unique = {name for name, _ in model.named_parameters()}
            aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - unique
            model = apply_tensor_parallelism(model, mesh_manager.get_mesh("tp"),
                                             {k: v for k, v in tp_plan.items() if k not in aliases})
            if aliases and hasattr(model, "tie_weights"):
                model.tie_weights()
            self.applied.append(f"tp={config.tp_size}: {len(tp_plan)} rules of the tp plan")
            self._record_fused_left_whole(model)
        if config.ep_size > 1 and ep_plan:
            if "ep_dispatch_experts" in ep_plan.values():
                model = apply_expert_parallelism(model, mesh_manager.get_mesh("ep"), mesh_manager.get_mesh("tp"),
                                                 ep_plan, ep_implementation=config.ep_implementation)
                self.applied.append(f"ep={config.ep_size}: {len(ep_plan)} rules of the ep plan "
                                    f"({config.ep_implementation} token routing)")
            else:
                self.unsharded.append(Unsharded("ep", tuple(sorted({_wildcard(k) for k in ep_plan})),
                                                "the ep plan has no 'ep_dispatch_experts' rule"))
        if self.before_fsdp is not None:
            self.before_fsdp(model)
        if config.dp_size > 1:
            with scalars_set_aside(model) as scalars:
                fsdp_plan = self._shard_tied_together(model, config, fsdp_plan)
                model = apply_fully_sharded_data_parallelism(model, mesh_manager, fsdp_plan, ep_plan)
            replicas = f" x {config.dp_replicate_size} replicas" if config.dp_replicate_size > 1 else ""
            self.applied.append(f"fsdp={config.fsdp_size}{replicas}: {len(fsdp_plan)} modules of the fsdp plan + root")
            if scalars:
                self.unsharded.append(Unsharded("dp", tuple(sorted({_wildcard(n) for n in scalars})),
                                                "scalar (0-d) parameters: FSDP2 cannot shard them, every rank holds them"))
        self._check_sharded(model)
        if self.warn and self.unsharded and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.warning("parallelism left modules whole:\n  %s", "\n  ".join(map(str, self.unsharded)))
        return model

    def _resolvable(self, model: nn.Module, config: Any) -> Any:
        """The config transformers resolves the plans with: a dim the model has no plan for is
        resolved as size 1 (transformers would raise), and attention TP rules ``tp`` cannot split
        by whole heads are dropped. Both are recorded in :attr:`unsharded`."""
        resolving = copy.copy(config)
        for kind in ("tp", "ep"):
            size = getattr(config, f"{kind}_size")
            override = getattr(config, f"{kind}_plan")
            plan = dict(getattr(model, f"{kind}_plan") or {})
            if isinstance(override, dict):
                plan = {} if kind == "tp" and not override else plan | override
            if size > 1 and not plan:
                self.unsharded.append(Unsharded(kind, ("*",), f"{type(model).__name__} has no {kind} plan "
                                                f"(base_model_{kind}_plan); pass {kind}_plan= to shard it"))
                setattr(resolving, f"{kind}_size", 1)
                continue
            if kind == "tp" and size > 1:
                dropped = _indivisible_attention(model, plan, size)
                for pattern, counts in dropped.items():
                    plan = {k: v for k, v in plan.items() if k != pattern and not k.startswith(pattern + ".")}
                    heads = ", ".join(f"{name}={count}" for name, count in counts.items())
                    self.unsharded.append(Unsharded("tp", (pattern,), f"head counts ({heads}) not divisible by tp={size}"))
                if dropped:
                    model._tp_plan = plan
                    resolving.tp_plan = None
        return resolving

    def _shard_tied_together(self, model: nn.Module, config: Any, fsdp_plan: dict[str, str]) -> dict[str, str]:
        """One FSDP group for the modules of each tied pair (``embed_tokens`` and ``lm_head``);
        returns the plan without them. transformers folds the head's rule into the embedding's
        and then wraps the root, which owns the alias too: FSDP2 refuses a parameter two groups
        share (transformers ties after its load, so it does not meet this; the skeleton here is
        tied from the start)."""
        from torch.distributed.fsdp import fully_shard
        from transformers.distributed.fsdp import _get_fsdp_policy_kwargs

        owners = []
        for tied, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
            modules = tuple(name.rpartition(".")[0] for name in (source, tied))
            try:  # the two modules hold one tensor (a wrapper, peft's modules_to_save, holds it one level down)
                held = [{id(p) for p in model.get_submodule(m).parameters()} for m in modules]
            except AttributeError:
                continue
            same = not held[0].isdisjoint(held[1])
            if same and modules not in owners and all(model.get_submodule(m) is not model for m in modules):
                owners.append(modules)  # once per module pair: a tied weight and its tied bias share one
        if not owners:
            return fsdp_plan
        dims = ("dp_replicate", "fsdp") if config.dp_replicate_size > 1 else "fsdp"
        mesh = self.mesh_manager.get_mesh(dims)
        for modules in owners:
            fully_shard([model.get_submodule(m) for m in modules], mesh=mesh, reshard_after_forward=False,
                        **_get_fsdp_policy_kwargs(config))
        grouped = {m for modules in owners for m in modules}
        return {name: style for name, style in fsdp_plan.items() if name not in grouped}

    def _record_fused_left_whole(self, model: nn.Module) -> None:
        """Fused projections (:mod:`hp_dcp_hf.transforms`) the tp plan left whole, by reason."""
        from hp_dcp_hf.transforms.tp import fused_without_tp_layout

        by_reason: dict[str, set[str]] = {}
        for path, reason in fused_without_tp_layout(model):
            by_reason.setdefault(reason, set()).add(_wildcard(path))
        for reason, patterns in by_reason.items():
            self.unsharded.append(Unsharded("tp", tuple(sorted(patterns)), f"fused projection without a TP layout: {reason}"))

    def _check_sharded(self, model: nn.Module) -> None:
        """Record a requested dim on which no parameter ended up sharded at all."""
        sharded: set[str] = set()
        for param in model.parameters():
            if isinstance(param, DTensor):
                names = param.device_mesh.mesh_dim_names or ("tp",)  # a caller's unnamed mesh is TP's
                sharded.update(n for n, p in zip(names, param.placements, strict=True) if isinstance(p, Shard))
        noted = {u.dim for u in self.unsharded if u.modules == ("*",)}
        for dim, size in self.sizes.items():
            if dim in _SHARDING_MESH_DIMS and size > 1 and dim not in noted \
                    and not sharded.intersection(_SHARDING_MESH_DIMS[dim]):
                self.unsharded.append(Unsharded(dim, ("*",), f"{dim}={size} sharded no parameter"))

    def describe(self) -> list[str]:
        """``applied`` and ``unsharded`` as report lines."""
        return [*self.applied, *(f"NOT SHARDED {u}" for u in self.unsharded)]

