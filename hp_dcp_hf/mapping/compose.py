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
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
from transformers.core_model_loading import (
    PermuteForRope,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
    dot_natural_key,
    rename_source_key,
)

from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.mapping.families import (
    StageRenamer,
    Template,
    families,
    family,
    natural_sorted,
    renamer_chain,
    split_kinds,
)
from hp_dcp_hf.mapping.ops import PermuteHeadsForRope
from hp_dcp_hf.mapping.structure import Bound, Structure
from hp_dcp_hf.mapping.symbolic import RegionTensor, UntraceableOp
from hp_dcp_hf.util.perf import paused_gc

logger = logging.getLogger(__name__)

WeightMapping = Sequence[WeightTransform]


class TensorSpec(NamedTuple):
    """Shape and dtype of a tensor, without data (a tuple: checkpoints hold tens of thousands)."""

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


Traced = Bound | Opaque


def require_model_facts(transform: WeightTransform, config: Any) -> None:
    """Refuse an op that would read a model fact the config lacks: transformers' ``PermuteForRope``
    takes ``num_attention_heads`` from the config and silently permutes as one head without it."""
    for op in getattr(transform, "operations", None) or ():
        if isinstance(op, PermuteForRope) and not isinstance(op, PermuteHeadsForRope):
            facts = getattr(config, op.subconfig_key, config) if op.subconfig_key else config
            heads = getattr(facts, "num_attention_heads", None)
            if not isinstance(heads, int) or heads < 1:
                where = f"config.{op.subconfig_key}" if op.subconfig_key else "config"
                raise MappingError(
                    f"{transform}: PermuteForRope needs the head count ({where}.num_attention_heads), and the "
                    f"config has none ({type(config).__name__}); pass config= with num_attention_heads to the "
                    "planner or load call"
                )


@dataclass
class Group:
    """One transform of one stage with the tensors it collected, as transformers groups them.

    ``transform`` is None for a plain rename of one key (made only when the group runs for real:
    a large checkpoint has tens of thousands).
    """

    transform: WeightTransform | None
    first_target: str
    inputs: list[tuple[str, str, str]] = field(default_factory=list)  # (renamed, source, pattern)
    outputs: tuple[str, ...] = ()

    @property
    def sources(self) -> list[str]:
        return [source for _, source, _ in self.inputs]

    def describe(self) -> str:
        return str(self.transform or f"rename {self.inputs[0][1]} -> {self.first_target}")

    def run(self, fetch: Callable[[str], Any], *, model: Any, config: Any) -> dict[str, Any]:
        """Run the transform's real ``convert`` on whatever ``fetch`` returns for each source."""
        if self.transform is None:
            transform: WeightTransform = WeightRenaming(self.inputs[0][1], self.first_target)
        else:
            transform = copy.deepcopy(self.transform)
            require_model_facts(transform, config)
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
        share: bool = True,
    ) -> None:
        self._final = final_names
        stages = [copy.deepcopy(list(stage)) for stage in later_stages]
        self._later = [split_kinds(stage) for stage in stages]
        self._rename = renamer_chain(stages, share) if stages else None
        self._shapes = later_shapes
        self._model = model

    def __contains__(self, name: object) -> bool:
        assert isinstance(name, str)
        return (name if self._rename is None else self._rename(name)) in self._final

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


def group_stage(
    names: Sequence[str],
    stage: WeightMapping,
    known: _LaterStages,
    base_model_prefix: str | None,
    *,
    share: bool = True,
) -> tuple[list[Group], list[str]]:
    """Group ``names`` by the transform that consumes them; also return the names nothing wants.

    ``share``: where the stage renames every member of a key family alike (see :mod:`families`),
    group family by family; otherwise key by key in transformers' order.
    """
    renamer = StageRenamer(stage, prefix=base_model_prefix, known=known, share=share)
    by_pattern = {pattern: converter for converter in split_kinds(stage)[1] for pattern in converter.source_patterns}

    def resolve(name: str, skeleton: str, indices: tuple[int, ...]) -> tuple[str, str | None] | None:
        """``(renamed, pattern)`` as transformers renames ``name`` for this model, None if nothing wants it."""
        renamed, pattern, templated = renamer(name, skeleton, indices)
        found = renamed in known
        if not found and templated:
            renamed, pattern = renamer.real(name)
            found = renamed in known
        if not found and name in known:
            renamed, pattern = rename_source_key(name, [], [], base_model_prefix, known)
            found = renamed in known
        return (renamed, pattern) if found else None

    parsed = families(names)
    if renamer.shares:
        return _group_families(names, parsed, resolve, renamer, by_pattern, known)
    entries = sorted(zip(names, parsed), key=lambda entry: (
        renamer.natural_keys(*entry[1]) if share else dot_natural_key(entry[0])))
    groups: dict[str, Group] = {}
    dropped = []
    for name, (skeleton, indices) in entries:
        resolved = resolve(name, skeleton, indices)
        if resolved is None:
            dropped.append(name)
            continue
        renamed, pattern = resolved
        group = groups.get(renamed)
        if group is None:
            group = groups[renamed] = Group(None if pattern is None else by_pattern[pattern], renamed)
        group.inputs.append((renamed, name, name if pattern is None else pattern))
    return list(groups.values()), dropped


def _group_families(
    names: Sequence[str],
    parsed: Sequence[tuple[str, tuple[int, ...]]],
    resolve: Callable[[str, str, tuple[int, ...]], tuple[str, str | None] | None],
    renamer: StageRenamer,
    by_pattern: Mapping[str, WeightConverter],
    known: _LaterStages,
) -> tuple[list[Group], list[str]]:
    """:func:`group_stage` family by family: the groups transformers makes, in its order.

    A family's members come in index order, which is transformers' order within a family. Once a
    family's template is checked, a member costs a tuple of its indices: members that fill the
    template alike share one name and one ``known`` check. Groups gather their inputs family by
    family, ordered by each family's first input, so every pattern first appears where it would in
    transformers' order (converters collect per pattern); where one pattern spans several
    families of a group, its inputs are sorted key by key.
    """
    natural = renamer.natural_keys
    members: dict[str, list[tuple[tuple[int, ...], str]]] = defaultdict(list)
    for name, (skeleton, indices) in zip(names, parsed):
        members[skeleton].append((indices, name))
    parts: dict[tuple[str, str], list[tuple[str, str, str | None]]] = {}  # (target, family) -> inputs
    dropped: list[str] = []
    for skeleton, family_members in members.items():
        family_members.sort()
        filled: dict[Any, tuple[str, str | None] | None] = {}
        shared = None
        for indices, name in family_members:
            if shared is None:
                shared = renamer.template(skeleton)
            resolved = None
            if shared is not None:
                template, pattern = shared
                key = template.key(indices)
                if key not in filled:
                    renamed = template.fill(indices)
                    filled[key] = (renamed, pattern) if renamed in known else None
                resolved = filled[key]
            if resolved is None:
                resolved = resolve(name, skeleton, indices)
            if resolved is None:
                dropped.append(name)
                continue
            parts.setdefault((resolved[0], skeleton), []).append((resolved[0], name, resolved[1]))
    by_target: dict[str, list[list[tuple[str, str, str | None]]]] = defaultdict(list)
    for (target, _), inputs in parts.items():
        by_target[target].append(inputs)

    def natural_key(entry: tuple[str, str, str | None]) -> Any:
        return natural(*family(entry[1]))

    groups = []
    for target, target_parts in by_target.items():
        target_parts.sort(key=lambda part: natural_key(part[0]))
        inputs = [entry for part in target_parts for entry in part]
        patterns = [{entry[2] for entry in part} for part in target_parts]
        if len(set().union(*patterns)) < sum(map(len, patterns)):  # a pattern spans families
            inputs.sort(key=natural_key)
        pattern = inputs[0][2]
        group = Group(None if pattern is None else by_pattern[pattern], target)
        group.inputs = [(renamed, name, name if p is None else p) for renamed, name, p in inputs]
        groups.append((natural_key(inputs[0]), group))
    groups.sort(key=lambda entry: entry[0])
    return [group for _, group in groups], list(natural_sorted(dropped))


class _QueryLog:
    """The model as a conversion op sees it, recording what the op asks: a traced structure is
    reused for another group only where the same questions get the same answers."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.queries: list[tuple[str, str, Any]] = []
        self.other = False  # asked something not recorded: the trace cannot be reused

    @staticmethod
    def answer(model: Any, kind: str, name: str) -> Any:
        if kind == "parameter":
            tensor = model.get_parameter(name)
            return tuple(tensor.shape), tensor.dtype
        return name in model

    def get_parameter(self, name: str) -> Any:
        tensor = self._model.get_parameter(name)
        self.queries.append(("parameter", name, (tuple(tensor.shape), tensor.dtype)))
        return tensor

    def __contains__(self, name: object) -> bool:
        found = name in self._model
        self.queries.append(("contains", str(name), found))
        return found

    def get(self, name: str, default: Any = None) -> Any:
        return True if name in self else default

    def __getattr__(self, attribute: str) -> Any:
        self.other = True
        return getattr(self._model, attribute)


@dataclass(frozen=True)
class _SharedTrace:
    """One group's trace, to bind to every group with the same signature: output names and the
    model's answers as templates over the first target's indices."""

    outputs: tuple[tuple[Template, Structure], ...]
    queries: tuple[tuple[str, Template, Any], ...]

    @classmethod
    def of(cls, first_target: str, structures: Mapping[str, Structure], log: _QueryLog) -> _SharedTrace | None:
        if log.other:
            return None
        indices = family(first_target)[1]
        outputs = tuple((Template.of(name, indices), s) for name, s in structures.items())
        queries = tuple((kind, Template.of(name, indices), answer) for kind, name, answer in log.queries)
        if any(t is None for t, _ in outputs) or any(t is None for _, t, _ in queries):
            return None
        return cls(outputs, queries)  # type: ignore[arg-type]

    def bind(self, first_target: str, keys: tuple[str, ...], model: Any) -> dict[str, Traced] | None:
        indices = family(first_target)[1]
        for kind, name, answer in self.queries:
            if _QueryLog.answer(model, kind, name.fill(indices)) != answer:
                return None
        return {name.fill(indices): Bound(structure, keys) for name, structure in self.outputs}


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
        share_structure: rename once per key family and trace once per structure (every layer's
            experts alike), binding keys; ``False`` renames every key and traces every group, the
            reference the shared path is tested against.
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
        share_structure: bool = True,
    ) -> None:
        self.trace = trace
        self.share_structure = share_structure
        self.stages = [list(stage) for stage in stages] or [[]]
        shapes = [*stage_shapes, *([{}] * (len(self.stages) - len(stage_shapes)))]
        # views[i]: the model as stage i's ops and renaming see it (the real one for the last stage)
        self.views = [
            _LaterStages(final_names, self.stages[i + 1 :], shapes[i + 1 :], model, share_structure)
            for i in range(len(self.stages))
        ]
        self.sources = dict(sources)
        self._model = model
        self._config = config
        self._shared: dict[Any, _SharedTrace | None] = {}  # group signature -> its trace to bind
        self._source_structures: dict[TensorSpec, Structure] = {}
        self.levels: list[dict[str, Group]] = []  # levels[i][name]: the group of stage i making name
        self.dropped: list[str] = []  # checkpoint keys the first stage does not use
        with paused_gc():
            self._compose(final_names, model, base_model_prefix)
        self.used_transforms = [t for stage in self.stages for t in stage if t.was_used()]

    def _compose(self, final_names: Collection[str], model: Any, base_model_prefix: str | None) -> None:
        names: list[str] = list(self.sources)
        lookup: Callable[[str], Traced] = self._source
        # The checkpoint keys each name is made of, by the groups that made it (a zero-element
        # tensor has no region to name its sources by); a checkpoint key is made of itself.
        lineage: Callable[[str], frozenset[str]] = self._no_lineage
        for index, stage in enumerate(self.stages):
            known = self.views[index]
            prefix = base_model_prefix if index == 0 else None
            groups, dropped = group_stage(names, stage, known, prefix, share=self.share_structure)
            if index == 0:
                self.dropped = dropped
            model_for_ops = model if index == len(self.stages) - 1 else known
            produced: dict[str, Traced] = {}
            producers: dict[str, Group] = {}
            made_of: dict[str, frozenset[str]] = {}
            for group in groups:
                sources = group.sources
                deps = frozenset(sources) if index == 0 else frozenset().union(*(lineage(s) for s in sources))
                outputs = self._trace_group(index, group, [lookup(s) for s in group.sources], model_for_ops, deps)
                group.outputs = tuple(outputs)
                for name, value in outputs.items():
                    producers[name] = group
                    produced[name] = value
                    made_of[name] = deps
            self.levels.append(producers)
            names, lookup, lineage = list(produced), produced.__getitem__, made_of.__getitem__
        self.traced: dict[str, Traced] = {n: v for n, v in produced.items() if n in final_names}
        self._lineage = {n: made_of[n] for n in self.traced}

    @staticmethod
    def _no_lineage(key: str) -> frozenset[str]:
        raise AssertionError("a checkpoint key is its own lineage")

    def _source(self, key: str) -> Bound:
        spec = self.sources[key]
        structure = self._source_structures.get(spec)
        if structure is None:
            structure = self._source_structures[spec] = Structure.source(spec.shape, spec.dtype)
        return Bound(structure, (key,))

    def _trace_group(
        self, index: int, group: Group, values: Sequence[Traced], model: Any, deps: frozenset[str]
    ) -> dict[str, Traced]:
        if self.trace and all(isinstance(v, Bound) for v in values):
            if group.transform is None:  # a plain rename: the tensor itself under a new name
                return {group.first_target: values[0]}
            try:
                return self._traced(index, group, values, model)  # type: ignore[arg-type]
            except (UntraceableOp, NotImplementedError, TypeError, AttributeError) as exc:
                logger.info("Deferring %s: %s cannot be traced (%s)", group.first_target, group.describe(), exc)
            except (ValueError, IndexError, RuntimeError) as exc:
                raise self._failure(group, values, exc) from exc
        try:
            shapes = group.run(
                dict(zip(group.sources, (torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
                                         for v in values))).__getitem__,
                model=model, config=self._config,
            )
        except MappingError:
            raise
        except Exception as exc:  # the real op rejects these inputs: the mapping does not compose
            raise self._failure(group, values, exc) from exc
        return {name: Opaque(t.shape, t.dtype, deps) for name, t in shapes.items()}

    def _traced(self, index: int, group: Group, values: Sequence[Bound], model: Any) -> dict[str, Traced]:
        """The group's outputs traced: bound to a structure traced already for an identical group
        (same stage and transform, same target family, same patterns and input structures), or
        traced now over slots."""
        keys = tuple(key for value in values for key in value.keys)
        signature = (index, id(group.transform), family(group.first_target)[0],
                     tuple(pattern for _, _, pattern in group.inputs), tuple(id(v.structure) for v in values))
        shared = self._shared.get(signature) if self.share_structure else None
        if shared is not None:
            outputs = shared.bind(group.first_target, keys, model)
            if outputs is not None:
                return outputs
        inputs, offset = {}, 0
        for source, value in zip(group.sources, values):
            inputs[source] = value.structure.shifted(offset)
            offset += len(value.keys)
        log = _QueryLog(model)
        out = group.run(inputs.__getitem__, model=log, config=self._config)
        if not all(isinstance(t, RegionTensor) for t in out.values()):
            raise UntraceableOp(f"{group.describe()} returns tensors that are not traced")
        slot_ndims = tuple(n for value in values for n in value.structure.slot_ndims)
        structures = {name: Structure(t, slot_ndims) for name, t in out.items()}
        if self.share_structure and signature not in self._shared:
            self._shared[signature] = _SharedTrace.of(group.first_target, structures, log)
        return {name: Bound(structure, keys) for name, structure in structures.items()}

    def _failure(self, group: Group, values: Sequence[Traced], exc: Exception) -> MappingError:
        shapes = ", ".join(f"{s} {tuple(v.shape)}" for s, v in zip(group.sources, values))
        return MappingError(f"{group.describe()} cannot convert [{shapes}]: {exc}", key=group.first_target)

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


