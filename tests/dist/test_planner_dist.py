"""Oracle tests: sharded loads on 2-4 gloo ranks equal transformers' single-process from_pretrained.

Every parameter's ``full_tensor()`` must be bit-identical to ``from_pretrained`` of the same
checkpoint, for every tiny model type and layout (uneven shards, ``_StridedShard`` contiguous and
not, 2-D meshes, ``Replicate``, tied weights, bf16 checkpoints into fp32 models), for both loaders;
and the ``dcp`` loader reads exactly the checkpoint bytes its shards need.
"""

from __future__ import annotations

import pytest
import torch

from hp_dcp_hf import HFMappingPlanner, HFStorageReader, load_hf_checkpoint
from hp_dcp_hf.geometry.shards import local_tensor
from hp_dcp_hf.tools.launch import run_ranks
from tests.support.layouts import LAYOUTS_1D, LAYOUTS_2D, apply_layout
from tests.support.models import MODEL_TYPES, load_reference, model_class, tiny_config

MOE = ("mixtral", "qwen3_moe", "sarvam_moe", "qwen3_vl_moe")


def _case_id(case) -> str:
    model_type, _, layout, loader, model_dtype = case
    return f"{model_type}-{layout}-{loader}-{str(model_dtype).removeprefix('torch.')}"


def _load_one(world: int, path: str, model_type: str, layout: str, loader: str, model_dtype: torch.dtype) -> dict:
    config = tiny_config(model_type)
    torch.manual_seed(1)
    model = model_class(model_type)(config).to(model_dtype)
    apply_layout(model, layout, world)
    reader = HFStorageReader(path, coalesce_gap=0)
    planner = HFMappingPlanner(model, trace=loader == "dcp")
    report = load_hf_checkpoint(model, path, loader=loader, reader=reader, planner=planner)
    reference = load_reference(path, model_type, model_dtype)
    state = model.state_dict()
    bad = sorted(k for k, v in state.items() if not torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, reference[k]))
    own = sum(local_tensor(state[k]).numel() * _source_itemsize(planner, reader, k) for k in planner.filled)
    return {
        "bad": bad,
        "missing": report.missing_keys,
        "unexpected": report.unexpected_keys,
        "bytes_read": reader.stats.total().bytes_read,
        "bytes_needed": planner.stats.bytes_needed,
        "own_bytes": own,
        "deferred": planner.stats.deferred_targets,
        "header_requests": reader.stats.total().header_requests,
    }


def _source_itemsize(planner, reader, target: str) -> int:
    (itemsize,) = {reader.entries[key].itemsize for key in planner.composition.source_keys(target)}
    return itemsize



def _run_cases(rank: int, world: int, cases: list) -> dict:
    return {_case_id(case): _load_one(world, *case[1:2], case[0], *case[2:]) for case in cases}


def _cases(world: int, paths: dict[str, str]) -> list:
    layouts = LAYOUTS_1D + (LAYOUTS_2D if world == 4 else ())
    cases = []
    for model_type in MODEL_TYPES:
        for layout in layouts:
            if layout == "ep_tp" and model_type not in MOE:
                continue
            cases.append((model_type, paths[model_type], layout, "dcp", torch.float32))
        cases.append((model_type, paths[model_type], layouts[-1], "legacy", torch.float32))
    cases.append(("llama", paths["llama"], "shard0", "dcp", torch.bfloat16))
    return cases


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"world{w}")
def results(request, tiny_checkpoints):
    world = request.param
    paths = {m: str(tiny_checkpoints(m, torch.bfloat16).path) for m in MODEL_TYPES}
    cases = _cases(world, paths)
    per_rank = run_ranks(world, _run_cases, cases, timeout=400)  # inside pytest's 600 s
    return world, cases, per_rank


def test_every_parameter_equals_from_pretrained(results):
    world, cases, per_rank = results
    failures = {
        (rank, case): r[case]["bad"][:3]
        for rank, r in enumerate(per_rank) for case in r if r[case]["bad"]
    }
    assert not failures
    assert all(not r[c]["missing"] and not r[c]["unexpected"] for r in per_rank for c in r)


def test_dcp_reads_exactly_the_bytes_its_shards_need(results):
    world, cases, per_rank = results
    for rank, r in enumerate(per_rank):
        for case, stats in r.items():
            if "-dcp-" not in case:
                continue
            assert stats["deferred"] == 0, case
            assert stats["bytes_read"] == stats["bytes_needed"] == stats["own_bytes"], (rank, case, stats)


def test_legacy_reads_whole_tensors(results):
    world, cases, per_rank = results
    total_needed = {c: sum(r[c]["own_bytes"] for r in per_rank) for c in per_rank[0] if "-legacy-" in c}
    for case, needed in total_needed.items():
        read = sum(r[case]["bytes_read"] for r in per_rank)
        assert read >= needed


def test_only_rank_zero_reads_headers(results):
    world, cases, per_rank = results
    assert all(r[c]["header_requests"] == 0 for r in per_rank[1:] for c in r)
    assert all(per_rank[0][c]["header_requests"] > 0 for c in per_rank[0])
