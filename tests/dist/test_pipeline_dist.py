"""``from_pretrained(distributed_config=...)`` on 4 gloo ranks with transformers' own plans, against
transformers.

One spawn runs every case (spawning 4 ranks costs more than the cases): tiny llama (dense, tied
embeddings), mixtral and qwen3_moe (MoE), plain and with the rewrites, are built on meta, laid out
by transformers' TP / EP / FSDP / HSDP plans (``dp=2,tp=2``, ``dp_replicate=2,tp=2``, EP with
all-to-all token routing over 2 and 4 ranks), loaded and run; their logits must match
transformers' single-process ``from_pretrained`` (computed once here, in the test process). A
checkpoint with two tensors removed checks ``strict=False`` (the model's own init fills them) and
``strict=True`` (a typed error on every rank).

Sizes: the TP'd dims must divide by 2 for the forward (``RowwiseParallel`` rebuilds its input
from even local shards), so llama's intermediate size is 42; the MoE ones are multiples of 4,
since transformers' ``grouped_mm`` experts need 16-byte aligned strides (an odd intermediate fails
in transformers too).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hp_dcp_hf.geometry.shards import local_tensor
from hp_dcp_hf.tools.launch import run_ranks
from tests.support.models import MODEL_TYPES, load_reference, model_class

IDS = torch.arange(14).reshape(2, 7) * 7 % 101
DROPPED = ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight")

CASES = {  # name -> (checkpoint, model type, transforms, mesh)
    "llama": ("llama", "llama", (), "dp=2,tp=2"),
    "mixtral": ("mixtral", "mixtral", (), "dp=2,tp=2"),
    "llama-hsdp": ("llama", "llama", (), "dp_replicate=2,tp=2"),
    "mixtral-ep2": ("mixtral", "mixtral", (), "dp=2,tp=2,ep=2"),
    "mixtral-ep4": ("mixtral", "mixtral", (), "ep=4"),
    "qwen3_moe-ep4": ("qwen3_moe", "qwen3_moe", (), "ep=4"),
    "llama-fused": ("llama", "llama", ("fuse_qkv", "fuse_gate_up"), "dp=2,tp=2"),
    "mixtral-rewritten": ("mixtral", "mixtral", ("fuse_qkv", "grouped_gemm_experts"), "dp=2,tp=2"),
}
MESH = "dp=2,tp=2"


def _run(rank: int, world: int, paths: dict[str, str]) -> dict:
    from torch.distributed.tensor import DTensor

    from hp_dcp_hf.errors import MissingKeysError
    from hp_dcp_hf.integrations.transformers import PretrainedLoadReport, from_pretrained

    out: dict = {}
    for name, (ckpt, _, transforms, mesh) in CASES.items():
        model, report = from_pretrained(paths[ckpt], dtype=torch.float32, transforms=transforms, distributed_config=mesh)
        # before the forward: FSDP2 leaves the root group unsharded after it
        params = dict(model.named_parameters(remove_duplicate=False))
        state_keys = sorted(model.state_dict())
        # full_tensor() is a collective: every rank gathers, rank 0 keeps it
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        with torch.no_grad():
            logits = model(input_ids=IDS).logits
        out[name] = {
            "logits": logits.clone(),
            "training": model.training,
            "is_report": isinstance(report, PretrainedLoadReport),
            "report": {k: getattr(report, k) for k in ("loaded_keys", "missing_keys", "unexpected_keys",
                                                         "initialized_keys", "loader")},
            "plan_bytes": report.plan.bytes_needed,
            "read_bytes": report.read.bytes_read,
            "seconds": dict(report.seconds),
            "state_keys": state_keys,
            "placements": {k: [repr(p) for p in v.placements] for k, v in params.items() if isinstance(v, DTensor)},
            "plain": sorted(k for k, v in params.items() if not isinstance(v, DTensor)),
            "inv_freq": model.model.rotary_emb.inv_freq.clone(),
            "original_inv_freq": model.model.rotary_emb.original_inv_freq.clone(),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "layout": report.layout,
            "unsharded": [str(u) for u in report.unsharded],
            "state": full if rank == 0 else None,
        }
    # strict=False: the two dropped tensors come from the model's own init, the rest from the file.
    torch.manual_seed(1234)  # SPMD: every rank seeded alike (spawned ranks start from random seeds)
    model, report = from_pretrained(paths["llama-missing"], dtype=torch.float32, distributed_config=MESH, strict=False)
    state = model.state_dict()
    dropped = {k: state[k].full_tensor() for k in DROPPED}
    kept = {k: v.full_tensor() for k, v in state.items() if k not in report.missing_keys and isinstance(v, DTensor)}
    embed_local = local_tensor(state["model.embed_tokens.weight"]).clone()
    down_local_finite = bool(local_tensor(state[DROPPED[1]]).isfinite().all())
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    out["missing"] = {
        "report": {k: getattr(report, k) for k in ("loaded_keys", "missing_keys", "initialized_keys")},
        "dropped": dropped,
        "kept": kept,
        "finite": bool(logits.isfinite().all()),
        "down_local_finite": down_local_finite,
        "embed_local": embed_local,
    }
    # Every tiny model type (their conversions: Chunk, Split, Transpose, PermuteForRope, ...).
    out["types"] = {}
    for model_type in MODEL_TYPES:
        model, report = from_pretrained(paths[f"type-{model_type}"], dtype=torch.float32, distributed_config=MESH)
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        out["types"][model_type] = {"state": full if rank == 0 else None, "missing": report.missing_keys,
                                    "sharded": sum(isinstance(v, DTensor) for v in model.state_dict().values())}
    try:
        from_pretrained(paths["llama-missing"], dtype=torch.float32, distributed_config=MESH)
        out["strict_error"] = None
    except MissingKeysError as e:
        out["strict_error"] = (type(e).__name__, str(e))
    return out


def _drop(src, dst, keys) -> None:
    """A copy of checkpoint ``src`` without ``keys`` (shards and index rewritten)."""
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for file in sorted({index["weight_map"][k] for k in keys}):
        tensors = load_file(dst / file)
        save_file({k: v for k, v in tensors.items() if k not in keys}, dst / file, metadata={"format": "pt"})
    for k in keys:
        del index["weight_map"][k]
    index_path.write_text(json.dumps(index))


@pytest.fixture(scope="module")
def run(tiny_checkpoints, tmp_path_factory):
    llama = tiny_checkpoints("llama", torch.bfloat16, intermediate_size=42)
    mixtral = tiny_checkpoints("mixtral", torch.bfloat16, intermediate_size=48)
    qwen3_moe = tiny_checkpoints("qwen3_moe", torch.bfloat16, moe_intermediate_size=24)
    missing = tmp_path_factory.mktemp("missing") / "llama"
    _drop(llama.path, missing, DROPPED)
    paths = {"llama": str(llama.path), "mixtral": str(mixtral.path), "qwen3_moe": str(qwen3_moe.path),
             "llama-missing": str(missing)}
    paths |= {f"type-{m}": str(tiny_checkpoints(m, torch.bfloat16).path) for m in MODEL_TYPES}
    per_rank = run_ranks(4, _run, paths, timeout=400)  # inside pytest's 600 s
    references = {}
    for model_type in ("llama", "mixtral", "qwen3_moe"):
        path = paths[model_type]
        model = model_class(model_type).from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            references[model_type] = {
                "logits": model(input_ids=IDS).logits,
                "state": load_reference(path, model_type, torch.float32),
                "inv_freq": model.model.rotary_emb.inv_freq.clone(),
            }
    for model_type in MODEL_TYPES:
        references[f"type-{model_type}"] = load_reference(paths[f"type-{model_type}"], model_type, torch.float32)
    return per_rank, references, paths


@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_transformers(run, case):
    per_rank, references, _ = run
    reference = references[CASES[case][1]]["logits"]
    for rank, result in enumerate(per_rank):
        logits = result[case]["logits"]
        assert logits.shape == reference.shape
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5, msg=f"rank {rank}")
        assert not result[case]["training"]


def test_layout_is_transformers_plans(run):
    per_rank, _, _ = run
    for result in per_rank:
        llama = result["llama"]["placements"]
        # colwise TP under FSDP2: (_StridedShard(0), Shard(0)); rowwise: (Shard(0), Shard(1)).
        assert llama["model.layers.0.self_attn.q_proj.weight"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
        assert llama["model.layers.1.mlp.down_proj.weight"] == ["Shard(dim=0)", "Shard(dim=1)"]
        assert llama["model.embed_tokens.weight"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
        assert not result["llama"]["plain"]
        assert result["llama"]["tied"]
        assert result["llama"]["layout"][0].startswith("tp=2: ")
        assert result["llama"]["layout"][1] == "fsdp=2: 3 modules of the fsdp plan + root"
        hsdp = result["llama-hsdp"]["placements"]
        assert hsdp["model.layers.0.self_attn.o_proj.weight"] == ["Replicate()", "Shard(dim=0)", "Shard(dim=1)"]
        mixtral = result["mixtral"]["placements"]
        # gate and up halves each split over tp
        assert mixtral["model.layers.0.mlp.experts.gate_up_proj"] == ["Shard(dim=0)", "_StridedShard(dim=1, sf=2)"]
        assert mixtral["model.layers.0.self_attn.o_proj.weight"] == ["Shard(dim=0)", "Shard(dim=1)"]
        for ep in ("mixtral-ep2", "mixtral-ep4", "qwen3_moe-ep4"):
            experts = result[ep]["placements"]["model.layers.0.mlp.experts.down_proj"]
            assert experts[-1] == "Shard(dim=0)", (ep, experts)  # experts split over the ep ranks
        for name, r in result.items():
            if name in CASES:
                assert r["unsharded"] == [], (name, r["unsharded"])


@pytest.mark.parametrize("case", [name for name, case in CASES.items() if not case[2]])
def test_bit_identical_to_from_pretrained(run, case):
    """Models without rewrites; the rewritten ones hold other tensors and are compared through the forward."""
    per_rank, references, _ = run
    reference = references[CASES[case][1]]["state"]
    state = per_rank[0][case]["state"]
    assert set(state) == set(reference)
    assert not sorted(k for k, v in state.items() if not torch.equal(v, reference[k]))


@pytest.mark.parametrize("case", list(CASES))
def test_report(run, case):
    per_rank, _, _ = run
    for result in per_rank:
        r = result[case]
        assert r["is_report"]
        report = r["report"]
        assert report["loader"] == "dcp"
        assert report["missing_keys"] == () and report["unexpected_keys"] == ()
        assert set(report["loaded_keys"]) == set(r["state_keys"])  # tied lm_head included for llama
        assert report["initialized_keys"] == ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq")
        assert r["plan_bytes"] == r["read_bytes"] > 0
        # the stages, and the load's phases (local files: no exchange)
        assert set(r["seconds"]) == {"skeleton", "transforms", "parallelize", "materialize", "load", "finalize",
                                     "metadata", "plan", "first_byte", "read", "convert", "finish"}
    assert "lm_head.weight" in per_rank[0][case]["report"]["loaded_keys"]  # tied (llama) or stored (mixtral)


@pytest.mark.parametrize("case", list(CASES))
def test_rotary_buffers_recomputed(run, case):
    per_rank, references, _ = run
    reference = references[CASES[case][1]]["inv_freq"]
    for result in per_rank:
        assert torch.equal(result[case]["inv_freq"], reference)
        assert torch.equal(result[case]["original_inv_freq"], reference)


def test_strict_false_initializes_missing_keys(run):
    per_rank, references, _ = run
    reference = references["llama"]["state"]
    for rank, result in enumerate(per_rank):
        r = result["missing"]
        # lm_head.weight is tied to the embedding: missing with it
        assert r["report"]["missing_keys"] == ("lm_head.weight", *DROPPED)
        assert set(DROPPED) <= set(r["report"]["initialized_keys"])
        assert not set(DROPPED) & set(r["report"]["loaded_keys"])
        norm = r["dropped"]["model.norm.weight"]
        assert torch.equal(norm, torch.ones_like(norm)), rank  # RMSNorm init
        down = r["dropped"]["model.layers.0.mlp.down_proj.weight"]
        assert r["down_local_finite"] and down.isfinite().all()
        assert 0.01 < down.std().item() < 0.03  # normal(0, initializer_range=0.02)
        assert not torch.allclose(down, reference["model.layers.0.mlp.down_proj.weight"])
        for key, value in r["kept"].items():
            assert torch.equal(value, reference[key]), (rank, key)
        assert r["finite"]
        embed = r["dropped"]["model.embed_tokens.weight"]
        assert 0.01 < embed.std().item() < 0.03
    # The embedding is initialized whole and each rank keeps its rows: the gathered tensor agrees.
    embed = per_rank[0]["missing"]["dropped"]["model.embed_tokens.weight"]
    assert all(torch.equal(r["missing"]["dropped"]["model.embed_tokens.weight"], embed) for r in per_rank)


def test_strict_true_raises_missing_keys_on_every_rank(run):
    per_rank, _, _ = run
    for result in per_rank:
        assert result["strict_error"] is not None
        name, message = result["strict_error"]
        assert name == "MissingKeysError"
        assert all(key in message for key in DROPPED)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_model_type_loads_like_transformers(run, model_type):
    """The checkpoint mapping is taken from the skeleton: FSDP2's renamed classes (``FSDPGteModel``)
    would hide transformers' class-keyed mappings (gte, gradium_phonon_tts) from the planner."""
    per_rank, references, _ = run
    reference = references[f"type-{model_type}"]
    result = per_rank[0]["types"][model_type]
    assert result["missing"] == ()
    assert result["sharded"] > 0
    assert set(result["state"]) == set(reference)
    bad = sorted(k for k, v in result["state"].items() if not torch.equal(v, reference[k]))
    assert not bad
