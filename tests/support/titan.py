"""Tiny torchtitan models, the matching transformers configs, torchtitan's own parallelization on
gloo ranks, and torchtitan's own ``from_hf`` as the oracle: the fixtures of the torchtitan tests.

Each family is built with torchtitan's own layer builders at test sizes (its debug models are
tens of millions of parameters); the transformers config of the same shapes makes the checkpoint
(``save_pretrained``) the tests load from and compare saves against.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan", exc_type=ImportError,
                    reason=f"torchtitan (the [torchtitan] extra) does not import with torch {torch.__version__}")

DIM, VOCAB, LAYERS = 64, 130, 2  # 130 rows: uneven over 4 ranks (33, 33, 33, 31)
FAMILIES = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v3_q_lora", "gpt_oss")
# A llama3 of the shapes vLLM's CPU engine serves as they are (tests/support/engine.py: head_dim 32,
# a vocabulary of whole 64-row blocks): the checkpoint is tests.support.models' llama of
# ENGINE_CONFIG with hidden_size 128, untied (made in vLLM's venv, which has no torchtitan). Not
# in FAMILIES: the mapping tests cover llama3.
ENGINE_LLAMA3 = "llama3_engine"
_ENGINE_DIM, _ENGINE_VOCAB = 128, 128


def _dims(family: str) -> tuple[int, int]:
    return (_ENGINE_DIM, _ENGINE_VOCAB) if family == ENGINE_LLAMA3 else (DIM, VOCAB)


def titan_config(family: str):
    """torchtitan's model config of ``family`` at test size."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    attn = "flex"
    if family in ("llama3", ENGINE_LLAMA3):
        from torchtitan.models.common import ComplexRoPE
        from torchtitan.models.llama3 import Llama3Model
        from torchtitan.models.llama3 import _build_llama3_layers as build

        dim, vocab = _dims(family)
        layers = build(n_layers=LAYERS, dim=dim, n_heads=4, n_kv_heads=2, hidden_dim=96, attn_backend=attn,
                       rope=ComplexRoPE.Config(dim=dim // 4, max_seq_len=256, theta=500000, scaling="none"))
        return Llama3Model.Config(dim=dim, vocab_size=vocab, layers=layers,
                                  **_ends(Embedding, RMSNorm, Linear, dim, vocab))
    if family in ("qwen3", "qwen3_moe"):
        from torchtitan.models.common import CosSinRoPE
        from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _build_qwen3_moe_layers

        rope = CosSinRoPE.Config(dim=16, max_seq_len=256, theta=1000000.0)
        if family == "qwen3":
            layers = _build_qwen3_layers(n_layers=LAYERS, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=16,
                                         hidden_dim=96, attn_backend=attn, rope=rope)
            return Qwen3Model.Config(dim=DIM, vocab_size=VOCAB, layers=layers, enable_weight_tying=True,
                                     **_ends(Embedding, RMSNorm, Linear))
        layers = _build_qwen3_moe_layers(n_layers=LAYERS, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=16,
                                         moe_hidden_dim=32, num_experts=4, top_k=2, attn_backend=attn,
                                         moe_comm_backend="standard", rope=rope)
        return Qwen3Model.Config(dim=DIM, vocab_size=VOCAB, layers=layers, **_ends(Embedding, RMSNorm, Linear))
    if family.startswith("deepseek_v3"):
        from torchtitan.models.common import ComplexRoPE
        from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers

        layers = _build_dsv3_layers(
            n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=24 if family.endswith("q_lora") else 0,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=0.7,
            dense_hidden_dim=96, moe_hidden_dim=32, num_experts=4, num_shared_experts=1, router_top_k=2,
            router_score_func="sigmoid", attn_backend=attn, moe_comm_backend="standard",
            non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim=8, max_seq_len=256, theta=10000.0, scaling="none"))
        return DeepSeekV3Model.Config(dim=DIM, vocab_size=VOCAB, layers=layers, mtp_layers=[],
                                      **_ends(Embedding, RMSNorm, Linear))
    if family == "gpt_oss":
        from torchtitan.models.common import CosSinRoPE
        from torchtitan.models.gpt_oss import GptOssModel, _build_gptoss_layers

        layers = _build_gptoss_layers(dim=DIM, n_layers=LAYERS, hidden_dim=32, num_experts=4, top_k=2,
                                      load_balance_coeff=1e-3, attn_backend=attn, moe_comm_backend="standard",
                                      rope=CosSinRoPE.Config(dim=64, max_seq_len=256, theta=150000.0))
        return GptOssModel.Config(dim=DIM, vocab_size=VOCAB, layers=layers, **_ends(Embedding, RMSNorm, Linear))
    raise ValueError(family)


def _ends(Embedding, RMSNorm, Linear, dim: int = DIM, vocab: int = VOCAB) -> dict[str, Any]:
    return {"tok_embeddings": Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
            "norm": RMSNorm.Config(normalized_shape=dim),
            "lm_head": Linear.Config(in_features=dim, out_features=vocab)}


def hf_config(family: str):
    """The transformers config whose model has the shapes of ``titan_config(family)``."""
    from transformers import AutoConfig

    common = {"vocab_size": VOCAB, "hidden_size": DIM, "num_hidden_layers": LAYERS, "num_attention_heads": 4}
    if family == "llama3":
        return AutoConfig.for_model("llama", **common, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                    tie_word_embeddings=False)
    if family == "qwen3":
        return AutoConfig.for_model("qwen3", **common, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                    tie_word_embeddings=True)
    if family == "qwen3_moe":
        return AutoConfig.for_model("qwen3_moe", **common, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                    moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                    decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
    if family.startswith("deepseek_v3"):
        return AutoConfig.for_model(
            "deepseek_v3", **common, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
            topk_group=1, q_lora_rank=24 if family.endswith("q_lora") else None, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, tie_word_embeddings=False)
    if family == "gpt_oss":
        return AutoConfig.for_model("gpt_oss", **common | {"num_attention_heads": 64}, num_key_value_heads=8,
                                    head_dim=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                    tie_word_embeddings=False)
    raise ValueError(family)


def make_checkpoint(family: str, path: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """``save_pretrained`` of the transformers model of ``hf_config(family)`` with random values."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family), dtype=dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    model.save_pretrained(path, max_shard_size="200KB")
    return path


def build(family: str, *, parallelism=None, device: str = "meta"):
    """torchtitan's model of ``family``, its sharding declared for ``parallelism`` (torchtitan's
    ``ParallelismConfig``; None: unparallelized)."""
    config = titan_config(family)
    if parallelism is not None:
        config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    with torch.device(device):
        return config.build()


def reference(family: str, path: Path) -> dict[str, torch.Tensor]:
    """torchtitan's own load of the checkpoint: its adapter's ``from_hf`` of the whole HF state dict,
    then ``load_state_dict(strict=False)`` (as its checkpointer does) into an unparallelized model;
    its own parameters and persistent buffers."""
    from safetensors.torch import load_file

    from hp_dcp_hf.load.written import own_state_dict

    hf = {}
    for file in sorted(path.glob("*.safetensors")):
        hf.update(load_file(file))
    model = build(family, device="cpu")
    with torch.no_grad():
        for tensor in own_state_dict(model).values():
            tensor.fill_(-7.0)  # what from_hf does not make stays visibly unloaded
    model.load_state_dict(adapter(family, model).from_hf(hf), strict=False)
    return {k: v.detach().clone() for k, v in own_state_dict(model).items()}


def adapter(family: str, model):
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
    from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    cls = {"llama3": Llama3StateDictAdapter, "qwen3": Qwen3StateDictAdapter, "qwen3_moe": Qwen3StateDictAdapter,
           "gpt_oss": GptOssStateDictAdapter}.get(family, DeepSeekV3StateDictAdapter)
    return cls(titan_config(family), None)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A torchtitan parallelism: degrees of its ``ParallelDims``."""

    name: str
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    dp_replicate: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp


def parallelized(family: str, layout: Layout):
    """``family``'s model on meta, parallelized by torchtitan's own parallelize function for
    ``layout`` on the running gloo world (DTensor backend), then materialized on CPU."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    parallel_dims_module.device_type = "cpu"  # torchtitan picks "cuda" when no accelerator is found
    backend = "partial_dtensor"
    parallelism = ParallelismConfig(spmd_backend=backend, data_parallel_shard_degree=layout.dp_shard,
                                    data_parallel_replicate_degree=layout.dp_replicate,
                                    tensor_parallel_degree=layout.tp, expert_parallel_degree=layout.ep)
    dims = ParallelDims(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, cp=1, tp=layout.tp, pp=1,
                        ep=layout.ep, world_size=layout.world, spmd_backend=backend)
    dims.build_mesh()
    model = build(family, parallelism=parallelism)
    parallelize_fn(family)(model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
                           compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp")
    model.to_empty(device="cpu")
    model.init_states()  # as torchtitan's trainer does: re-ties tied weights that parallelizing replaced
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a DTensor's local shard, a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def parallelize_fn(family: str):
    if family in ("llama3", ENGINE_LLAMA3):
        from torchtitan.models.llama3 import parallelize_llama
        return parallelize_llama
    if family.startswith("qwen3"):
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3
        return parallelize_qwen3
    if family.startswith("deepseek_v3"):
        from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3
        return parallelize_deepseekv3
    from torchtitan.models.gpt_oss.parallelize import parallelize_gptoss
    return parallelize_gptoss


def quantize_checkpoint(family: str, path: Path, out: Path) -> tuple[Path, Path]:
    """``path``'s checkpoint as the Hub ships ``family``: DeepSeek-V3's projections FP8 block-quantized
    (16 x 16 blocks, ``weight_scale_inv``), GPT-OSS's experts MXFP4 (``_blocks`` / ``_scales``); and its
    twin holding the dequantized values, made by the tests' reference quantizers."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.support.quantized import dequantize_reference, is_projection, quantize_fp8, quantize_mxfp4

    quantized, twin = out / "quantized", out / "twin"
    for target in (quantized, twin):
        shutil.copytree(path, target)
    index_path = quantized / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for file in sorted(set(index["weight_map"].values())):
        stored, dequantized = {}, {}
        for key, value in load_file(path / file).items():
            stored[key] = dequantized[key] = value
            if family.startswith("deepseek_v3") and is_projection(key, value):
                q, scale = quantize_fp8(value, (16, 16))
                stored[key], stored[f"{key}_scale_inv"] = q, scale
                dequantized[key] = dequantize_reference(q, scale, (16, 16), dtype=value.dtype)
            elif family == "gpt_oss" and key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                from transformers.integrations.mxfp4 import convert_moe_packed_tensors

                blocks, scales = quantize_mxfp4(value.transpose(1, 2))  # MXFP4 groups run along the inputs
                del stored[key]
                stored[f"{key}_blocks"], stored[f"{key}_scales"] = blocks, scales
                dequantized[key] = convert_moe_packed_tensors(blocks, scales, dtype=value.dtype)
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in dequantized or k in stored}
        index["weight_map"].update(dict.fromkeys(stored, file))
        save_file(stored, quantized / file, metadata={"format": "pt"})
        save_file(dequantized, twin / file, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = ({"quant_method": "mxfp4"} if family == "gpt_oss" else
                                     {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [16, 16]})
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return quantized, twin
