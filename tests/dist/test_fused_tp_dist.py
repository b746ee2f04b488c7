"""Fused projections under transformers' own TP plans: sharded by whole heads, loaded exactly.

The flow of a training framework: ``fuse_qkv`` + ``fuse_gate_up`` on the meta skeleton, then
transformers' ``prepare_distribute_model`` / ``maybe_distribute_model`` (its ``apply_tensor_parallelism``
with the plan the rewrites retargeted, FSDP2 on top for ``fsdp_size``), then materialize and load
(:func:`hp_dcp_hf.integrations.transformers.from_pretrained`). Tiny llama with biases, 4 query / 2 key-value heads of
10, intermediate 42, untied head (transformers' ``apply_tensor_parallelism`` cannot shard a tied
``lm_head``), on:

* tp=2 (2 ranks): ``qkv_proj`` and ``gate_up_proj`` sharded, global rows rank-major;
* tp=3 (3 ranks): 4 heads do not divide, so ``qkv_proj`` (and ``o_proj``) stay whole and are
  reported, while ``gate_up_proj`` (42 = 3 x 14) is sharded;
* fsdp=2 x tp=2 (4 ranks): FSDP2 over the TP shards, ``(_StridedShard(0), Shard(0))``.

Oracle: transformers' single-process ``from_pretrained`` of the unfused model. Every gathered
parameter equals the reference's, the fused ones equal the reference's q/k/v (gate/up) cut into
``tp`` chunks each, concatenated rank-major; the logits match within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from hp_dcp_hf.tools.launch import run_ranks
from tests.support.models import model_class

OVERRIDES = dict(attention_bias=True, mlp_bias=True, intermediate_size=42, tie_word_embeddings=False)
IDS = torch.arange(14).reshape(2, 7) * 7 % 101
CASES = {  # name -> (world, DistributedConfig sizes)
    "tp2": (2, dict(tp_size=2)),
    "tp3": (3, dict(tp_size=3)),
    "fsdp2_tp2": (4, dict(tp_size=2, fsdp_size=2)),
}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _run(rank: int, world: int, path: str, sizes: dict) -> dict:
    from transformers import DistributedConfig

    from hp_dcp_hf.geometry.shards import local_tensor
    from hp_dcp_hf.integrations.transformers import from_pretrained
    from hp_dcp_hf.transforms.tp import fused_without_tp_layout

    cls = model_class("llama")
    config, _, mesh_manager = cls.prepare_distribute_model(DistributedConfig(**sizes))
    model, report = from_pretrained(
        path, dtype=torch.float32, transforms=("fuse_qkv", "fuse_gate_up"),
        parallelize=lambda m: type(m).maybe_distribute_model(m, config, mesh_manager),
    )
    params = dict(model.named_parameters())  # before the forward: FSDP2 leaves the root unsharded after it
    full = {k: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for k, p in params.items()}
    local = {k: local_tensor(p) for k, p in params.items()}
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    with torch.enable_grad():  # the DTensor (training) path of the styles
        model.train()
        trained = model(input_ids=IDS).logits.detach()
    return {
        "values": full if rank == 0 else None,
        "logits": logits.clone(),
        "logits_with_grad": trained.clone(),
        "local_numel": {k: t.numel() for k, t in local.items()},
        "placements": {k: tuple((type(x).__name__, getattr(x, "dim", None)) for x in p.placements)
                       if isinstance(p, DTensor) else () for k, p in params.items()},
        "unsharded": fused_without_tp_layout(model),
        "missing": report.missing_keys,
        "unexpected": report.unexpected_keys,
        "deferred": report.plan.deferred_targets,
        "bytes_read": report.read.bytes_read,
        "bytes_needed": report.plan.bytes_needed,
        "own_bytes": sum(t.numel() * 2 for t in local.values()),  # bf16 checkpoint
    }


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    ckpt = tiny_checkpoints("llama", torch.bfloat16, **OVERRIDES)
    reference = model_class("llama").from_pretrained(ckpt.path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(input_ids=IDS).logits
    return str(ckpt.path), reference.state_dict(), logits


@pytest.fixture(scope="module", params=sorted(CASES))
def results(request, checkpoint):
    world, sizes = CASES[request.param]
    path, _, _ = checkpoint
    return request.param, run_ranks(world, _run, path, sizes, timeout=180)


def _expected(reference: dict[str, torch.Tensor], name: str, groups: int) -> torch.Tensor:
    """The reference tensor of ``name``; a fused one from the unfused parts, rank-major over ``groups``."""
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            tensors = [reference[name.replace(fused, part)] for part in parts]
            return torch.cat([t.chunk(groups)[rank] for rank in range(groups) for t in tensors])
    return reference[name]


def test_values_equal_the_unfused_reference(results, checkpoint):
    case, per_rank = results
    _, reference, _ = checkpoint
    tp = CASES[case][1]["tp_size"]
    values = per_rank[0]["values"]
    assert sum(".qkv_proj." in k for k in values) == 4 and sum(".gate_up_proj." in k for k in values) == 4
    assert not any(f".{part}." in k for parts in FUSED.values() for part in parts for k in values)
    for name, value in values.items():
        groups = 1 if case == "tp3" and ".qkv_proj." in name else tp  # tp=3 leaves q/k/v whole
        assert torch.equal(value, _expected(reference, name, groups)), (case, name)
    for result in per_rank:
        assert not result["missing"] and not result["unexpected"]
        assert result["deferred"] == 0
        assert result["bytes_read"] == result["bytes_needed"] == result["own_bytes"], (case, result)


def test_fused_projections_are_sharded_by_whole_heads(results):
    case, per_rank = results
    world, sizes = CASES[case]
    result = per_rank[0]
    global_numel = {k: v.numel() for k, v in result["values"].items()}
    for name, numel in global_numel.items():
        placements = result["placements"][name]
        if case == "tp3" and (".self_attn.qkv_proj." in name or ".self_attn.o_proj." in name):
            assert placements == () and result["local_numel"][name] == numel, name  # whole, plain tensor
        elif ".qkv_proj." in name or ".gate_up_proj." in name:
            assert result["local_numel"][name] == numel // world, (name, placements)
            assert placements[-1] == ("Shard", 0), (name, placements)  # on tp; FSDP2 adds _StridedShard(0)
    if case == "tp3":
        assert [r["unsharded"] for r in per_rank] == [[
            (f"model.layers.{i}.self_attn.qkv_proj", "4 query heads not divisible by tp=3") for i in (0, 1)
        ]] * world
    else:
        assert all(r["unsharded"] == [] for r in per_rank)


def test_logits_equal_the_unfused_reference(results, checkpoint):
    _, per_rank = results
    _, _, expected = checkpoint
    for result in per_rank:
        torch.testing.assert_close(result["logits"], expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(result["logits_with_grad"], expected, rtol=0, atol=1e-5)
