"""The family matrix: a tiny, CPU-buildable model for every model type of transformers' checkpoint
conversion table.

:mod:`tests.support.models` holds a few hand-made tiny models; this module covers *every* model type that
is a key of ``transformers.conversion_mapping._build_checkpoint_conversion_mapping()`` and of
``transformers.CONFIG_MAPPING`` (the model types whose checkpoints ``from_pretrained`` has to
convert on load). Each one is built from its default config (``AutoConfig.for_model``) shrunk by a
generic, recursive shrinker (:func:`tiny_family_config`; sub-configs too) plus a small table of
per-family overrides (:data:`FAMILY_OVERRIDES`, one reason each), given seeded distinct random
values (:func:`tests.support.models._randomize_`) and written with ``save_pretrained`` in the original
checkpoint format (:func:`make_family_checkpoint`). :func:`load_family_reference` is the oracle: the
single-process transformers ``from_pretrained`` state dict.

Sizes. Tests shard unevenly, so sizes avoid factors 2, 3 and 4 where the config allows: vocab
101, dense intermediate sizes 43. Head counts must divide cleanly: 4 attention heads, 2 key-value
heads, head dim 10 (even, for RoPE; 16 with a partial rotary factor so the rotary part stays even).
Where the head dim is derived (``hidden / heads``) the hidden size is 40 (48 in vision towers, head
dim 12 for 2-D rotary embeddings), else 44 (so ``hidden != heads * head_dim``).

**MoE expert intermediate sizes are 28, a multiple of 4 elements**: stacked experts may run through
``torch._grouped_mm``, which on CPU needs 16-byte aligned strides (4 fp32 elements). 28 is still not
a multiple of 3 nor equal to any other size. Expert counts are 4 with top-2 routing; where the
family mixes dense and MoE layers (``first_k_dense_replace``, ``decoder_sparse_step``,
``mlp_only_layers``, per-layer type lists) the shrunk config keeps at least one of each.

:data:`FAMILIES` / :data:`UNBUILDABLE` are literal tables computed offline with
``python -m tests.support.families`` (which re-derives them; paste its output here when transformers
changes). ``tests/test_families.py`` checks that together they cover the conversion table exactly.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tests.support.models import _randomize_

__all__ = [
    "DIST_FAMILIES",
    "FAMILIES",
    "FAMILY_OVERRIDES",
    "MOE_FAMILIES",
    "UNBUILDABLE",
    "build_family_model",
    "is_moe",
    "conversion_op_kinds",
    "conversion_table_types",
    "family_model_class",
    "load_family_reference",
    "make_family_checkpoint",
    "probe_family",
    "save_family_model",
    "tiny_family_config",
]

# -- sizes -------------------------------------------------------------------------------------

VOCAB = 101
INTERMEDIATE = 43
#: Expert (stacked, possibly ``torch._grouped_mm``) intermediate size: a multiple of 4 elements.
EXPERT_INTERMEDIATE = 28
HIDDEN = 44  # with an explicit head_dim
HIDDEN_DERIVED = 40  # hidden / 4 heads = head dim 10
HIDDEN_VISION = 48  # hidden / 4 heads = head dim 12 (2-D rotary embeddings split it in halves)
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 10
HEAD_DIM_PARTIAL_ROPE = 16  # partial_rotary_factor 0.25 / 0.5 keeps an even rotary dim
MAX_POSITIONS = 64
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
LAYERS = 2
PATCH = 4
IMAGE = 16

#: Budget of one family: checkpoint bytes (fp32) and seconds for build + save + load.
MAX_CHECKPOINT_BYTES = 4 * 2**20
MAX_SECONDS = 20.0

_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_LAYER_COUNT_KEYS = (
    "num_hidden_layers",
    "depth",
    "num_layers",
    "encoder_layers",
    "decoder_layers",
    "n_layers",
)

#: Plain replacements, applied where the key holds an int (bools excluded).
_SCALARS: dict[str, int] = {
    "vocab_size": VOCAB,
    "max_position_embeddings": MAX_POSITIONS,
    "num_attention_heads": HEADS,
    "num_heads": HEADS,
    "attention_heads": HEADS,
    "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "moe_intermediate_size": EXPERT_INTERMEDIATE,
    "expert_ffn_hidden_size": EXPERT_INTERMEDIATE,
    "shared_expert_intermediate_size": INTERMEDIATE,
    "moe_shared_expert_intermediate_size": INTERMEDIATE,
    "shared_intermediate_size": INTERMEDIATE,
    "share_expert_dim": INTERMEDIATE,
    "dense_intermediate_size": INTERMEDIATE,
    "ffn_hidden_size": INTERMEDIATE,
    "encoder_ffn_dim": INTERMEDIATE,
    "decoder_ffn_dim": INTERMEDIATE,
    "num_experts_per_tok": EXPERTS_PER_TOKEN,
    "num_experts_per_token": EXPERTS_PER_TOKEN,
    "moe_topk": EXPERTS_PER_TOKEN,
    "moe_k": EXPERTS_PER_TOKEN,
    # multi-head latent attention (MLA) and its sparse indexer
    "kv_lora_rank": 13,
    "q_lora_rank": 19,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 6,
    "qk_head_dim": 10,
    "v_head_dim": 8,
    "index_head_dim": 8,
    "index_n_heads": 2,
    "index_topk": 4,
    "index_kpool": 4,
    # linear attention / state space layers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "ssm_state_size": 8,
    "mamba_num_heads": 4,
    "mamba_head_dim": 8,
    "n_groups": 2,
    "mamba_d_state": 8,
    "mamba_dt_rank": 4,
    # vision / audio towers
    "patch_size": PATCH,
    "num_position_embeddings": (IMAGE // PATCH) ** 2,
    "projection_dim": 16,
    "max_source_positions": MAX_POSITIONS,
    "image_seq_length": (IMAGE // PATCH) ** 2,
    "mm_tokens_per_image": 4,
    "max_image_size": IMAGE,
    "max_img_size": IMAGE,
    "min_image_size": 2 * PATCH,
    "num_patches": (IMAGE // PATCH) ** 2,
    "projector_hidden_size": INTERMEDIATE,
    "projection_intermediate_size": INTERMEDIATE,
    "projection_hidden_dim": INTERMEDIATE,
    "pretrain_image_size": IMAGE,
    "unpadded_vocab_size": VOCAB,
    "mlp_dim": INTERMEDIATE,
    "output_channels": 16,
    "downsample_hidden_size": 16,
    "d_model": HIDDEN_DERIVED,
    "sliding_window": 32,
    "sliding_window_size": 32,
    "swa_num_attention_heads": HEADS,
    "swa_num_key_value_heads": KV_HEADS,
    "swa_head_dim": HEAD_DIM,
    "linear_head_dim": 8,
    "linear_num_heads": 4,
    "zero_expert_num": 2,
    "decoder_self_attention_heads": HEADS,
    "decoder_cross_attention_heads": HEADS,
    "num_queries": 10,
}

#: Lists of layer indices: any non-empty one keeps a single index (first or last layer).
_INDEX_LISTS_FIRST = (
    "mlp_only_layers",
    "deepstack_visual_indexes",
    "intermediate_layers_indices",
    "window_block_indices",
)
_INDEX_LISTS_LAST = ("fullatt_block_indexes", "global_attn_indexes", "cross_attention_layers")

#: Keys whose value is the text model's hidden size (projections into the language model).
_TEXT_HIDDEN_KEYS = ("out_hidden_size", "text_hidden_size", "thinker_hidden_size")

_TOKEN_KEY = re.compile(r"(token_id|token_index|token_ids|_id)$")


# -- per-family overrides ----------------------------------------------------------------------


_SWIN_BACKBONE = dict(
    image_size=64,
    embed_dim=8,
    depths=[1, 1, 1, 1],
    num_heads=[1, 1, 2, 2],
    window_size=2,
    hidden_size=64,
)
_RESNET_BACKBONE = dict(embedding_size=8, hidden_sizes=[8, 12, 16, 20], depths=[1, 1, 1, 1])
_HGNET_BACKBONE = dict(
    embedding_size=8,
    depths=[1, 1, 1, 1],
    hidden_sizes=[12, 16, 20, 24],
    stem_channels=[3, 8, 8],
    stage_in_channels=[8, 12, 16, 20],
    stage_mid_channels=[4, 8, 8, 8],
    stage_out_channels=[12, 16, 20, 24],
    stage_num_blocks=[1, 1, 1, 1],
    stage_numb_of_layers=[2, 2, 2, 2],
)
#: RT-DETR style heads: encoder inputs are the backbone's last 3 stages, everything else d_model.
_DETR_HEAD = dict(encoder_hidden_dim=40, d_model=40, decoder_in_channels=[40, 40, 40], num_denoising=4)


def _family(
    config: Mapping[str, Any] | None = None, reason: str = "", cls: str | None = None
) -> dict[str, Any]:
    return {"config": dict(config or {}), "reason": reason, "cls": cls}


#: Overrides the generic shrinker needs: merged (recursively) into the shrunk config dict.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "dory": _family(
        dict(
            num_hidden_layers=6,
            layer_types=["sliding_attention", "mlp", "sliding_attention", "mlp", "full_attention", "mlp"],
            n_input_layers=2,
            n_recurrent_layers=2,
            n_output_layers=2,
        ),
        "the serialized config interleaves (attention, mlp) blocks: 3 layers, 1 input/recurrent/output each",
    ),
    "glm5_next": _family(dict(text_config=dict(num_key_value_heads=HEADS)), "config requires MHA"),
    "glm5_next_text": _family(dict(num_key_value_heads=HEADS), "config requires MHA"),
    "molmo2": _family(
        dict(adapter_config=dict(vision_feature_layer=[-1, -2])),
        "feature layers must index the 2 vision layers",
    ),
    "granitemoehybrid": _family(
        dict(mamba_n_heads=4, mamba_d_head=20), "mamba heads * head dim must equal expand * hidden (80)"
    ),
    "swin": _family(_SWIN_BACKBONE, "a narrow 4-stage pyramid (64 px image) with 2x2 windows"),
    "radio": _family(dict(patch_dim=3 * PATCH * PATCH), "patch_dim is channels * patch_size ** 2"),
    "granite_speech": _family(
        dict(
            encoder_config=dict(hidden_dim=40, dim_head=10, input_dim=16, context_size=8, max_pos_emb=64),
            projector_config=dict(encoder_hidden_size=40),
        ),
        "the conformer encoder sizes are not the generic names",
    ),
    "granite_speech_plus": _family(
        dict(
            encoder_config=dict(hidden_dim=40, dim_head=10, input_dim=16, context_size=8, max_pos_emb=64),
            projector_config=dict(encoder_hidden_size=40),
        ),
        "the conformer encoder sizes are not the generic names",
    ),
    "sapiens2": _family(
        dict(
            num_key_value_heads_per_layer=[HEADS, KV_HEADS],
            num_key_value_attention_heads=KV_HEADS,
            num_first_full_attention_layers=1,
            num_last_full_attention_layers=1,
        ),
        "per-layer key-value heads must divide the 4 heads",
    ),
    "inkling2": _family(
        dict(text_config=dict(vocab_size=128)),
        "embedding rows padded past unpadded_vocab_size (101), as on the hub",
    ),
    "inkling2_loop": _family(
        dict(text_config=dict(vocab_size=128)),
        "embedding rows padded past unpadded_vocab_size (101), as on the hub",
    ),
    "inkling2_text": _family(
        dict(vocab_size=128), "embedding rows padded past unpadded_vocab_size (101), as on the hub"
    ),
    "inkling2_loop_text": _family(
        dict(vocab_size=128), "embedding rows padded past unpadded_vocab_size (101), as on the hub"
    ),
    "deformable_detr": _family(
        dict(
            use_timm_backbone=False,
            backbone=None,
            backbone_config=dict(model_type="resnet", out_indices=[2, 3, 4], **_RESNET_BACKBONE),
            d_model=64,
        ),
        "the default backbone is timm's resnet50: use transformers' ResNet; GroupNorm(32) needs d_model 64",
    ),
    "maskformer": _family(
        dict(backbone_config=_SWIN_BACKBONE, fpn_feature_size=32, mask_feature_size=32),
        "the Swin backbone pyramid (4 stages) and the pixel decoder widths",
    ),
    "rt_detr": _family(
        dict(backbone_config=_RESNET_BACKBONE, encoder_in_channels=[12, 16, 20], **_DETR_HEAD),
        "ResNet backbone widths; the encoder takes its last 3 stages",
    ),
    "rt_detr_v2": _family(
        dict(backbone_config=_RESNET_BACKBONE, encoder_in_channels=[12, 16, 20], **_DETR_HEAD),
        "ResNet backbone widths; the encoder takes its last 3 stages",
    ),
    "d_fine": _family(
        dict(
            backbone_config=_HGNET_BACKBONE, encoder_in_channels=[16, 20, 24], lqe_hidden_dim=8, **_DETR_HEAD
        ),
        "HGNet-v2 backbone widths; the encoder takes its last 3 stages",
    ),
    "pp_doclayout_v2": _family(
        dict(
            backbone_config=_HGNET_BACKBONE,
            encoder_in_channels=[16, 20, 24],
            reading_order_config=dict(coordinate_size=10, shape_size=10, max_2d_position_embeddings=64),
            **_DETR_HEAD,
        ),
        "HGNet-v2 backbone widths; the encoder takes its last 3 stages",
    ),
    "pp_doclayout_v3": _family(
        dict(backbone_config=_HGNET_BACKBONE, encoder_in_channels=[16, 20, 24], **_DETR_HEAD),
        "HGNet-v2 backbone widths; the encoder takes its last 3 stages",
    ),
    "pp_doclayout_v4": _family(
        dict(
            backbone_config=_HGNET_BACKBONE,
            encoder_in_channels=[16, 20, 24],
            global_pointer_head_size=8,
            **_DETR_HEAD,
        ),
        "HGNet-v2 backbone widths; the encoder takes its last 3 stages",
    ),
    "dinov3_convnext": _family(
        dict(hidden_sizes=[8, 12, 16, 20], depths=[1, 1, 1, 1]), "ConvNeXt stage widths"
    ),
    "lw_detr": _family(
        dict(
            backbone_config=dict(num_windows=4, num_windows_side=2), projector_out_channels=40, group_detr=2
        ),
        "the window grid must divide the 4x4 patch grid",
    ),
    "tipsv2": _family(dict(text_config=dict(hidden_size=HIDDEN_VISION)), "text and vision widths must match"),
    "tipsv2_dpt": _family(
        dict(neck_hidden_sizes=[8, 12, 16, 20], fusion_hidden_size=16, num_depth_bins=8), "DPT neck widths"
    ),
    "sam3_tracker": _family(
        dict(
            vision_config=dict(
                backbone_config=dict(pretrain_image_size=IMAGE, window_size=2),
                backbone_feature_sizes=[[16, 16], [8, 8], [4, 4]],
            ),
        ),
        "feature-map sizes follow the 16 px image",
    ),
    "sam3_tracker_video": _family(
        dict(
            vision_config=dict(
                backbone_config=dict(pretrain_image_size=IMAGE, window_size=2),
                backbone_feature_sizes=[[16, 16], [8, 8], [4, 4]],
            ),
            memory_attention_feed_forward_hidden_size=INTERMEDIATE,
            memory_attention_rope_feat_sizes=[4, 4],
            memory_attention_num_layers=1,
            memory_encoder_output_channels=16,
        ),
        "feature-map sizes follow the 16 px image; memory attention widths",
    ),
    "gemma3n_text": _family(
        dict(
            intermediate_size=[INTERMEDIATE, INTERMEDIATE],
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            laurel_rank=4,
            num_kv_shared_layers=0,
        ),
        "per-layer inputs and KV sharing sized for 2 layers",
    ),
    "emu3": _family(
        dict(
            pad_token_id=0,
            vocabulary_map={"<|extra_200|>": 99, "<image>": 98, "<|visual token 000000|>": 97},
            vq_config=dict(
                codebook_size=16,
                base_channels=32,
                channel_multiplier=[1, 1],
                num_res_blocks=1,
                attn_resolutions=[],
            ),
        ),
        "default config has no pad_token_id nor vocabulary_map; VQ-GAN widths",
    ),
    "vibevoice_asr": _family(
        dict(
            acoustic_tokenizer_encoder_config=dict(
                num_filters=4, downsampling_ratios=[2, 2], depths=[1, 1, 1]
            ),
            semantic_tokenizer_encoder_config=dict(
                num_filters=4, downsampling_ratios=[2, 2], depths=[1, 1, 1]
            ),
        ),
        "the convolutional audio tokenizers double their width per stage: 2 stages of 4 filters",
    ),
    "colqwen2": _family(
        dict(
            vlm_config=dict(vision_config=dict(embed_dim=HIDDEN_VISION, hidden_size=HIDDEN_DERIVED)),
            embedding_dim=16,
        ),
        "Qwen2-VL vision: embed_dim is the tower width, hidden_size the text width",
    ),
    "t5gemma2_encoder": _family(
        dict(text_config=dict(dropout_rate=0.0)),
        "the encoder reads dropout_rate, which the default config lacks",
    ),
    "dots3_note_audio_encoder": _family(
        dict(conv_output_size=16 * 16, adapter_out_dim=HIDDEN),
        "conv stem output = downsample width * mel bins / 8",
    ),
    "unlimited_ocr": _family(
        dict(
            text_config=dict(hidden_size=40),
            vision_config=dict(sam_config=dict(downsample_channels=[20, 24])),
        ),
        "head_dim is derived: keep it even; SAM downsampler widths",
    ),
    "qwen3_omni_moe": _family(
        dict(
            talker_config=dict(
                text_config=dict(shared_expert_intermediate_size=INTERMEDIATE),
                code_predictor_config=dict(num_code_groups=4),
                spatial_merge_size=2,
                num_code_groups=4,
                accept_hidden_layer=1,
            ),
            code2wav_config=dict(decoder_dim=16, num_quantizers=4),
        ),
        "the talker reads shared_expert_intermediate_size and spatial_merge_size, which its default "
        "config lacks; 4 codec groups; a narrow code2wav decoder",
    ),
    "gradium_phonon_tts": _family(
        dict(
            hidden_size=HIDDEN_DERIVED,
            head_dim=HEAD_DIM,
            num_key_value_heads=HEADS,
            latent_dim=8,
            audio_prompt_dim=12,
            duration_delta_embedding_dim=8,
            flow_head_config=dict(latent_dim=8, condition_dim=HIDDEN_DERIVED, frequency_embedding_size=8),
        ),
        "save_pretrained's PermuteForRope revert assumes MHA and hidden == heads * head_dim",
    ),
    "mistral_large4": _family(
        dict(vision_config=dict(hidden_size=HIDDEN_DERIVED)),
        "save_pretrained's PermuteForRope revert of the vision q/k assumes hidden == heads * head_dim",
    ),
    "nemo_speechlm": _family(
        dict(
            audio_config=dict(
                asr_config=dict(num_key_value_heads=HEADS),
                diarization_config=dict(audio_config=dict(num_key_value_heads=HEADS)),
            ),
            word_timestamp_config=dict(num_key_value_heads=HEADS),
        ),
        "the audio encoders' fused qkv conversion does not round-trip with GQA: keep them MHA",
    ),
    "dots3_note_vision_encoder": _family(dict(adapter_out_dim=HIDDEN), "adapter output is the text width"),
    "deepseek_ocr2": _family(
        dict(
            vision_config=dict(
                encoder_config=dict(hidden_size=HIDDEN_DERIVED), sam_config=dict(downsample_channels=[20, 24])
            ),
            text_config=dict(
                hidden_size=40,
                mlp_layer_types=["dense", "sparse"],
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
            ),
        ),
        "head_dim is derived from hidden / heads: keep it even for RoPE",
    ),
    "esm": _family(dict(vocab_size=33, pad_token_id=1, mask_token_id=32), "default config has no vocab"),
    "hunyuan_v1_moe": _family(
        dict(
            head_dim=HEAD_DIM,
            hidden_size=HIDDEN,
            num_experts=EXPERTS,
            moe_topk=EXPERTS_PER_TOKEN,
            intermediate_size=EXPERT_INTERMEDIATE,
        ),
        "default config has no head_dim and a single expert (whose size is intermediate_size)",
    ),
    "hunyuan_vl": _family(
        dict(
            text_config=dict(head_dim=HEAD_DIM, hidden_size=HIDDEN),
            vision_config=dict(out_hidden_size=HIDDEN, text_hidden_size=HIDDEN),
        ),
        "default config has no head_dim",
    ),
    "dots1": _family(
        dict(
            n_routed_experts=EXPERTS,
            num_experts_per_tok=EXPERTS_PER_TOKEN,
            n_shared_experts=1,
            first_k_dense_replace=1,
        ),
        "default config has no experts; layer 0 dense, layer 1 MoE",
    ),
    "lfm2_moe": _family(dict(layer_types=["conv", "full_attention"]), "default config has no layer_types"),
    "ernie4_5_vl_moe": _family(
        dict(text_config=dict(rope_parameters=dict(mrope_section=[2, 2, 1]))),
        "the 3-D rope sections (default [22, 22, 20]) must add up to head_dim / 2",
    ),
    "qwen4_exp_text": _family(
        dict(
            indexer_n_heads=2,
            indexer_kv_heads=1,
            indexer_head_dim=12,
            indexer_budget=8,
            indexer_compress_ratio=4,
            hc_lowrank=8,
        ),
        "default config has no indexer sizes",
    ),
}


# -- the shrinker ------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _pick_layers(values: list | str, count: int) -> list | str:
    """``count`` entries of a per-layer list: first occurrences of each distinct value, in order,
    then padded with the first value's repeats (so a dense + MoE or linear + full mix survives)."""
    seq = list(values)
    picked: list[Any] = []
    for value in seq:
        if value not in picked:
            picked.append(value)
    picked = picked[:count]
    while len(picked) < count:
        picked.insert(0, seq[0])
    # keep the original relative order of first appearance
    picked.sort(key=seq.index)
    return "".join(picked) if isinstance(values, str) else picked


def _distinct(values: list | str) -> int:
    return len({repr(v) for v in values})


def _shrink(d: dict[str, Any], text_hidden: int | None) -> dict[str, Any]:
    """One config dict shrunk (sub-config dicts recursively)."""
    out = dict(d)
    rope = out.get("rope_parameters")
    partial = isinstance(rope, Mapping) and any(
        isinstance(p.get("partial_rotary_factor"), float) and p["partial_rotary_factor"] < 1.0
        for p in (rope, *(v for v in rope.values() if isinstance(v, Mapping)))
    )
    head_dim = HEAD_DIM_PARTIAL_ROPE if partial else HEAD_DIM
    vision = "patch_size" in out or "image_size" in out
    moe = any(_is_int(out.get(k)) and out[k] > 1 for k in _EXPERT_COUNT_KEYS)

    # layer count and the per-layer lists that follow it
    old_layers = next((out[k] for k in _LAYER_COUNT_KEYS if _is_int(out.get(k))), None)
    if old_layers is None and isinstance(out.get("layers_block_type"), list):  # nemotron_h: derived
        old_layers = len(out["layers_block_type"])
    per_layer = (
        [
            k
            for k, v in out.items()
            if isinstance(v, (list, str)) and len(v) == old_layers and k != "model_type"
        ]
        if old_layers and old_layers > LAYERS
        else []
    )
    layers = max([LAYERS] + [min(_distinct(out[k]), 4) for k in per_layer])
    # a backbone with one stage per layer: keep as many stages as it outputs (DPT necks take 4)
    stages = out.get("stage_names")
    if isinstance(stages, list) and old_layers and len(stages) == old_layers + 1 and old_layers > LAYERS:
        outputs = len(out.get("out_indices") or out.get("out_features") or [1])
        layers = max(layers, min(outputs, 4))
        indices = list(range(layers - min(outputs, 4) + 1, layers + 1))
        out["stage_names"] = ["stem"] + [f"stage{i}" for i in range(1, layers + 1)]
        out["out_indices"] = indices
        out["out_features"] = [f"stage{i}" for i in indices]
    for key in _LAYER_COUNT_KEYS:
        if _is_int(out.get(key)) and out[key] > layers:
            out[key] = layers
    for key in per_layer:
        out[key] = _pick_layers(out[key], layers)
    per_layer_config = out.get("per_layer_config")
    if isinstance(per_layer_config, dict) and per_layer_config:
        # heterogeneous layers ({"05": {...}, "11": {...}}): keep the first entry, on the last layer
        # (the per-layer lists keep the original's first layers in order, the special ones last)
        first_key = sorted(per_layer_config, key=int)[0]
        out["per_layer_config"] = {f"{layers - 1:0{len(first_key)}d}": per_layer_config[first_key]}

    if isinstance(out.get("text_config"), dict):  # siblings project into this text model
        out["text_config"] = _shrink(out["text_config"], text_hidden)
        text_hidden = out["text_config"].get("hidden_size", text_hidden)
    for key, value in list(out.items()):
        if key == "text_config":
            continue
        if isinstance(value, dict) and key not in ("id2label", "label2id", "rope_parameters"):
            out[key] = _shrink(value, text_hidden)
        elif _is_int(value) and key in _SCALARS:
            out[key] = _SCALARS[key] if value > _SCALARS[key] else value
        elif key in _INDEX_LISTS_FIRST and isinstance(value, list) and value:
            out[key] = [0]
        elif key in _INDEX_LISTS_LAST and isinstance(value, list) and value:
            out[key] = [layers - 1]

    if _is_int(out.get("hidden_size")):
        if vision and not _is_int(out.get("head_dim")):
            out["hidden_size"] = HIDDEN_VISION
        elif _is_int(out.get("head_dim")):
            out["hidden_size"] = HIDDEN
        else:
            out["hidden_size"] = HIDDEN_DERIVED if not partial else HEADS * HEAD_DIM_PARTIAL_ROPE
    if _is_int(out.get("head_dim")):
        old = d["head_dim"]
        if old == d.get("qk_rope_head_dim"):
            out["head_dim"] = out["qk_rope_head_dim"]
        elif old == d.get("qk_head_dim"):
            out["head_dim"] = out["qk_head_dim"]
        else:
            out["head_dim"] = head_dim
    if _is_int(out.get("intermediate_size")):
        # an MoE config without a separate expert size uses intermediate_size for the experts
        expert_sized = moe and "moe_intermediate_size" not in out
        out["intermediate_size"] = EXPERT_INTERMEDIATE if expert_sized else INTERMEDIATE
    if isinstance(out.get("intermediate_size"), list):
        out["intermediate_size"] = [INTERMEDIATE] * len(out["intermediate_size"])
    if isinstance(out.get("moe_intermediate_size"), list):
        out["moe_intermediate_size"] = [EXPERT_INTERMEDIATE, EXPERT_INTERMEDIATE - 8][
            : len(out["moe_intermediate_size"])
        ]
    for key in _EXPERT_COUNT_KEYS:
        if _is_int(out.get(key)) and out[key] > EXPERTS:
            out[key] = EXPERTS
    for key in ("n_group", "num_expert_group"):
        if _is_int(out.get(key)) and out[key] > 1:
            out[key] = 2
    if _is_int(out.get("topk_group")) and out["topk_group"] > 1:
        out["topk_group"] = 1
    for key in ("first_k_dense_replace", "num_dense_layers"):
        if _is_int(out.get(key)) and out[key] > 1:
            out[key] = 1
    if _is_int(out.get("decoder_sparse_step")) and out["decoder_sparse_step"] > 1:
        out["decoder_sparse_step"] = 2
    if vision:
        if _is_int(out.get("image_size")):
            out["image_size"] = IMAGE
        elif isinstance(out.get("image_size"), list):
            out["image_size"] = [IMAGE] * len(out["image_size"])
        if isinstance(out.get("patch_size"), list):
            out["patch_size"] = [PATCH] * len(out["patch_size"])
    if text_hidden is not None:
        for key in _TEXT_HIDDEN_KEYS:
            if _is_int(out.get(key)):
                out[key] = text_hidden
    if isinstance(rope, Mapping) and isinstance(rope.get("mrope_section"), list):
        half = (out.get("head_dim") if _is_int(out.get("head_dim")) else HEAD_DIM) // 2
        sections = rope["mrope_section"]
        total = sum(sections)
        new = [max(1, math.floor(half * s / total)) for s in sections]
        new[0] += half - sum(new)
        out["rope_parameters"] = dict(rope, mrope_section=new)
    return out


def _text_hidden(d: Mapping[str, Any]) -> int | None:
    text = d.get("text_config")
    if isinstance(text, Mapping) and _is_int(text.get("hidden_size")):
        return text["hidden_size"]
    return d["hidden_size"] if _is_int(d.get("hidden_size")) else None


def _remap_token_ids(d: dict[str, Any], mapping: dict[int, int]) -> None:
    """Token ids past the shrunk vocab move to distinct ids counted down from ``VOCAB - 1``
    (an embedding's ``padding_idx`` has to be a valid row); equal ids stay equal."""
    for key, value in d.items():
        if key in ("id2label", "label2id") or not isinstance(key, str):
            continue
        if isinstance(value, dict):
            _remap_token_ids(value, mapping)
        elif _TOKEN_KEY.search(key) and (_is_int(value) or isinstance(value, list)):
            ids = value if isinstance(value, list) else [value]
            if not all(_is_int(i) for i in ids):
                continue
            new = []
            for i in ids:
                if i >= VOCAB and i not in mapping:
                    mapping[i] = VOCAB - 1 - len(mapping)
                new.append(mapping.get(i, i))
            d[key] = new if isinstance(value, list) else new[0]


_ALIAS_KEY = re.compile(r"(dim|size|hidden)")


def _hidden_aliases(
    old: Mapping[str, Any], new: Mapping[str, Any], aliases: dict[int, int]
) -> dict[int, int]:
    """``{old hidden size: new hidden size}`` of every (sub-)config, outermost first."""
    for key in ("hidden_size", *_TEXT_HIDDEN_KEYS):
        if _is_int(old.get(key)) and _is_int(new.get(key)):
            aliases.setdefault(old[key], new[key])
    for key, value in old.items():
        if isinstance(value, Mapping) and isinstance(new.get(key), Mapping):
            _hidden_aliases(value, new[key], aliases)
    return aliases


def _apply_hidden_aliases(old: Mapping[str, Any], new: dict[str, Any], aliases: Mapping[int, int]) -> None:
    """Sizes the shrinker left alone that equal some config's hidden size (``condition_dim``,
    ``adapter_input_size``, ``audio_hidden_size``, ...) follow that hidden size."""
    for key, value in old.items():
        if isinstance(value, Mapping) and isinstance(new.get(key), dict):
            _apply_hidden_aliases(value, new[key], aliases)
        elif (
            _is_int(value)
            and new.get(key) == value
            and value in aliases
            and key not in _SCALARS
            and _ALIAS_KEY.search(key)
        ):
            new[key] = aliases[value]


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def tiny_family_config(model_type: str, **config_overrides: Any):
    """The tiny ``PreTrainedConfig`` of ``model_type``: defaults shrunk, family overrides merged."""
    from transformers import CONFIG_MAPPING, AutoConfig

    data = AutoConfig.for_model(model_type).to_dict()
    shrunk = _shrink(data, None)
    hidden = _text_hidden(shrunk)
    if hidden is not None and hidden != _text_hidden(data):
        shrunk = _shrink(data, hidden)
    _apply_hidden_aliases(data, shrunk, _hidden_aliases(data, shrunk, {}))
    _remap_token_ids(shrunk, {})
    spec = FAMILY_OVERRIDES.get(model_type)
    if spec is not None:
        shrunk = _merge(shrunk, spec["config"])
    shrunk = _merge(shrunk, config_overrides)
    shrunk.pop("transformers_version", None)
    return CONFIG_MAPPING[model_type].from_dict(copy.deepcopy(shrunk))


# -- model class, build, checkpoint, reference -------------------------------------------------

#: Auto mappings tried first, in order (then every other ``MODEL_*_MAPPING_NAMES``).
_AUTO_MAPPINGS = (
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)


def _candidate_classes(model_type: str) -> list[str]:
    from transformers.models.auto import modeling_auto

    names = [n for n in dir(modeling_auto) if n.startswith("MODEL_") and n.endswith("_MAPPING_NAMES")]
    ordered = list(_AUTO_MAPPINGS) + sorted(n for n in names if n not in _AUTO_MAPPINGS)
    out: list[str] = []
    for name in ordered:
        mapping = getattr(modeling_auto, name, {})
        if model_type in mapping and isinstance(mapping[model_type], str) and mapping[model_type] not in out:
            out.append(mapping[model_type])
    return out


def _module_classes(config_cls: type) -> list[type]:
    """The model classes of ``config_cls``'s package that take exactly that config (for sub-model
    types such as ``dots3_note_audio_encoder`` that no auto mapping lists)."""
    import importlib
    import pkgutil

    from transformers import PreTrainedModel

    package = importlib.import_module(config_cls.__module__.rsplit(".", 1)[0])
    out: list[type] = []
    for sub in pkgutil.iter_modules(package.__path__):
        if not sub.name.startswith("modeling_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{sub.name}")
        for name, value in vars(module).items():
            if (
                isinstance(value, type)
                and issubclass(value, PreTrainedModel)
                and value.__module__ == module.__name__
                and getattr(value, "config_class", None) is config_cls
                and not name.endswith("PreTrainedModel")
            ):
                out.append(value)
    return out


def family_model_class(model_type: str) -> type:
    """The class a family is built, saved and loaded with.

    The override's class, else the first class of the auto mappings (image-text-to-text,
    multimodal LM, causal LM, seq2seq, speech seq2seq, ``AutoModel``, then the others) whose
    ``config_class`` is the family's config (so ``emu3`` gets ``Emu3ForConditionalGeneration``, not
    the text-only ``Emu3ForCausalLM``), else the first mapped class at all, else a model class of
    the family's package that takes the config (sub-model types no auto mapping lists).
    """
    import transformers
    from transformers import CONFIG_MAPPING

    spec = FAMILY_OVERRIDES.get(model_type)
    if spec is not None and spec["cls"]:
        return getattr(transformers, spec["cls"])
    config_cls = CONFIG_MAPPING[model_type]
    candidates = [getattr(transformers, name, None) for name in _candidate_classes(model_type)]
    candidates = [cls for cls in candidates if isinstance(cls, type)]
    for cls in candidates:
        if getattr(cls, "config_class", None) is config_cls:
            return cls
    if candidates:  # served by another family's class (exaone -> LlamaForCausalLM, sarvam_moe -> Glm4Moe)
        return candidates[0]
    found = _module_classes(config_cls)
    if found:
        return found[-1]
    raise ValueError(f"no model class takes {config_cls.__name__} ({model_type!r})")


def build_family_model(model_type: str, *, dtype: torch.dtype = torch.float32, seed: int = 0):
    """The tiny ``model_type`` model with seeded distinct random values, eval mode, on CPU."""
    config = tiny_family_config(model_type)
    torch.manual_seed(seed)
    model = family_model_class(model_type)._from_config(config, dtype=dtype)
    _randomize_(model, seed)
    return model.eval()


def make_family_checkpoint(
    model_type: str,
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int | None = None,
    seed: int = 0,
) -> Path:
    """Write the tiny ``model_type`` checkpoint (``save_pretrained``: original format); return it.

    ``max_shard_size`` (e.g. ``"100KB"``) writes several files plus an index; ``None`` one file.
    """
    return save_family_model(
        build_family_model(model_type, dtype=dtype, seed=seed), directory, max_shard_size
    )


def save_family_model(
    model, directory: str | os.PathLike[str], max_shard_size: str | int | None = None
) -> Path:
    """``model.save_pretrained(directory)`` (what :func:`make_family_checkpoint` writes)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


def load_family_reference(
    path: str | os.PathLike[str], model_type: str, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The oracle: the state dict of a single-process transformers ``from_pretrained`` of ``path``."""
    model = family_model_class(model_type).from_pretrained(Path(path), dtype=dtype)
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def conversion_table_types() -> list[str]:
    """The conversion table's keys that are model types (in ``CONFIG_MAPPING``), in table order."""
    from transformers import CONFIG_MAPPING
    from transformers.conversion_mapping import _build_checkpoint_conversion_mapping

    return [key for key in _build_checkpoint_conversion_mapping() if key in CONFIG_MAPPING]


def is_moe(model: torch.nn.Module) -> bool:
    """Whether ``model`` has stacked experts: a 3-D parameter under an ``experts`` module."""
    return any(
        param.dim() == 3 and "experts" in name.split(".")[:-1] for name, param in model.named_parameters()
    )


# -- probing (python -m tests.support.families) --------------------------------------------------------


def _reason(error: BaseException) -> str:
    """``"ExceptionClass: first line of the message"`` (a missing package named as such)."""
    if isinstance(error, ModuleNotFoundError) and error.name:
        return f"needs the {error.name} package (ModuleNotFoundError: No module named {error.name!r})"
    missing = re.search(r"(\w+) requires the (\w+) library", str(error))
    if isinstance(error, ImportError) and missing:
        who, package = missing.groups()
        return f"needs the {package} package (ImportError: {who} requires the {package} library)"
    text = str(error).strip().splitlines()
    if error.__cause__ is not None and (not text or text[0].endswith(":")):
        return _reason(error.__cause__)  # StrictDataclassClassValidationError: the validator's error
    line = re.sub(r"\s+", " ", text[0]) if text else ""
    if len(line) > 160:
        line = line[:157] + "..."
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def probe_family(model_type: str, directory: str | os.PathLike[str] | None = None) -> tuple[str | None, dict]:
    """Try one family: build, ``save_pretrained``, ``from_pretrained`` (fp32, CPU), compare.

    Returns ``(None, info)`` when it works, else ``(reason, info)``; ``info`` holds ``bytes``,
    ``moe`` (:func:`is_moe`) and ``seconds`` as far as the probe got.
    """
    info: dict[str, Any] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() if directory is None else contextlib.nullcontext(directory) as tmp:
        try:
            model = build_family_model(model_type)
        except Exception as e:
            return _reason(e), info
        expected = {key: value.detach().clone() for key, value in model.state_dict().items()}
        info["bytes"] = sum(t.numel() * t.element_size() for t in expected.values())
        info["moe"] = is_moe(model)
        if info["bytes"] > MAX_CHECKPOINT_BYTES:
            return f"too large when shrunk: {info['bytes'] / 2**20:.1f} MiB", info
        try:
            path = save_family_model(model, Path(tmp) / model_type)
            del model
            reference = load_family_reference(path, model_type)
        except Exception as e:
            return _reason(e), info
        if set(reference) != set(expected):
            diff = sorted(set(reference) ^ set(expected))
            return f"save/from_pretrained changes the keys: {diff[:3]}", info
        changed = [key for key in expected if not torch.equal(expected[key], reference[key])]
        if changed:
            return f"save/from_pretrained does not round-trip: {changed[:3]}", info
    info["seconds"] = round(time.perf_counter() - start, 2)
    if info["seconds"] > MAX_SECONDS:
        return f"too slow: {info['seconds']:.1f} s", info
    return None, info


# -- the tables (python -m tests.support.families) -----------------------------------------------------
# Derived with ``python -m tests.support.families`` on transformers 5.24 / torch 2.13 (CPU): 152 of the
# conversion table's 154 model types build, save_pretrained and from_pretrained (fp32) exactly.

#: Buildable model types, in conversion-table order.
FAMILIES: tuple[str, ...] = (
    "dory",
    "hy_v4",
    "hy_v4_vl",
    "cosmos3_edge",
    "inkling2",
    "inkling2_text",
    "axk2",
    "gemma4_unified",
    "radio",
    "hrm_text",
    "hunyuan_vl",
    "lw_detr",
    "videomae",
    "swin",
    "altclip",
    "kimi_k25",
    "deepseek_v4",
    "glm5_next",
    "llava",
    "minimax_m3_vl",
    "qwen2_audio",
    "granite_speech",
    "aria_text",
    "granitemoe",
    "vibevoice_asr",
    "llava_next",
    "video_llava",
    "fuyu",
    "mllama",
    "molmo2",
    "emu3",
    "paddleocr_vl",
    "deepseek_ocr2",
    "step3p7",
    "step3p5_vision",
    "colqwen2",
    "shieldgemma2",
    "pi0",
    "esm",
    "dinov3_convnext",
    "dinov3_vit",
    "yolos",
    "timesfm2_5",
    "olmo_hybrid",
    "exaone",
    "lara_mini",
    "qwen3_5_text",
    "apertus1p5_text",
    "sam3_tracker",
    "t5gemma2_encoder",
    "mixtral",
    "qwen2_moe",
    "dots3_note_audio_encoder",
    "dots3_note_vision_encoder",
    "qwen3_vl_moe",
    "cosmos3_omni",
    "phimoe",
    "lfm3",
    "lfm3_vl_vision",
    "lfm2_moe",
    "ernie4_5_vl_moe",
    "maskformer",
    "rt_detr",
    "pp_doclayout_v4",
    "deformable_detr",
    "d_fine",
    "nemotron_h",
    "jamba",
    "hyperclovax_vision_v2",
    "nomic_bert",
    "gte",
    "jina_embeddings_v3",
    "cohere_asr",
    "qianfan_ocr",
    "sapiens2",
    "unlimited_ocr",
    "tipsv2",
    "tipsv2_dpt",
    "bailing_hybrid",
    "sarvam_moe",
    "ernie4_5_moe",
    "pixio",
    "minimax_m2",
    "exaone_moe",
    "kolibri1",
    "mimo_v2_flash",
    "flint",
    "hy_v3",
    "qwen3_5_moe_text",
    "laguna",
    "axk1",
    "qwen4_exp_text",
    "kimi_linear",
    "jev",
    "gradium_phonon_tts",
    "nemo_speechlm",
    "mistral_large4",
    "mistral_large4_text",
    "inkling2_loop",
    "inkling2_loop_text",
    "minimax",
    "afmoe",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "dots1",
    "glm4_moe",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "glm4v_moe",
    "longcat_flash",
    "solar_open",
    "mellum",
    "qwen3_moe",
    "beam",
    "qwen3_omni_moe",
    "qwen3_omni_moe_thinker",
    "qwen3_omni_moe_text",
    "qwen3_next",
    "hunyuan_v1_moe",
    "flex_olmo",
    "olmoe",
    "sarvam_mla",
    "cohere2_moe",
    "rt_detr_v2",
    "pp_doclayout_v2",
    "pp_doclayout_v3",
    "sam3_tracker_video",
    "mlcd",
    "aria",
    "paligemma",
    "aya_vision",
    "got_ocr2",
    "gemma3",
    "internvl",
    "vipllava",
    "mistral3",
    "pp_chart2table",
    "voxtral",
    "voxtral_realtime",
    "audioflamingo3",
    "glmasr",
    "musicflamingo",
    "granite_speech_plus",
    "granitemoeshared",
    "granitemoehybrid",
    "gemma3n_text",
    "glm5_next_text",
    "hy_v4_vl_text",
    "llava_next_video",
    "llava_onevision",
    "qwen2_5_omni_thinker",
)

#: Model types of the conversion table that do not build tiny on CPU here, with the reason.
UNBUILDABLE: dict[str, str] = {
    "inkling_mm_model": "needs the scipy package (ModuleNotFoundError: No module named 'scipy')",
    "timm_wrapper": "needs the timm package (ImportError: TimmWrapperModel requires the timm library)",
}

#: The 2-rank family matrix (``tests/dist/test_families_dist.py``): a few families whose checkpoint
#: conversions together use every kind of op of the table at least twice where two families have
#: it, with and without a tp plan (a greedy cover of :func:`conversion_op_kinds`; every family of
#: the table loads in one process in ``tests/test_families.py``, which also checks this cover).
DIST_FAMILIES: tuple[str, ...] = (
    "kimi_k25", "inkling2_loop", "inkling2_loop_text", "molmo2", "gte", "sarvam_moe", "ernie4_5_vl_moe",
    "jev", "dory", "step3p7", "qwen3_vl_moe",
)


def conversion_op_kinds(model_type: str) -> frozenset[str]:
    """The kinds of transform in a family's checkpoint conversion mapping (``WeightRenaming``,
    each op class of its ``WeightConverter`` s), plus ``"tp plan"`` or ``"no tp plan"``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    with torch.device("meta"):
        model = family_model_class(model_type)._from_config(tiny_family_config(model_type))
    kinds = {"tp plan" if getattr(model, "_tp_plan", None) else "no tp plan"}
    for transform in get_model_conversion_mapping(model, key_mapping=None, hf_quantizer=None):
        if isinstance(transform, WeightConverter):
            kinds.update(type(op).__name__ for op in transform.operations)
        else:
            kinds.add(type(transform).__name__)
    return frozenset(kinds)


#: Families with stacked experts (a 3-D parameter under an ``experts`` module).
MOE_FAMILIES: frozenset[str] = frozenset(
    {
        "hy_v4",
        "hy_v4_vl",
        "inkling2",
        "inkling2_text",
        "axk2",
        "kimi_k25",
        "deepseek_v4",
        "glm5_next",
        "minimax_m3_vl",
        "aria_text",
        "granitemoe",
        "deepseek_ocr2",
        "step3p7",
        "lara_mini",
        "mixtral",
        "qwen2_moe",
        "dots3_note_vision_encoder",
        "qwen3_vl_moe",
        "phimoe",
        "lfm2_moe",
        "ernie4_5_vl_moe",
        "nemotron_h",
        "jamba",
        "unlimited_ocr",
        "bailing_hybrid",
        "sarvam_moe",
        "ernie4_5_moe",
        "minimax_m2",
        "exaone_moe",
        "kolibri1",
        "mimo_v2_flash",
        "flint",
        "hy_v3",
        "qwen3_5_moe_text",
        "laguna",
        "axk1",
        "qwen4_exp_text",
        "kimi_linear",
        "nemo_speechlm",
        "mistral_large4",
        "mistral_large4_text",
        "inkling2_loop",
        "inkling2_loop_text",
        "minimax",
        "afmoe",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "dots1",
        "glm4_moe",
        "glm4_moe_lite",
        "glm_moe_dsa",
        "glm4v_moe",
        "longcat_flash",
        "solar_open",
        "mellum",
        "qwen3_moe",
        "beam",
        "qwen3_omni_moe",
        "qwen3_omni_moe_thinker",
        "qwen3_omni_moe_text",
        "qwen3_next",
        "hunyuan_v1_moe",
        "flex_olmo",
        "olmoe",
        "sarvam_mla",
        "cohere2_moe",
        "aria",
        "granitemoeshared",
        "granitemoehybrid",
        "glm5_next_text",
        "hy_v4_vl_text",
    }
)


def _main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    types = argv or conversion_table_types()
    families: list[str] = []
    moe: list[str] = []
    broken: dict[str, str] = {}
    for model_type in types:
        reason, info = probe_family(model_type)
        status = "ok" if reason is None else reason
        print(f"# {model_type}: {status} {info}", file=sys.stderr, flush=True)
        if reason is None:
            families.append(model_type)
            if info.get("moe"):
                moe.append(model_type)
        else:
            broken[model_type] = reason
    print("FAMILIES: tuple[str, ...] = (")
    for t in families:
        print(f"    {json.dumps(t)},")
    print(")\n\nUNBUILDABLE: dict[str, str] = {")
    for t, r in broken.items():
        print(f"    {json.dumps(t)}: {json.dumps(r)},")
    print("}\n\nMOE_FAMILIES: frozenset[str] = frozenset(\n    {")
    for t in moe:
        print(f"        {json.dumps(t)},")
    print("    }\n)")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
