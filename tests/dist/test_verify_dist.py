"""``verify_against_checkpoint`` after a load on 2 and 4 gloo ranks: FSDP2, TP with fused qkv /
gate-up, FSDP2 x TP with fused qkv, and HSDP (replicas).

A bf16 tiny llama (biases, untied head) loaded in float32, so the check compares through the
load's cast. Per layout: a clean load verifies, and the ranks read each checkpoint byte once between
them (summed payload bytes read = the checkpoint's tensor bytes; the float32 bytes compared are twice
that); one element changed in one rank's shard is a :class:`VerificationError` on every rank, naming
that rank, the tensor and a box the rank holds (under HSDP the replica the checkpoint check did not
read, found by comparing the replicas' digests); one byte flipped in a copy of the checkpoint file is
found on every rank, naming the tensor, the file and a box holding the flipped element.
"""

from __future__ import annotations

import re
import shutil
import warnings

import pytest
import torch

from hp_dcp_hf.storage import ReadStats, filesystem, locate, scan
from hp_dcp_hf.tools.launch import run_ranks

OVERRIDES = dict(attention_bias=True, mlp_bias=True, intermediate_size=42, tie_word_embeddings=False)
CASES = {  # world -> {name: (mesh, transforms)}
    2: {"fsdp2": ("dp=2", ()), "tp2-fused": ("tp=2", ("fuse_qkv", "fuse_gate_up"))},
    4: {"fsdp2-tp2-fused": ("dp=2,tp=2", ("fuse_qkv",)), "hsdp": ("dp_replicate=2,tp=2", ())},
}
SHARD_PARAM = "model.layers.1.mlp.down_proj.weight"
"""The parameter the shard test changes on the last rank (rowwise under TP: its columns cut)."""
FLIPPED = ("model.layers.0.self_attn.k_proj.weight", (3, 5))
"""The checkpoint tensor and element whose byte the flipped copy changes."""
_BOX = re.compile(r"offsets \[([\d, ]*)\] of sizes \[([\d, ]*)\]")


def _box(reason: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offsets, sizes = _BOX.search(reason).groups()
    return tuple(int(v) for v in offsets.split(",")), tuple(int(v) for v in sizes.split(","))


def _outcome(model, path: str) -> dict:
    """What verifying ``model`` against ``path`` raised: the error's fields, or {} when it passed."""
    from hp_dcp_hf.errors import VerificationError
    from hp_dcp_hf.sync.verify import verify_against_checkpoint

    try:
        verify_against_checkpoint(model, path)
    except VerificationError as error:
        return {"key": error.key, "file": error.file, "reason": error.reason, "rank": error.rank}
    return {}


def _run(rank: int, world: int, path: str, flipped: str, cases: dict) -> dict:
    from hp_dcp_hf import from_pretrained
    from hp_dcp_hf.geometry.shards import local_tensor
    from hp_dcp_hf.sync.source import HFWeightSource
    from hp_dcp_hf.sync.verify import verify_against_checkpoint

    results = {}
    for name, (mesh, transforms) in cases.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = from_pretrained(path, dtype=torch.float32, distributed_config=mesh, transforms=transforms)
        clean = verify_against_checkpoint(model, path)
        held = {(s.name, s.box.offsets, s.box.sizes) for s in HFWeightSource(model).slices()}
        local = local_tensor(dict(model.named_parameters())[SHARD_PARAM]).view(-1)
        kept = local[0].clone()
        with torch.no_grad():
            if rank == world - 1:
                local[0] += 1
            shard = _outcome(model, path)
            local[0] = kept
        results[name] = {
            "slices": clean.slices, "bytes_compared": clean.bytes_compared, "bytes_read": clean.read.bytes_read,
            "bytes_needed": clean.read.bytes_needed, "absent": clean.absent, "held": held, "shard": shard,
            "file": _outcome(model, flipped),
            "restored": verify_against_checkpoint(model, path).slices,
        }
    return results


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory):
    """The checkpoint, and a copy with one byte of :data:`FLIPPED`'s element flipped."""
    path = tiny_checkpoints("llama", torch.bfloat16, **OVERRIDES).path
    flipped = tmp_path_factory.mktemp("flipped") / "llama"
    shutil.copytree(path, flipped)
    location, single_file = locate(*filesystem(str(flipped)))
    catalog = scan(location, single_file, ReadStats())
    key, (row, col) = FLIPPED
    tensor = catalog.entries[key]
    at = tensor.data_start + (row * tensor.shape[1] + col) * tensor.itemsize + 1  # bf16's high byte
    with open(flipped / tensor.file, "r+b") as file:
        file.seek(at)
        byte = file.read(1)[0]
        file.seek(at)
        file.write(bytes([byte ^ 0x01]))
    total = sum(t.nbytes for t in catalog.entries.values())
    return str(path), str(flipped), tensor.file, total


@pytest.fixture(scope="module", params=sorted(CASES))
def results(request, checkpoints):
    path, flipped, _, _ = checkpoints
    world = request.param
    return world, run_ranks(world, _run, path, flipped, CASES[world], timeout=300)


def test_a_clean_load_verifies_reading_each_checkpoint_byte_once(results, checkpoints):
    world, per_rank = results
    _, _, _, total = checkpoints
    for name in CASES[world]:
        ranks = [r[name] for r in per_rank]
        assert all(r["absent"] == () for r in ranks), name
        assert sum(r["bytes_read"] for r in ranks) == total, name  # each checkpoint byte read once
        assert all(r["bytes_read"] == r["bytes_needed"] for r in ranks), name
        assert sum(r["bytes_compared"] for r in ranks) == 2 * total, name  # bf16 read, float32 compared
        assert all(r["slices"] == r["restored"] and r["slices"] > 0 for r in ranks), name


def test_a_changed_shard_is_named_on_every_rank(results):
    world, per_rank = results
    for name in CASES[world]:
        outcomes = [r[name]["shard"] for r in per_rank]
        assert all(o and o["key"] == SHARD_PARAM and o["rank"] == outcomes[0]["rank"] for o in outcomes), name
        failing = outcomes[0]["rank"]
        reason = outcomes[failing]["reason"]
        if failing == world - 1:  # the changed rank's slice is the one the checkpoint check read
            offsets, sizes = _box(reason)
            assert (SHARD_PARAM, offsets, sizes) in per_rank[failing][name]["held"], (name, reason)
            assert "compared as float32" in reason
        else:  # HSDP: a replica the checkpoint check left to its twin, found by the replicas' digests
            assert name == "hsdp" and f"replica(s) on ranks [{world - 1}]" in reason, (name, reason)


def test_a_flipped_checkpoint_byte_is_named_on_every_rank(results, checkpoints):
    world, per_rank = results
    _, _, file, _ = checkpoints
    key, element = FLIPPED
    for name in CASES[world]:
        outcomes = [r[name]["file"] for r in per_rank]
        assert all(o and o["key"] == key and o["file"] == file for o in outcomes), (name, outcomes)
        assert len({o["rank"] for o in outcomes}) == 1, (name, outcomes)
        failing = outcomes[0]["rank"]
        offsets, sizes = _box(outcomes[failing]["reason"])
        assert (key, offsets, sizes) in per_rank[failing][name]["held"], (name, outcomes)
        assert all(o <= e < o + s for o, s, e in zip(offsets, sizes, element)), (name, offsets, sizes)
