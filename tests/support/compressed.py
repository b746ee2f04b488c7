"""Tiny compressed-tensors checkpoints, written by compressed-tensors itself, and their oracle twins.

llm-compressor quantizes a model's ``Linear`` layers in their checkpoint layout (MoE experts as one
``Linear`` per expert), calibrates each weight's scales with a min-max observer, compresses with
compressed-tensors' ``ModelCompressor`` and writes ``quantization_config`` with
``ModelCompressor.update_config``. :func:`make_compressed_checkpoint` does the same to a tiny
family checkpoint: the checkpoint's ``Linear`` weights become real ``nn.Linear`` modules under their
checkpoint names, compressed-tensors' ``apply_quantization_config`` matches the config groups
(targets, ignore, mixed precision) to them, their scales come from compressed-tensors'
``calculate_qparams`` / ``generate_gparam`` on the weight's min and max (the observer is the only
part of llm-compressor re-done here), and ``ModelCompressor.compress_model`` writes the tensors.

The oracle (:func:`decompress_checkpoint`) is compressed-tensors' own decompression of the whole
checkpoint: the same modules rebuilt from the config (``apply_quantization_config`` +
``compress_model``, as transformers prepared a model for ``run_compressed=False``), loaded with
the checkpoint's tensors, decompressed by ``ModelCompressor.decompress_model``. The *twin* is the
checkpoint with every compressed module replaced by its decompressed ``weight`` (in the dtype
compressed-tensors gives it) and no quantization; transformers' ``from_pretrained`` of the twin
(conversions included) is the state dict a correct load must reproduce, bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from safetensors.torch import load_file, save_file

from tests.support.families import family_model_class, save_family_model, tiny_family_config
from tests.support.models import _randomize_

logger.disable("compressed_tensors")  # its warnings on ceil block grids, as llm-compressor users see them

INDEX = "model.safetensors.index.json"
SHARD = "40KB"


@dataclass(frozen=True)
class CompressedCheckpoint:
    path: Path  # the compressed checkpoint
    twin: Path  # the oracle's values as a dense checkpoint
    model_type: str
    compressed: tuple[str, ...]  # checkpoint names of the compressed modules
    formats: tuple[str, ...]  # the formats compressed-tensors chose, one per config group


def build_model(model_type: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0, **overrides: Any):
    """The tiny family model, with ``overrides`` on its config (sizes that fit a group size)."""
    config = tiny_family_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = family_model_class(model_type)._from_config(config, dtype=dtype)
    _randomize_(model, seed)
    return model.eval()


def linear_weights(model: torch.nn.Module, stored: Mapping[str, torch.Tensor]) -> list[str]:
    """The checkpoint keys of ``Linear`` weights: the model's own ``nn.Linear`` modules, and the
    per-expert projections its conversions fuse (``Linear`` layers in the checkpoint layout)."""
    linear = {
        name + ".weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
    }
    return sorted(
        k
        for k, v in stored.items()
        if v.ndim == 2 and (k in linear or (".experts." in k and k.endswith("proj.weight")))
    )


def _container(shapes: Mapping[str, tuple[int, int]], dtype: torch.dtype) -> torch.nn.Module:
    """``nn.Linear`` modules (no bias) at checkpoint module names ``shapes`` (out, in features)."""
    root = torch.nn.Module()
    for name, (rows, cols) in shapes.items():
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, torch.nn.Linear(cols, rows, bias=False, dtype=dtype))
    return root


def _observe(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of ``weight`` per scale of ``args.strategy`` (a memoryless min-max observer)."""
    from compressed_tensors.quantization import QuantizationStrategy as S
    from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

    if args.strategy == S.TENSOR:
        return torch.aminmax(weight)
    if args.strategy == S.CHANNEL:
        return weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    if args.strategy in (S.GROUP, S.TENSOR_GROUP):
        groups = weight.unflatten(-1, (-1, args.group_size))
        return groups.amin(-1), groups.amax(-1)
    if args.strategy == S.BLOCK:
        b0, b1 = args.block_structure
        padded = maybe_pad_tensor_for_block_quant(weight, (b0, b1))
        blocks = padded.unflatten(-1, (-1, b1)).unflatten(0, (-1, b0))  # [R/b0, b0, C/b1, b1]
        return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    raise ValueError(f"no observer for strategy {args.strategy}")


def _calibrate(module: torch.nn.Module) -> None:
    """Set the weight's scale, zero point and global scale as llm-compressor's min-max observer
    would, with compressed-tensors' own ``calculate_qparams`` / ``generate_gparam``; activation
    parameters (static input scales) get fixed values."""
    from compressed_tensors.quantization import QuantizationStrategy as S
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = module.quantization_scheme.weights
    weight = module.weight.data
    lo, hi = _observe(weight, args)
    global_scale = None
    if args.strategy == S.TENSOR_GROUP:
        global_scale = generate_gparam(weight.amin().reshape(1), weight.amax().reshape(1))
        module.weight_global_scale.data.copy_(global_scale)
    scale, zero_point = calculate_qparams(lo, hi, args, global_scale=global_scale)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    for name, value in (("input_scale", 0.5), ("input_zero_point", 0), ("input_global_scale", 3.0)):
        if hasattr(module, name):
            getattr(module, name).data.fill_(value)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory ``path``."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _rewrite(path: Path, replace: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """Each file of checkpoint ``path`` through ``replace`` (which may rename keys), index updated."""
    index = json.loads((path / INDEX).read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = replace(load_file(path / file))
        save_file(tensors, path / file, metadata={"format": "pt"})
        weight_map.update({key: file for key in tensors})
    index["weight_map"] = dict(sorted(weight_map.items()))
    (path / INDEX).write_text(json.dumps(index, indent=2))


def _modules_of(tensors: Mapping[str, torch.Tensor], names: set[str]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, _, param = key.rpartition(".")
        if module in names:
            out.setdefault(module, {})[param] = value
    return out


def compress_modules(
    weights: Mapping[str, torch.Tensor], config_groups: Mapping[str, Any], ignore: tuple[str, ...] = ()
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """``Linear`` weights (by module name) compressed by compressed-tensors under ``config_groups`` /
    ``ignore``: the compressed modules' tensors (by module, then parameter name) and the
    ``quantization_config`` ``ModelCompressor.update_config`` writes for them."""
    import tempfile

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    dtype = next(iter(weights.values())).dtype
    container = _container({name: tuple(w.shape) for name, w in weights.items()}, dtype)
    for name, weight in weights.items():
        container.get_submodule(name).weight.data.copy_(weight)
    config = QuantizationConfig.model_validate({"config_groups": dict(config_groups), "ignore": list(ignore)})
    apply_quantization_config(container, config, show_progress=False)
    quantized = {name for name, module in container.named_modules() if hasattr(module, "quantization_scheme")}
    for name in sorted(quantized):
        _calibrate(container.get_submodule(name))
    compressor = ModelCompressor.from_pretrained_model(container)
    compressor.compress_model(container)
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text("{}")
        compressor.update_config(directory)
        written = json.loads((Path(directory) / "config.json").read_text())["quantization_config"]
    return _modules_of(container.state_dict(), quantized), written


def decompress_tensors(
    stored: Mapping[str, torch.Tensor],
    quantization_config: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, int]],
) -> dict[str, torch.Tensor]:
    """compressed-tensors' decompression of checkpoint tensors ``stored`` whose compressed modules
    have (out, in) ``shapes``: each compressed module's ``weight`` (in the dtype compressed-tensors
    computes it in), every other tensor as stored, the activation and KV-cache parameters gone (an
    unquantized model has no place for them).

    The modules are rebuilt as transformers prepared a model for ``run_compressed=False``
    (``apply_quantization_config`` + ``compress_model`` give them the compressed parameters), take
    the stored tensors, and ``ModelCompressor.decompress_model`` decompresses them.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationMetadata, apply_quantization_config
    from transformers.utils.quantization_config import CompressedTensorsConfig

    compressor = ModelCompressor.from_compression_config(
        CompressedTensorsConfig.from_dict(dict(quantization_config))
    )
    container = _container(shapes, torch.bfloat16)
    apply_quantization_config(container, compressor.quantization_config, show_progress=False)
    compressor.compress_model(container)
    for module in shapes:
        for name, param in container.get_submodule(module).named_parameters(recurse=False):
            param.data = stored[f"{module}.{name}"].clone()
    compressor.decompress_model(container)
    qparams = set(QuantizationMetadata.all_qparam_names()) | {"weight_packed", "q_scale"}
    out = {
        k: v
        for k, v in stored.items()
        if k.rpartition(".")[0] not in shapes and k.rpartition(".")[2] not in qparams
    }
    for module in shapes:
        out[f"{module}.weight"] = container.get_submodule(module).weight.data.clone()
    return out


def make_compressed_checkpoint(
    model_type: str,
    directory: Path,
    config_groups: Mapping[str, Any],
    *,
    ignore: tuple[str, ...] = ("lm_head",),
    dtype: torch.dtype = torch.bfloat16,
    overrides: Mapping[str, Any] | None = None,
) -> CompressedCheckpoint:
    """A tiny ``model_type`` checkpoint (``dtype``, 40 KB files) with its ``Linear`` weights
    compressed by compressed-tensors under ``config_groups`` / ``ignore`` (a
    ``QuantizationConfig``'s), and its oracle twin."""
    model = build_model(model_type, dtype, **(overrides or {}))
    path, twin = directory / "compressed", directory / "twin"
    save_family_model(model, path, max_shard_size=SHARD)
    stored = read_tensors(path)
    weights = {key.removesuffix(".weight"): stored[key] for key in linear_weights(model, stored)}
    compressed, quantization_config = compress_modules(weights, config_groups, ignore)

    def replace(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in tensors.items():
            module = key.removesuffix(".weight")
            if module in compressed:
                out.update({f"{module}.{param}": t.contiguous() for param, t in compressed[module].items()})
            else:
                out[key] = value
        return out

    _rewrite(path, replace)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_twin(path, twin, {name: tuple(weights[name].shape) for name in compressed})
    formats = tuple(sorted({group["format"] for group in quantization_config["config_groups"].values()}))
    return CompressedCheckpoint(path, twin, model_type, tuple(sorted(compressed)), formats)


def write_twin(path: Path, twin: Path, shapes: Mapping[str, tuple[int, int]]) -> None:
    """The checkpoint ``path`` dense: :func:`decompress_checkpoint`'s tensors in ``path``'s files,
    ``config.json`` without ``quantization_config``."""
    import shutil

    values = decompress_tensors(
        read_tensors(path), json.loads((path / "config.json").read_text())["quantization_config"], shapes
    )
    shutil.copytree(path, twin)
    index = json.loads((twin / INDEX).read_text())
    files = {}
    for key, file in index["weight_map"].items():
        module = key.rpartition(".")[0]
        name = f"{module}.weight" if module in shapes else key
        if name in values:
            files.setdefault(file, {})[name] = values[name]
    for file in set(index["weight_map"].values()):
        save_file(files.get(file, {}), twin / file, metadata={"format": "pt"})
    index["weight_map"] = {key: file for file, tensors in files.items() for key in tensors}
    (twin / INDEX).write_text(json.dumps(index, indent=2))
    config = json.loads((twin / "config.json").read_text())
    del config["quantization_config"]
    (twin / "config.json").write_text(json.dumps(config, indent=2))


# -- the checkpoints the tests load ------------------------------------------------------------------


def weights_args(num_bits: int, kind: str = "int", strategy: str = "group", **more) -> dict:
    """A config group's ``weights``."""
    return {"num_bits": num_bits, "type": kind, "strategy": strategy, **more}


DYNAMIC_INT8 = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
LLAMA48 = {
    "hidden_size": 48,
    "intermediate_size": 80,
    "head_dim": 12,
    "num_key_value_heads": 4,
}  # tp=4 shards it
LLAMA64 = {"hidden_size": 64, "intermediate_size": 96, "head_dim": 16, "num_key_value_heads": 4}
QWEN48 = {"hidden_size": 48, "moe_intermediate_size": 32, "head_dim": 12, "num_key_value_heads": 4}

#: name -> (model type, config groups, ignore, config overrides, dtype): one checkpoint per format
#: and strategy compressed-tensors 0.20 writes for Linear weights, and a mixed-precision one.
CASES = {
    "fp8-tensor": ("llama", {"FP8": ["Linear"]}, ("lm_head",), {}, torch.bfloat16),  # static input_scale
    "fp8-channel": ("deepseek_v3", {"FP8_DYNAMIC": ["Linear"]}, ("lm_head",), {}, torch.bfloat16),
    "fp8-block": (
        "deepseek_v3",
        {
            "g": {
                "targets": ["Linear"],
                "weights": weights_args(8, "float", "block", block_structure=[16, 16]),
            }
        },
        ("lm_head",),
        {},
        torch.float32,
    ),  # fp32 scales
    "fp8-group": (
        "qwen3_moe",
        {"g": {"targets": ["Linear"], "weights": weights_args(8, "float", group_size=4)}},
        ("lm_head",),
        {},
        torch.bfloat16,
    ),  # naive-quantized: no activation scheme
    "int8-channel": ("qwen3_moe", {"INT8": ["Linear"]}, ("lm_head",), {}, torch.bfloat16),
    "int8-asym-group": (
        "qwen3_moe",
        {
            "g": {
                "targets": ["Linear"],
                "weights": weights_args(8, group_size=4, symmetric=False),
                "input_activations": DYNAMIC_INT8,
            }
        },
        ("lm_head",),
        {},
        torch.bfloat16,
    ),
    "w4a16": (
        "llama",
        {"g": {"targets": ["Linear"], "weights": weights_args(4, group_size=16)}},
        (),
        LLAMA48,
        torch.bfloat16,
    ),
    "w4a16-asym": (
        "llama",
        {"g": {"targets": ["Linear"], "weights": weights_args(4, group_size=16, symmetric=False)}},
        (),
        LLAMA48,
        torch.bfloat16,
    ),
    "w4-channel-asym": (
        "llama",
        {"g": {"targets": ["Linear"], "weights": weights_args(4, strategy="channel", symmetric=False)}},
        ("lm_head",),
        LLAMA48,
        torch.bfloat16,
    ),
    "w8a16-pack": (
        "llama",
        {"g": {"targets": ["Linear"], "weights": weights_args(8, group_size=16)}},
        ("lm_head",),
        LLAMA48,
        torch.bfloat16,
    ),
    "w3a16": (
        "llama",
        {"g": {"targets": ["Linear"], "weights": weights_args(3, group_size=16)}},
        ("lm_head",),
        LLAMA48,
        torch.bfloat16,
    ),  # 32 values in 3 words: values straddle words
    "nvfp4": ("qwen3_moe", {"NVFP4": ["Linear"]}, ("lm_head",), QWEN48, torch.bfloat16),  # input_global_scale
    "mxfp4": ("llama", {"MXFP4A16": ["Linear"]}, ("lm_head",), LLAMA64, torch.bfloat16),
    "mxfp6": ("llama", {"MXFP6A16": ["Linear"]}, ("lm_head",), LLAMA64, torch.bfloat16),
    "mxfp8": ("llama", {"MXFP8A16": ["Linear"]}, ("lm_head",), LLAMA64, torch.bfloat16),
    "mixed": (
        "qwen3_moe",
        {  # Kimi-K2's layout: FP8 attention, INT4 experts
            "attention": {
                "targets": ["re:.*self_attn.*"],
                "weights": weights_args(8, "float", "channel"),
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            },
            "experts": {"targets": ["re:.*mlp.experts.*"], "weights": weights_args(4, group_size=16)},
        },
        ("lm_head",),
        QWEN48,
        torch.bfloat16,
    ),
}


def make_case(name: str, directory: Path) -> CompressedCheckpoint:
    """The checkpoint of ``CASES[name]`` under ``directory``."""
    model_type, groups, ignore, overrides, dtype = CASES[name]
    return make_compressed_checkpoint(
        model_type, directory, groups, ignore=ignore, dtype=dtype, overrides=overrides
    )
