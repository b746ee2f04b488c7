"""How a save replaces the checkpoint at its path without ever showing a mix: the publish journal.

A checkpoint is entered through one file: ``model.safetensors`` when it exists (transformers reads
it first), else ``model.safetensors.index.json``. Replacing that one file is atomic on every
destination (a ``rename(2)``; an S3 upload completing or an object put), so a publish is planned
around one switch:

1. the new weight files go to names no reader looks at yet: ``save_pretrained``'s when the old
   checkpoint does not use them, else (the same model saved again) those names with the save's id;
2. the entry file is replaced: the index written, or ``model.safetensors`` committed (or removed,
   when a sharded checkpoint replaces a single file); before the switch a reader sees the old
   checkpoint whole, after it the new one;
3. what only the old checkpoint used is removed;
4. files published under the save's id get ``save_pretrained``'s names back by a second switch:
   each is copied to its final name (a hard link; on S3 a server-side copy), which no index names
   any more, then the index is written again naming them, then the id-named files are dropped.
   Every save therefore ends with ``save_pretrained``'s names, and a reader sees the new checkpoint
   whole all along (through the first index until the second is written, then through it).

``config.json`` (and ``generation_config.json``) is a second file no rename can switch together
with the weights. When the new one differs from the old one, the old entry file is removed
*before* it is written: a reader between those steps finds no checkpoint (a clear error), never
the new config over the old weights.

The steps are written down first, as a :class:`Journal` (write-ahead intent, once every rank's
bytes are durable), and each step is idempotent, so whoever finds a journal (the next save into
the path, or ``hp-dcp-hf repair``) rolls the publish forward to the end. **The journal is the
commit point**: a save whose journal was written is committed, even when ``save_hf_checkpoint``
never returned (its ranks died while publishing). Before a journal exists nothing was published
and a dead save's staged data is simply dropped.

Pure logic: which names, which steps, their JSON, which leftovers of a save a listing shows; the
destinations carry the steps out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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
    file ``name`` with ``text``, ``remove`` ``name`` (a missing file is removed already), ``copy``
    published file ``source`` to ``name``, or ``drop`` ``name``, a file of this very save that the
    index no longer names (``remove`` spares the save's own files when a publish is replayed)."""

    op: Literal["commit", "write", "remove", "copy", "drop"]
    name: str
    text: str | None = None
    source: str | None = None


OPS = ("commit", "write", "remove", "copy", "drop")


@dataclass(frozen=True)
class Journal:
    """The steps that publish save ``save_id``; ``staged`` maps each committed name to where the
    destination staged it (a file of the staging directory, an upload id)."""

    save_id: str
    steps: tuple[Step, ...]
    staged: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        steps = [{"op": s.op, "name": s.name, **({"text": s.text} if s.text is not None else {}),
                  **({"source": s.source} if s.source is not None else {})} for s in self.steps]
        return json.dumps({"save_id": self.save_id, "steps": steps, "staged": self.staged}, indent=1) + "\n"

    @classmethod
    def from_json(cls, raw: str | bytes, *, file: str = JOURNAL_FILE) -> Journal:
        try:
            data = json.loads(raw)
            steps = tuple(Step(s["op"], s["name"], s.get("text"), s.get("source")) for s in data["steps"])
            journal = cls(str(data["save_id"]), steps, {str(k): str(v) for k, v in data["staged"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointFormatError(f"not a publish journal: {type(e).__name__}: {e}", file=file) from e
        if any(s.op not in OPS or not _plain_name(s.name) for s in steps):
            raise CheckpointFormatError("the publish journal holds an unknown step", file=file)
        if any(s.op == "commit" and s.name not in journal.staged for s in steps):
            raise CheckpointFormatError("the publish journal commits a file it did not stage", file=file)
        committed = {s.name for s in steps if s.op == "commit"}
        if any(s.op == "copy" and s.source not in committed for s in steps):
            raise CheckpointFormatError("the publish journal copies a file it does not commit", file=file)
        return journal

    def copies(self) -> dict[str, str]:
        """Each file published under the save's id -> the final name it is copied to."""
        return {s.source: s.name for s in self.steps if s.op == "copy" and s.source is not None}

    def describe(self) -> str:
        """What rolling this journal forward does, in words (for ``repair``)."""
        count = {op: [s.name for s in self.steps if s.op == op] for op in OPS}
        parts = [f"commit {len(count['commit'])} weight file(s)"]
        written = sorted(set(count["write"]))
        if written:
            parts.append(f"write {', '.join(written)}")
        if count["copy"]:
            parts.append(f"give {len(count['copy'])} file(s) save_pretrained's names")
        if count["remove"]:
            parts.append(f"remove the older checkpoint's {', '.join(count['remove'])}")
        return "; ".join(parts)


def _plain_name(name: str) -> bool:
    """A name inside the path: no separator, not ``.`` or ``..``, not empty."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def final_names(names: Sequence[str], existing: Collection[str], save_id: str) -> dict[str, str]:
    """Where each weight file of a save is committed: ``save_pretrained``'s name, unless a sharded
    save's names are taken at the path (by the older checkpoint), then all of them with the save's
    id (:func:`plan_publish` copies them back to ``save_pretrained``'s names after the switch). A
    single ``model.safetensors`` keeps its name: replacing it is the switch itself."""
    if names == [SINGLE_FILE] or not any(name in existing for name in names):
        return {name: name for name in names}
    tag = save_id[:12]
    return {name: name.replace("model-", f"model-{tag}-", 1) for name in names}


def index_text(index: Mapping[str, Any], names: Mapping[str, str] | None = None) -> str:
    """The text of ``index`` (its ``weight_map`` renamed by ``names`` when given), as a save writes it."""
    if names is not None:
        index = {**index, "weight_map": {key: names[name] for key, name in index["weight_map"].items()}}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def plan_publish(
    save_id: str,
    weight_files: Mapping[str, str],
    index: Mapping[str, Any] | None,
    extra_files: Mapping[str, str],
    existing: Collection[str],
    existing_texts: Mapping[str, str],
    staged: Mapping[str, str],
) -> Journal:
    """The journal publishing ``weight_files`` (``save_pretrained``'s name -> the name it is
    committed under, see :func:`final_names`; one ``model.safetensors`` when ``index`` is None;
    ``index``'s ``weight_map`` names ``save_pretrained``'s files) and ``extra_files`` (name -> text)
    over what the path holds (``existing`` names; ``existing_texts``: the current text of those of
    ``extra_files`` it has). It ends with ``save_pretrained``'s names in any case."""
    sharded = index is not None
    committed = list(weight_files.values())
    renamed = {final: name for final, name in weight_files.items() if final != name}
    entries = [name for name in (SINGLE_FILE, INDEX_FILE) if name in existing]
    changed = {name: text for name, text in sorted(extra_files.items()) if existing_texts.get(name) != text}
    steps = [Step("commit", name) for name in committed if sharded]
    if changed and entries:  # no reader may pair the new config with the old weights
        steps += [Step("remove", name) for name in entries]
        entries = []
    steps += [Step("write", name, text) for name, text in changed.items()]
    if sharded:
        steps.append(Step("write", INDEX_FILE, index_text(index, weight_files)))
        if SINGLE_FILE in entries:  # the switch: transformers reads model.safetensors before any index
            steps.append(Step("remove", SINGLE_FILE))
    else:
        steps.append(Step("commit", SINGLE_FILE))
        if INDEX_FILE in entries:
            steps.append(Step("remove", INDEX_FILE))
    kept = {s.name for s in steps if s.op == "remove"} | set(committed) | set(renamed)
    steps += [Step("remove", name) for name in sorted(existing) if WEIGHT_FILE.fullmatch(name) and name not in kept]
    if renamed and index is not None:  # the second switch: save_pretrained's names, no index names them now
        steps += [Step("copy", final, source=name) for final, name in renamed.items()]
        steps.append(Step("write", INDEX_FILE, index_text(index)))
        steps += [Step("drop", name) for name in renamed.values()]
    return Journal(save_id, tuple(steps), dict(staged))


def leftovers(names: Iterable[str]) -> list[str]:
    """The names of a listing that a running or dead save made: its journal, lock, staging."""
    return sorted(name for name in names if name in (JOURNAL_FILE, LOCK_FILE) or name.startswith(STAGING_PREFIX))


def leftovers_warning(url: str, found: Sequence[str]) -> str:
    """The one line a reader warns with when a listing of ``url`` shows ``found`` (see :func:`leftovers`)."""
    what = []
    if JOURNAL_FILE in found:
        what.append(f"its publish journal ({JOURNAL_FILE}: the save is committed and not yet completed)")
    if any(name.startswith(STAGING_PREFIX) for name in found):
        what.append("staged files (" + ", ".join(n for n in found if n.startswith(STAGING_PREFIX)) + ")")
    if LOCK_FILE in found:
        what.append(f"its lock ({LOCK_FILE})")
    return (f"{url}: a save into this path is running or was interrupted: it left {'; '.join(what)}; unless "
            f"a save runs there now, `hp-dcp-hf repair {url}` completes or drops it (`--dry-run` says which)")
