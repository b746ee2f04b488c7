"""compressed-tensors checkpoints load into bf16 and fp32 models as the values compressed-tensors'
own decompression gives, in one process.

The checkpoints are written by compressed-tensors' compressors from tiny real models, and the
oracle is compressed-tensors' decompression of the whole checkpoint, loaded through transformers'
``from_pretrained`` as a dense twin (``tests/support/compressed.py``). Shapes are awkward on purpose:
DeepSeek-V3's MLA projections (17 and 19 rows, 13 input columns) in 16 x 16 FP8 blocks make ceil
grids, the Llama with 48 hidden / 80 intermediate cuts INT4 groups of 16 and zero-point words of 8
rows unevenly, its quantized ``lm_head`` has 101 rows.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import hp_dcp_hf
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.mapping.compose import TensorSpec
from hp_dcp_hf.quant.compressed import compressed_tensors
from hp_dcp_hf.tools.rank_plans import plan_ranks
from tests.support.compressed import (
    CASES,
    DYNAMIC_INT8,
    compress_modules,
    decompress_tensors,
    make_case,
    read_tensors,
    weights_args,
)
from tests.support.families import family_model_class, load_family_reference
from tests.support.quantized import _edit as edit_copy
from tests.support.quantized import assert_refused_before_any_write

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


FORMATS = {  # the format compressed-tensors chose for each case
    "fp8-tensor": "float-quantized",
    "fp8-channel": "float-quantized",
    "fp8-block": "naive-quantized",
    "fp8-group": "naive-quantized",
    "int8-channel": "int-quantized",
    "int8-asym-group": "int-quantized",
    "w4a16": "pack-quantized",
    "w4a16-asym": "pack-quantized",
    "w4-channel-asym": "pack-quantized",
    "w8a16-pack": "pack-quantized",
    "w3a16": "pack-quantized",
    "nvfp4": "nvfp4-pack-quantized",
    "mxfp4": "mxfp4-pack-quantized",
    "mxfp6": "mxfp6-pack-quantized",
    "mxfp8": "mxfp8-quantized",
    "mixed": "float-quantized,pack-quantized",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each case's checkpoint, made once for the module, on first use."""
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = make_case(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


# -- a box of values, in one process (no checkpoint) ----------------------------------------------------

#: name -> (weight shape, config groups): single weights compressed by compressed-tensors.
WEIGHTS = {
    "fp8-tensor": ((37, 45), {"FP8": ["Linear"]}),
    "fp8-channel": ((37, 45), {"FP8_DYNAMIC": ["Linear"]}),
    "fp8-group": (
        (37, 45),
        {"g": {"targets": ["Linear"], "weights": weights_args(8, "float", group_size=5)}},
    ),
    "fp8-block": (
        (37, 45),
        {
            "g": {
                "targets": ["Linear"],
                "weights": weights_args(8, "float", "block", block_structure=[16, 16]),
            }
        },
    ),
    "int8-asym-tensor": (
        (37, 45),
        {
            "g": {
                "targets": ["Linear"],
                "weights": weights_args(8, strategy="tensor", symmetric=False),
                "input_activations": DYNAMIC_INT8,
            }
        },
    ),
    "int8-asym-group": (
        (37, 45),
        {
            "g": {
                "targets": ["Linear"],
                "weights": weights_args(8, group_size=9, symmetric=False),
                "input_activations": DYNAMIC_INT8,
            }
        },
    ),
    "w4-group": ((37, 56), {"g": {"targets": ["Linear"], "weights": weights_args(4, group_size=8)}}),
    "w4-asym-group": (
        (37, 56),
        {"g": {"targets": ["Linear"], "weights": weights_args(4, group_size=8, symmetric=False)}},
    ),
    "w4-asym-channel": (
        (37, 56),
        {"g": {"targets": ["Linear"], "weights": weights_args(4, strategy="channel", symmetric=False)}},
    ),
    "w4-asym-tensor": (
        (37, 56),
        {"g": {"targets": ["Linear"], "weights": weights_args(4, strategy="tensor", symmetric=False)}},
    ),
    "w2-channel": ((37, 64), {"g": {"targets": ["Linear"], "weights": weights_args(2, strategy="channel")}}),
    "w3-asym-group": (
        (37, 64),
        {"g": {"targets": ["Linear"], "weights": weights_args(3, group_size=16, symmetric=False)}},
    ),
    "w8-pack-group": ((37, 48), {"g": {"targets": ["Linear"], "weights": weights_args(8, group_size=16)}}),
    "nvfp4": ((37, 64), {"NVFP4": ["Linear"]}),
    "mxfp4": ((37, 64), {"MXFP4A16": ["Linear"]}),
    "mxfp6": ((37, 64), {"MXFP6A16": ["Linear"]}),
    "mxfp8": ((37, 64), {"MXFP8A16": ["Linear"]}),
}


def _compressed_weight(name: str, dtype: torch.dtype = torch.bfloat16):
    """A weight compressed under ``WEIGHTS[name]``: its stored tensors, config, the
    :class:`CompressedWeight` read from their specs, and compressed-tensors' decompression."""
    shape, groups = WEIGHTS[name]
    generator = torch.Generator().manual_seed(len(name))
    weight = (torch.randn(shape, generator=generator) * torch.rand(shape[0], 1, generator=generator)).to(
        dtype
    )
    compressed, config = compress_modules({"m": weight}, groups)
    stored = {f"m.{param}": tensor for param, tensor in compressed["m"].items()}
    sources = {key: TensorSpec(tuple(t.shape), t.dtype) for key, t in stored.items()}
    found, consumed = compressed_tensors(config, sources)
    whole = decompress_tensors(stored, config, {"m": shape})["m.weight"]
    return stored, config, found["m.weight"], consumed, whole


def _random_boxes(shape, count: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        lo = [int(torch.randint(0, n, (1,), generator=generator)) for n in shape]
        size = [int(torch.randint(1, n - o + 1, (1,), generator=generator)) for n, o in zip(shape, lo)]
        yield Box(tuple(lo), tuple(size))


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_every_box_is_compressed_tensors_decompression(name):
    """Any box (borders inside int32 words, bytes, FP6 triples, groups, blocks, zero-point words)
    from the stored boxes :meth:`CompressedWeight.reads` names: compressed-tensors' decompression of
    the whole weight at that box, bit for bit and in its dtype."""
    stored, _, tensor, consumed, whole = _compressed_weight(name)
    assert tensor.shape({}) == tuple(whole.shape)
    assert tensor.data in stored and set(consumed) | {tensor.data} == set(stored)
    for box in [Box.full(whole.shape), *_random_boxes(whole.shape, 40, seed=7)]:
        parts = {key: stored[key][part.slices()] for key, part in tensor.reads(box)}
        values = tensor.values(parts, box, torch.float32)
        assert values.dtype == whole.dtype and torch.equal(values, whole[box.slices()]), box


def test_a_box_reads_its_words_and_the_groups_covering_it():
    """INT4 in groups of 8, asymmetric: rows [5, 17) x columns [13, 29) read packed words [1, 4)
    (values 8..31: borders inside words 1 and 3), scale rows [5, 17) x groups [1, 4), and zero-point
    words [0, 3) (8 rows a word: rows 5..16 are in words 0..2) of those groups."""
    stored, _, tensor, _, _ = _compressed_weight("w4-asym-group")
    reads = dict(tensor.reads(Box((5, 13), (12, 16))))
    assert reads == {
        "m.weight_packed": Box((5, 1), (12, 3)),
        "m.weight_scale": Box((5, 1), (12, 3)),
        "m.weight_zero_point": Box((0, 1), (3, 3)),
    }
    assert tuple(stored["m.weight_zero_point"].shape) == (5, 7)  # 37 rows in words of 8


@pytest.mark.parametrize(
    ("name", "box", "expected"),
    [
        (
            "w3-asym-group",
            Box((0, 40), (2, 10)),
            {
                "m.weight_packed": Box((0, 3), (2, 3)),  # 32 values in 3 words
                "m.weight_scale": Box((0, 2), (2, 2)),
                "m.weight_zero_point": Box((0, 2), (3, 2)),
            },
        ),  # 3 words: 32 rows
        (
            "nvfp4",
            Box((3, 15), (4, 2)),
            {
                "m.weight_packed": Box((3, 7), (4, 2)),
                "m.weight_scale": Box((3, 0), (4, 2)),
                "m.weight_global_scale": Box((0,), (1,)),
            },
        ),
        (
            "mxfp6",
            Box((0, 5), (1, 30)),
            {"m.weight_packed": Box((0, 3), (1, 24)), "m.weight_scale": Box((0, 0), (1, 2))},
        ),
        (
            "fp8-block",
            Box((15, 3), (2, 30)),
            {"m.weight": Box((15, 3), (2, 30)), "m.weight_scale": Box((0, 0), (2, 3))},
        ),
        (
            "fp8-tensor",
            Box((1, 1), (2, 2)),
            {"m.weight": Box((1, 1), (2, 2)), "m.weight_scale": Box((0,), (1,))},
        ),
    ],
)
def test_reads_are_whole_units_and_covering_scales(name, box, expected):
    """3-bit values: a box touching values 40..49 reads the 3 words of the 32-value unit 32..63;
    NVFP4 columns 15, 16 read bytes 7, 8 and the two 16-value scales; FP6 columns [5, 35) read the
    3-byte units of values [4, 36), bytes [3, 27); naive FP8 reads exactly its values, the 16 x 16
    blocks and the one tensor scale covering them."""
    _, _, tensor, _, _ = _compressed_weight(name)
    assert dict(tensor.reads(box)) == expected


def test_activation_and_kv_cache_parameters_are_consumed():
    """Static input scales, NVFP4's input global scale, KV-cache scales: no unquantized model
    takes them, so they are consumed (never reported unexpected), as are the weight's own."""
    stored, config, _, consumed, _ = _compressed_weight("nvfp4")
    extra = (
        "m.input_scale",
        "m.input_zero_point",
        "m.output_scale",
        "attn.k_scale",
        "attn.v_scale",
        "attn.q_scale",
    )
    sources = {key: TensorSpec(tuple(t.shape), t.dtype) for key, t in stored.items()}
    sources.update({key: TensorSpec((1,), torch.float32) for key in extra})
    found, consumed = compressed_tensors(config, sources)
    assert set(found) == {"m.weight"}
    assert consumed == {
        *extra,
        "m.weight_packed",
        "m.weight_scale",
        "m.weight_global_scale",
        "m.input_global_scale",
    }


def test_an_fp32_model_gets_the_bf16_values_compressed_tensors_computes():
    """compressed-tensors computes NVFP4 in float32 (E2M1 x E4M3 scale / global scale) and rounds to
    bfloat16: that rounding is part of the values, so an fp32 model gets them too, not the more
    precise float32 products (which differ here)."""
    stored, _, tensor, _, whole = _compressed_weight("nvfp4")
    box = Box.full(whole.shape)
    ours = tensor.values({k: stored[k][b.slices()] for k, b in tensor.reads(box)}, box, torch.float32)
    assert torch.equal(ours.to(torch.float32), whole.to(torch.float32))
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    fp4 = unpack_fp4_from_uint8(stored["m.weight_packed"], *whole.shape, dtype=torch.float32)
    scale = (
        stored["m.weight_scale"].to(torch.float32).repeat_interleave(16, dim=1)
        / stored["m.weight_global_scale"]
    )
    assert not torch.equal(fp4 * scale, whole.to(torch.float32))


# -- loads ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_loads_as_compressed_tensors_decompresses(checkpoints, case):
    """bf16 and fp32 models: every parameter bit-identical to compressed-tensors' decompression cast
    to the model dtype (through transformers' conversions: stacked experts); the scales, zero
    points, shapes and activation parameters consumed; each needed byte read once."""
    checkpoint = checkpoints(case)
    assert ",".join(checkpoint.formats) == FORMATS[case]
    cls = family_model_class(checkpoint.model_type)
    for dtype in (torch.bfloat16, torch.float32):
        reference = load_family_reference(checkpoint.twin, checkpoint.model_type, dtype)
        model, report = hp_dcp_hf.from_pretrained(str(checkpoint.path), dtype=dtype, model_cls=cls)
        state = model.state_dict()
        assert set(state) == set(reference)
        assert not sorted(k for k, v in reference.items() if not torch.equal(state[k], v)), dtype
        assert report.missing_keys == () and report.unexpected_keys == ()
        assert report.plan.quantized_bytes > 0 and report.plan.scale_bytes > 0
        assert report.plan.bytes_needed == report.read.bytes_read


@pytest.mark.parametrize("case", ["w4a16-asym", "nvfp4", "mixed", "fp8-tensor"])
def test_one_process_reads_every_stored_byte_but_the_unused_ones(checkpoints, case):
    """One process reads each stored byte once, except those no value needs: ``weight_shape`` (the
    shape comes from the metadata) and activation parameters."""
    checkpoint = checkpoints(case)
    plan = plan_ranks(str(checkpoint.path), "dp=1", dtype=torch.bfloat16)
    unused = sum(
        t.numel() * t.element_size()
        for k, t in read_tensors(checkpoint.path).items()
        if k.endswith(("weight_shape", "input_scale", "input_global_scale", "input_zero_point"))
    )
    assert plan["ranks"][0].bytes_needed == plan["checkpoint_bytes"] - unused
    assert case != "w4a16-asym" or unused > 0


def _items(rank_plan, key):
    return [(tuple(i["offsets"]), tuple(i["lengths"])) for i in rank_plan.items if i["key"] == key]


def _read(rank_plan, key, stored) -> int:
    """Bytes of ``key`` the rank's items read."""
    return sum(math.prod(lengths) for _, lengths in _items(rank_plan, key)) * stored[key].element_size()


def test_row_shards_read_their_rows_and_zero_point_words(checkpoints):
    """dp=4 (FSDP2) cuts the 101 rows of the INT4 asymmetric lm_head 26/26/26/23: each rank reads
    its rows of packed words and scales, and the zero-point words of its rows (8 rows a word: the
    words at the borders 26, 52, 78 are read by both neighbours); over the ranks each packed and
    scale byte once."""
    checkpoint = checkpoints("w4a16-asym")
    plan = plan_ranks(str(checkpoint.path), "dp=4", dtype=torch.bfloat16, with_items=True)
    stored = read_tensors(checkpoint.path)
    packed, scale, zero = (
        stored[f"lm_head.{n}"] for n in ("weight_packed", "weight_scale", "weight_zero_point")
    )
    assert tuple(packed.shape) == (101, 6) and tuple(zero.shape) == (13, 3)
    zero_rows = []
    for rank, rank_plan in enumerate(plan["ranks"]):
        lo, hi = 26 * rank, min(26 * rank + 26, 101)
        assert _items(rank_plan, "lm_head.weight_packed") == [((lo, 0), (hi - lo, 6))]
        assert _items(rank_plan, "lm_head.weight_scale") == [((lo, 0), (hi - lo, 3))]
        zero_rows.append(_items(rank_plan, "lm_head.weight_zero_point"))
        assert zero_rows[-1] == [((lo // 8, 0), (-(-hi // 8) - lo // 8, 3))]
    for key in ("weight_packed", "weight_scale"):
        read = sum(_read(r, f"lm_head.{key}", stored) for r in plan["ranks"])
        assert read == stored[f"lm_head.{key}"].numel() * stored[f"lm_head.{key}"].element_size()
    assert sum(_read(r, "lm_head.weight_zero_point", stored) for r in plan["ranks"]) == (13 + 3) * 3 * 4
    # every weight is cut in rows: over the ranks, each packed byte of the checkpoint once
    packed = sum(t.numel() * 4 for k, t in stored.items() if k.endswith("weight_packed"))
    assert sum(r.quantized_bytes for r in plan["ranks"]) == packed


def test_column_shards_read_the_words_and_groups_across_their_borders(checkpoints):
    """tp=4 splits o_proj's 48 input columns 12 a rank (row-wise TP): rank 1's columns [12, 24) read
    words [1, 3) (8 values a word: the border at 12 is inside word 1, read by ranks 0 and 1 both)
    and groups [0, 2) of 16 (the border inside group 0)."""
    checkpoint = checkpoints("w4a16")
    plan = plan_ranks(str(checkpoint.path), "tp=4", dtype=torch.bfloat16, with_items=True)
    key = "model.layers.0.self_attn.o_proj"
    for rank, rank_plan in enumerate(plan["ranks"]):
        lo, hi = 12 * rank, 12 * rank + 12
        assert _items(rank_plan, f"{key}.weight_packed") == [((0, lo // 8), (48, -(-hi // 8) - lo // 8))]
        assert _items(rank_plan, f"{key}.weight_scale") == [((0, lo // 16), (48, -(-hi // 16) - lo // 16))]


def test_transformers_dequantize_gets_moe_experts_wrong(checkpoints):
    """transformers 5.24's own ``CompressedTensorsConfig(dequantize=True)`` load of the same
    checkpoints: on MoE experts it drops NVFP4's global scale (values about 7000x too large: the
    E4M3 scales carry it) and fails on FP8 groups and 16 x 16 blocks, INT8 and asymmetric zero
    points; on dense layers (DeepSeek-V3's FP8 channels) it is right, as ours are everywhere."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    outcomes = {}
    for case in ("nvfp4", "fp8-group", "fp8-block", "int8-channel", "int8-asym-group", "fp8-channel"):
        checkpoint = checkpoints(case)
        dtype = CASES[case][4]
        cls = family_model_class(checkpoint.model_type)
        reference = load_family_reference(checkpoint.twin, checkpoint.model_type, dtype)
        ours, _ = hp_dcp_hf.from_pretrained(str(checkpoint.path), dtype=dtype, model_cls=cls)
        assert all(torch.equal(v, reference[k]) for k, v in ours.state_dict().items()), case
        try:
            theirs = cls.from_pretrained(
                checkpoint.path, dtype=dtype, quantization_config=CompressedTensorsConfig(dequantize=True)
            ).state_dict()
        except RuntimeError as e:
            assert "conversion" in str(e)
            outcomes[case] = "raises"
            continue
        wrong = [k for k, v in reference.items() if not torch.equal(theirs[k], v)]
        outcomes[case] = wrong or "exact"
        if case == "nvfp4":
            assert wrong and all(".experts." in k for k in wrong)
            ratios = [
                float(theirs[k].float().abs().amax() / reference[k].float().abs().amax()) for k in wrong
            ]
            assert all(1000 < r < 100000 for r in ratios), ratios
    assert {c: (o if isinstance(o, str) else "wrong") for c, o in outcomes.items()} == {
        "nvfp4": "wrong",
        "fp8-group": "raises",
        "fp8-block": "raises",
        "int8-channel": "raises",
        "int8-asym-group": "raises",
        "fp8-channel": "exact",
    }


# -- bad input ---------------------------------------------------------------------------------------------


def _edit(checkpoint_path, destination, edit_tensors=None, edit_config=None):
    """tests/test_quantized.py's edit of a copy, ``edit_config`` given the quantization_config."""
    config_edit = None if edit_config is None else (lambda config: edit_config(config["quantization_config"]))
    return edit_copy(checkpoint_path, destination, edit_tensors, config_edit)


PROJ = "model.layers.1.mlp.down_proj"


def _truncated(key, columns):
    return lambda tensors: {k: (v[:, :columns].contiguous() if k == key else v) for k, v in tensors.items()}


def _group(config):
    return config["config_groups"]["group_0"]


FP8_PROJ = "model.layers.0.mlp.down_proj"
BAD = {  # case -> (checkpoint, edit, key of the error (None: config.json), words of the message)
    "unknown format": (
        "w4a16-asym",
        {"edit_config": lambda c: _group(c).update(format="marlin-24")},
        None,
        "'marlin-24'",
    ),
    "format of nothing": (
        "w4a16-asym",
        {"edit_config": lambda c: c.update(format="nonsense") or _group(c).pop("format")},
        None,
        "nonsense",
    ),
    "targets match nothing": (
        "w4a16-asym",
        {
            "edit_config": lambda c: c["config_groups"].update(
                extra={**_group(c), "targets": ["re:.*vision_tower.*"]}
            )
        },
        None,
        "matches no stored compressed tensor",
    ),
    "untargeted": (
        "w4a16-asym",
        {"edit_config": lambda c: c["ignore"].append(PROJ)},
        f"{PROJ}.weight_packed",
        "ignore",
    ),
    "scale shape": (
        "w4a16-asym",
        {
            "edit_tensors": lambda t: {
                k: (v[1:].contiguous() if k == f"{PROJ}.weight_scale" else v) for k, v in t.items()
            }
        },
        f"{PROJ}.weight_scale",
        "does not fit strategy 'group' group_size 16",
    ),
    "packed length": (
        "w4a16-asym",
        {"edit_tensors": _truncated(f"{PROJ}.weight_packed", 9)},
        f"{PROJ}.weight_packed",
        "does not hold 80 values",
    ),
    "zero points": (
        "w4a16-asym",
        {"edit_tensors": lambda t: {k: v for k, v in t.items() if k != f"{PROJ}.weight_zero_point"}},
        f"{PROJ}.weight_packed",
        "without its weight_zero_point",
    ),
    "bad config": (
        "w4a16-asym",
        {"edit_config": lambda c: _group(c)["weights"].update(strategy="diagonal")},
        None,
        "diagonal",
    ),
    "sparse": (
        "w4a16-asym",
        {"edit_config": lambda c: c.update(sparsity_config={"format": "sparse-24-bitmask"})},
        None,
        "sparsity_config",
    ),
    "transforms": (
        "w4a16-asym",
        {"edit_config": lambda c: c.update(transform_config={"config_groups": {"u": {}}})},
        None,
        "transform_config",
    ),
    "fp8 without scales": (
        "fp8-tensor",
        {"edit_tensors": lambda t: {k: v for k, v in t.items() if k != f"{FP8_PROJ}.weight_scale"}},
        f"{FP8_PROJ}.weight",
        "float8_e4m3fn weight without its weight_scale",
    ),
    "channel scales": (
        "fp8-tensor",
        {
            "edit_tensors": lambda t: {
                k: (v.expand(44, 1).contiguous() if k == f"{FP8_PROJ}.weight_scale" else v)
                for k, v in t.items()
            }
        },
        f"{FP8_PROJ}.weight_scale",
        "does not fit strategy 'tensor'",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_compressed_checkpoints_raise_before_any_write(checkpoints, case, tmp_path):
    name, options, key, words = BAD[case]
    checkpoint = checkpoints(name)
    bad = _edit(checkpoint.path, tmp_path / "bad", **options)
    assert_refused_before_any_write(checkpoint.model_type, checkpoint.twin, bad, key, words)


def test_legacy_loader_decompresses_whole_tensors(checkpoints):
    """The legacy loader (whole tensors, conversions run in memory) stages each compressed weight's
    values whole (one box of the whole tensor): the same values."""
    checkpoint = checkpoints("mixed")
    reference = load_family_reference(checkpoint.twin, checkpoint.model_type, torch.bfloat16)
    model, report = hp_dcp_hf.from_pretrained(
        str(checkpoint.path),
        dtype=torch.bfloat16,
        loader="legacy",
        model_cls=family_model_class(checkpoint.model_type),
    )
    assert report.plan.deferred_targets > 0
    assert not sorted(k for k, v in model.state_dict().items() if not torch.equal(v, reference[k]))


def test_cli_inspect_counts_compressed_weights(checkpoints, capsys):
    from hp_dcp_hf.tools.cli import main

    checkpoint = checkpoints("w4a16-asym")
    assert main(["inspect", str(checkpoint.path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["quantization"]
    stored = read_tensors(checkpoint.path)
    assert info["weights"] == len(checkpoint.compressed)
    assert info["weight_bytes"] == sum(
        stored[f"{m}.weight_packed"].numel() * 4 for m in checkpoint.compressed
    )
    assert info["scale_bytes"] == sum(
        stored[f"{m}.{n}"].numel() * stored[f"{m}.{n}"].element_size()
        for m in checkpoint.compressed
        for n in ("weight_scale", "weight_zero_point")
    )


def test_cli_plan_names_the_formats_of_a_mixed_checkpoint(checkpoints, capsys):
    from hp_dcp_hf.tools.cli import main

    checkpoint = checkpoints("mixed")
    formats = sorted({group["format"] for group in json.loads((checkpoint.path / "config.json").read_text())
                      ["quantization_config"]["config_groups"].values()})
    assert len(formats) > 1
    assert main(["plan", str(checkpoint.path), "--mesh", "dp=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quantization"] == f"compressed-tensors: {', '.join(formats)}"
