"""Compose conversion stages: checkpoint keys -> canonical model -> every recorded rewrite.

Each stage is a list of transformers ``WeightRenaming`` / ``WeightConverter``. Within a stage, keys
are grouped exactly as transformers' ``convert_and_load_state_dict_in_model`` groups them (sorted
by ``dot_natural_key``, all renamings then at most one converter, ``base_model_prefix`` added or
stripped on the first stage), and each group runs the transform's own ``convert``. The same
groups run on symbolic tensors (to plan reads), on meta tensors (to learn shapes of what cannot be
traced), and on real tensors (the legacy loader and deferred groups), so the three always agree.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    WeightTransform,
    dot_natural_key,
    rename_source_key,
)

from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.mapping.symbolic import RegionTensor, UntraceableOp

logger = logging.getLogger(__name__)

WeightMapping = Sequence[WeightTransform]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor, without data."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Opaque:
    """A tensor produced by an op that tracing cannot express: known shape, known sources."""

    shape: torch.Size
    dtype: torch.dtype
    sources: frozenset[str]

    def source_keys(self) -> set[str]:
        return set(self.sources)


Traced = RegionTensor | Opaque


@dataclass
class Group:
    """One transform of one stage with the tensors it collected, as transformers groups them."""

    transform: WeightTransform
    first_target: str
    inputs: list[tuple[str, str, str]] = field(default_factory=list)  # (renamed, source, pattern)
    outputs: tuple[str, ...] = ()

    @property
    def sources(self) -> list[str]:
        return [source for _, source, _ in self.inputs]

    def run(self, fetch: Callable[[str], Any], *, model: Any, config: Any) -> dict[str, Any]:
        """Run the transform's real ``convert`` on whatever ``fetch`` returns for each source."""
        transform = copy.deepcopy(self.transform)
        for renamed, source, pattern in self.inputs:
            transform.add_tensor(renamed, source, pattern, partial(fetch, source))
        out = transform.convert(self.first_target, model=model, config=config)
        return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}


class _LaterStages:
    """What the stages after one stage make of a name: the view of the model that stage sees.

    Transformers' renaming asks ``name in known`` / ``known.get(name)`` (does ``name`` reach a
    model tensor through the later stages?), and ops such as ``Split`` or
    ``Transpose(check_dims=True)`` ask ``model.get_parameter(name)`` for a shape. A name that later
    stages only rename has the final parameter's shape; a name a later rewrite consumes has the
    shape that rewrite recorded (``add_weight_mapping(..., source_shapes=...)``). Later stages are
    simulated on copies of their transforms, so ``was_used`` flags reflect the real grouping only.
    """

    def __init__(
        self,
        final_names: Collection[str],
        later_stages: Sequence[WeightMapping],
        later_shapes: Sequence[Mapping[str, Sequence[int]]],
        model: Any,
    ) -> None:
        self._final = final_names
        self._later = [_split_kinds(copy.deepcopy(list(stage))) for stage in later_stages]
        self._shapes = later_shapes
        self._model = model

    def __contains__(self, name: object) -> bool:
        assert isinstance(name, str)
        for renamings, converters in self._later:
            name, _ = rename_source_key(name, renamings, converters)
        return name in self._final

    def get(self, name: str, default: Any = None) -> Any:
        return True if name in self else default

    def get_parameter(self, name: str) -> torch.Tensor:
        current = name
        for (renamings, converters), shapes in zip(self._later, self._shapes):
            if current in shapes:
                return torch.empty(tuple(shapes[current]), device="meta")
            current, pattern = rename_source_key(current, renamings, converters)
            if pattern is not None:
                raise MappingError(
                    "a conversion asks for the shape of a tensor that a later rewrite consumes; record it "
                    "with add_weight_mapping(..., source_shapes={name: shape})", key=name,
                )
        try:
            return self._model.get_parameter(current)
        except AttributeError as e:
            raise MappingError("a conversion asks for the shape of a tensor the model does not have",
                               key=name) from e


def _split_kinds(stage: Sequence[WeightTransform]) -> tuple[list[WeightRenaming], list[WeightConverter]]:
    return (
        [t for t in stage if isinstance(t, WeightRenaming)],
        [t for t in stage if isinstance(t, WeightConverter)],
    )


def group_stage(
    names: Sequence[str],
    stage: WeightMapping,
    known: _LaterStages,
    base_model_prefix: str | None,
) -> tuple[list[Group], list[str]]:
    """Group ``names`` by the transform that consumes them; also return the names nothing wants."""
    renamings, converters = _split_kinds(stage)
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    groups: dict[str, Group] = {}
    dropped = []
    for name in sorted(names, key=dot_natural_key):
        renamed, pattern = rename_source_key(name, renamings, converters, base_model_prefix, known)
        if renamed not in known and name in known:
            renamed, pattern = rename_source_key(name, [], [], base_model_prefix, known)
        if renamed not in known:
            dropped.append(name)
            continue
        if pattern is not None:
            group = groups.setdefault(renamed, Group(by_pattern[pattern], renamed))
        else:
            group = groups.setdefault(renamed, Group(WeightRenaming(name, renamed), renamed))
            pattern = name
        group.inputs.append((renamed, name, pattern))
    return list(groups.values()), dropped


class Composition:
    """All stages composed: for every final target, how it is made from checkpoint tensors.

    Args:
        stages: the checkpoint mapping first, then each recorded rewrite stage.
        stage_shapes: for each stage, shapes of the tensors it consumes (by name before it), as
            recorded by the rewrite; only ops that ask for parameter shapes need them.
        sources: checkpoint keys with their shapes and dtypes.
        final_names: names the composition must produce (the model's state dict keys to fill).
        model: the final model, for ops that read parameter shapes and for the config.
        base_model_prefix: added or stripped on the first stage, as transformers does.
        trace: plan in index space; ``False`` treats every conversion as untraceable (the legacy
            loader: whole source tensors, real ops in memory).
    """

    def __init__(
        self,
        stages: Sequence[WeightMapping],
        sources: Mapping[str, TensorSpec],
        final_names: Collection[str],
        *,
        stage_shapes: Sequence[Mapping[str, Sequence[int]]] = (),
        model: Any = None,
        config: Any = None,
        base_model_prefix: str | None = None,
        trace: bool = True,
    ) -> None:
        self.trace = trace
        self.stages = [list(stage) for stage in stages] or [[]]
        shapes = [*stage_shapes, *([{}] * (len(self.stages) - len(stage_shapes)))]
        # views[i]: the model as stage i's ops and renaming see it (the real one for the last stage)
        self.views = [
            _LaterStages(final_names, self.stages[i + 1 :], shapes[i + 1 :], model) for i in range(len(self.stages))
        ]
        self.sources = dict(sources)
        self._model = model
        self._config = config
        self.levels: list[dict[str, Group]] = []  # levels[i][name]: the group of stage i making name
        self.dropped: list[str] = []  # checkpoint keys the first stage does not use
        traced: dict[str, Traced] = {
            key: RegionTensor.source(key, spec.shape, spec.dtype) for key, spec in self.sources.items()
        }
        # The checkpoint keys each name is made of, by the groups that made it (a zero-element
        # tensor has no region to name its sources by).
        lineage: dict[str, frozenset[str]] = {key: frozenset((key,)) for key in self.sources}
        for index, stage in enumerate(self.stages):
            known = self.views[index]
            prefix = base_model_prefix if index == 0 else None
            groups, dropped = group_stage(list(traced), stage, known, prefix)
            if index == 0:
                self.dropped = dropped
            model_for_ops = model if index == len(self.stages) - 1 else known
            produced: dict[str, Traced] = {}
            producers: dict[str, Group] = {}
            made_of: dict[str, frozenset[str]] = {}
            for group in groups:
                deps = frozenset().union(*(lineage[s] for s in group.sources))
                outputs = self._trace_group(group, traced, model_for_ops, deps)
                group.outputs = tuple(outputs)
                for name, value in outputs.items():
                    producers[name] = group
                    produced[name] = value
                    made_of[name] = deps
            self.levels.append(producers)
            traced, lineage = produced, made_of
        self.traced: dict[str, Traced] = {n: v for n, v in traced.items() if n in final_names}
        self._lineage = {n: lineage[n] for n in self.traced}
        self.used_transforms = [t for stage in self.stages for t in stage if t.was_used()]

    def _trace_group(
        self, group: Group, inputs: Mapping[str, Traced], model: Any, deps: frozenset[str]
    ) -> dict[str, Traced]:
        values = [inputs[s] for s in group.sources]
        if self.trace and all(isinstance(v, RegionTensor) for v in values):
            try:
                return group.run(inputs.__getitem__, model=model, config=self._config)
            except (UntraceableOp, NotImplementedError, TypeError, AttributeError) as exc:
                logger.info("Deferring %s: %s cannot be traced (%s)", group.first_target, group.transform, exc)
            except (ValueError, IndexError, RuntimeError) as exc:
                raise self._failure(group, inputs, exc) from exc
        try:
            shapes = group.run(
                lambda s: torch.empty(tuple(inputs[s].shape), dtype=inputs[s].dtype, device="meta"),
                model=model, config=self._config,
            )
        except MappingError:
            raise
        except Exception as exc:  # the real op rejects these inputs: the mapping does not compose
            raise self._failure(group, inputs, exc) from exc
        return {name: Opaque(t.shape, t.dtype, deps) for name, t in shapes.items()}

    def _failure(self, group: Group, inputs: Mapping[str, Traced], exc: Exception) -> MappingError:
        shapes = ", ".join(f"{s} {tuple(inputs[s].shape)}" for s in group.sources)
        return MappingError(f"{group.transform} cannot convert [{shapes}]: {exc}", key=group.first_target)

    def source_keys(self, name: str) -> set[str]:
        """Checkpoint keys final target ``name`` is made of (every input of the groups that made
        it, so a zero-element target names its sources too)."""
        return set(self._lineage[name])

    def evaluate(self, names: Collection[str], fetch: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Real values of final targets ``names``, from checkpoint tensors given by ``fetch``.

        Runs only the groups these targets depend on, each once.
        """
        memo: dict[tuple[int, str], torch.Tensor] = {}

        def value(level: int, name: str) -> torch.Tensor:
            if level == 0:
                return fetch(name)
            if (level, name) not in memo:
                group = self.levels[level - 1][name]
                model = self._model if level == len(self.stages) else self.views[level - 1]
                outputs = group.run(partial(value, level - 1), model=model, config=self._config)
                memo.update({(level, n): v for n, v in outputs.items()})
            return memo[(level, name)]

        return {name: value(len(self.stages), name) for name in names}


