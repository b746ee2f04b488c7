"""How a save replaces the checkpoint at its path without ever showing a mix: the publish journal.

A checkpoint is entered through one file: ``model.safetensors`` when it exists (transformers reads
it first), else ``model.safetensors.index.json``. Replacing that one file is atomic on every
destination (a ``rename(2)``; an S3 upload completing or an object put), so a publish is planned
around one switch:

1. the new weight files go to names no reader looks at yet (names the old checkpoint does not use:
   ``save_pretrained``'s, or with the save's id when those are taken);
2. the entry file is replaced: the index written, or ``model.safetensors`` committed (or removed,
   when a sharded checkpoint replaces a single file); before the switch a reader sees the old
   checkpoint whole, after it the new one;
3. what only the old checkpoint used is removed.

``config.json`` (and ``generation_config.json``) is a second file no rename can switch together
with the weights. When the new one differs from the old one, the old entry file is removed
*before* it is written: a reader between those steps finds no checkpoint (a clear error), never
the new config over the old weights.

The steps are written down first, as a :class:`Journal` (write-ahead intent, once every rank's
bytes are durable), and each step is idempotent, so whoever finds a journal (the next save into
the path, or ``hp-dcp-hf repair``) rolls the publish forward to the end. Before a journal exists
nothing was published and a dead save's staged data is simply dropped.

Pure logic: which names, which steps, their JSON; the destinations carry the steps out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from hp_dcp_hf.errors import CheckpointFormatError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
JOURNAL_FILE = ".hp-dcp-hf-journal.json"
LOCK_FILE = ".hp-dcp-hf-lock"
STAGING_PREFIX = ".hp-dcp-hf-staging-"
SAVE_ID_KEY = "hp_dcp_hf_save_id"
"""The key of the save id in each written file's ``__metadata__`` and in the index's ``metadata``."""

SAVE_ID_LENGTH = 32  # uuid4().hex: a fixed width, so headers lay out alike before the id is known
WEIGHT_FILE = re.compile(r"model(-[0-9a-f]{12})?(-\d{5}-of-\d{5})?\.safetensors")
"""Weight files a save writes (``save_pretrained``'s names, or with a save id): those of an older
checkpoint that the new one lacks are removed once the new one is in place."""


@dataclass(frozen=True)
class Step:
    """One idempotent publish step: ``commit`` a staged weight file to ``name``, ``write`` small
    file ``name`` with ``text``, or ``remove`` ``name`` (a missing file is removed already)."""

    op: Literal["commit", "write", "remove"]
    name: str
    text: str | None = None


@dataclass(frozen=True)
class Journal:
    """The steps that publish save ``save_id``; ``staged`` maps each committed name to where the
    destination staged it (a file of the staging directory, an upload id)."""

    save_id: str
    steps: tuple[Step, ...]
    staged: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        steps = [{"op": s.op, "name": s.name, **({"text": s.text} if s.text is not None else {})} for s in self.steps]
        return json.dumps({"save_id": self.save_id, "steps": steps, "staged": self.staged}, indent=1) + "\n"

    @classmethod
    def from_json(cls, raw: str | bytes, *, file: str = JOURNAL_FILE) -> Journal:
        try:
            data = json.loads(raw)
            steps = tuple(Step(s["op"], s["name"], s.get("text")) for s in data["steps"])
            journal = cls(str(data["save_id"]), steps, {str(k): str(v) for k, v in data["staged"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointFormatError(f"not a publish journal: {type(e).__name__}: {e}", file=file) from e
        if any(s.op not in ("commit", "write", "remove") or not _plain_name(s.name) for s in steps):
            raise CheckpointFormatError("the publish journal holds an unknown step", file=file)
        if any(s.op == "commit" and s.name not in journal.staged for s in steps):
            raise CheckpointFormatError("the publish journal commits a file it did not stage", file=file)
        return journal


def _plain_name(name: str) -> bool:
    """A name inside the path: no separator, not ``.`` or ``..``, not empty."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def final_names(names: Sequence[str], existing: Collection[str], save_id: str) -> dict[str, str]:
    """Where each weight file of a save goes: ``save_pretrained``'s name, unless a sharded save's
    names are taken at the path (by the older checkpoint), then all of them with the save's id. A
    single ``model.safetensors`` keeps its name: replacing it is the switch itself."""
    if names == [SINGLE_FILE] or not any(name in existing for name in names):
        return {name: name for name in names}
    tag = save_id[:12]
    return {name: name.replace("model-", f"model-{tag}-", 1) for name in names}


def plan_publish(
    save_id: str,
    weight_files: Sequence[str],
    index_text: str | None,
    extra_files: Mapping[str, str],
    existing: Collection[str],
    existing_texts: Mapping[str, str],
    staged: Mapping[str, str],
) -> Journal:
    """The journal publishing ``weight_files`` (final names; one ``model.safetensors`` when
    ``index_text`` is None) and ``extra_files`` (name -> text) over what the path holds
    (``existing`` names; ``existing_texts``: the current text of those of ``extra_files`` it has)."""
    sharded = index_text is not None
    entries = [name for name in (SINGLE_FILE, INDEX_FILE) if name in existing]
    changed = {name: text for name, text in sorted(extra_files.items()) if existing_texts.get(name) != text}
    steps = [Step("commit", name) for name in weight_files if sharded]
    if changed and entries:  # no reader may pair the new config with the old weights
        steps += [Step("remove", name) for name in entries]
        entries = []
    steps += [Step("write", name, text) for name, text in changed.items()]
    if sharded:
        steps.append(Step("write", INDEX_FILE, index_text))
        if SINGLE_FILE in entries:  # the switch: transformers reads model.safetensors before any index
            steps.append(Step("remove", SINGLE_FILE))
    else:
        steps.append(Step("commit", SINGLE_FILE))
        if INDEX_FILE in entries:
            steps.append(Step("remove", INDEX_FILE))
    removed = {s.name for s in steps if s.op == "remove"} | set(weight_files)
    steps += [Step("remove", name) for name in sorted(existing) if WEIGHT_FILE.fullmatch(name) and name not in removed]
    return Journal(save_id, tuple(steps), dict(staged))
