"""The family matrix under parallelism: the families of :data:`tests.support.families.DIST_FAMILIES`
(together they use every kind of conversion op of transformers' table; ``tests/test_families.py``
loads all of them in one process and checks that cover) load through ``hp_dcp_hf.from_pretrained``
on 2 gloo ranks with FSDP2 (``dp=2``) and with transformers' tp plan (``tp=2``), and a
representative MoE subset on 4 ranks (``dp=2,tp=2`` and ``ep=4``); every parameter's
``full_tensor()`` is bit-identical to transformers' single-process ``from_pretrained``.

One process group per world size loops over the families (spawning is the expensive part). Each
rank-0 result is compared against the oracle in the test process. The checkpoints (fp32, 100 KB
shards: the larger families span several files plus an index) are written once per session.
Families whose class has no tp plan load whole under ``tp=2`` and say so in ``report.unsharded``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hp_dcp_hf.tools.launch import run_ranks
from tests.support.families import (
    DIST_FAMILIES,
    MOE_FAMILIES,
    family_model_class,
    load_family_reference,
    make_family_checkpoint,
)

MESHES_2 = ("dp=2", "tp=2")
MESHES_4 = ("dp=2,tp=2", "ep=4")
#: Every MoE routing/expert layout kind at 4 ranks: Mixtral-style, Qwen2/3-MoE with shared experts,
#: DeepSeek-V3 (MLA, grouped routing), OLMoE, GLM-4-MoE, and Qwen3-VL-MoE (transposed experts).
MOE_SUBSET = tuple(t for t in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "glm4_moe", "qwen3_vl_moe")
                   if t in MOE_FAMILIES)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _run(rank: int, world: int, paths: dict[str, str], meshes: tuple[str, ...]) -> dict:
    from hp_dcp_hf import from_pretrained

    out: dict = {}
    for family, path in paths.items():
        for mesh in meshes:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model, report = from_pretrained(path, dtype=torch.float32, model_cls=family_model_class(family), distributed_config=mesh)
                state = {k: _full(v) for k, v in model.state_dict().items()}  # every rank: collectives
                out[(family, mesh)] = {"state": state if rank == 0 else None, "missing": report.missing_keys,
                                       "unexpected": report.unexpected_keys,
                                       "unsharded": [str(u) for u in report.unsharded]}
            except Exception as error:  # noqa: BLE001 - reported per family, the loop goes on
                out[(family, mesh)] = {"error": f"{type(error).__name__}: {error}"}
    return out


def _checkpoints(root, families) -> dict[str, str]:
    return {family: str(make_family_checkpoint(family, root / family, max_shard_size="100KB")) for family in families}


def _check(result: dict, paths: dict[str, str], meshes: tuple[str, ...]) -> list[str]:
    problems = []
    for family, path in paths.items():
        reference = load_family_reference(path, family)
        for mesh in meshes:
            r = result[(family, mesh)]
            if "error" in r:
                problems.append(f"{family} {mesh}: {r['error']}")
                continue
            if r["missing"] or r["unexpected"]:
                problems.append(f"{family} {mesh}: missing {r['missing']}, unexpected {r['unexpected']}")
            if sorted(r["state"]) != sorted(reference):
                problems.append(f"{family} {mesh}: keys differ")
                continue
            bad = sorted(k for k, v in r["state"].items() if not torch.equal(v, reference[k]))
            if bad:
                problems.append(f"{family} {mesh}: {len(bad)} tensors differ, e.g. {bad[:3]}")
    return problems


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_op_cover_on_2_ranks(tmp_path_factory):
    paths = _checkpoints(tmp_path_factory.mktemp("families"), DIST_FAMILIES)
    per_rank = run_ranks(2, _run, paths, MESHES_2, timeout=400)
    assert not _check(per_rank[0], paths, MESHES_2)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_moe_subset_on_4_ranks(tmp_path_factory):
    assert len(MOE_SUBSET) >= 6
    paths = _checkpoints(tmp_path_factory.mktemp("moe_families"), MOE_SUBSET)
    per_rank = run_ranks(4, _run, paths, MESHES_4, timeout=400)
    assert not _check(per_rank[0], paths, MESHES_4)
    for family in MOE_SUBSET:
        assert per_rank[0][(family, "ep=4")]["unsharded"] == [], family  # experts really split over ep
