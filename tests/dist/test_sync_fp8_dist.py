"""FP8 refit on 4 and 2 gloo ranks: ``HFWeightSource(model, quantize=...)`` gives each trainer rank
the FP8 weights and ``weight_scale_inv`` boxes the FP8 save writes, and the slices assembled over
the ranks are, byte for byte, the one-process ``save_hf_checkpoint(quantize=)`` of the model, which
is transformers' ``Fp8Quantize`` of the full tensors (kept weights as they are). Every layout here
splits scale blocks between ranks (FSDP2 rows of 10 or 11 inside 16-row blocks, TP and FSDP cuts at
row and column 100 inside 128 x 128 blocks, fused q/k/v and gate/up in TP rank order), so each
block's amax is the one ``snapshot()`` agrees across the ranks that hold parts of it.

After a step (every parameter changed in place) and the next ``snapshot()``, the slices are the FP8
save the ranks write of the stepped model: no scale is stale. Reading FP8 slices before the first
snapshot is a :class:`SyncError`; scales are never zero.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.quant.encode import CeilGrids, fp8_config
from hp_dcp_hf.tools.launch import run_ranks
from tests.support.checkpoints import SHARD
from tests.support.families import family_model_class, save_family_model
from tests.support.fp8 import BLOCK16, FP8, MIXED, assert_fp8_of, bits, llama, tensors

LLAMA_128 = {"hidden_size": 200, "intermediate_size": 260, "head_dim": 50}  # TP/FSDP cuts at 100, 130
MODELS = {  # checkpoint -> (sizes, quantize)
    "llama": ({}, CeilGrids(BLOCK16)),
    "llama128": (LLAMA_128, CeilGrids("fp8")),
    "mixed32x64": (MIXED, {"quant_method": "fp8", "weight_block_size": [32, 64]}),  # down_proj kept in bf16
}
CASES_4 = {  # name -> (checkpoint, mesh, transforms)
    "llama-dp4": ("llama", "dp=4", ()),
    "llama-fused-dp2tp2": ("llama", "dp=2,tp=2", ("fuse_qkv", "fuse_gate_up")),
    "mixed32x64-dp2tp2": ("mixed32x64", "dp=2,tp=2", ()),
}
CASES_2 = {
    "llama128-dp2": ("llama128", "dp=2", ()),
    "llama128-tp2": ("llama128", "tp=2", ()),
}


def _held(source) -> list[tuple[str, tuple, tuple, torch.Tensor]]:
    """Every slice this rank holds, as (name, offsets, sizes, its bytes)."""
    return [(held.name, held.box.offsets, held.box.sizes, bits(values).clone()) for held, values in source]


def _refit(rank: int, world: int, cases: dict, paths: dict, out: str) -> dict:
    import warnings

    from hp_dcp_hf import from_pretrained, save_hf_checkpoint
    from hp_dcp_hf.errors import SyncError
    from hp_dcp_hf.sync.source import HFWeightSource

    results = {}
    for name, (checkpoint, mesh, transforms) in cases.items():
        quantize = MODELS[checkpoint][1]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = from_pretrained(paths[checkpoint], model_cls=family_model_class("llama"),
                                       distributed_config=mesh, transforms=transforms)
        source = HFWeightSource(model, quantize=quantize)
        fp8 = next(i for i, s in enumerate(source.slices()) if source.meta(s.name).dtype == FP8)
        with pytest.raises(SyncError, match="after snapshot"):
            source.read(fp8)
        source.snapshot()
        first = _held(source)
        with torch.no_grad():  # a step: every parameter changes in place
            for parameter in model.parameters():
                parameter.mul_(-1.5)
        source.snapshot()
        results[name] = {"metadata": source.metadata(), "first": first, "stepped": _held(source),
                         "held_bytes": source.held_bytes}
        save_hf_checkpoint(model, os.path.join(out, name), quantize=quantize)
    return results


def _assembled(metadata, per_rank: list[list]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors the ranks' slices make, each element from exactly one slice."""
    full = {m.name: torch.zeros((*m.shape, m.dtype.itemsize), dtype=torch.uint8) for m in metadata}
    count = {m.name: torch.zeros(m.shape, dtype=torch.int32) for m in metadata}
    for held in per_rank:
        for name, offsets, sizes, data in held:
            where = Box(offsets, sizes).slices()
            full[name][where] = data.view(torch.uint8).reshape(*sizes, -1)
            count[name][where] += 1
    assert all(bool((c == 1).all()) for c in count.values())
    return {m.name: full[m.name].flatten().view(m.dtype).reshape(m.shape) for m in metadata}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each model's bf16 checkpoint (save_pretrained's) and its FP8 save in one process."""
    from hp_dcp_hf import save_hf_checkpoint

    root = tmp_path_factory.mktemp("sync-fp8-dist")
    paths = {}
    for checkpoint, (sizes, quantize) in MODELS.items():
        model = llama(**sizes)
        paths[checkpoint] = str(save_family_model(model, root / checkpoint, SHARD))
        save_hf_checkpoint(model, root / f"{checkpoint}-fp8", quantize=quantize)
    return root, paths


@pytest.fixture(scope="module")
def refit_4(checkpoints):
    root, paths = checkpoints
    return run_ranks(4, _refit, CASES_4, paths, str(root / "out4"), timeout=400)


@pytest.fixture(scope="module")
def refit_2(checkpoints):
    root, paths = checkpoints
    return run_ranks(2, _refit, CASES_2, paths, str(root / "out2"), timeout=400)


def _check(root, out: str, cases: dict, per_rank: list[dict], tmp_path) -> None:
    for name, (checkpoint, _, _) in cases.items():
        quantize = MODELS[checkpoint][1]
        metadata = per_rank[0][name]["metadata"]
        assert all(r[name]["metadata"] == metadata for r in per_rank), name
        saved = tensors(root / f"{checkpoint}-fp8")
        assert {m.name: (m.dtype, m.shape) for m in metadata} == {k: (v.dtype, tuple(v.shape))
                                                                   for k, v in saved.items()}, name
        for update, expected in (("first", saved), ("stepped", tensors(root / out / name))):
            sent = _assembled(metadata, [r[name][update] for r in per_rank])
            assert not [k for k, v in expected.items() if not torch.equal(bits(sent[k]), bits(v))], (name, update)
            assert all(bool((v > 0).all()) for k, v in sent.items() if k.endswith("weight_scale_inv")), name
        (tmp_path / name).mkdir()
        save_file(_assembled(metadata, [r[name]["first"] for r in per_rank]), tmp_path / name / "model.safetensors")
        block = tuple(fp8_config(quantize).weight_block_size)
        assert assert_fp8_of(tmp_path / name, root / checkpoint, block, isinstance(quantize, CeilGrids)), name
        assert sum(r[name]["held_bytes"] for r in per_rank) == sum(v.numel() * v.element_size()
                                                                   for v in saved.values()), name


def test_4_ranks_send_what_the_fp8_save_writes(checkpoints, refit_4, tmp_path):
    root, _ = checkpoints
    _check(root, "out4", CASES_4, refit_4, tmp_path)


def test_2_ranks_send_what_the_fp8_save_writes(checkpoints, refit_2, tmp_path):
    root, _ = checkpoints
    _check(root, "out2", CASES_2, refit_2, tmp_path)
