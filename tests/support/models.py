"""Tiny, real transformers checkpoints: the oracle source of every correctness test.

Each entry of :data:`TINY_MODELS` is a real transformers architecture shrunk to a few kB. The
factory builds it from its config with a fixed seed, gives *every* floating tensor random values
(norm weights and biases too, so a misplaced slice can never hide behind a constant), and writes it
with ``save_pretrained``. transformers 5 ``save_pretrained`` reverts the model's checkpoint
conversion mapping, so the files are in the model's **original checkpoint format** (Mixtral:
per-expert ``block_sparse_moe.experts.N.w1``; GTE: fused ``attention.qkv_proj``; ...), exactly
what ``from_pretrained`` has to convert on load. :func:`load_reference` is that single-process
``from_pretrained`` load: the state dict a correct loader has to reproduce, bit for bit.

Sizes are deliberately awkward: vocab 101, intermediate 43 and MoE intermediate 23 are primes (not
divisible by 2, 3 or 4). The hidden size has to be a multiple of the head count (the configs
validate it), so the GQA models (4 query / 2 key-value heads of dim 10; head dims must be even for
RoPE) use hidden 44, which also differs from ``heads * head_dim = 40``; GTE needs
``hidden = heads * head_dim`` and uses 5 heads of 14 (hidden 70).

Checkpoint conversion ops per model type (``transformers.conversion_mapping.
get_model_conversion_mapping(model)`` on transformers 5.24; ``test_models_fixture`` checks this
table against the installed transformers, see :data:`EXPECTED_CONVERSION_OPS`)::

    model type          class                                  WeightConverter ops                 renames
    ------------------  -------------------------------------  ----------------------------------  -------------------------------
    llama               LlamaForCausalLM (tied lm_head)        none                                legacy only
    mixtral             MixtralForCausalLM                     MergeModulelist, Concatenate        block_sparse_moe -> mlp, legacy
    qwen3_moe           Qwen3MoeForCausalLM                    MergeModulelist, Concatenate        legacy
    gte                 GteModel                               Chunk (qkv_proj, up_gate_proj)      PrefixChange, renames, legacy
    sarvam_moe          Glm4MoeForCausalLM                     Split (GQA query_key_value),        renames, legacy
                                                               MergeModulelist, Concatenate
    qwen3_vl_moe        Qwen3VLMoeForConditionalGeneration     Transpose(1, 2) (fused experts)     legacy
    gradium_phonon_tts  GradiumPhononTTSModel                  Chunk + PermuteForRope (in_proj)    renames, legacy

Notes on the table:

* ``legacy`` is the ``get_checkpoint_conversion_mapping("legacy")`` list appended to every model
  (``LayerNorm.gamma/beta``, ``weight_g/v``, ...): renames that match nothing here.
* ``sarvam_moe`` is served by ``Glm4MoeForCausalLM`` (transformers' auto mapping) with
  ``model_type == "sarvam_moe"``; its layer 0 is dense (``first_k_dense_replace=1``), layer 1 MoE
  with a shared expert. ``Split`` cuts the fused ``[q|k|v]`` rows by target size (40/20/20).
* ``qwen3_vl_moe`` has a tiny vision tower; only the text experts use ``Transpose``. Its op is
  ``Transpose(1, 2, check_dims=True)``: it transposes only when the stored shape differs from the
  parameter's, so ``save_pretrained`` writes the *model* layout; :func:`make_checkpoint` rewrites
  the fused experts to the original (transposed, ``[E, hidden, 2*inter]``) layout of the hub files.
* ``gradium_phonon_tts``: save reverts the Chunk + PermuteForRope (the fused ``in_proj`` holds q/k
  rows in interleaved-RoPE order) but not all of its prefix renames, so the file is a mix of
  original and model names; ``from_pretrained`` still loads it exactly (that is what we test).
* Other ops in transformers 5.24, not covered here (no tiny buildable model): ``Interleave``
  (inkling*), ``ErnieFuseAndSplitTextVisionExperts``, Inkling2 dequantize/unpad ops.
  ``nomic_bert``, ``jina_embeddings_v3``, ``hrm_text`` and ``Dinov2Model`` use Chunk as well.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hp_dcp_hf.geometry.shards import (
    keep_shard_geometry,
)

__all__ = [
    "EXPECTED_CONVERSION_OPS",
    "MODEL_TYPES",
    "TINY_MODELS",
    "TinyModel",
    "build_model",
    "checkpoint_files",
    "checkpoint_keys",
    "conversion_ops",
    "load_reference",
    "make_checkpoint",
    "model_class",
    "read_checkpoint",
    "tiny_config",
]

_DENSE = dict(
    vocab_size=101,
    hidden_size=44,
    intermediate_size=43,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=10,
    max_position_embeddings=64,
)


@dataclass(frozen=True)
class TinyModel:
    """One tiny architecture: its ``model_type``, the transformers class and config kwargs."""

    model_type: str
    class_name: str
    config: Mapping[str, Any]
    notes: str = ""
    #: Rewrites applied to the saved files, for formats ``save_pretrained`` does not restore.
    postprocess: Callable[[Path], None] | None = None


def _transpose_fused_experts(path: Path) -> None:
    """Store ``mlp.experts.gate_up_proj`` / ``down_proj`` as the original Qwen3-VL-MoE files do.

    The hub checkpoints hold ``[experts, hidden, 2 * inter]`` and ``[experts, inter, hidden]``;
    transformers 5 keeps ``[experts, 2 * inter, hidden]`` / ``[experts, hidden, inter]`` and its
    ``Transpose(1, 2, check_dims=True)`` transposes on load only when the shapes differ, so
    ``save_pretrained`` (shapes equal) writes the model layout. Rewrite to the original one.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    for file in checkpoint_files(path):
        with safe_open(file, "pt") as handle:
            metadata = handle.metadata()
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        if not any(key.endswith(_FUSED_EXPERTS) for key in tensors):
            continue
        for key, tensor in tensors.items():
            if key.endswith(_FUSED_EXPERTS):
                tensors[key] = tensor.transpose(1, 2).contiguous()
        save_file(tensors, file, metadata=metadata)


_FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


TINY_MODELS: dict[str, TinyModel] = {
    "llama": TinyModel(
        "llama",
        "LlamaForCausalLM",
        dict(_DENSE, tie_word_embeddings=True),
        "dense GQA, tied embeddings: lm_head.weight is not in the checkpoint",
    ),
    "mixtral": TinyModel(
        "mixtral",
        "MixtralForCausalLM",
        dict(_DENSE, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
        "MoE, per-expert block_sparse_moe.experts.N.w1/w2/w3 -> stacked mlp.experts.gate_up_proj/down_proj",
    ),
    "qwen3_moe": TinyModel(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        dict(
            _DENSE,
            moe_intermediate_size=23,
            num_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
        "MoE with q/k norms, per-expert mlp.experts.N.gate_proj/up_proj/down_proj -> stacked",
    ),
    "gte": TinyModel(
        "gte",
        "GteModel",
        dict(
            vocab_size=101,
            hidden_size=70,
            intermediate_size=43,
            num_hidden_layers=2,
            num_attention_heads=5,
            max_position_embeddings=64,
        ),
        "encoder, fused attention.qkv_proj (weight + bias) and mlp.up_gate_proj -> Chunk(dim=0)",
    ),
    "sarvam_moe": TinyModel(
        "sarvam_moe",
        "Glm4MoeForCausalLM",
        dict(
            _DENSE,
            moe_intermediate_size=23,
            n_routed_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
        "GQA fused attention.query_key_value -> Split(dim=0) by target sizes; MoE with shared expert",
    ),
    "qwen3_vl_moe": TinyModel(
        "qwen3_vl_moe",
        "Qwen3VLMoeForConditionalGeneration",
        dict(
            text_config=dict(
                _DENSE,
                moe_intermediate_size=23,
                num_experts=4,
                num_experts_per_tok=2,
            ),
            vision_config=dict(
                depth=1,
                hidden_size=16,
                intermediate_size=20,
                num_heads=2,
                out_hidden_size=44,
                deepstack_visual_indexes=[0],
            ),
            tie_word_embeddings=False,
        ),
        "fused experts stored transposed: mlp.experts.gate_up_proj/down_proj -> Transpose(1, 2)",
        postprocess=_transpose_fused_experts,
    ),
    "gradium_phonon_tts": TinyModel(
        "gradium_phonon_tts",
        "GradiumPhononTTSModel",
        dict(
            vocab_size=101,
            hidden_size=40,
            intermediate_size=43,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            latent_dim=8,
            audio_prompt_dim=12,
            duration_delta_embedding_dim=8,
            flow_head_config=dict(
                hidden_size=16,
                num_hidden_layers=1,
                latent_dim=8,
                condition_dim=40,
                frequency_embedding_size=8,
                loss_weighting_hidden_size=8,
            ),
        ),
        "fused self_attn.in_proj -> Chunk(dim=0) + PermuteForRope on q/k",
    ),
}

DEFAULT_SHARD_SIZE = "20KB"  # the test checkpoints' max_shard_size: several files even for tiny models

MODEL_TYPES: tuple[str, ...] = tuple(TINY_MODELS)

#: WeightConverter operation class names of each model's checkpoint conversion mapping, in order
#: of first appearance (renames excluded). Checked against the installed transformers.
EXPECTED_CONVERSION_OPS: dict[str, tuple[str, ...]] = {
    "llama": (),
    "mixtral": ("MergeModulelist", "Concatenate"),
    "qwen3_moe": ("MergeModulelist", "Concatenate"),
    "gte": ("Chunk",),
    "sarvam_moe": ("MergeModulelist", "Concatenate", "Split"),
    "qwen3_vl_moe": ("Transpose",),
    "gradium_phonon_tts": ("Chunk", "PermuteForRope"),
}


def _spec(model_type: str) -> TinyModel:
    try:
        return TINY_MODELS[model_type]
    except KeyError:
        raise ValueError(f"unknown tiny model type {model_type!r}; known: {', '.join(MODEL_TYPES)}") from None


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def model_class(model_type: str) -> type:
    """The transformers class the tiny ``model_type`` is built and loaded with."""
    import transformers

    return getattr(transformers, _spec(model_type).class_name)


def tiny_config(model_type: str, **config_overrides: Any):
    """The tiny ``PreTrainedConfig`` of ``model_type``; overrides merge into nested sub-configs."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **_merge(_spec(model_type).config, config_overrides))


@torch.no_grad()
def _randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give every floating parameter and persistent buffer seeded random values.

    Drawn in float32 in ``state_dict`` order, then cast to each tensor's dtype, so the bf16 and
    fp32 variants of one seed hold the same values up to rounding. 1-D ``*weight`` tensors (norm scales) are ``1 + 0.1 * x``,
    all others ``0.1 * x``: distinct values everywhere, and a sane forward pass.
    """
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen or not tensor.is_floating_point():
            continue
        seen.add(id(tensor))
        values = torch.randn(tensor.shape, generator=gen, dtype=torch.float32) * 0.1
        if tensor.dim() == 1 and name.endswith("weight"):
            values += 1.0
        tensor.copy_(values)


def build_model(
    model_type: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    **config_overrides: Any,
):
    """The tiny model, seeded random weights, in ``dtype``, eval mode, on CPU.

    Deterministic: the same arguments give bit-identical weights (this is the model that
    :func:`make_checkpoint` writes).
    """
    config = tiny_config(model_type, **config_overrides)
    torch.manual_seed(seed)
    # ``dtype`` at construction honours ``_keep_in_fp32_modules_strict`` (e.g. the Glm4Moe router
    # stays float32 in a bf16 model, and is saved as F32), exactly as ``from_pretrained`` does.
    model = model_class(model_type)._from_config(config, dtype=dtype)
    _randomize_(model, seed)
    return model.eval()


def make_checkpoint(
    model_type: str,
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: str | int | None = None,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write the tiny ``model_type`` checkpoint (original format) to ``directory``; return it.

    ``max_shard_size`` (e.g. ``"20KB"``) forces several ``model-0000i-of-0000n.safetensors`` files
    plus ``model.safetensors.index.json``; ``None`` writes one ``model.safetensors``.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(model_type, dtype=dtype, seed=seed, **config_overrides)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    spec = _spec(model_type)
    if spec.postprocess is not None:
        spec.postprocess(path)
    return path


def load_reference(
    path: str | os.PathLike[str],
    model_type: str,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """The oracle: state dict of a single-process ``from_pretrained`` of ``path``.

    Keys are the model's (converted) names, tied aliases included (e.g. llama's ``lm_head.weight``).
    """
    model = model_class(model_type).from_pretrained(Path(path), dtype=dtype)
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def conversion_ops(model: Any) -> tuple[str, ...]:
    """WeightConverter op class names of ``model``'s checkpoint mapping, in first-seen order.

    ``model`` is a ``PreTrainedModel`` or a tiny ``model_type`` (built on the meta device).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    if isinstance(model, str):
        with torch.device("meta"):
            model = model_class(model)._from_config(tiny_config(model))
    ops: list[str] = []
    for transform in get_model_conversion_mapping(model):
        if isinstance(transform, WeightConverter):
            for op in transform.operations:
                if type(op).__name__ not in ops:
                    ops.append(type(op).__name__)
    return tuple(ops)


def checkpoint_files(path: str | os.PathLike[str]) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint directory, sorted."""
    return sorted(Path(path).glob("*.safetensors"))


def checkpoint_keys(path: str | os.PathLike[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{key: (safetensors dtype, shape)}`` of every tensor in the checkpoint, read from headers."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in checkpoint_files(path):
        with open(file, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        header.pop("__metadata__", None)
        for key, info in header.items():
            out[key] = (info["dtype"], tuple(info["shape"]))
    return out


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint as stored (original names, original layout)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        out.update(load_file(file))
    return out


def replace_parameters(model: torch.nn.Module, make) -> None:
    """Every parameter replaced by ``make(param)`` (tied parameters by one), and the shard geometry
    kept through ``state_dict()``."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in done:
                done[id(param)] = make(param)
            module._parameters[name] = done[id(param)]
    keep_shard_geometry(model)
