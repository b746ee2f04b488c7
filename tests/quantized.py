"""Tiny FP8 block-scaled checkpoints, written as real ones are, and their dequantized twins.

DeepSeek-V3/R1 and Qwen3-FP8 ship each projection weight as ``float8_e4m3fn`` with a scale per
``weight_block_size`` block in ``<name>_scale_inv`` (float32 for DeepSeek, bf16 for Qwen3), the
other tensors (embeddings, norms, routers) in bf16, and ``config.json`` carrying
``quantization_config = {"quant_method": "fp8", "weight_block_size": [b, b], ...}``.

:func:`make_fp8_checkpoint` writes such a checkpoint from a tiny family model (quantized here by
:func:`quantize_fp8`: per block, amax over the fp8 range), and next to it its *twin*: the same
checkpoint with every quantized weight replaced by its dequantized bf16 value, computed by
transformers' own ``Fp8Dequantize`` op on the whole tensor (zero-padded to whole blocks when the
grid is a ceil grid, which that op refuses). transformers' single-process ``from_pretrained`` of
the twin is the oracle of every quantized load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.families import build_family_model, save_family_model

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
INDEX = "model.safetensors.index.json"


def _grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[-2] // block[0]), -(-shape[-1] // block[1])


def _padded(tensor: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = _grid(tuple(tensor.shape), block)
    out = torch.zeros(*tensor.shape[:-2], rows * block[0], cols * block[1], dtype=tensor.dtype)
    out[..., : tensor.shape[-2], : tensor.shape[-1]] = tensor
    return out


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32):
    """``(float8 weight, scale_inv grid)`` of ``weight``: each block divided by its amax / 448."""
    rows, cols = _grid(tuple(weight.shape), block)
    padded = _padded(weight.float(), block)
    blocks = padded.reshape(*padded.shape[:-2], rows, block[0], cols, block[1])
    scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=2.0**-20).to(scale_dtype)
    scaled = blocks / scale.float()[..., :, None, :, None]
    q = scaled.reshape(padded.shape)[..., : weight.shape[-2], : weight.shape[-1]].to(FP8)
    return q.contiguous(), scale.contiguous()


def dequantize_reference(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """transformers' ``Fp8Dequantize`` on the whole tensor, zero-padded to whole ``block`` s (it
    infers the block from the grid, which only a padded tensor makes right), then cropped."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    padded = _padded(q, block)
    out = Fp8Dequantize(None)._dequantize_one(padded, scale, output_dtype=dtype)
    return out[..., : q.shape[-2], : q.shape[-1]].contiguous()


def is_projection(key: str, tensor: torch.Tensor) -> bool:
    """What FP8 checkpoints quantize: the 2-D ``*proj*`` weights (not embeddings, norms, routers)."""
    return key.endswith(".weight") and tensor.ndim == 2 and "proj" in key


@dataclass(frozen=True)
class Fp8Checkpoint:
    path: Path  # the quantized checkpoint
    twin: Path  # the same values, dequantized, in bf16, no quantization_config
    block: tuple[int, int]
    quantized: tuple[str, ...]  # checkpoint keys stored in fp8


def make_fp8_checkpoint(
    model_type: str,
    directory: Path,
    *,
    block: tuple[int, int] = (16, 16),
    scale_dtype: torch.dtype = torch.float32,
    scales_apart: bool = False,
    select: Callable[[str, torch.Tensor], bool] = is_projection,
) -> Fp8Checkpoint:
    """A tiny ``model_type`` checkpoint (bf16, 40 KB files) with the ``select`` ed weights FP8
    block-quantized, and its dequantized twin. ``scales_apart``: every scale in a file of its own."""
    model = build_family_model(model_type, dtype=torch.bfloat16)
    path, twin = directory / "fp8", directory / "twin"
    save_family_model(model, path, max_shard_size="40KB")
    save_family_model(model, twin, max_shard_size="40KB")
    index = json.loads((path / INDEX).read_text())  # the files are small enough to make an index
    weight_map: dict[str, str] = index["weight_map"]
    quantized: list[str] = []
    scales: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        tensors = load_file(path / file)
        stored, dequantized = {}, {}
        for key, value in tensors.items():
            if not select(key, value):
                stored[key] = dequantized[key] = value
                continue
            q, scale = quantize_fp8(value, block, scale_dtype)
            stored[key] = q
            (scales if scales_apart else stored)[f"{key}_scale_inv"] = scale
            dequantized[key] = dequantize_reference(q, scale, block)
            quantized.append(key)
        save_file(stored, path / file, metadata={"format": "pt"})
        save_file(dequantized, twin / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in stored})
    if scales:
        save_file(scales, path / "model-scales.safetensors", metadata={"format": "pt"})
        weight_map.update({k: "model-scales.safetensors" for k in scales})
    (path / INDEX).write_text(json.dumps(index, indent=2))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return Fp8Checkpoint(path, twin, block, tuple(sorted(quantized)))
