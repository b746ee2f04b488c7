"""FP8 saves in one process: ``save_hf_checkpoint(model, path, quantize="fp8")`` writes the
block-scaled FP8 checkpoint transformers' FP8 quantizer makes of the model.

The oracle is transformers' own: ``from_pretrained(..., quantization_config=FineGrainedFP8Config(...))``
of the model's bf16 checkpoint, then ``save_pretrained`` (its quantizer refuses to quantize on the
fly without a GPU, though all it runs is ``Fp8Quantize``'s plain torch: :func:`quantizing_on_cpu`
lifts that one check). A weight whose dims are not multiples of the block stays in the model's
dtype, as there; transformers writes beside it its ``FP8Linear``'s uninitialized scale, which its
CPU load multiplies in, while the save writes no scale and names the module in
``modules_to_not_convert``. :class:`~hp_dcp_hf.quant.encode.CeilGrids` quantizes those weights too,
on ceil grids: ``Fp8Quantize`` of the weight zero-padded to whole blocks. transformers'
``from_pretrained`` of our output loads (dequantized, on CPU), and a checkpoint loaded from FP8 and
saved back is byte-identical to the one it came from.
"""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

import hp_dcp_hf
from hp_dcp_hf.errors import ArgumentError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.quant.encode import (
    BlockAmax,
    CeilGrids,
    Fp8Box,
    Fp8Layout,
    block_amax,
    fp8_config,
    fp8_scales,
    quantize_box,
)
from hp_dcp_hf.quant.grid import whole_blocks
from tests.support.checkpoints import SHARD, anonymized, assert_same_checkpoint
from tests.support.families import (
    build_family_model,
    family_model_class,
    save_family_model,
)
from tests.support.fp8 import (
    BLOCK16,
    FP8,
    MIXED,
    assert_fp8_of,
    assert_is_transformers_own,
    bits,
    fp8quantize,
    llama,
    tensors,
    transformers_fp8_model,
)
from tests.support.quantized import dequantize_reference, is_projection

#: llama sizes where every projection is whole 16 x 16 blocks (transformers' Fp8Quantize converts them all)
DIVISIBLE = {"hidden_size": 64, "intermediate_size": 96, "head_dim": 16, "num_attention_heads": 4,
             "num_key_value_heads": 2}

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def assembled_fp8_model(model, quantization_config):
    """transformers' FP8 model of ``model``'s weights built from its config, as ``save_pretrained``
    orders a model built so (one loaded by ``from_pretrained`` saves in another order, FP8 or not):
    its quantizer's ``FP8Linear`` modules holding what its ``Fp8Quantize`` makes of each weight (for
    weights of whole blocks, where that is every tensor they hold)."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    quantizer = FineGrainedFP8HfQuantizer(copy.deepcopy(quantization_config), pre_quantized=False)
    fp8 = type(model)._from_config(copy.deepcopy(model.config), dtype=torch.bfloat16)
    quantizer.preprocess_model(fp8)
    converted = {k for k, v in fp8.state_dict().items() if v.dtype == FP8}
    op, state = quantizer.get_quantize_ops(), {}
    for key, value in model.state_dict().items():
        state.update(op.convert({key: value}) if key in converted else {key: value})
    fp8.load_state_dict(state, assign=True, strict=True)
    fp8.hf_quantizer = quantizer
    quantizer.postprocess_model(fp8)
    return fp8


# -- the arithmetic ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, block", [((64, 96), (16, 16)), ((40, 44), (16, 16)), ((3, 20, 33), (8, 16)),
                                          ((130, 200), (128, 128))])
def test_block_arithmetic_is_fp8quantize_s_by_parts_too(shape, block):
    """Blocks quantized whole, and from parts whose amaxes are combined by max (the reduction), are
    ``Fp8Quantize``'s tensors bit for bit: a zero block, NaN and -0.0 included; sliced as the writer
    slices boxes too. Where the shape is whole blocks, ``Fp8Quantize`` needs no padding."""
    torch.manual_seed(1)
    weight = (torch.randn(shape) * 10.0 ** torch.randint(-4, 3, shape)).to(torch.bfloat16)
    weight[..., : block[0], : block[1]] = 0  # a block of zeros: scale 1
    weight[..., -1, -1] = float("nan")
    weight[..., 0, -1] = -0.0
    q, scale_inv = fp8quantize(weight, block)
    if all(n % b == 0 for n, b in zip(shape[-2:], block)):
        from transformers.integrations.finegrained_fp8 import Fp8Quantize
        from transformers.utils.quantization_config import FineGrainedFP8Config

        op = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=block)))
        direct = op.convert({"w.weight": weight})
        assert torch.equal(bits(direct["w.weight"]), bits(q)) and torch.equal(bits(direct["w.weight_scale_inv"]),
                                                                             bits(scale_inv))
    full = Box.full(shape)
    scale, inverse = fp8_scales(block_amax(weight, full, block))
    assert torch.equal(bits(inverse), bits(scale_inv))
    assert torch.equal(bits(quantize_box(weight, full, block, scale)), bits(q))
    # parts cut inside blocks: amax per part, max over parts, each part quantized alone
    rows, cols = shape[-2:]
    cuts = [(0, rows // 3 + 1), (rows // 3 + 1, rows)], [(0, cols // 2 - 3), (cols // 2 - 3, cols)]
    parts = [Box((*(0,) * (len(shape) - 2), r0, c0), (*shape[:-2], r1 - r0, c1 - c0)) for r0, r1 in cuts[0]
             for c0, c1 in cuts[1]]
    layout = Fp8Layout(fp8_config({"quant_method": "fp8", "weight_block_size": list(block)}), {"w": shape})
    amax = BlockAmax(layout, {"w": parts})
    for part in parts:
        amax.add("w", part, weight[part.slices()])
    assembled = torch.empty(shape, dtype=FP8)
    for part in parts:
        part_scale, _ = amax.scales("w", layout.scale_box(part))
        box = Fp8Box(weight[part.slices()], part, block, part_scale)
        assembled[part.slices()] = box[tuple(slice(0, n) for n in part.sizes)]
        half = tuple(slice(n // 2, n) for n in part.sizes)  # a slice of the box, as the writer's staging cuts it
        assert torch.equal(bits(box[half]), bits(q[part.slices()][half]))
    assert torch.equal(bits(assembled), bits(q))
    _, inverse = amax.scales("w", Box.full(layout.grid("w")))
    assert torch.equal(bits(inverse), bits(scale_inv))


def test_partial_blocks_get_ceil_grids_where_fp8quantize_leaves_the_weight():
    """transformers' ``Fp8Quantize`` returns a weight whose dims are not whole blocks unquantized;
    its ``FP8Linear`` allocates a ceil grid of scales for it: that grid is what a ``CeilGrids``
    save writes, each partial block scaled by the amax of the elements it has."""
    from transformers.integrations.finegrained_fp8 import FP8Linear, Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    weight = torch.randn(40, 44, dtype=torch.bfloat16)
    op = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=(16, 16))))
    assert op.convert({"w.weight": weight}) == {"w.weight": weight}
    assert not whole_blocks(weight.shape, (16, 16)) and whole_blocks((3, 48, 32), (16, 16))
    layout = Fp8Layout(fp8_config(CeilGrids(BLOCK16)), {"w.weight": (40, 44)})
    assert layout.grid("w.weight") == tuple(FP8Linear(44, 40, block_size=(16, 16)).weight_scale_inv.shape) == (3, 3)


# -- what the save writes ----------------------------------------------------------------------------


@pytest.mark.parametrize("block", [(128, 128), (32, 64)], ids=["fp8", "32x64"])
def test_fp8_save_is_transformers_own_fp8_checkpoint(block, tmp_path):
    """Projections that are and are not whole blocks (of 128 x 128 and of a custom 32 x 64): every
    tensor transformers' FP8 checkpoint of the same weights holds is ours bit for bit, the same
    weights FP8 and the same kept in bf16. It also holds a scale beside each kept weight (its
    ``FP8Linear``'s uninitialized one), ours none, the module in ``modules_to_not_convert``
    instead, so that its quantizer builds from our config.json exactly the FP8 modules we wrote.
    transformers' CPU load of ours is what its own FP8 model holds (``Fp8Dequantize`` of its FP8
    weights, the kept ones as they are) and what hp-dcp-hf loads. (Its CPU load of its own
    checkpoint cannot be the reference: it multiplies the kept weights by those uninitialized
    scales, or, as here, where rows do not divide by the grid, raises.)"""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.utils.quantization_config import FineGrainedFP8Config

    model = llama(**MIXED)
    quantize = "fp8" if block == (128, 128) else FineGrainedFP8Config(weight_block_size=block)
    their_model = transformers_fp8_model(model, fp8_config(quantize), tmp_path / "bf16")
    their_model.save_pretrained(theirs := tmp_path / "theirs", max_shard_size="200KB")
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "ours", quantize=quantize, max_shard_size="200KB")
    fp8, kept = assert_is_transformers_own(tmp_path / "ours", theirs)
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    their_config = json.loads((theirs / "config.json").read_text())
    written = config.pop("quantization_config")
    assert written["modules_to_not_convert"] == sorted({"lm_head"} | {k.removesuffix(".weight") for k in kept})
    assert their_config.pop("quantization_config") == {**written, "modules_to_not_convert": None}
    assert config == their_config
    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config.from_dict(written), pre_quantized=True)
    with torch.device("meta"):
        skeleton = type(model)._from_config(model.config, dtype=torch.bfloat16)
    quantizer.preprocess_model(skeleton)
    assert {k for k, v in skeleton.state_dict().items() if v.dtype == FP8} == fp8
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_parameters"] == skeleton.num_parameters()  # no scales of kept weights

    loaded = type(model).from_pretrained(tmp_path / "ours").state_dict()
    their_state = their_model.state_dict()
    ours_loaded, _ = hp_dcp_hf.from_pretrained(str(tmp_path / "ours"), model_cls=type(model))
    for key, value in loaded.items():
        held = their_state[key]
        if key in fp8:
            held = dequantize_reference(held, their_state[key.removesuffix("weight") + "weight_scale_inv"], block)
        assert value.dtype == torch.bfloat16 and torch.equal(value, held), key
        assert torch.equal(ours_loaded.state_dict()[key], value), key
    assert all(torch.equal(loaded[k], model.state_dict()[k]) for k in kept)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "qwen3_moe", "gte"])
@pytest.mark.parametrize("ceil_grids", [True, False], ids=["ceil", "whole"])
def test_fp8_save_is_fp8quantize_of_the_projections(family, ceil_grids, tmp_path):
    """MLA (deepseek_v3), per-expert weights each on its own grid (qwen3_moe's stacked experts), a
    checkpoint tensor made of three model tensors (gte's qkv_proj): the projections that are whole
    blocks (of 4 x 4: some are, some not; ``CeilGrids``: every one, on ceil grids, as the tiny
    sizes are not multiples of 16) are FP8 with their scales, everything else is
    ``save_pretrained``'s, and config.json is ``save_pretrained``'s with the quantization_config,
    naming modules only where projections are kept."""
    model = build_family_model(family, dtype=torch.bfloat16)
    reference = save_family_model(model, tmp_path / "reference", SHARD)
    block = (16, 16) if ceil_grids else (4, 4)  # 4 x 4: some projections whole blocks, some not
    quantize = {"quant_method": "fp8", "weight_block_size": list(block)}
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "ours", quantize=CeilGrids(quantize) if ceil_grids else quantize,
                                 max_shard_size=SHARD)
    quantized = assert_fp8_of(tmp_path / "ours", reference, block, ceil_grids)
    assert quantized
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    written = config.pop("quantization_config")
    skipped = written.pop("modules_to_not_convert")
    assert written == {"activation_scheme": "dynamic", "dequantize": False, "expert_dtype": "fp8",
                       "modules_to_convert": None, "quant_method": "fp8", "scale_fmt": "float",
                       "weight_block_size": list(block)}
    kept = {k for k, v in tensors(reference).items() if is_projection(k, v)} - quantized
    assert (skipped is None) == (not kept)  # named only where a projection is kept
    assert config == json.loads((reference / "config.json").read_text())


@pytest.mark.parametrize("block", [(16, 16), (128, 128)], ids=["16x16", "default"])
def test_fp8_save_is_save_pretrained_of_transformers_fp8_model(block, tmp_path):
    """Whole blocks everywhere: same files, keys, bits, index (``total_parameters`` counts the
    scales, as the FP8 model's parameters) and config.json as ``save_pretrained`` of transformers'
    FP8 model built from the config (:func:`assembled_fp8_model`); transformers' ``from_pretrained``
    loads it (dequantizing, on CPU) to exactly what
    hp-dcp-hf loads from it."""
    from transformers.utils.quantization_config import FineGrainedFP8Config

    sizes = DIVISIBLE if block == (16, 16) else {"hidden_size": 256, "intermediate_size": 384, "head_dim": 64,
                                                 "num_attention_heads": 4, "num_key_value_heads": 2}
    model = llama(**sizes)
    quantize = FineGrainedFP8Config(weight_block_size=block) if block == (16, 16) else "fp8"
    shard = SHARD if block == (16, 16) else "200KB"  # several files
    assembled_fp8_model(model, fp8_config(quantize)).save_pretrained(tmp_path / "theirs", max_shard_size=shard)
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "ours", quantize=quantize, max_shard_size=shard)
    assert_same_checkpoint(tmp_path / "ours", tmp_path / "theirs")
    assert len(list((tmp_path / "ours").glob("*.safetensors"))) > 1
    theirs = type(model).from_pretrained(tmp_path / "ours").state_dict()
    ours, _ = hp_dcp_hf.from_pretrained(str(tmp_path / "ours"), model_cls=type(model))
    stored = tensors(tmp_path / "ours")
    for key, value in theirs.items():
        expected = (dequantize_reference(stored[key], stored[key.removesuffix("weight") + "weight_scale_inv"], block)
                    if stored[key].dtype == FP8 else stored[key])
        assert value.dtype == torch.bfloat16 and torch.equal(value, expected) and torch.equal(ours.state_dict()[key], value)


@pytest.mark.parametrize("family, sizes, quantize", [
    ("llama", None, CeilGrids(BLOCK16)), ("llama", MIXED, "fp8"), ("llama", MIXED, CeilGrids("fp8")),
    ("qwen3_moe", None, CeilGrids(BLOCK16)), ("deepseek_v3", None, CeilGrids(BLOCK16))],
    ids=["llama-ceil", "llama-mixed-128", "llama-mixed-128-ceil", "qwen3_moe-ceil", "deepseek_v3-ceil"])
def test_loaded_from_fp8_and_saved_back_is_byte_identical(family, sizes, quantize, tmp_path):
    """quantize(dequantize(q, s)) is (q, s) with transformers' arithmetic, for weights a bf16 model
    held: loaded into bf16 (the config's dtype) and saved back, every file is the original's byte
    for byte, config.json and the index too, but for the save id; with kept weights (their modules
    in ``modules_to_not_convert``) and with ceil grids alike."""
    model = build_family_model(family, dtype=torch.bfloat16) if sizes is None else llama(**sizes)
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "fp8", quantize=quantize, max_shard_size=SHARD)
    loaded, _ = hp_dcp_hf.from_pretrained(str(tmp_path / "fp8"), model_cls=family_model_class(family))
    assert next(loaded.parameters()).dtype == torch.bfloat16
    writer = hp_dcp_hf.HFStorageWriter(tmp_path / "again", max_shard_size=SHARD)
    hp_dcp_hf.save_hf_checkpoint(loaded, tmp_path / "again", quantize=quantize, writer=writer)
    original, again = ({p.name: p.read_bytes() for p in (tmp_path / d).iterdir()} for d in ("fp8", "again"))
    assert anonymized(again) == anonymized(original)
    assert writer.bytes_written == sum(v.numel() * v.element_size() for v in tensors(tmp_path / "fp8").values())
    assert writer.amax_reduced == 0  # one process: no block is split between ranks


def test_a_float32_model_quantizes_the_values_of_dtype(tmp_path):
    """Loaded into float32, the dequantized values are exact products; ``dtype=torch.bfloat16``
    quantizes the bf16 values the checkpoint gave, so the save is byte-identical again (the float32
    values themselves would give scales an ulp off: amax = 448 * scale_inv is rounded once less)."""
    hp_dcp_hf.save_hf_checkpoint(build_family_model("llama", dtype=torch.bfloat16), tmp_path / "fp8",
                                 quantize=CeilGrids(BLOCK16), max_shard_size=SHARD)
    loaded, _ = hp_dcp_hf.from_pretrained(str(tmp_path / "fp8"), model_cls=family_model_class("llama"),
                                          dtype=torch.float32)
    hp_dcp_hf.save_hf_checkpoint(loaded, tmp_path / "again", quantize=CeilGrids(BLOCK16), max_shard_size=SHARD,
                                 dtype=torch.bfloat16)
    original, again = ({p.name: p.read_bytes() for p in (tmp_path / d).iterdir()} for d in ("fp8", "again"))
    assert anonymized(again) == anonymized(original)


def test_load_save_to_save_quantize_fp8(capsys, tmp_path):
    """``hp-dcp-hf load PATH --save-to DIR --save-quantize fp8`` writes what ``save_hf_checkpoint(...,
    quantize="fp8")`` writes, from a bf16 checkpoint and from that FP8 one (byte-identical again).
    Loaded into float32 (``--dtype float32``), both quantize the checkpoint's bf16 values
    (``--save-dtype checkpoint`` looks past the FP8 weights and their scales)."""
    from hp_dcp_hf.quant.encode import FORMATS
    from hp_dcp_hf.tools.cli import main
    from hp_dcp_hf.tools.cli.save_to import SAVE_QUANTIZE_CHOICES

    assert SAVE_QUANTIZE_CHOICES == FORMATS
    model = llama(**MIXED)  # FP8 attention, the MLP kept in bf16
    path = save_family_model(model, tmp_path / "bf16")
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "api", quantize="fp8")
    assert math.prod(tensors(tmp_path / "api")["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape) == 4
    for source, out in ((path, "cli"), (tmp_path / "api", "again")):
        code = main(["load", str(source), "--dtype", "float32", "--save-to", str(tmp_path / out),
                     "--save-quantize", "fp8"])
        assert code == 0, capsys.readouterr().err
        api, cli = ({p.name: p.read_bytes() for p in (tmp_path / d).iterdir()} for d in ("api", out))
        assert anonymized(cli) == anonymized(api), source


# -- bad input -----------------------------------------------------------------------------------------


def _bad_quantize():
    from transformers.utils.quantization_config import FineGrainedFP8Config

    return {
        "unknown-name": ("int4", "must be one of ['fp8']"),
        "other-method": ({"quant_method": "mxfp4"}, "quant_method 'fp8'"),
        "type": (8, "got int"),
        "ue8m0": (FineGrainedFP8Config(scale_fmt="ue8m0"), "scale_fmt='ue8m0'"),
        "static": (FineGrainedFP8Config(activation_scheme="static"), "activation_scheme='static'"),
        "per-tensor": (FineGrainedFP8Config(weight_block_size=None), "weight_block_size must be two positive ints"),
        "embeddings": (FineGrainedFP8Config(modules_to_convert=["embed_tokens"]), "modules_to_convert"),
    }


@pytest.mark.parametrize("case", list(_bad_quantize()))
def test_bad_quantize_is_an_argument_error_before_any_write(case, tmp_path):
    quantize, words = _bad_quantize()[case]
    with pytest.raises(ArgumentError, match=words.replace("[", r"\[").replace("]", r"\]")):
        hp_dcp_hf.save_hf_checkpoint(build_family_model("llama"), tmp_path / "out", quantize=quantize)
    assert not (tmp_path / "out").exists()


def test_models_fp8_cannot_come_from_are_argument_errors(tmp_path):
    """A model quantized already (transformers' FP8 model: its config and FP8 parameters), a module
    that is not a transformers model, a model transformers' FP8 quantizer refuses (gpt-oss: experts
    with biases), quantize= beside a planner: each an ArgumentError, nothing written."""
    from hp_dcp_hf.save.planner import HFSavePlanner

    fp8 = transformers_fp8_model(llama(**DIVISIBLE), fp8_config(BLOCK16), tmp_path / "bf16")
    cases = [
        (fp8, {}, "quantized already \\(its config has a quantization_config\\)"),
        (llama(**DIVISIBLE).to(FP8), {}, "quantized already \\(it holds model.embed_tokens.weight in torch.float8"),
        (torch.nn.Linear(4, 4), {}, "needs a transformers model"),
        (build_family_model("gpt_oss"), {}, "FP8 quantizer cannot convert GptOssForCausalLM"),
    ]
    for model, kwargs, words in cases:
        with pytest.raises(ArgumentError, match=words):
            hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "out", quantize="fp8", **kwargs)
    model = llama()
    with pytest.raises(ArgumentError, match="go to the planner given"):
        hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "out", quantize="fp8", planner=HFSavePlanner(model))
    assert not (tmp_path / "out").exists()
