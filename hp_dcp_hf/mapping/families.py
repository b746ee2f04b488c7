"""Key families: names that differ only by their integer components (``layers.3.mlp.experts.17``).

A checkpoint of a large MoE holds tens of thousands of keys but a few dozen families. Renaming
with transformers' patterns, and sorting the way transformers sorts, cost per key; both depend on
a family's literal text alone when the patterns cannot tell indices apart, so they are computed
once per family and the indices substituted. Pure string logic, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from itertools import islice
from operator import itemgetter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: transformers' core_model_loading imports torch.distributed.tensor
    from transformers.core_model_loading import WeightConverter, WeightRenaming, WeightTransform

# A whole dot-separated component that is a decimal integer (``w1`` and ``shard_2`` stay literal,
# as transformers' natural sort treats them).
_INDEX = re.compile(r"(?<![^.])(\d+)(?![^.])")
# An integer component after a dot, in names joined by newlines: parsed in one pass (a literal
# first character lets the regex engine skip ahead, several times faster than the lookarounds).
_DOTTED_INDEX = re.compile(r"\.(\d+)(?=[.\n])")
_SLOT = "\0"


def family(name: str) -> tuple[str, tuple[int, ...]]:
    """``name`` as its family (integer components replaced by a slot marker) and its indices."""
    parts = _INDEX.split(name)
    return _SLOT.join(parts[0::2]), tuple(map(int, parts[1::2]))


def families(names: Sequence[str]) -> list[tuple[str, tuple[int, ...]]]:
    """:func:`family` of every name, parsed in one regex pass over all of them."""
    joined = "\n".join(names) + "\n"
    skeletons = _DOTTED_INDEX.sub("." + _SLOT, joined).split("\n")[:-1]
    if len(skeletons) != len(names) or _SLOT in joined:  # names that would confuse the joined parse
        return [family(name) for name in names]
    numbers = iter(map(int, _DOTTED_INDEX.findall(joined)))
    parsed = [(skeleton, tuple(islice(numbers, skeleton.count(_SLOT)))) for skeleton in skeletons]
    for i, name in enumerate(names):
        if name[:1].isdigit():  # an integer first component has no dot before it
            parsed[i] = family(name)
    return parsed


@dataclass(frozen=True)
class Template:
    """A name with slots: ``texts[0] + str(indices[slots[0]]) + texts[1] + ...``."""

    texts: tuple[str, ...]
    slots: tuple[int, ...]
    _format: str = field(init=False, repr=False, compare=False)
    _key: Callable[[Sequence[int]], Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        escaped = [text.replace("{", "{{").replace("}", "}}") for text in self.texts]
        fields = [escaped[0]]
        for position, slot in enumerate(self.slots):
            fields.append(f"{{{slot}}}{escaped[position + 1]}")
        object.__setattr__(self, "_format", "".join(fields))
        object.__setattr__(self, "_key", itemgetter(*self.slots) if self.slots else lambda indices: ())

    @classmethod
    def of(cls, name: str, indices: Sequence[int]) -> Template | None:
        """``name`` with each integer component that is one of ``indices`` made a slot of it; None
        when that is ambiguous (repeated indices) or ``name`` holds an integer not among them."""
        if len(set(indices)) != len(indices):
            return None
        where = {index: slot for slot, index in enumerate(indices)}
        parts = _INDEX.split(name)
        slots = tuple(where.get(int(i), -1) for i in parts[1::2])
        if -1 in slots:
            return None
        return cls(tuple(parts[0::2]), slots)

    def fill(self, indices: Sequence[int]) -> str:
        return self._format.format(*indices)

    def key(self, indices: Sequence[int]) -> Any:
        """The indices the filled name depends on: members with equal keys get equal names."""
        return self._key(indices)


def dot_natural_key(name: str) -> list[tuple[Any, ...]]:
    """transformers' ``core_model_loading.dot_natural_key``, the order of its state-dict names: dot
    components, digits by value before text, a text's trailing digits by value. Restated here so
    that sorting names (``inspect``) imports no transformers, whose module costs seconds of
    ``torch.distributed.tensor`` imports; ``tests/test_startup.py`` checks that both agree."""
    parts: list[tuple[Any, ...]] = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
            continue
        text = part.rstrip("0123456789")
        digits = part[len(text):]
        parts.append((1, text, int(digits)) if digits else (1, text))
    return parts


class NaturalKeys:
    """transformers' ``dot_natural_key``, computed once per family and filled with the indices."""

    def __init__(self) -> None:
        self._families: dict[str, tuple[tuple[Any, ...], ...]] = {}

    def __call__(self, skeleton: str, indices: Sequence[int]) -> tuple[Any, ...]:
        chunks = self._families.get(skeleton)
        if chunks is None:
            chunks = self._families[skeleton] = self._chunks(skeleton, len(indices))
        key = chunks[0]
        for index, chunk in zip(indices, chunks[1:]):
            key += ((0, index),) + chunk
        return key

    @staticmethod
    def _chunks(skeleton: str, slots: int) -> tuple[tuple[Any, ...], ...]:
        """The family's key cut at its slots (distinct sentinels locate each slot's ``(0, index)``)."""
        sentinels = [10**12 + slot for slot in range(slots)]
        key = dot_natural_key(Template(tuple(skeleton.split(_SLOT)), tuple(range(slots))).fill(sentinels))
        cuts = [key.index((0, sentinel)) for sentinel in sentinels]
        bounds = [-1, *cuts, len(key)]
        return tuple(tuple(key[bounds[i] + 1 : bounds[i + 1]]) for i in range(slots + 1))


def natural_sorted(names: Collection[str]) -> tuple[str, ...]:
    """``names`` sorted by transformers' ``dot_natural_key``, computed per family."""
    names = list(names)
    natural = NaturalKeys()
    keys = [natural(skeleton, indices) for skeleton, indices in families(names)]
    return tuple(name for _, name in sorted(zip(keys, names)))


def _index_blind(stage: Sequence[WeightTransform]) -> bool:
    """Whether the stage renames every member of a family alike: its source patterns and scopes
    name no particular index, and no transform renames statefully (``GroupWeightRename``)."""
    from transformers.core_model_loading import WeightTransform

    for transform in stage:
        if type(transform).rename_source_key is not WeightTransform.rename_source_key:
            return False
        texts = [*transform.source_patterns, transform.scope_prefix or ""]
        if any(re.search(r"(?<!\\)\d|\\d(?![+*])", text) for text in texts):
            return False
    return True


def split_kinds(stage: Sequence[WeightTransform]) -> tuple[list[WeightRenaming], list[WeightConverter]]:
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    return (
        [t for t in stage if isinstance(t, WeightRenaming)],
        [t for t in stage if isinstance(t, WeightConverter)],
    )


_UNSEEN = object()


class StageRenamer:
    """transformers' ``rename_source_key`` for one stage, per family where the stage allows.

    A family's template comes from the first member the stage maps into ``known`` (or any member
    when there is no ``known``) and is checked against a real rename of the next member. The caller
    renames for real a templated name that turns out not to be ``known``. ``share=False`` renames
    every key for real.
    """

    def __init__(self, stage: Sequence[WeightTransform], *, prefix: str | None = None,
                 known: Any = None, share: bool = True) -> None:
        from transformers.core_model_loading import rename_source_key

        self._rename_source_key = rename_source_key
        self._renamings, self._converters = split_kinds(stage)
        self._prefix, self._known = prefix, known
        self._share = share and _index_blind(stage)
        self._templates: dict[str, Any] = {}  # skeleton -> (Template, pattern, checked) or None
        self.natural_keys = NaturalKeys()

    @property
    def shares(self) -> bool:
        """Whether families are renamed through templates (else every key is renamed for real)."""
        return self._share

    def template(self, skeleton: str) -> tuple[Template, str | None] | None:
        """The family's template and pattern once checked against a second member, else None."""
        entry = self._templates.get(skeleton)
        return entry[:2] if entry is not None and entry is not _UNSEEN and entry[2] else None

    def real(self, name: str) -> tuple[str, str | None]:
        return self._rename_source_key(name, self._renamings, self._converters, self._prefix, self._known)

    def __call__(self, name: str, skeleton: str, indices: tuple[int, ...]) -> tuple[str, str | None, bool]:
        """``(renamed, pattern, templated)``: ``templated`` when the name was filled in a template."""
        if not self._share or not indices:
            return *self.real(name), False
        entry = self._templates.get(skeleton, _UNSEEN)
        if entry is None:
            return *self.real(name), False
        if entry is _UNSEEN:
            renamed, pattern = self.real(name)
            # A member with repeated indices cannot tell which slot an integer came from: wait for another.
            if len(set(indices)) == len(indices) and (self._known is None or renamed in self._known):
                template = Template.of(renamed, indices)
                self._templates[skeleton] = None if template is None else (template, pattern, False)
            return renamed, pattern, False
        template, pattern, checked = entry
        renamed = template.fill(indices)
        if not checked:
            actual = self.real(name)
            self._templates[skeleton] = (template, pattern, True) if actual == (renamed, pattern) else None
            return *actual, False
        return renamed, pattern, True


def renamer_chain(stages: Sequence[Sequence[WeightTransform]], share: bool) -> Callable[[str], str]:
    """A name through the renaming of ``stages`` (no prefix logic, no model): what later stages
    make of a name."""
    renamers = [StageRenamer(stage, share=share) for stage in stages]

    def rename(name: str) -> str:
        for renamer in renamers:
            name = renamer(name, *family(name))[0]
        return name

    return rename
