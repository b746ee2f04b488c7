"""Killing real save jobs: 2 gloo ranks (FSDP2) saving over an older checkpoint, SIGKILLed at every
step of the save, and at random instants.

After every kill the path loads, through hp-dcp-hf and through transformers' ``from_pretrained``,
as exactly the old checkpoint or exactly the new one (every tensor bit-identical), never a mix;
after ``repair`` (or the next save) nothing of the killed save is left (no staging directory or
file, no journal, lock or lease, no pending multipart upload), and the path holds the new
checkpoint exactly when the killed save had journaled its publish.

Destinations: a local directory and S3 (moto's server). Older checkpoints: ``save_pretrained``'s
sharded files under the names the new save wants (it must take others, then switch the index), and
``save_pretrained``'s single ``model.safetensors`` (a sharded save replaces it). The fault points
come from a traced clean save (:mod:`tests.support.save_jobs`): every step, killed before it runs, and the
last one after it. ``HP_DCP_HF_KILL_TRIES`` sets the random kills (default 6 local, 4 on S3 here;
``bench/kill_saves.py`` runs the long loop).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

import hp_dcp_hf
from hp_dcp_hf.errors import HPDCPHFError
from hp_dcp_hf.storage.format.journal import JOURNAL_FILE
from hp_dcp_hf.storage.write.writer import destination_for
from hp_dcp_hf.tools.inspection import inspect_checkpoint
from tests.support.families import family_model_class, save_family_model
from tests.support.save_jobs import SHARD, Zygote, build_model
from tests.support.servers.s3 import BUCKET, MotoS3

OLD, NEW = 1, 2  # the seeds of the older checkpoint and of the model the job saves
RANDOM_TRIES = int(os.environ.get("HP_DCP_HF_KILL_TRIES", "6"))

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    zygote = Zygote(tmp_path_factory.mktemp("jobs"))
    yield zygote
    zygote.close()


@pytest.fixture(scope="module")
def states():
    return {"old": build_model(OLD).state_dict(), "new": build_model(NEW).state_dict()}


@pytest.fixture(scope="module")
def olds(tmp_path_factory):
    """The older checkpoints, as ``save_pretrained`` wrote them: under the names the save wants, and
    as one file."""
    root = tmp_path_factory.mktemp("olds")
    model = build_model(OLD)
    return {"same names": save_family_model(model, root / "same", SHARD), "one file": save_family_model(model, root / "one")}


class Place:
    """Where a job saves: a local directory or an S3 prefix, laid anew from an older checkpoint."""

    def __init__(self, kind: str, root: Path, server: MotoS3 | None) -> None:
        self.kind, self.root, self.moto, self.count = kind, root, server, 0

    def fresh(self, old: Path) -> str:
        self.count += 1
        if self.kind == "local":
            path = self.root / f"ckpt-{self.count}"
            shutil.copytree(old, path)
            return str(path)
        prefix = f"ckpt-{self.count}"
        self.moto.upload_dir(old, BUCKET, prefix)
        return f"s3://{BUCKET}/{prefix}"

    @property
    def options(self) -> dict:
        return self.moto.storage_options() if self.kind == "s3" else {}

    def names(self, path: str) -> list[str]:
        if self.kind == "local":
            return sorted(os.listdir(path))
        prefix = path.removeprefix(f"s3://{BUCKET}/") + "/"
        listed = self.moto.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
        return sorted(o["Key"].removeprefix(prefix) for o in listed)

    def pending_uploads(self, path: str) -> list[str]:
        if self.kind == "local":
            return []
        prefix = path.removeprefix(f"s3://{BUCKET}/") + "/"
        return [u["Key"] for u in self.moto.client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])]

    def download(self, path: str, into: Path) -> Path:
        """What a plain reader of the path gets: every file there (an S3 prefix synced to a directory)."""
        if self.kind == "local":
            return Path(path)
        prefix = path.removeprefix(f"s3://{BUCKET}/")
        into.mkdir()
        for name in self.names(path):
            body = self.moto.client.get_object(Bucket=BUCKET, Key=f"{prefix}/{name}")["Body"].read()
            (into / name).write_bytes(body)
        return into


@pytest.fixture(scope="module", params=["local", "s3"])
def place(request, tmp_path_factory):
    server = request.getfixturevalue("moto") if request.param == "s3" else None
    return Place(request.param, tmp_path_factory.mktemp(request.param), server)


def which(state: dict[str, torch.Tensor], states: dict[str, dict[str, torch.Tensor]]) -> str:
    found = [name for name, reference in states.items()
             if all(torch.equal(state[key], value) for key, value in reference.items())]
    return found[0] if found else "a mix"


def seen(place: Place, path: str, states, warned: list[str] | None = None) -> tuple[str, str]:
    """What the path loads as through hp-dcp-hf and through transformers: ``old``, ``new``, ``a
    mix`` or the error that refused it; hp-dcp-hf's warnings naming repair go to ``warned``."""
    model = build_model(0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hp_dcp_hf.load_hf_checkpoint(model, path, **place.options)
        ours = which(model.state_dict(), states)
        if warned is not None:
            warned += [str(w.message) for w in caught if "hp-dcp-hf repair" in str(w.message)]
    except HPDCPHFError as e:
        ours = f"refused: {type(e).__name__}"
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            theirs = which(family_model_class("llama").from_pretrained(
                place.download(path, Path(tmp) / "copy"), dtype=torch.float32).state_dict(), states)
        except Exception as e:  # noqa: BLE001 - any refusal is fine; a silent mix is not
            theirs = f"refused: {type(e).__name__}"
    return ours, theirs


def leftovers(place: Place, path: str) -> list[str]:
    return [n for n in place.names(path) if n.startswith(".hp-dcp-hf")] + place.pending_uploads(path)


def check_after_kill(place: Place, path: str, states, recover_by: str, zygote: Zygote) -> dict:
    """The path is whole (old or new, both readers agree) and, while a killed save's journal, lock
    or staging is visible there, the load and inspect warn naming repair and inspect lists them;
    repair (``--dry-run`` first, which changes nothing) says what it rolls forward and drops;
    recovery completes a journaled publish and leaves nothing behind."""
    warned: list[str] = []
    ours, theirs = seen(place, path, states, warned)
    assert ours in ("old", "new") and theirs == ours, (ours, theirs, place.names(path))
    names = place.names(path)
    journaled = JOURNAL_FILE in names
    visible = [n for n in names if n.startswith(".hp-dcp-hf")]
    assert len(warned) == bool(visible) and all(f"`hp-dcp-hf repair {path}`" in line for line in warned), warned
    if visible:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = inspect_checkpoint(path, place.options)["unfinished_save"]
        assert {i["name"] for i in report["items"]} >= set(visible), (report, visible)
        assert ("would complete the publish" in report["repair"]) == journaled, report
    if recover_by == "repair":
        destination = destination_for(path, place.options)
        dry = destination.repair(dry_run=True)
        assert place.names(path) == names and ("would complete the publish" in dry) == journaled, dry
        done = destination.repair()
        assert ("completed the publish" in done and "commit point" in done) == journaled, done
    else:  # the next save into the path
        exits, results, _ = zygote.start(path, NEW, options=place.options).wait()
        assert exits == [0, 0] and all(r["ok"] for r in results), results
    assert leftovers(place, path) == []
    assert not [n for n in place.names(path) if re.fullmatch(r"model-[0-9a-f]{12}-.*", n)]  # save_pretrained's names
    expected = "new" if journaled or recover_by == "save" else ours
    assert seen(place, path, states) == (expected, expected)
    return {"before": ours, "journaled": journaled}


def traced_steps(zygote: Zygote, place: Place, old: Path) -> list[tuple[str, int]]:
    job = zygote.start(place.fresh(old), NEW, trace=True, options=place.options)
    exits, results, _ = job.wait()
    assert exits == [0, 0] and all(r["ok"] for r in results), results
    steps = [tuple(line.split()) for line in (job.out / "trace.txt").read_text().split("\n") if line]
    return [(op, int(call)) for op, call in steps]


@pytest.mark.parametrize("old_kind", ["same names", "one file"])
def test_a_kill_at_every_step_leaves_the_old_or_the_new_checkpoint(zygote, place, olds, states, old_kind):
    steps = traced_steps(zygote, place, olds[old_kind])
    assert ("commit", 1) in steps and ("write_text", 1) in steps
    points = [(op, call, "before") for op, call in steps] + [(*steps[-1], "after")]
    if place.kind == "s3" and old_kind == "one file":
        # Up to the journal a save runs the same steps whatever the old checkpoint is ("same names"
        # kills each of them on S3): over one file, the first of them and every step from the journal on.
        journal = points.index(("write_text", 1, "before"))
        points = points[:1] + points[journal:]
    outcomes = []
    for i, (op, call, when) in enumerate(points):
        path = place.fresh(olds[old_kind])
        exits, _, _ = zygote.start(path, NEW, kill={"rank": 0, "op": op, "call": call, "when": when},
                                   options=place.options).wait()
        assert exits[0] == -signal.SIGKILL, (op, call, exits)
        # Every other point recovers by the next save, locally; on S3, where a save job costs most, by
        # repair (the same roll-forward a save runs first; S3's random kills recover by saves too).
        by_save = place.kind == "local" and i % 2 == 1
        outcome = check_after_kill(place, path, states, "save" if by_save else "repair", zygote)
        outcomes.append((op, call, when, outcome["before"]))
    # Before the journal the old checkpoint stands; once the switch is made, the new one.
    befores = [before for *_, before in outcomes]
    assert befores[0] == "old" and befores[-1] == "new" and befores == sorted(befores, key=("old", "new").index)


def test_a_rank_killed_while_writing_fails_the_others_typed_and_leaves_nothing(zygote, place, olds, states):
    path = place.fresh(olds["same names"])
    exits, results, _ = zygote.start(path, NEW, whole=False, options=place.options,
                                     kill={"rank": 1, "op": "write", "call": 1, "when": "before"}).wait()
    assert exits == [0, -signal.SIGKILL]
    assert results[0]["ok"] is False and results[0]["error"] == "StorageWriteError", results
    assert seen(place, path, states) == ("old", "old")
    assert leftovers(place, path) == []  # the coordinator dropped what it staged


def test_the_coordinator_killed_while_publishing_fails_the_survivor_typed(zygote, place, olds, states):
    path = place.fresh(olds["same names"])
    exits, results, _ = zygote.start(path, NEW, whole=False, options=place.options,
                                     kill={"rank": 0, "op": "commit", "call": 2, "when": "before"}).wait()
    assert exits == [-signal.SIGKILL, 0]
    assert results[1]["ok"] is False and results[1]["error"] == "StorageWriteError", results
    assert check_after_kill(place, path, states, "repair", zygote) == {"before": "old", "journaled": True}


def test_a_peer_lost_after_the_switch_is_a_successful_save(zygote, place, olds, states):
    """Rank 1 dies while rank 0 removes the older files (the new checkpoint is in place): rank 0's
    save succeeds, since the new checkpoint is the one at the path."""
    path = place.fresh(olds["same names"])
    exits, results, _ = zygote.start(path, NEW, whole=False, options=place.options,
                                     kill={"rank": 0, "op": "remove", "call": 1, "when": "before",
                                           "action": "kill peer"}).wait()
    assert exits == [0, -signal.SIGKILL]
    assert results[0] == {"ok": True}
    assert seen(place, path, states) == ("new", "new") and leftovers(place, path) == []


def random_kills(zygote: Zygote, place: Place, olds: dict[str, Path], states, tries: int, seed: int = 19) -> dict:
    """``tries`` saves over an older checkpoint (alternately under the same names and over one file),
    each SIGKILLed at a random instant of its run (all ranks, or one), each checked and recovered
    (alternately by the next save and by repair); how many left the old, how many the new."""
    clean = [zygote.start(place.fresh(olds["same names"]), NEW, options=place.options).wait()[2] for _ in range(2)]
    window = 1.2 * max(clean)
    rng = random.Random(seed)
    outcomes = {"old": 0, "new": 0, "journaled": 0, "whole job": 0, "one rank": 0}
    for i in range(tries):
        path = place.fresh(olds[("same names", "one file")[i % 2]])
        job = zygote.start(path, NEW, whole=False, options=place.options)
        victims = job.pids if rng.random() < 0.5 else [rng.choice(job.pids)]
        time.sleep(rng.uniform(0, window))
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.wait()
        outcome = check_after_kill(place, path, states, "repair" if i % 2 else "save", zygote)
        outcomes[outcome["before"]] += 1
        outcomes["journaled"] += outcome["journaled"]
        outcomes["whole job" if len(victims) > 1 else "one rank"] += 1
    return outcomes


def test_random_kills(zygote, place, olds, states):
    tries = RANDOM_TRIES if place.kind == "local" else max(1, RANDOM_TRIES * 2 // 3)
    outcomes = random_kills(zygote, place, olds, states, tries)
    assert outcomes["old"] + outcomes["new"] == tries
