"""FP8 saves on 4 and 2 gloo ranks: each rank quantizes and writes only its own boxes, and the
files are byte for byte the ones one process writes (which are transformers' ``Fp8Quantize`` of the
full tensors: ``tests/test_save_fp8.py``), also where TP and FSDP borders fall inside scale blocks.
A model whose projections are and are not whole blocks (of 128 x 128 and of 32 x 64) saves on
every layout to transformers' own FP8 checkpoint of its weights (its kept weights in bf16); the
others save with ``CeilGrids``, every projection FP8 on ceil grids.

Every layout here splits blocks between ranks: FSDP2 rows of 10 or 11 inside 16-row blocks
(``dp=4``), FSDP over TP with 128 x 128 blocks cut at row and column 100 (``dp=2,tp=2``; FSDP
alone cuts them at row 100 on 2 ranks), fused q/k/v and gate/up laid out in TP rank order, stacked
experts under TP, MLA with ceil grids. Ranks
agree on the split blocks' amax with one ``all_reduce(MAX)`` of those blocks only: under ``dp=4``
its size is counted here from the borders torch's chunking puts inside blocks. An FP8 checkpoint
loaded under ``dp=2,tp=2`` and saved back is byte-identical. A rank failing before its first byte
fails every rank, which all still meet in the reduction, and nothing is published.
"""

from __future__ import annotations

import os

import pytest
import torch

from hp_dcp_hf.quant.encode import CeilGrids, fp8_config
from hp_dcp_hf.tools.launch import run_ranks
from tests.support.checkpoints import SHARD, anonymized
from tests.support.families import build_family_model, family_model_class, save_family_model
from tests.support.fp8 import (
    BLOCK16,
    MIXED,
    assert_is_transformers_own,
    llama,
    tensors,
    transformers_fp8_model,
)

LLAMA_128 = {"hidden_size": 200, "intermediate_size": 260, "head_dim": 50}  # TP/FSDP cuts at 100, 130
MODELS = {  # checkpoint -> (model type, sizes, quantize)
    "llama": ("llama", {}, CeilGrids(BLOCK16)),
    "llama128": ("llama", LLAMA_128, CeilGrids("fp8")),
    "qwen3_moe": ("qwen3_moe", None, CeilGrids(BLOCK16)),
    "deepseek_v3": ("deepseek_v3", None, CeilGrids(BLOCK16)),
    "mixed": ("llama", MIXED, "fp8"),  # FSDP cuts rows 256 / 4 inside 128-blocks
    "mixed32x64": ("llama", MIXED, {"quant_method": "fp8", "weight_block_size": [32, 64]}),
}
TRANSFORMERS_OWN = ("mixed", "mixed32x64")  # checkpoints compared with transformers' own FP8 one too
CASES = {  # name -> (checkpoint, mesh, transforms); "-fp8": load the FP8 checkpoint one process saved
    "llama-dp4": ("llama", "dp=4", ()),
    "llama128-dp2tp2": ("llama128", "dp=2,tp=2", ()),
    "llama-fused": ("llama", "dp=2,tp=2", ("fuse_qkv", "fuse_gate_up")),
    "qwen3_moe-dp2tp2": ("qwen3_moe", "dp=2,tp=2", ()),
    "deepseek_v3-tp4": ("deepseek_v3", "tp=4", ()),
    "llama-fp8-dp2tp2": ("llama-fp8", "dp=2,tp=2", ()),
    "mixed-dp4": ("mixed", "dp=4", ()),
    "mixed32x64-dp2tp2": ("mixed32x64", "dp=2,tp=2", ()),
}
CASES_2 = {  # few cases: a world's start costs more than its saves (the suite's time)
    "llama128-dp2": ("llama128", "dp=2", ()),
    "mixed32x64-dp2": ("mixed32x64", "dp=2", ()),  # rows 352 / 2 inside 32-blocks
}


def _model(checkpoint: str):
    family, sizes, _ = MODELS[checkpoint]
    return build_family_model(family, dtype=torch.bfloat16) if sizes is None else llama(**sizes)


def _save(rank: int, world: int, cases: dict, paths: dict, out: str) -> dict:
    import warnings

    from hp_dcp_hf import HFSavePlanner, HFStorageWriter, from_pretrained, save_hf_checkpoint
    from hp_dcp_hf.errors import MappingError

    results = {}
    for name, (checkpoint, mesh, transforms) in cases.items():
        family, _, quantize = MODELS[checkpoint.removesuffix("-fp8")]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = from_pretrained(paths[checkpoint], model_cls=family_model_class(family),
                                       distributed_config=mesh, transforms=transforms)
            planner = HFSavePlanner(model, quantize=quantize)
            writer = HFStorageWriter(os.path.join(out, name), max_shard_size=SHARD)
            save_hf_checkpoint(model, os.path.join(out, name), planner=planner, writer=writer)
        results[name] = {"written": writer.bytes_written, "planned": planner.bytes_planned,
                         "reduced": writer.amax_reduced}
    if world == 4:  # rank 1 fails before its first byte: the others must not wait for it in the reduction
        planner = HFSavePlanner(model, quantize=quantize)
        if rank == 1:
            def unresolvable(item):
                raise MappingError("injected: no data for this item", key=item.index.fqn)

            planner.resolve_data = unresolvable
        try:
            save_hf_checkpoint(model, os.path.join(out, "failed"), planner=planner)
        except Exception as e:  # noqa: BLE001 - the test checks the type
            results["failed"] = f"{type(e).__name__}: {e}"
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each model's bf16 checkpoint (save_pretrained's), its FP8 save in one process and, for
    :data:`TRANSFORMERS_OWN`, transformers' own FP8 checkpoint of it."""
    from hp_dcp_hf import save_hf_checkpoint

    root = tmp_path_factory.mktemp("save-fp8-dist")
    paths = {}
    for checkpoint, (_, _, quantize) in MODELS.items():
        model = _model(checkpoint)
        paths[checkpoint] = str(save_family_model(model, root / checkpoint, SHARD))
        save_hf_checkpoint(model, root / f"{checkpoint}-fp8", quantize=quantize, max_shard_size=SHARD)
        paths[f"{checkpoint}-fp8"] = str(root / f"{checkpoint}-fp8")
        if checkpoint in TRANSFORMERS_OWN:
            transformers_fp8_model(model, fp8_config(quantize), root / f"{checkpoint}-bf16").save_pretrained(
                root / f"{checkpoint}-transformers")
            assert_is_transformers_own(root / f"{checkpoint}-fp8", root / f"{checkpoint}-transformers")  # 1 process
    return root, paths


@pytest.fixture(scope="module")
def saved_4(checkpoints):
    root, paths = checkpoints
    return run_ranks(4, _save, CASES, paths, str(root / "out4"), timeout=400)


@pytest.fixture(scope="module")
def saved_2(checkpoints):
    root, paths = checkpoints
    return run_ranks(2, _save, CASES_2, paths, str(root / "out2"), timeout=400)


def _files(path) -> dict[str, bytes]:
    return anonymized({p.name: p.read_bytes() for p in path.iterdir()})


def _check(root, out: str, cases: dict, per_rank: list[dict]) -> None:
    for name, (checkpoint, _, _) in cases.items():
        expected = root / f"{checkpoint.removesuffix('-fp8')}-fp8"
        assert _files(root / out / name) == _files(expected), name
        if checkpoint in TRANSFORMERS_OWN:
            assert_is_transformers_own(root / out / name, root / f"{checkpoint}-transformers")
        written = [r[name]["written"] for r in per_rank]
        assert written == [r[name]["planned"] for r in per_rank], name
        assert sum(written) == sum(v.numel() * v.element_size() for v in tensors(expected).values()), name  # once
        reduced = {r[name]["reduced"] for r in per_rank}
        assert len(reduced) == 1 and reduced.pop() > 0, name  # one reduction, of the same blocks on every rank


def test_4_ranks_write_what_one_process_writes(checkpoints, saved_4):
    root, _ = checkpoints
    _check(root, "out4", CASES, saved_4)


def test_2_ranks_write_what_one_process_writes(checkpoints, saved_2):
    root, _ = checkpoints
    _check(root, "out2", CASES_2, saved_2)


def test_the_reduction_carries_only_the_split_blocks(checkpoints, saved_4):
    """Under ``dp=4`` FSDP2 cuts every weight's rows as ``torch.chunk`` does (ceil(rows / 4) each):
    a 16-row block row is split where a cut falls strictly inside it, and then each of its blocks."""
    root, _ = checkpoints
    blocks = 0
    for value in tensors(root / "llama-fp8").values():
        if value.dtype == torch.float8_e4m3fn:
            rows, cols = value.shape
            cuts = [k * -(-rows // 4) for k in range(1, 4) if k * -(-rows // 4) < rows]
            split_rows = {cut // 16 for cut in cuts if cut % 16}
            blocks += len(split_rows) * -(-cols // 16)
    assert saved_4[0]["llama-dp4"]["reduced"] == blocks
    assert blocks < sum(v.numel() for k, v in tensors(root / "llama-fp8").items() if k.endswith("_scale_inv"))


def test_a_rank_failing_fails_every_rank_and_publishes_nothing(checkpoints, saved_4):
    root, _ = checkpoints
    failures = [r["failed"] for r in saved_4]
    assert all(f.startswith("MappingError") and "injected" in f for f in failures), failures
    assert not (root / "out4" / "failed").exists() or not any(
        p.suffix == ".safetensors" for p in (root / "out4" / "failed").iterdir())
