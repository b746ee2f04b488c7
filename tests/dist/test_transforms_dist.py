"""Sharded loads into rewritten models equal the rewritten single-process ``from_pretrained``.

Shards of the fused tensors are cut where the rewrite's pieces do not line up: ``qkv_proj``
(40 | 20 | 20 rows) and ``gate_up_proj`` (43 | 43 rows) over 3 ranks, grouped-GEMM experts
``w13 [E, H, 2I]`` / ``w2 [E, I, H]`` over a 2 x 2 mesh (experts on one dim, TP on the other).
Every rank reads exactly the checkpoint bytes of its own shards, each once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hp_dcp_hf import HFMappingPlanner, HFStorageReader, load_hf_checkpoint
from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.tools.launch import run_ranks
from hp_dcp_hf.transforms import fuse_gate_up, fuse_qkv, grouped_gemm_experts
from tests.support.layouts import apply_layout
from tests.support.models import model_class, tiny_config

REWRITES = {"qkv": fuse_qkv, "gate_up": fuse_gate_up, "experts": grouped_gemm_experts}
MODELS = {
    "llama": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", dict(mlp_only_layers=[0])),
}
# (model, rewrites, layout): 1-D layouts of tests.support.layouts on 3 ranks; "ep_tpN" on a 2 x 2 mesh.
CASES = {
    3: [
        ("llama", ("qkv", "gate_up"), "shard0"),
        ("llama", ("qkv", "gate_up"), "shard_last"),
        ("llama", ("gate_up", "qkv"), "strided"),
        ("mixtral", ("qkv", "experts"), "shard0"),
    ],
    4: [
        ("mixtral", ("experts", "qkv"), "ep_tp2"),
        ("mixtral", ("experts",), "ep_tp1"),
        ("qwen3_moe", ("qkv", "experts", "gate_up"), "ep_tp2"),
    ],
}


def _case_id(case) -> str:
    return f"{case[0]}-{'+'.join(case[1])}-{case[2]}"


def _apply_ep_tp(model: nn.Module, tp_dim: int) -> None:
    """Experts ``[Shard(0), Shard(tp_dim)]`` (EP outer, TP inner); 2-D ``[Replicate, Shard(0)]``;
    1-D replicated. Local shards filled with NaN, so an element the load forgets shows."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in replaced:
                placements = {3: [Shard(0), Shard(tp_dim)], 2: [Replicate(), Shard(0)]}.get(
                    param.dim(), [Replicate(), Replicate()])
                dt = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
                replaced[id(param)] = nn.Parameter(dt, requires_grad=False)
            module.register_parameter(name, replaced[id(param)])
    with torch.no_grad():
        for param in replaced.values():
            param.to_local().fill_(float("nan"))


def _load_one(rank: int, world: int, path: str, name: str, rewrites: tuple[str, ...], layout: str) -> dict:
    model_type, overrides = MODELS[name]
    with torch.device("meta"):
        model = model_class(model_type)(tiny_config(model_type, **overrides)).float()
    for rewrite in rewrites:
        REWRITES[rewrite](model)
    model.to_empty(device="cpu")
    model.tie_weights()
    if layout.startswith("ep_tp"):
        _apply_ep_tp(model, int(layout[-1]))
    else:
        apply_layout(model, layout, world)
    reader = HFStorageReader(path, coalesce_gap=0)
    planner = HFMappingPlanner(model)
    report = load_hf_checkpoint(model, path, reader=reader, planner=planner)
    state = model.state_dict()
    values = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
    itemsize = {k: {reader.entries[s].itemsize for s in planner.composition.source_keys(k)} for k in planner.filled}
    return {
        "values": values if rank == 0 else None,
        "missing": report.missing_keys,
        "unexpected": report.unexpected_keys,
        "deferred": planner.stats.deferred_targets,
        "bytes_read": reader.stats.total().bytes_read,
        "bytes_needed": planner.stats.bytes_needed,
        "own_bytes": sum(local[k].numel() * size for k, (size,) in itemsize.items()),
    }


def _rewrite_after_parallelizing(world: int, path: str) -> str:
    """Rewrites run before sharding; on DTensors they must refuse, not guess."""
    with torch.device("meta"):
        model = model_class("llama")(tiny_config("llama")).float()
    model.to_empty(device="cpu")
    apply_layout(model, "shard0", world)
    try:
        fuse_qkv(model)
    except MappingError as error:
        return str(error)
    return "no error"


def _run(rank: int, world: int, cases: list, paths: dict[str, str]) -> dict:
    out = {_case_id(case): _load_one(rank, world, paths[case[0]], *case) for case in cases}
    out["after_parallelizing"] = _rewrite_after_parallelizing(world, paths["llama"])
    return out


@pytest.fixture(scope="module", params=sorted(CASES), ids=lambda w: f"world{w}")
def results(request, tiny_checkpoints):
    world = request.param
    checkpoints = {name: tiny_checkpoints(model_type, torch.bfloat16, **overrides)
                   for name, (model_type, overrides) in MODELS.items()}
    paths = {name: str(ckpt.path) for name, ckpt in checkpoints.items()}
    per_rank = run_ranks(world, _run, CASES[world], paths, timeout=300)
    pretrained = {}
    references = {}
    for name, rewrites, _ in CASES[world]:
        if name not in pretrained:
            ckpt = checkpoints[name]
            pretrained[name] = model_class(ckpt.model_type).from_pretrained(ckpt.path, dtype=torch.float32)
        if (name, rewrites) not in references:
            reference = copy.deepcopy(pretrained[name])
            for rewrite in rewrites:
                REWRITES[rewrite](reference)
            references[name, rewrites] = reference.state_dict()
    return world, per_rank, references


def test_values_equal_rewritten_from_pretrained(results):
    world, per_rank, references = results
    for name, rewrites, layout in CASES[world]:
        got, expected = per_rank[0][_case_id((name, rewrites, layout))]["values"], references[name, rewrites]
        assert list(got) == list(expected)
        assert not [k for k in expected if not torch.equal(got[k], expected[k])], (name, rewrites, layout)
        assert all(not r[_case_id((name, rewrites, layout))]["missing"] for r in per_rank)
        assert all(not r[_case_id((name, rewrites, layout))]["unexpected"] for r in per_rank)


def test_each_rank_reads_exactly_its_shards(results):
    world, per_rank, _ = results
    for rank, result in enumerate(per_rank):
        for case in CASES[world]:
            stats = result[_case_id(case)]
            assert stats["deferred"] == 0, (rank, case)
            assert stats["bytes_read"] == stats["bytes_needed"] == stats["own_bytes"] > 0, (rank, case, stats)


def test_rewrites_refuse_sharded_models(results):
    _, per_rank, _ = results
    assert all("already DTensors; apply the rewrite before parallelizing" in r["after_parallelizing"]
               for r in per_rank)
