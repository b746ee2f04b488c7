"""Tiny quantized checkpoints (FP8 block-scaled, MXFP4), written as real ones are, and their
dequantized twins.

DeepSeek-V3/R1 and Qwen3-FP8 ship each projection weight as ``float8_e4m3fn`` with a scale per
``weight_block_size`` block in ``<name>_scale_inv`` (float32 for DeepSeek, bf16 for Qwen3), the
other tensors (embeddings, norms, routers) in bf16, and ``config.json`` carrying
``quantization_config = {"quant_method": "fp8", "weight_block_size": [b, b], ...}``.

:func:`make_fp8_checkpoint` writes such a checkpoint from a tiny family model (quantized here by
:func:`quantize_fp8`: per block, amax over the fp8 range), and next to it its *twin*: the same
checkpoint with every quantized weight replaced by its dequantized bf16 value, computed by
transformers' own ``Fp8Dequantize`` op on the whole tensor (zero-padded to whole blocks when the
grid is a ceil grid, which that op refuses). gpt-oss ships its experts as MXFP4
(:func:`make_mxfp4_checkpoint`). transformers' single-process ``from_pretrained`` of the twin is
the oracle of every quantized load.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hp_dcp_hf
from hp_dcp_hf.errors import QuantizationError
from tests.support.families import build_family_model, family_model_class, save_family_model

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
class QuantizedCheckpoint:
    path: Path  # the quantized checkpoint
    twin: Path  # the same values, dequantized, in bf16, no quantization_config
    quantized: tuple[str, ...]  # model-side names of the tensors stored quantized


#: ``quantize(key, tensor)``: None to store the tensor as it is, else the tensors that replace it in
#: the quantized checkpoint and its dequantized value (the twin's).
Quantize = Callable[[str, torch.Tensor], "tuple[dict[str, torch.Tensor], torch.Tensor] | None"]


def _write_pair(model, directory: Path, quantize: Quantize, quantization_config: dict,
                apart: Callable[[str], bool] | None = None) -> QuantizedCheckpoint:
    """``model`` saved twice (bf16, 40 KB files): quantized as ``quantize`` says, and as the twin.
    Tensors that ``apart`` selects go to a file of their own."""
    path, twin = directory / "quantized", directory / "twin"
    save_family_model(model, path, max_shard_size="40KB")
    save_family_model(model, twin, max_shard_size="40KB")
    index = json.loads((path / INDEX).read_text())  # the files are small enough to make an index
    weight_map: dict[str, str] = index["weight_map"]
    quantized: list[str] = []
    separate: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        stored, dequantized = {}, {}
        for key, value in load_file(path / file).items():
            replaced = quantize(key, value)
            if replaced is None:
                stored[key] = dequantized[key] = value
                continue
            del weight_map[key]
            tensors, dequantized[key] = replaced
            for name, tensor in tensors.items():
                (separate if apart and apart(name) else stored)[name] = tensor
            quantized.append(key)
        save_file(stored, path / file, metadata={"format": "pt"})
        save_file(dequantized, twin / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in stored})
    if separate:
        save_file(separate, path / "model-scales.safetensors", metadata={"format": "pt"})
        weight_map.update({k: "model-scales.safetensors" for k in separate})
    (path / INDEX).write_text(json.dumps(index, indent=2))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return QuantizedCheckpoint(path, twin, tuple(sorted(quantized)))


def make_fp8_checkpoint(
    model_type: str,
    directory: Path,
    *,
    block: tuple[int, int] = (16, 16),
    scale_dtype: torch.dtype = torch.float32,
    scales_apart: bool = False,
    select: Callable[[str, torch.Tensor], bool] = is_projection,
) -> QuantizedCheckpoint:
    """A tiny ``model_type`` checkpoint with the ``select`` ed weights FP8 block-quantized, and its
    dequantized twin. ``scales_apart``: every scale in a file of its own."""

    def quantize(key: str, value: torch.Tensor):
        if not select(key, value):
            return None
        q, scale = quantize_fp8(value, block, scale_dtype)
        return {key: q, f"{key}_scale_inv": scale}, dequantize_reference(q, scale, block)

    return _write_pair(
        build_family_model(model_type, dtype=torch.bfloat16), directory, quantize,
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)},
        apart=(lambda name: name.endswith("_scale_inv")) if scales_apart else None,
    )


# -- MXFP4 (gpt-oss) ------------------------------------------------------------------------------

FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [..., G, 16], scales [..., G])`` of ``values [..., G * 32]``: per group of 32, the
    exponent that brings its amax into FP4's range, each value rounded to the nearest E2M1."""
    groups = values.float().reshape(*values.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1)
    exponent = (torch.floor(torch.log2(amax.clamp(min=2.0**-100))) - 2).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - FP4_MAGNITUDES).abs().argmin(-1)
    nibbles = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def make_mxfp4_checkpoint(directory: Path, *, hidden_size: int = 64, intermediate_size: int = 32) -> QuantizedCheckpoint:
    """A tiny gpt-oss checkpoint as gpt-oss ships: its experts' ``gate_up_proj`` / ``down_proj`` as
    MXFP4 ``_blocks`` and ``_scales``, and its dequantized twin (transformers' own
    ``convert_moe_packed_tensors`` on the whole tensors). Sizes where groups of 32 run: hidden and
    intermediate sizes multiples of 32."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tests.support.families import family_model_class, tiny_family_config
    from tests.support.models import _randomize_

    config = tiny_family_config("gpt_oss", hidden_size=hidden_size, intermediate_size=intermediate_size)
    torch.manual_seed(0)
    model = family_model_class("gpt_oss")._from_config(config, dtype=torch.bfloat16)
    _randomize_(model, 0)

    def quantize(key: str, value: torch.Tensor):
        if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return None
        blocks, scales = quantize_mxfp4(value.transpose(1, 2))  # values are [E, G * 32, R]
        dequantized = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
        return {f"{key}_blocks": blocks, f"{key}_scales": scales}, dequantized

    return _write_pair(model.eval(), directory, quantize, {"quant_method": "mxfp4"})


def _edit(checkpoint_path, destination, edit_tensors=None, edit_config=None):
    shutil.copytree(checkpoint_path, destination)
    if edit_tensors is not None:
        index = json.loads((destination / "model.safetensors.index.json").read_text())
        for file in sorted(set(index["weight_map"].values())):
            tensors = load_file(destination / file)
            edited = edit_tensors(dict(tensors))
            save_file(edited, destination / file, metadata={"format": "pt"})
            for key in set(tensors) - set(edited):
                del index["weight_map"][key]
        (destination / "model.safetensors.index.json").write_text(json.dumps(index))
    if edit_config is not None:
        config = json.loads((destination / "config.json").read_text())
        edit_config(config)
        (destination / "config.json").write_text(json.dumps(config))
    return destination


def assert_refused_before_any_write(model_type: str, twin, bad, key: str | None, reason: str) -> None:
    """Loading ``bad`` into the bf16 model of ``twin``'s config raises a QuantizationError naming
    ``key`` (else config.json) and ``reason``, and leaves the model as it was."""
    model = family_model_class(model_type)._from_config(hp_dcp_hf.model.config.read_config(str(twin)), dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(QuantizationError) as raised:
        hp_dcp_hf.load_hf_checkpoint(model, str(bad))
    assert reason in str(raised.value)
    assert raised.value.key == key
    if key is None:
        assert raised.value.file == "config.json"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
