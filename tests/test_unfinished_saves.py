"""A save that did not finish says so, and every save ends with ``save_pretrained``'s names.

Interrupted here in one process as a dying process stops (its lock dropped, nothing else run;
``tests/dist/test_kill_dist.py`` kills real jobs): the loads (``load_hf_checkpoint``,
``from_pretrained``, a bare ``dcp.load``) and ``inspect`` warn in one line naming
``hp-dcp-hf repair PATH``, ``inspect`` lists what was left with its size, ``repair --dry-run`` says
what repair would do and changes nothing, and ``repair`` says what it did (rolled forward: the
journal is the commit point; dropped: staging of saves that died before it).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

import hp_dcp_hf
from hp_dcp_hf.errors import StorageWriteError
from hp_dcp_hf.storage.format.journal import JOURNAL_FILE, LOCK_FILE, STAGING_PREFIX
from hp_dcp_hf.storage.write.destination import Destination, Directory
from hp_dcp_hf.tools.cli import main
from tests.support.checkpoints import anonymized, assert_same_checkpoint
from tests.support.families import build_family_model, save_family_model
from tests.support.servers.s3 import BUCKET, objects, pending_uploads

SHARD = "20KB"


class Killed(Exception):
    """The process dies here: nothing after this step runs but the kernel closing its files."""


def die_at(monkeypatch, cls: type, op: str, call: int) -> None:
    """The save's process dies at the ``call``-th call of destination step ``op`` (before it runs)."""
    real, calls = getattr(cls, op), {"n": 0}

    def step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise Killed
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, op, step)
    monkeypatch.setattr(Destination, "abort", lambda self, staged: os.close(self._lock_fd))  # death: no cleanup


def warned(load) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load()
    return [str(w.message) for w in caught if "hp-dcp-hf repair" in str(w.message)]


def load_warnings(path: Path) -> dict[str, list[str]]:
    """The repair warnings of each way to load ``path``."""
    import torch.distributed.checkpoint as dcp

    from hp_dcp_hf import HFStorageReader

    return {
        "load_hf_checkpoint": warned(lambda: hp_dcp_hf.load_hf_checkpoint(build_family_model("llama"), str(path))),
        "from_pretrained": warned(lambda: hp_dcp_hf.from_pretrained(str(path))),
        "dcp.load": warned(lambda: dcp.load(build_family_model("llama").state_dict(),
                                            storage_reader=HFStorageReader(str(path)), no_dist=True)),
    }


def cli(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_a_save_killed_after_its_journal_is_named_and_repair_says_it_rolls_forward(tmp_path, capsys, monkeypatch):
    old, new = build_family_model("llama", seed=1), build_family_model("llama", seed=2)
    path = save_family_model(old, tmp_path / "ckpt", SHARD)
    die_at(monkeypatch, Directory, "commit", 2)  # the journal is written, one shard committed
    with pytest.raises(StorageWriteError, match="its publish was journaled"):
        hp_dcp_hf.save_hf_checkpoint(new, path, max_shard_size=SHARD)
    monkeypatch.undo()
    listed = sorted(os.listdir(path))
    assert JOURNAL_FILE in listed and LOCK_FILE in listed

    for how, lines in load_warnings(path).items():  # the old checkpoint loads, and says so
        assert len(lines) == 1, (how, lines)
        assert f"`hp-dcp-hf repair {path}`" in lines[0] and JOURNAL_FILE in lines[0] and LOCK_FILE in lines[0]
        assert "committed" in lines[0]
    out = cli(capsys, "inspect", str(path))
    assert "unfinished" in out and f"journal {JOURNAL_FILE} (" in out and f"lock {LOCK_FILE} (" in out
    assert "would complete the publish of save" in out
    info = json.loads(cli(capsys, "inspect", str(path), "--json"))
    items = {i["kind"]: i for i in info["unfinished_save"]["items"]}
    assert items["journal"]["bytes"] == (path / JOURNAL_FILE).stat().st_size
    assert items["staging"]["bytes"] == sum(f.stat().st_size for f in (path / items["staging"]["name"]).iterdir()) > 0

    dry = cli(capsys, "repair", str(path), "--dry-run")
    assert "would complete the publish of save" in dry and "journal is the commit point" in dry
    assert "never returned" in dry and "would remove the lock" in dry
    assert sorted(os.listdir(path)) == listed  # changed nothing
    done = cli(capsys, "repair", str(path))
    assert "completed the publish of save" in done and "commit 8 weight file(s)" in done
    assert "give 8 file(s) save_pretrained's names" in done and "removed the lock a dead save left" in done
    assert not [n for n in os.listdir(path) if n.startswith(".hp-dcp-hf")]
    assert assert_same_checkpoint(path, save_family_model(new, tmp_path / "reference", SHARD)) is None
    assert load_warnings(path) == {"load_hf_checkpoint": [], "from_pretrained": [], "dcp.load": []}
    assert "unfinished" not in cli(capsys, "inspect", str(path))


def test_a_save_killed_while_writing_is_named_and_repair_drops_its_staging(tmp_path, capsys, monkeypatch):
    old = build_family_model("llama", seed=1)
    path = save_family_model(old, tmp_path / "ckpt", SHARD)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    die_at(monkeypatch, Directory, "check_staged", 1)  # every byte staged, no journal
    with pytest.raises(StorageWriteError, match="holds the older checkpoint as it was"):
        hp_dcp_hf.save_hf_checkpoint(build_family_model("llama", seed=2), path, max_shard_size=SHARD)
    monkeypatch.undo()
    (staging,) = [n for n in os.listdir(path) if n.startswith(STAGING_PREFIX)]
    size = sum(f.stat().st_size for f in (path / staging).iterdir())
    (line,) = load_warnings(path)["load_hf_checkpoint"]
    assert f"staged files ({staging})" in line and JOURNAL_FILE not in line
    out = cli(capsys, "inspect", str(path))
    assert f"staging {staging} (" in out and "would drop staged data no journal publishes" in out
    dry = cli(capsys, "repair", str(path), "--dry-run")
    assert f"would drop staged data no journal publishes (a save killed before writing its journal published nothing): {staging} (" in dry
    assert f"{size} B)" in dry or "MiB)" in dry
    done = cli(capsys, "repair", str(path))
    assert f"dropped staged data no journal publishes (a save killed before writing its journal published nothing): {staging}" in done
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # the old checkpoint, exactly


def test_a_save_over_the_same_names_ends_with_save_pretrained_s_names(tmp_path):
    """Over save_pretrained's checkpoint of the same names, then over its own: the files are the ones
    save_pretrained writes, under its names, each time (no save id in any name)."""
    path = save_family_model(build_family_model("llama", seed=1), tmp_path / "ckpt", SHARD)
    for seed in (2, 3):
        model = build_family_model("llama", seed=seed)
        hp_dcp_hf.save_hf_checkpoint(model, path, max_shard_size=SHARD)
        assert_same_checkpoint(path, save_family_model(model, tmp_path / f"reference-{seed}", SHARD))
    one = save_family_model(build_family_model("llama", seed=1), tmp_path / "one")  # one file over one file
    hp_dcp_hf.save_hf_checkpoint(build_family_model("llama", seed=2), one)
    assert sorted(p.name for p in one.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_s3_saves_end_with_save_pretrained_s_names_and_leftovers_warn_at_no_request(moto, tmp_path):
    """On S3 the second switch copies server-side; a lock a dead save left is warned of from the
    listing the load makes anyway (the same requests as a clean load)."""
    options = moto.storage_options()
    old, new = build_family_model("llama", seed=1), build_family_model("llama", seed=2)
    moto.upload_dir(save_family_model(old, tmp_path / "old", SHARD), BUCKET, "same")
    url = f"s3://{BUCKET}/same"
    hp_dcp_hf.save_hf_checkpoint(new, url, max_shard_size=SHARD, **options)
    hp_dcp_hf.save_hf_checkpoint(new, tmp_path / "local", max_shard_size=SHARD)
    assert anonymized(objects(moto, "same")) == anonymized({p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()})
    assert pending_uploads(moto) == []

    def load_requests() -> tuple[list[str], int]:
        moto.start_recording()
        lines = warned(lambda: hp_dcp_hf.load_hf_checkpoint(build_family_model("llama"), url, storage_options=options))
        moto.stop_recording()
        return lines, sorted((r.method, r.path, r.query) for r in moto.recording())

    load_requests()  # the first load of the prefix in this process also locates it
    clean, clean_requests = load_requests()
    moto.client.put_object(Bucket=BUCKET, Key=f"same/{LOCK_FILE}", Body=b"{}")
    (line,), requests = load_requests()
    assert clean == [] and requests == clean_requests and f"`hp-dcp-hf repair {url}`" in line
    assert sum(1 for _, _, query in requests if "list-type" in query) == 1  # the one listing a load makes
