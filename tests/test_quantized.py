"""Quantized checkpoints (FP8 block-scaled, MXFP4) load into bf16 models as their dequantized
values, in one process.

The oracle is transformers' ``from_pretrained`` of the dequantized twin (``tests/support/quantized.py``):
the values transformers' own ``Fp8Dequantize`` gives on whole tensors, then its conversions. The
tiny DeepSeek-V3 has ceil scale grids everywhere (blocks of 16: the MLA ``kv_a_proj_with_mqa`` has
17 rows, ``q_a_proj`` 19, hidden size 44), per-expert FP8 weights that the conversion merges into
stacked experts, float32 scales; the tiny Qwen3-MoE has bf16 scales, stored in a file of their own.
The tiny gpt-oss stores its experts as MXFP4 blocks and E8M0 scales, its other weights in bf16.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import hp_dcp_hf
from hp_dcp_hf.errors import QuantizationError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.mapping.compose import TensorSpec
from hp_dcp_hf.quant.decode import BlockScaled, Mxfp4
from hp_dcp_hf.tools.rank_plans import plan_ranks
from tests.support.families import family_model_class, load_family_reference
from tests.support.quantized import (
    FP8,
    _edit,
    assert_refused_before_any_write,
    dequantize_reference,
    make_fp8_checkpoint,
    make_mxfp4_checkpoint,
    quantize_fp8,
    quantize_mxfp4,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CHECKPOINTS = {  # name -> (model type, make_fp8_checkpoint options)
    "deepseek_v3": ("deepseek_v3", {}),
    "qwen3_moe-bf16-scales-apart": ("qwen3_moe", {"scale_dtype": torch.bfloat16, "scales_apart": True}),
}


@pytest.fixture(scope="module", params=[*CHECKPOINTS, "gpt_oss-mxfp4"])
def quantized(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt_oss-mxfp4":
        model_type, checkpoint = "gpt_oss", make_mxfp4_checkpoint(directory)
    else:
        model_type, options = CHECKPOINTS[request.param]
        checkpoint = make_fp8_checkpoint(model_type, directory, **options)
    return model_type, checkpoint, load_family_reference(checkpoint.twin, model_type, torch.bfloat16)


# -- the dequantize step --------------------------------------------------------------------------


def test_scale_box_covers_the_weight_box():
    tensor = BlockScaled("w", "w_scale_inv", (16, 8))
    assert tensor.scale_box(Box((24, 0), (24, 17))) == Box((1, 0), (2, 3))  # rows [24, 48) -> [1, 3)
    assert tensor.scale_box(Box((3, 16, 40), (1, 1, 1))) == Box((3, 1, 5), (1, 1, 1))  # experts dim kept
    assert tensor.scale_box(Box((16, 8), (16, 8))) == Box((1, 1), (1, 1))


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_dequantize_matches_transformers_on_whole_tensors(scale_dtype):
    """On a divisible grid, transformers' op runs as is: bit-identical, E8M0 ``uint8`` scales too."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    q = (torch.randn(3, 32, 48) * 50).to(FP8)
    scale = torch.randint(110, 130, (3, 2, 3), dtype=torch.uint8) if scale_dtype == torch.uint8 else (
        torch.rand(3, 2, 3) + 0.01).to(scale_dtype)
    expected = Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=torch.float32)
    actual = BlockScaled("w", "s", (16, 16)).dequantize(q, scale, Box.full(q.shape))
    assert torch.equal(actual, expected)


def test_every_box_of_a_ceil_grid_dequantizes_alike():
    """Boxes at any offsets (borders inside scale blocks) give the whole tensor's values there."""
    torch.manual_seed(1)
    weight = torch.randn(2, 37, 45)
    q, scale = quantize_fp8(weight, (16, 16))
    whole = dequantize_reference(q, scale, (16, 16), dtype=torch.float32)
    tensor = BlockScaled("w", "s", (16, 16))
    generator = torch.Generator().manual_seed(2)
    for _ in range(50):
        lo = [int(torch.randint(0, n, (1,), generator=generator)) for n in q.shape]
        size = [int(torch.randint(1, n - o + 1, (1,), generator=generator)) for n, o in zip(q.shape, lo)]
        box = Box(tuple(lo), tuple(size))
        sbox = tensor.scale_box(box)
        values = tensor.dequantize(q[box.slices()], scale[sbox.slices()], box)
        assert torch.equal(values, whole[box.slices()]), box


def test_mxfp4_boxes_match_transformers_on_whole_tensors():
    """Any box of the values (borders inside a 32-value group or a packed byte, any rows and
    experts) from the blocks and scales :meth:`Mxfp4.reads` names: transformers' whole-tensor
    ``convert_moe_packed_tensors`` at that box, bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(3)
    blocks, scales = quantize_mxfp4(torch.randn(3, 21, 96) * torch.rand(3, 21, 96) * 40)
    whole = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [3, 96, 21]
    tensor = Mxfp4("x", "x_blocks", "x_scales")
    assert tensor.shape({"x_blocks": TensorSpec(tuple(blocks.shape), torch.uint8)}) == (3, 96, 21)
    stored = {"x_blocks": blocks, "x_scales": scales}
    generator = torch.Generator().manual_seed(4)
    for _ in range(60):
        lo = [int(torch.randint(0, n, (1,), generator=generator)) for n in whole.shape]
        size = [int(torch.randint(1, n - o + 1, (1,), generator=generator)) for n, o in zip(whole.shape, lo)]
        box = Box(tuple(lo), tuple(size))
        parts = {key: stored[key][part.slices()] for key, part in tensor.reads(box)}
        assert torch.equal(tensor.values(parts, box, torch.bfloat16), whole[box.slices()]), box


def test_transformers_shard_on_read_pairs_the_wrong_scales():
    """transformers 5.24 slices an FP8 weight and its scales independently under TP / FSDP
    (``DtensorShardOperation``) and infers the block from the local grid. 40 rows in blocks of 16
    (a ceil grid of 3) row-sharded on 4 ranks: rank 0 is right by luck, ranks 1 and 2 get wrong
    values, rank 3 gets no scale rows and fails. Reading the scale blocks that cover each rank's
    rows, ours is exact on every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from transformers.distributed.sharding_utils import DtensorShardOperation
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from hp_dcp_hf.tools.fake_ranks import clear_sharding_caches, register_fake_backend

    torch.manual_seed(5)
    q, scale = quantize_fp8(torch.randn(40, 32), (16, 16))
    whole = dequantize_reference(q, scale, (16, 16), dtype=torch.float32)
    ours = BlockScaled("w", "s", (16, 16))
    theirs: list[str] = []
    register_fake_backend()
    for rank in range(4):
        dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=4)
        try:
            mesh = init_device_mesh("cpu", (4,))
            param = DTensor.from_local(torch.empty(10, 32), mesh, [Shard(0)], shape=torch.Size((40, 32)), stride=(32, 1))
            shard = DtensorShardOperation(param)
            try:
                values = Fp8Dequantize(None)._dequantize_one(shard.shard_tensor(q), shard.shard_tensor(scale),
                                                             output_dtype=torch.float32)
                theirs.append("exact" if torch.equal(values, whole[10 * rank : 10 * rank + 10]) else "wrong")
            except (ValueError, ZeroDivisionError, RuntimeError):
                theirs.append("error")
        finally:
            dist.destroy_process_group()
            clear_sharding_caches()
        box = Box((10 * rank, 0), (10, 32))
        assert torch.equal(ours.dequantize(q[box.slices()], scale[ours.scale_box(box).slices()], box),
                           whole[box.slices()])
    assert theirs == ["exact", "wrong", "wrong", "error"]


# -- loads ------------------------------------------------------------------------------------------


def test_loads_like_transformers(quantized):
    model_type, checkpoint, reference = quantized
    model, report = hp_dcp_hf.from_pretrained(str(checkpoint.path), dtype=torch.bfloat16,
                                              model_cls=family_model_class(model_type))
    state = model.state_dict()
    assert set(state) == set(reference)
    assert all(state[k].dtype == v.dtype for k, v in reference.items())
    assert {state[k].dtype for k in checkpoint.quantized if k in state} == {torch.bfloat16}
    assert report.plan.quantized_bytes > 0 and report.plan.scale_bytes > 0
    assert not sorted(k for k, v in reference.items() if not torch.equal(state[k], v))
    assert report.missing_keys == () and report.unexpected_keys == ()  # scales are consumed
    assert report.plan.bytes_needed == report.read.bytes_read


def test_legacy_loader_dequantizes_whole_tensors(quantized):
    """The legacy loader (whole tensors, real conversions in memory; also any conversion that
    cannot be traced) stages each quantized tensor's values whole: the same values."""
    model_type, checkpoint, reference = quantized
    model, report = hp_dcp_hf.from_pretrained(str(checkpoint.path), dtype=torch.bfloat16, loader="legacy",
                                              model_cls=family_model_class(model_type))
    state = model.state_dict()
    assert report.plan.deferred_targets > 0
    assert not sorted(k for k, v in reference.items() if not torch.equal(state[k], v))


def test_read_volume_is_every_stored_byte_once(quantized):
    """One process reads the whole checkpoint: each quantized tensor's bytes and its scales exactly once."""
    _, checkpoint, _ = quantized
    plan = plan_ranks(str(checkpoint.path), "dp=1", dtype=torch.bfloat16)
    assert plan["ranks"][0].bytes_needed == plan["checkpoint_bytes"]


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    return make_fp8_checkpoint("deepseek_v3", tmp_path_factory.mktemp("rows"))


@pytest.mark.parametrize("world", [4, 16])
def test_row_shards_read_the_scale_blocks_covering_them(deepseek_fp8, world):
    """FSDP2 over ``world`` ranks splits the 19 rows of ``q_a_proj`` in chunks of ``ceil(19 / world)``
    (5/5/5/4 on 4 ranks; 2 rows each on 16, the last ones empty): borders inside the 16-row scale
    blocks. Planned without a process group, each rank reads exactly its weight rows and the scale
    rows ``[a // 16, ceil(b / 16))``."""
    plan = plan_ranks(str(deepseek_fp8.path), f"dp={world}", dtype=torch.bfloat16, with_items=True)
    key = "model.layers.0.self_attn.q_a_proj.weight"
    chunk = -(-19 // world)
    for rank, rank_plan in enumerate(plan["ranks"]):
        lo, hi = min(chunk * rank, 19), min(chunk * rank + chunk, 19)
        weight = [(i["offsets"], i["lengths"]) for i in rank_plan.items if i["key"] == key]
        scale = [(i["offsets"], i["lengths"]) for i in rank_plan.items if i["key"] == key + "_scale_inv"]
        if lo == hi:
            assert weight == scale == []
            continue
        assert weight == [([lo, 0], [hi - lo, 44])]
        first, end = lo // 16, -(-hi // 16)
        assert scale == [([first, 0], [end - first, 3])]


def test_transformers_reads_a_divisible_checkpoint_as_we_do(tmp_path):
    """Where transformers can dequantize the checkpoint itself (every grid divides its weight), its
    ``from_pretrained`` gives our values: the twin oracle is the real thing."""
    checkpoint = make_fp8_checkpoint(
        "deepseek_v3", tmp_path, block=(4, 4),
        select=lambda key, t: key.endswith("proj.weight") and t.ndim == 2 and t.shape[0] % 4 == 0 and t.shape[1] % 4 == 0,
    )
    cls = family_model_class("deepseek_v3")
    theirs = cls.from_pretrained(checkpoint.path, dtype=torch.bfloat16).state_dict()
    ours, _ = hp_dcp_hf.from_pretrained(str(checkpoint.path), dtype=torch.bfloat16, model_cls=cls)
    twin = load_family_reference(checkpoint.twin, "deepseek_v3", torch.bfloat16)
    assert len(checkpoint.quantized) >= 10
    for key, value in ours.state_dict().items():
        assert torch.equal(value, theirs[key]) and torch.equal(value, twin[key]), key


def test_transformers_reads_mxfp4_as_we_do(tmp_path):
    """transformers dequantizes gpt-oss's MXFP4 experts on CPU itself: its values are ours."""
    checkpoint = make_mxfp4_checkpoint(tmp_path)
    cls = family_model_class("gpt_oss")
    theirs = cls.from_pretrained(checkpoint.path, dtype=torch.bfloat16).state_dict()
    ours, _ = hp_dcp_hf.from_pretrained(str(checkpoint.path), dtype=torch.bfloat16, model_cls=cls)
    assert set(ours.state_dict()) == set(theirs)
    for key, value in ours.state_dict().items():
        assert torch.equal(value, theirs[key]), key


# -- bad input ----------------------------------------------------------------------------------------


SCALE = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"


def test_mxfp4_blocks_without_scales_raise(tmp_path):
    checkpoint = make_mxfp4_checkpoint(tmp_path / "good")
    scales = "model.layers.1.mlp.experts.down_proj_scales"
    bad = _edit(checkpoint.path, tmp_path / "bad", edit_tensors=lambda t: {k: v for k, v in t.items() if k != scales})
    with pytest.raises(QuantizationError) as raised:
        hp_dcp_hf.from_pretrained(str(bad), dtype=torch.bfloat16, model_cls=family_model_class("gpt_oss"))
    assert raised.value.key == scales.replace("_scales", "_blocks") and "without their scales" in str(raised.value)


@pytest.mark.parametrize("case", ["missing scale", "grid", "quant_method", "block size"])
def test_bad_quantized_checkpoints_raise_before_any_write(case, tmp_path):
    checkpoint = make_fp8_checkpoint("deepseek_v3", tmp_path / "good")
    edits = {
        "missing scale": ({"edit_tensors": lambda t: {k: v for k, v in t.items() if k != SCALE}},
                          SCALE.removesuffix("_scale_inv"), "without its scales"),
        "grid": ({"edit_tensors": lambda t: {k: (v[:1] if k == SCALE else v) for k, v in t.items()}},
                 SCALE.removesuffix("_scale_inv"), "does not fit"),
        "quant_method": ({"edit_config": lambda c: c["quantization_config"].update(quant_method="nonsense")},
                         None, "nonsense"),
        "block size": ({"edit_config": lambda c: c["quantization_config"].update(weight_block_size=[16])},
                       None, "weight_block_size"),
    }
    options, key, reason = edits[case]
    bad = _edit(checkpoint.path, tmp_path / "bad", **options)
    assert_refused_before_any_write("deepseek_v3", checkpoint.twin, bad, key, reason)


def test_the_loaded_model_is_not_quantized(quantized):
    """The checkpoint's quantization_config stays with the checkpoint: the bf16 model's config has none."""
    model_type, checkpoint, _ = quantized
    model, _ = hp_dcp_hf.from_pretrained(str(checkpoint.path), dtype=torch.bfloat16,
                                         model_cls=family_model_class(model_type))
    assert getattr(model.config, "quantization_config", None) is None
    assert json.loads((checkpoint.path / "config.json").read_text())["quantization_config"]["quant_method"]


# -- the CLI ------------------------------------------------------------------------------------------


def test_cli_inspect_and_plan_show_quantized_bytes(capsys, tmp_path):
    from hp_dcp_hf.tools.cli import main

    checkpoint = make_fp8_checkpoint("deepseek_v3", tmp_path)
    assert main(["inspect", str(checkpoint.path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["quantization"]
    weights = {k: v for k, v in _stored(checkpoint.path).items() if k in checkpoint.quantized}
    assert info["format"] == "fp8, blocks 16x16" and info["weights"] == len(weights) == 28
    assert info["weight_bytes"] == sum(v.numel() for v in weights.values())  # one byte each
    assert info["scale_bytes"] == sum(_stored(checkpoint.path)[k + "_scale_inv"].numel() * 4 for k in weights)
    assert main(["plan", str(checkpoint.path), "--mesh", "dp=2", "--dtype", "bfloat16", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["quantization"] == "fp8, blocks 16x16"
    # dp=2 splits every weight in two: the ranks' quantized bytes add up to the stored ones
    assert sum(r["quantized_bytes"] for r in plan["ranks"]) == info["weight_bytes"]
    assert all(0 < r["scale_bytes"] <= info["scale_bytes"] for r in plan["ranks"])
    assert main(["plan", str(checkpoint.path), "--mesh", "dp=2", "--dtype", "bfloat16"]) == 0
    assert "quantized checkpoint (fp8, blocks 16x16)" in capsys.readouterr().out


def _stored(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in path.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


# -- loading as stored ----------------------------------------------------------------------------------


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == FP8 else tensor


def test_a_model_keeping_fp8_weights_loads_them_as_stored(tmp_path):
    """transformers' ``FP8Linear`` keeps the FP8 weight and its ``weight_scale_inv``: both load as
    stored, byte for byte, and nothing is dequantized."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    checkpoint = make_fp8_checkpoint("llama", tmp_path)
    with torch.device("meta"):
        model = family_model_class("llama")._from_config(hp_dcp_hf.model.config.read_config(str(checkpoint.twin)),
                                                         dtype=torch.bfloat16)
    replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"],
                            quantization_config=FineGrainedFP8Config(weight_block_size=(16, 16)))
    model.to_empty(device="cpu")
    report = hp_dcp_hf.load_hf_checkpoint(model, str(checkpoint.path))
    stored = _stored(checkpoint.path)
    state = model.state_dict()
    assert report.missing_keys == () and report.unexpected_keys == ()
    assert {state[k].dtype for k in checkpoint.quantized} == {FP8}
    assert set(stored) <= set(state)
    assert all(torch.equal(_bits(state[k]), _bits(v)) for k, v in stored.items())


class _Fp8Proj(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)


@pytest.mark.parametrize("scale_layout", ["row-sharded", "replicated"])
def test_stored_scales_must_cover_the_weight_rows_a_rank_holds(scale_layout, tmp_path):
    """40 weight rows in blocks of 16, both tensors row-sharded over 4 ranks: rank 1 holds weight
    rows [10, 20) but only scale row 1, so it could not use its weights (rows 10..15 need scale row
    0): a LayoutError at planning time. Replicated scales cover every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hp_dcp_hf import HFMappingPlanner, HFStorageReader
    from hp_dcp_hf.errors import LayoutError
    from hp_dcp_hf.tools.fake_ranks import clear_sharding_caches, register_fake_backend

    q, scale = quantize_fp8(torch.randn(40, 32), (16, 16))
    save_file({"proj.weight": q, "proj.weight_scale_inv": scale}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [16, 16], "activation_scheme": "dynamic"}}))
    metadata = HFStorageReader(str(tmp_path)).read_metadata()
    register_fake_backend()
    outcomes = []
    for rank in range(4):
        dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=4)
        try:
            mesh = init_device_mesh("cpu", (4,))
            weight = DTensor.from_local(torch.empty(10, 32, dtype=FP8), mesh, [Shard(0)],
                                        shape=torch.Size((40, 32)), stride=(32, 1))
            if scale_layout == "replicated":
                scales = DTensor.from_local(torch.empty(3, 2), mesh, [Replicate()])
            else:
                local_rows = (1, 1, 1, 0)[rank]
                scales = DTensor.from_local(torch.empty(local_rows, 2), mesh, [Shard(0)],
                                            shape=torch.Size((3, 2)), stride=(2, 1))
            model = torch.nn.Module()
            model.proj = _Fp8Proj(weight, scales)
            planner = HFMappingPlanner(model, weights_mapping=[])
            try:
                planner.plan_reads(model.state_dict(), metadata)
                outcomes.append("planned")
            except LayoutError as e:
                assert e.key == "proj.weight" and "scale block" in e.reason
                outcomes.append("LayoutError")
        finally:
            dist.destroy_process_group()
            clear_sharding_caches()
    expected = ["planned"] * 4 if scale_layout == "replicated" else ["planned", "LayoutError", "LayoutError", "LayoutError"]
    assert outcomes == expected


def test_a_dequantized_model_saves_back_as_its_bf16_twin(quantized, tmp_path):
    """Saving the loaded model writes its bf16 values and no quantization_config: exactly the
    dequantized twin's files."""
    from tests.support.checkpoints import assert_same_checkpoint

    model_type, checkpoint, _ = quantized
    model, _ = hp_dcp_hf.from_pretrained(str(checkpoint.path), dtype=torch.bfloat16,
                                         model_cls=family_model_class(model_type))
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "saved", max_shard_size="40KB")
    assert_same_checkpoint(tmp_path / "saved", checkpoint.twin)
