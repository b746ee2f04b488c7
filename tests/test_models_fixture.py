"""The oracle is sound: tiny checkpoints are real, in the original format, and load back exactly.

Every correctness test compares against ``TinyCheckpoint.reference()`` (single-process
``from_pretrained``). These tests pin what that oracle is: bit-identical to the model that wrote
the files, built from files in the *original* checkpoint layout (checked here independently of
transformers' own conversion code), sharded as asked.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import tests.support.models as models
from tests.support.models import (
    EXPECTED_CONVERSION_OPS,
    MODEL_TYPES,
    build_model,
    checkpoint_files,
    checkpoint_keys,
    conversion_ops,
    read_checkpoint,
)

SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32"}


def assert_state_dicts_identical(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        got = actual[key]
        assert got.dtype == value.dtype, key
        assert got.shape == value.shape, key
        assert torch.equal(got, value), key


# --- the oracle round-trips -------------------------------------------------------------------


def test_reference_is_bit_identical_to_the_writer(tiny_checkpoint):
    writer = tiny_checkpoint.build_model()
    assert_state_dicts_identical(tiny_checkpoint.reference(), writer.state_dict())


def test_single_file_checkpoint(tiny_checkpoints):
    for model_type in ("llama", "mixtral"):
        ckpt = tiny_checkpoints(model_type, torch.bfloat16, max_shard_size=None)
        assert [p.name for p in checkpoint_files(ckpt.path)] == ["model.safetensors"]
        assert not ckpt.sharded
        assert_state_dicts_identical(ckpt.reference(), ckpt.build_model().state_dict())


def test_sharded_layout_and_index(tiny_checkpoint):
    files = checkpoint_files(tiny_checkpoint.path)
    assert len(files) >= 3, files
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(files):05d}\.safetensors", f.name) for f in files)
    index = json.loads((tiny_checkpoint.path / "model.safetensors.index.json").read_text())
    keys = checkpoint_keys(tiny_checkpoint.path)
    assert sorted(index["weight_map"]) == sorted(keys)
    assert set(index["weight_map"].values()) == {f.name for f in files}
    for file in files:
        assert set(checkpoint_keys_of(file)) == {k for k, v in index["weight_map"].items() if v == file.name}


def checkpoint_keys_of(file) -> list[str]:
    with open(file, "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    return [key for key in header if key != "__metadata__"]


def test_checkpoint_dtype(tiny_checkpoint):
    dtypes = {dtype for dtype, _ in checkpoint_keys(tiny_checkpoint.path).values()}
    expected = SAFETENSORS_DTYPE[tiny_checkpoint.dtype]
    if tiny_checkpoint.model_type == "sarvam_moe":
        # Glm4Moe keeps its router (gate.weight, e_score_correction_bias) in float32: a mixed file.
        assert dtypes == {expected, "F32"}
    else:
        assert dtypes == {expected}


def test_same_seed_same_weights_other_seed_differs():
    a, b = build_model("mixtral").state_dict(), build_model("mixtral").state_dict()
    assert_state_dicts_identical(a, b)
    c = build_model("mixtral", seed=1).state_dict()
    assert not torch.equal(a["model.norm.weight"], c["model.norm.weight"])


def test_bf16_and_fp32_variants_hold_the_same_values():
    low = build_model("llama", dtype=torch.bfloat16).state_dict()
    high = build_model("llama", dtype=torch.float32).state_dict()
    for key, value in low.items():
        assert torch.equal(high[key].to(torch.bfloat16), value), key


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_no_constant_tensors(model_type):
    # Norm scales and biases are random too, so a misplaced slice can never look right.
    for key, value in build_model(model_type, dtype=torch.float32).state_dict().items():
        if value.is_floating_point() and value.numel() > 1:
            assert value.unique().numel() > value.numel() // 2, key


def test_config_overrides_reach_nested_configs(tiny_checkpoints):
    ckpt = tiny_checkpoints("qwen3_vl_moe", torch.bfloat16, text_config={"num_experts": 3})
    shapes = checkpoint_keys(ckpt.path)
    assert shapes["model.language_model.layers.0.mlp.experts.gate_up_proj"][1] == (3, 44, 46)
    assert_state_dicts_identical(ckpt.reference(), ckpt.build_model().state_dict())


# --- the conversion each model type exercises ---------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_conversion_ops_table_matches_transformers(model_type):
    assert conversion_ops(model_type) == EXPECTED_CONVERSION_OPS[model_type]
    assert re.search(rf"^    {model_type} ", models.__doc__, re.M), "docstring table misses it"


# --- the files are in the original format (checked without transformers' conversion code) -------


def test_llama_tied_lm_head_not_in_checkpoint(llama_checkpoint):
    keys = checkpoint_keys(llama_checkpoint.path)
    assert "lm_head.weight" not in keys
    assert "model.embed_tokens.weight" in keys
    ref = llama_checkpoint.reference()
    assert torch.equal(ref["lm_head.weight"], ref["model.embed_tokens.weight"])
    assert sorted(keys) == sorted(k for k in ref if k != "lm_head.weight")


def test_mixtral_per_expert_keys(mixtral_checkpoint):
    keys = checkpoint_keys(mixtral_checkpoint.path)
    expert_keys = {k for k in keys if ".experts." in k}
    assert expert_keys == {
        f"model.layers.{layer}.block_sparse_moe.experts.{expert}.w{w}.weight"
        for layer in range(2)
        for expert in range(4)
        for w in (1, 2, 3)
    }
    assert not any(".mlp." in k or "gate_up_proj" in k for k in keys)
    assert keys["model.layers.0.block_sparse_moe.experts.0.w1.weight"] == ("BF16", (43, 44))
    stored, ref = read_checkpoint(mixtral_checkpoint.path), mixtral_checkpoint.reference()
    for layer in range(2):
        src = f"model.layers.{layer}.block_sparse_moe"
        gate_up = ref[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        down = ref[f"model.layers.{layer}.mlp.experts.down_proj"]
        assert gate_up.shape == (4, 86, 44) and down.shape == (4, 44, 43)
        for e in range(4):
            fused = torch.cat(
                [stored[f"{src}.experts.{e}.w1.weight"], stored[f"{src}.experts.{e}.w3.weight"]]
            )
            assert torch.equal(gate_up[e], fused)
            assert torch.equal(down[e], stored[f"{src}.experts.{e}.w2.weight"])
        assert torch.equal(ref[f"model.layers.{layer}.mlp.gate.weight"], stored[f"{src}.gate.weight"])


def test_qwen3_moe_per_expert_keys(qwen3_moe_checkpoint):
    stored, ref = read_checkpoint(qwen3_moe_checkpoint.path), qwen3_moe_checkpoint.reference()
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in stored)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in stored
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        for e in range(4):
            fused = torch.cat([stored[f"{p}.{e}.gate_proj.weight"], stored[f"{p}.{e}.up_proj.weight"]])
            assert torch.equal(ref[f"{p}.gate_up_proj"][e], fused)
            assert torch.equal(ref[f"{p}.down_proj"][e], stored[f"{p}.{e}.down_proj.weight"])


def test_gte_fused_qkv_and_up_gate(gte_checkpoint):
    stored, ref = read_checkpoint(gte_checkpoint.path), gte_checkpoint.reference()
    assert not any("q_proj" in k or k.startswith("layers.") for k in stored)
    for layer in range(2):
        src, dst = f"encoder.layer.{layer}", f"layers.{layer}"
        for kind in ("weight", "bias"):
            qkv = stored[f"{src}.attention.qkv_proj.{kind}"]
            assert qkv.shape[0] == 3 * 70
            for part, name in zip(qkv.chunk(3), ("q", "k", "v"), strict=True):
                assert torch.equal(ref[f"{dst}.self_attn.{name}_proj.{kind}"], part)
        up, gate = stored[f"{src}.mlp.up_gate_proj.weight"].chunk(2)  # target order: up, gate
        assert torch.equal(ref[f"{dst}.mlp.up_proj.weight"], up)
        assert torch.equal(ref[f"{dst}.mlp.gate_proj.weight"], gate)
        assert torch.equal(ref[f"{dst}.post_attention_layernorm.weight"], stored[f"{src}.attn_ln.weight"])


def test_sarvam_moe_gqa_split(sarvam_moe_checkpoint):
    stored, ref = read_checkpoint(sarvam_moe_checkpoint.path), sarvam_moe_checkpoint.reference()
    assert "model.word_embeddings.weight" in stored and "model.embed_tokens.weight" not in stored
    for layer in range(2):
        qkv = stored[f"model.layers.{layer}.attention.query_key_value.weight"]
        q, k, v = qkv.split([40, 20, 20])  # GQA: unequal parts, hence Split and not Chunk
        for name, part in (("q", q), ("k", k), ("v", v)):
            assert torch.equal(ref[f"model.layers.{layer}.self_attn.{name}_proj.weight"], part)
    # layer 0 dense, layer 1 MoE (first_k_dense_replace=1) with a shared expert and an f32 router
    assert "model.layers.0.mlp.gate_proj.weight" in stored
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in stored
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in stored
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert torch.equal(
        ref["model.layers.1.mlp.gate.e_score_correction_bias"], stored["model.layers.1.mlp.gate.expert_bias"]
    )


def test_qwen3_vl_moe_experts_stored_transposed(qwen3_vl_moe_checkpoint):
    stored, ref = read_checkpoint(qwen3_vl_moe_checkpoint.path), qwen3_vl_moe_checkpoint.reference()
    for layer in range(2):
        p = f"model.language_model.layers.{layer}.mlp.experts"
        assert stored[f"{p}.gate_up_proj"].shape == (4, 44, 46)  # [E, hidden, 2 * inter] as on the hub
        assert stored[f"{p}.down_proj"].shape == (4, 23, 44)
        assert ref[f"{p}.gate_up_proj"].shape == (4, 46, 44)
        assert torch.equal(ref[f"{p}.gate_up_proj"], stored[f"{p}.gate_up_proj"].transpose(1, 2))
        assert torch.equal(ref[f"{p}.down_proj"], stored[f"{p}.down_proj"].transpose(1, 2))


def test_gradium_fused_in_proj_with_rope_permutation(gradium_phonon_tts_checkpoint):
    stored, ref = (
        read_checkpoint(gradium_phonon_tts_checkpoint.path),
        gradium_phonon_tts_checkpoint.reference(),
    )
    heads, head_dim, hidden = 4, 10, 40
    for layer in range(2):
        fused = stored[f"layers.{layer}.self_attn.in_proj.weight"]
        q, k, v = fused.chunk(3)
        # q/k rows are stored in interleaved-RoPE order; the model wants rotate-half order.
        for name, part in (("q", q), ("k", k)):
            unpermuted = part.view(heads, head_dim // 2, 2, hidden).transpose(1, 2).reshape(hidden, hidden)
            assert not torch.equal(ref[f"layers.{layer}.self_attn.{name}_proj.weight"], part)
            assert torch.equal(ref[f"layers.{layer}.self_attn.{name}_proj.weight"], unpermuted)
        assert torch.equal(ref[f"layers.{layer}.self_attn.v_proj.weight"], v)
