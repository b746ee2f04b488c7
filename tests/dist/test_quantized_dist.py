"""Quantized checkpoints on 4 gloo ranks: every layout reads only its quantized boxes and the
scales covering them, and loads exactly the dequantized values (FP8 block-scaled DeepSeek-V3 and
Qwen3-MoE, MXFP4 gpt-oss experts).

Each case loads the quantized checkpoint and its dequantized twin (``tests/support/quantized.py``) through
``from_pretrained`` with the same mesh and rewrites; every parameter's ``full_tensor()`` must be
bit-identical between the two (the twin's loads are themselves checked against transformers in
the other dist tests), and, for the unrewritten cases, to transformers' single-process load of the
twin. Layouts: FSDP2 over TP (``dp=2,tp=2``: ``_StridedShard``), EP over 4 ranks, a 4-way row split
(``dp=4``: 19 and 17 rows cut 5/5/5/4 and 5/4/4/4, borders inside the 16-row scale blocks), and
the MoE rewrites (``fuse_qkv``, ``grouped_gemm_experts``) under ``dp=2,tp=2``; gpt-oss's MXFP4
experts under ``dp=2,tp=2``, ``ep=4`` and ``tp=4``.
"""

from __future__ import annotations

import pytest
import torch

from hp_dcp_hf.tools.launch import run_ranks
from tests.support.families import family_model_class, load_family_reference
from tests.support.quantized import make_fp8_checkpoint, make_mxfp4_checkpoint

CHECKPOINTS = {  # name -> (model type, make_fp8_checkpoint options; None: MXFP4)
    "deepseek_v3": ("deepseek_v3", {}),
    "qwen3_moe": ("qwen3_moe", {"scale_dtype": torch.bfloat16, "scales_apart": True}),
    "gpt_oss": ("gpt_oss", None),
}
CASES = {  # name -> (checkpoint, mesh, transforms)
    "deepseek_v3-dp2tp2": ("deepseek_v3", "dp=2,tp=2", ()),
    "deepseek_v3-ep4": ("deepseek_v3", "ep=4", ()),
    "deepseek_v3-dp4": ("deepseek_v3", "dp=4", ()),
    "qwen3_moe-dp2tp2": ("qwen3_moe", "dp=2,tp=2", ()),
    "qwen3_moe-ep4": ("qwen3_moe", "ep=4", ()),
    "qwen3_moe-rewritten": ("qwen3_moe", "dp=2,tp=2", ("fuse_qkv", "grouped_gemm_experts")),
    "gpt_oss-dp2tp2": ("gpt_oss", "dp=2,tp=2", ()),
    "gpt_oss-ep4": ("gpt_oss", "ep=4", ()),
    "gpt_oss-tp4": ("gpt_oss", "tp=4", ()),
}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _run(rank: int, world: int, paths: dict) -> dict:
    import warnings

    from hp_dcp_hf import from_pretrained

    out = {}
    for name, (checkpoint, mesh, transforms) in CASES.items():
        model_cls = family_model_class(CHECKPOINTS[checkpoint][0])
        states, reports = {}, {}
        for kind in ("fp8", "twin"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, report = from_pretrained(paths[checkpoint][kind], model_cls=model_cls, dtype=torch.bfloat16,
                                                transforms=transforms, distributed_config=mesh)
            states[kind] = {k: _full(v) for k, v in model.state_dict().items()}  # every rank: collectives
            reports[kind] = report
        report = reports["fp8"]
        out[name] = {
            "states": states if rank == 0 else None,
            "missing": report.missing_keys, "unexpected": report.unexpected_keys,
            "bytes_needed": report.plan.bytes_needed, "bytes_read": report.read.bytes_read,
            "bytes_by_key": dict(report.plan.bytes_by_key),
            "unsharded": [str(u) for u in report.unsharded],
        }
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    checkpoints = {
        name: make_mxfp4_checkpoint(tmp_path_factory.mktemp(name)) if options is None
        else make_fp8_checkpoint(model_type, tmp_path_factory.mktemp(name), **options)
        for name, (model_type, options) in CHECKPOINTS.items()
    }
    paths = {name: {"fp8": str(c.path), "twin": str(c.twin)} for name, c in checkpoints.items()}
    per_rank = run_ranks(4, _run, paths, timeout=400)
    references = {
        name: load_family_reference(c.twin, CHECKPOINTS[name][0], torch.bfloat16) for name, c in checkpoints.items()
    }
    return per_rank, checkpoints, references


@pytest.mark.parametrize("case", list(CASES))
def test_bit_identical_to_the_dequantized_twin(run, case):
    per_rank, _, references = run
    checkpoint, _, transforms = CASES[case]
    states = per_rank[0][case]["states"]
    assert set(states["fp8"]) == set(states["twin"])
    assert not sorted(k for k, v in states["fp8"].items() if not torch.equal(v, states["twin"][k]))
    if not transforms:
        reference = references[checkpoint]
        assert set(states["fp8"]) == set(reference)
        assert not sorted(k for k, v in reference.items() if not torch.equal(states["fp8"][k], v))


@pytest.mark.parametrize("case", list(CASES))
def test_reads_what_the_plan_needs(run, case):
    per_rank, _, _ = run
    for result in per_rank:
        assert result[case]["missing"] == () and result[case]["unexpected"] == ()
        assert result[case]["bytes_read"] == result[case]["bytes_needed"] > 0


def test_row_split_reads_each_fp8_byte_once(run):
    """dp=4 shards every weight disjointly: over the ranks, each FP8 weight byte is read exactly
    once, and each rank reads scale rows only where its weight rows are."""
    per_rank, checkpoints, _ = run
    checkpoint = checkpoints["deepseek_v3"]
    from safetensors import safe_open

    stored = {}
    for file in checkpoint.path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            stored.update({k: f.get_slice(k).get_shape() for k in f.keys()})  # noqa: SIM118
    for key in checkpoint.quantized:
        rows, cols = stored[key]
        read = [r["deepseek_v3-dp4"]["bytes_by_key"].get(key, 0) for r in per_rank]
        assert sum(read) == rows * cols, key  # float8: one byte each
        scale_rows = [r["deepseek_v3-dp4"]["bytes_by_key"].get(key + "_scale_inv", 0) for r in per_rank]
        assert all((w > 0) == (s > 0) for w, s in zip(read, scale_rows)), key


def test_experts_split_over_ep(run):
    per_rank, _, _ = run
    for case in ("deepseek_v3-ep4", "qwen3_moe-ep4", "gpt_oss-ep4"):
        assert not [u for u in per_rank[0][case]["unsharded"] if "ep" in u.split(":")[0]], case
