"""compressed-tensors checkpoints on 4 gloo ranks: every layout loads exactly the values
compressed-tensors' own decompression gives, reading only its packed units and the scales and zero
points covering them.

The checkpoints and their oracle twins are ``tests/support/compressed.py``'s (written by compressed-tensors'
compressors, decompressed by its ``ModelCompressor``). Each case loads the compressed checkpoint
through ``from_pretrained`` on one spawned world of 4 ranks, reused by every case (4-way meshes, and
2 x 2 ones whose dims cut in 2); each parameter's ``full_tensor()`` must be bit-identical to
transformers' single-process load of the twin in the model dtype, or, with rewrites, to the twin
loaded with the same mesh and rewrites. Shard borders fall inside int32 words (tp=4: 12 of 48
columns, 8 values a word; 3-bit units of 32 values cut at 24 by tp=2), inside INT4 groups and
NVFP4's 16-value blocks (24 or 12 of 48 columns), inside zero-point words (12 of 48 rows, 8 rows a
word; the 101-row ``lm_head`` cut 26/26/26/23), inside 16 x 16 FP8 blocks of DeepSeek-V3's ceil
grids (19 rows cut 5/5/5/4), and experts go to their EP ranks. Each rank's reads are the plan's,
and its quantized and scale bytes those ``plan_ranks`` computes for it without a process group.
"""

from __future__ import annotations

import pytest
import torch

from hp_dcp_hf.tools.launch import run_ranks
from hp_dcp_hf.tools.rank_plans import plan_ranks
from tests.support.compressed import make_case, read_tensors
from tests.support.families import family_model_class, load_family_reference

#: name -> (checkpoint case of tests/support/compressed.py, mesh, transforms, model dtype)
CASES = {
    "w4a16-asym-tp4": ("w4a16-asym", "tp=4", (), torch.bfloat16),
    "w4a16-asym-dp4": ("w4a16-asym", "dp=4", (), torch.float32),
    "w3a16-dp2tp2": ("w3a16", "dp=2,tp=2", (), torch.bfloat16),
    "nvfp4-tp4": ("nvfp4", "tp=4", (), torch.bfloat16),
    "nvfp4-ep4": ("nvfp4", "ep=4", (), torch.float32),
    "mixed-rewritten": ("mixed", "dp=2,tp=2", ("fuse_qkv", "grouped_gemm_experts"), torch.bfloat16),
    "fp8-block-dp4": ("fp8-block", "dp=4", (), torch.float32),
    "fp8-channel-ep4": ("fp8-channel", "ep=4", (), torch.float32),
    "mxfp4-tp4": ("mxfp4", "tp=4", (), torch.float32),
    "int8-asym-group-dp2tp2": ("int8-asym-group", "dp=2,tp=2", (), torch.bfloat16),
}
#: the same on a world of 2 ranks (column borders inside INT4 words and NVFP4 blocks, rows split)
CASES_2 = {
    "w4a16-asym-tp2": ("w4a16-asym", "tp=2", (), torch.bfloat16),
    "nvfp4-dp2": ("nvfp4", "dp=2", (), torch.float32),
}
ALL_CASES = {**CASES, **CASES_2}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _run(rank: int, world: int, paths: dict, cases: dict) -> dict:
    import warnings

    from hp_dcp_hf import from_pretrained

    out = {}
    for name, (checkpoint, mesh, transforms, dtype) in cases.items():
        path, twin, model_type = paths[checkpoint]
        states = {}
        for kind, where in (("compressed", path), ("twin", twin)):
            if kind == "twin" and not transforms:
                continue  # compared with transformers' own load of the twin instead
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, report = from_pretrained(
                    where,
                    model_cls=family_model_class(model_type),
                    dtype=dtype,
                    transforms=transforms,
                    distributed_config=mesh,
                )
            states[kind] = {k: _full(v) for k, v in model.state_dict().items()}  # every rank: collectives
            if kind == "compressed":
                result = {
                    "missing": report.missing_keys,
                    "unexpected": report.unexpected_keys,
                    "bytes_needed": report.plan.bytes_needed,
                    "bytes_read": report.read.bytes_read,
                    "quantized_bytes": report.plan.quantized_bytes,
                    "scale_bytes": report.plan.scale_bytes,
                    "bytes_by_key": dict(report.plan.bytes_by_key),
                    "unsharded": [str(u) for u in report.unsharded],
                }
        out[name] = {**result, "states": states if rank == 0 else None}
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    needed = sorted({checkpoint for checkpoint, *_ in ALL_CASES.values()})
    return {name: make_case(name, tmp_path_factory.mktemp(name)) for name in needed}


@pytest.fixture(scope="module")
def run(checkpoints):
    """Every case's per-rank results, from one spawned world of 4 ranks and one of 2."""
    paths = {name: (str(c.path), str(c.twin), c.model_type) for name, c in checkpoints.items()}
    out = {}
    for world, cases in ((4, CASES), (2, CASES_2)):
        per_rank = run_ranks(world, _run, paths, cases, timeout=400)
        out.update({name: [rank_result[name] for rank_result in per_rank] for name in cases})
    return out


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_bit_identical_to_compressed_tensors(run, checkpoints, case):
    name, _, transforms, dtype = ALL_CASES[case]
    states = run[case][0]["states"]
    if transforms:
        expected = states["twin"]
    else:
        checkpoint = checkpoints[name]
        expected = load_family_reference(checkpoint.twin, checkpoint.model_type, dtype)
    ours = states["compressed"]
    assert set(ours) == set(expected)
    assert {v.dtype for v in ours.values() if v.is_floating_point()} >= {dtype}
    assert not sorted(k for k, v in expected.items() if not torch.equal(ours[k], v))


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_each_rank_reads_what_it_needs(run, case):
    for result in run[case]:
        assert result["missing"] == () and result["unexpected"] == ()
        assert result["bytes_read"] == result["bytes_needed"] > 0
        assert result["quantized_bytes"] > 0 and result["scale_bytes"] > 0


@pytest.mark.parametrize("case", ["w4a16-asym-tp4", "w4a16-asym-dp4", "nvfp4-tp4", "fp8-block-dp4", "w4a16-asym-tp2"])
def test_each_rank_reads_what_plan_ranks_says(run, checkpoints, case):
    """Each rank's quantized and scale bytes are those ``plan_ranks`` computes for its coordinate
    without a process group (the reads the one-process tests check box by box)."""
    name, mesh, transforms, dtype = ALL_CASES[case]
    plan = plan_ranks(str(checkpoints[name].path), mesh, transforms=transforms, dtype=dtype)
    for result, rank_plan in zip(run[case], plan["ranks"]):
        assert (result["bytes_needed"], result["quantized_bytes"], result["scale_bytes"]) == (
            rank_plan.bytes_needed,
            rank_plan.quantized_bytes,
            rank_plan.scale_bytes,
        )


@pytest.mark.parametrize("case", ["w4a16-asym-dp4", "fp8-block-dp4"])
def test_dp4_reads_each_quantized_byte_once(run, checkpoints, case):
    """dp=4 cuts every weight in rows: over the 4 ranks, each stored packed (or FP8) byte is read
    exactly once; each rank reads scales only for rows it holds."""
    name, *_ = CASES[case]
    stored = read_tensors(checkpoints[name].path)
    data = [k for k in stored if k.endswith("weight_packed")] or [
        k for k in stored if k.endswith(".weight") and f"{k}_scale" in stored
    ]
    for key in data:
        read = [r["bytes_by_key"].get(key, 0) for r in run[case]]
        assert sum(read) == stored[key].numel() * stored[key].element_size(), key
        scales = [r["bytes_by_key"].get(key.rpartition(".")[0] + ".weight_scale", 0) for r in run[case]]
        assert all((w > 0) == (s > 0) for w, s in zip(read, scales)), key


def test_tp4_reads_the_words_across_column_borders(run, checkpoints):
    """Row-wise TP over 4 ranks cuts o_proj's 48 input columns at 12, 24, 36: rank r reads INT4
    words [12r // 8, ceil(12(r + 1) / 8)) of every row (the words at 12 and 36 twice over the
    world), and the zero-point words of all 48 rows."""
    key = "model.layers.0.self_attn.o_proj"
    for rank, result in enumerate(run["w4a16-asym-tp4"]):
        words = -(-12 * (rank + 1) // 8) - 12 * rank // 8
        assert result["bytes_by_key"][f"{key}.weight_packed"] == 48 * words * 4
        assert (
            result["bytes_by_key"][f"{key}.weight_zero_point"]
            == 6 * (-(-12 * (rank + 1) // 16) - 12 * rank // 16) * 4
        )


def test_experts_split_over_ep(run):
    for case in ("nvfp4-ep4", "fp8-channel-ep4"):
        assert not [u for u in run[case][0]["unsharded"] if "ep" in u.split(":")[0]], case
