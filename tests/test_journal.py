"""The publish journal as pure logic: which names a save takes, and that every prefix of its steps
leaves a path a reader sees as the complete old checkpoint, the complete new one, or (only when
the config changes) no checkpoint, never a mix.

The path is simulated: each file is owned by the old or the new save, the index names its files,
and a reader goes as transformers does (``model.safetensors`` first, else the index).
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hp_dcp_hf.errors import CheckpointFormatError
from hp_dcp_hf.storage.format.journal import INDEX_FILE, SINGLE_FILE, Journal, Step, final_names, plan_publish

SAVE_ID = "0123456789abcdef0123456789abcdef"


def shard_names(count: int) -> list[str]:
    return [SINGLE_FILE] if count == 0 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def old_path(old_shards: int | None) -> dict[str, tuple]:
    """The older checkpoint: ``None`` nothing, ``0`` one file, else that many shards and an index."""
    if old_shards is None:
        return {}
    files = {name: ("old",) for name in shard_names(old_shards)}
    if old_shards:
        files[INDEX_FILE] = ("old", tuple(files))
    return {**files, "config.json": ("old", "config A")}


def view(path: dict[str, tuple], config_owners: dict[str, str]) -> str:
    """What a reader of the simulated path loads: ``old``, ``new``, ``none`` or ``a mix``
    (``config_owners``: whose each config text is; ``any`` when both saves have it)."""
    if SINGLE_FILE in path:
        owners = {path[SINGLE_FILE][0]}
    elif INDEX_FILE in path:
        owner, files = path[INDEX_FILE]
        if any(name not in path for name in files):
            return "a mix"  # files missing: a loud error, counted as a failure of the design here
        owners = {owner} | {path[name][0] for name in files}
    else:
        return "none"
    config = path.get("config.json")
    if config is not None:
        owners.add(config_owners[config[1]])
    owners.discard("any")
    return owners.pop() if len(owners) == 1 else "a mix"


def run(step: Step, path: dict[str, tuple]) -> None:
    if step.op in ("remove", "drop"):
        path.pop(step.name, None)
    elif step.op in ("commit", "copy"):
        path[step.name] = ("new",)
    elif step.name == INDEX_FILE:
        path[step.name] = ("new", tuple(sorted(set(json.loads(step.text)["weight_map"].values()))))
    else:
        path[step.name] = ("new", step.text)


def index_of(names: list[str]) -> dict | None:
    """An index mapping one key to each of ``names`` (save_pretrained's), None for one file."""
    return None if names == [SINGLE_FILE] else {"metadata": {}, "weight_map": {f"k{i}": n for i, n in enumerate(names)}}


@given(old_shards=st.one_of(st.none(), st.integers(0, 4)), new_shards=st.integers(0, 4),
       config_changes=st.booleans())
def test_every_prefix_of_the_steps_is_the_old_or_the_new_checkpoint(old_shards, new_shards, config_changes):
    path = old_path(old_shards)
    before = "old" if old_shards is not None else "none"
    names = final_names(shard_names(new_shards), set(path), SAVE_ID)
    extra = {"config.json": "config B" if config_changes else "config A"}
    texts = {name: text for name, (_, *rest) in path.items() if name == "config.json" for text in rest}
    journal = plan_publish(SAVE_ID, names, index_of(shard_names(new_shards)), extra, set(path), texts,
                           {name: f"staged/{name}" for name in names.values()})
    owners = {"config A": "old", "config B": "new"} if config_changes else {"config A": "any"}
    seen = [view(path, owners)]
    for step in journal.steps:
        run(step, path)
        seen.append(view(path, owners))
    assert seen[0] == before and seen[-1] == "new", (journal.steps, seen)
    assert "a mix" not in seen, (journal.steps, seen)
    if before == "old" and "none" in seen:  # a hole only where a config change must not meet the old weights
        assert config_changes
    order = ["old", "none", "new"]
    assert seen == sorted(seen, key=order.index)  # never back
    expected = set(shard_names(new_shards)) | {"config.json"} | ({INDEX_FILE} if new_shards else set())
    assert set(path) == expected  # save_pretrained's names; the old checkpoint's files are gone, nothing else left


def test_names_are_committed_as_save_pretrained_s_unless_the_old_checkpoint_holds_them():
    shards = shard_names(3)
    assert final_names(shards, set(), SAVE_ID) == {n: n for n in shards}
    assert final_names(shards, set(shard_names(2)), SAVE_ID) == {n: n for n in shards}
    taken = final_names(shards, {shards[1]}, SAVE_ID)
    assert taken == {n: n.replace("model-", "model-0123456789ab-") for n in shards}
    assert final_names([SINGLE_FILE], {SINGLE_FILE}, SAVE_ID) == {SINGLE_FILE: SINGLE_FILE}  # the switch itself


def test_an_unchanged_config_is_not_rewritten_and_leaves_no_hole():
    path = old_path(2)
    names = final_names(shard_names(2), set(path), SAVE_ID)
    journal = plan_publish(SAVE_ID, names, index_of(shard_names(2)), {"config.json": "config A"}, set(path),
                           {"config.json": "config A"}, {})
    assert [s.op for s in journal.steps] == ["commit", "commit", "write", "copy", "copy", "write", "drop", "drop"]
    assert journal.steps[2].name == journal.steps[5].name == INDEX_FILE
    assert [s.name for s in journal.steps if s.op == "copy"] == shard_names(2)  # over the old files, unnamed now


def test_a_directory_commits_only_from_the_save_s_staging(tmp_path):
    from hp_dcp_hf.storage.write.destination import Directory

    (tmp_path / "secret").write_text("x")
    for where in ("../secret", "/etc/passwd", f".hp-dcp-hf-staging-{SAVE_ID}/../../secret", ".hp-dcp-hf-staging-other/a"):
        journal = Journal(SAVE_ID, (Step("commit", "a"),), {"a": where})
        with pytest.raises(CheckpointFormatError, match="outside the save's staging"):
            Directory(str(tmp_path / "ckpt")).commit(journal, "a")
    assert (tmp_path / "secret").read_text() == "x"


def test_the_journal_round_trips_and_refuses_what_is_not_one():
    journal = Journal(SAVE_ID, (Step("commit", "a"), Step("write", "b", "text"), Step("remove", "c"),
                                Step("copy", "d", source="a"), Step("drop", "a")), {"a": "x/a"})
    assert Journal.from_json(journal.to_json()) == journal
    for raw in (b"", b"[]", b'{"save_id": "x"}', b'{"save_id": "x", "steps": [{"op": "rm", "name": "a"}], "staged": {}}',
                b'{"save_id": "x", "steps": [{"op": "remove", "name": "../a"}], "staged": {}}',
                b'{"save_id": "x", "steps": [{"op": "commit", "name": "a"}], "staged": {}}',
                b'{"save_id": "x", "steps": [{"op": "copy", "name": "a", "source": "b"}], "staged": {}}'):
        with pytest.raises(CheckpointFormatError, match="journal"):
            Journal.from_json(raw)


# -- replayed on a real directory -------------------------------------------------------------------


@pytest.mark.parametrize("old_shard, new_shard", [(None, None), ("40KB", "40KB"), (None, "40KB"), ("40KB", None)],
                         ids=["one-file-over-one-file", "shards-over-shards", "shards-over-one-file",
                              "one-file-over-shards"])
def test_a_publish_cut_after_any_step_and_replayed_twice_is_whole(tmp_path, monkeypatch, old_shard, new_shard):
    """A save with another config (another dtype) stopped at each step of its publish as a dying
    process stops (its lock dropped, nothing else run), then repaired twice: the path holds exactly
    the new checkpoint (the old one when it stopped before its journal), and nothing is left."""
    import torch

    import hp_dcp_hf
    from hp_dcp_hf.errors import StorageWriteError
    from hp_dcp_hf.storage.write.destination import Destination, Directory
    from tests.support.families import build_family_model, save_family_model

    old, new = build_family_model("llama", seed=1), build_family_model("llama", seed=2, dtype=torch.bfloat16)
    calls = {"n": 0, "cut": 0}

    def counted(real):
        def step(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == calls["cut"]:
                raise OSError("killed")
            return real(self, *args, **kwargs)
        return step

    for name in ("commit", "copy", "write_text", "remove"):  # the journal's write, then every step
        monkeypatch.setattr(Directory, name, counted(getattr(Directory, name)))
    monkeypatch.setattr(Destination, "abort", lambda self, staged: os.close(self._lock_fd))  # death: no cleanup
    save = {"max_shard_size": new_shard} if new_shard else {}
    hp_dcp_hf.save_hf_checkpoint(new, save_family_model(old, tmp_path / "clean", old_shard), **save)
    total = calls["n"]
    for cut in range(1, total + 1):
        path = save_family_model(old, tmp_path / f"cut-{cut}", old_shard)
        calls.update(n=0, cut=cut)
        try:  # success only when the new checkpoint was in place already (stopped while cleaning)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hp_dcp_hf.save_hf_checkpoint(new, path, **save)
            assert Directory(str(path)).current_save_id() is not None
        except StorageWriteError:
            pass
        calls["cut"] = 0
        for _ in range(2):
            Directory(str(path)).repair()
        loaded = build_family_model("llama", seed=3, dtype=torch.bfloat16)
        hp_dcp_hf.load_hf_checkpoint(loaded, str(path))
        expected = (old if cut == 1 else new).state_dict()
        assert all(torch.equal(v, expected[k].to(v.dtype)) for k, v in loaded.state_dict().items()), (cut, total)
        assert not [p for p in os.listdir(path) if p.startswith(".hp-dcp-hf")], (cut, os.listdir(path))
