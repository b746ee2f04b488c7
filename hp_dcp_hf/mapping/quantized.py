"""Block-scaled quantized checkpoints, read as the values they stand for.

FP8 checkpoints (DeepSeek-V3/R1, Qwen3-FP8) store a quantized weight ``W`` as float8 with one
float scale per block of ``weight_block_size`` (128 x 128) in a companion ``W_scale_inv``; the
value of element ``[..., i, j]`` is ``float32(W[..., i, j]) * float32(S[..., i // b0, j // b1])``,
the arithmetic of transformers' ``Fp8Dequantize``. The scale grid is ``ceil(rows / b0) x ceil(cols /
b1)``: the last blocks of a dim may be partial.

When the model's parameters are floating point, the planner treats each quantized weight as a
checkpoint tensor of its dequantized values (:func:`dequantized_sources`): the conversion mapping
and the recorded rewrites compose on it as on any tensor, and a box of it is read as the weight
bytes of that box plus the scale blocks covering it (:meth:`BlockScaled.scale_box`), dequantized on
arrival (:meth:`BlockScaled.dequantize`). The block size comes from ``weight_block_size``, never
from the grid, and which names are companions comes from transformers' own quantizer (its
``serialized_names`` and the scale renamings it adds to every model's conversions).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from hp_dcp_hf.box import Box
from hp_dcp_hf.errors import QuantizationError
from hp_dcp_hf.mapping.compose import TensorSpec
from hp_dcp_hf.storage.catalog import CONFIG_FILE as _CONFIG_FILE

_FP8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                 if hasattr(torch, n))


@dataclass(frozen=True)
class BlockScaled:
    """Checkpoint tensor ``weight`` holds quantized values, scaled per ``block`` of its last two dims
    by checkpoint tensor ``scale`` (leading dims, such as stacked experts, match one to one)."""

    weight: str
    scale: str
    block: tuple[int, int]

    def scale_box(self, box: Box) -> Box:
        """The scale blocks that cover ``box`` of the weight: rows ``[a // b0, ceil(b / b0))``, same
        for columns."""
        lead = box.ndim - 2
        offsets, sizes = list(box.offsets[:lead]), list(box.sizes[:lead])
        for start, size, block in zip(box.offsets[lead:], box.sizes[lead:], self.block):
            first, end = start // block, -(-(start + size) // block)
            offsets.append(first)
            sizes.append(end - first)
        return Box(tuple(offsets), tuple(sizes))

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, box: Box) -> torch.Tensor:
        """float32 values of ``box`` from its quantized ``weight`` and the :meth:`scale_box` part of
        the scales, at the box's global offsets (one vectorized multiply)."""
        index = [
            torch.arange(start, start + size) // block - start // block
            for start, size, block in zip(box.offsets[-2:], box.sizes[-2:], self.block)
        ]
        return weight.to(torch.float32) * scale_values(scale)[..., index[0][:, None], index[1][None, :]]


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32 multipliers: E8M0 exponents stored as ``uint8`` mean ``2 ** (byte - 127)``
    (as transformers reads them); float scales (float32, bf16, ``float8_e8m0fnu``) are converted."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)


def _transformers_quantizer(quantization_config: Mapping[str, Any]):
    from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

    method = quantization_config.get("quant_method")
    try:
        config = AutoQuantizationConfig.from_dict(dict(quantization_config))
        return AutoHfQuantizer.from_config(config, pre_quantized=True)
    except (ValueError, KeyError, TypeError) as e:
        raise QuantizationError(f"quantization_config with quant_method {method!r}: {e}", file=_CONFIG_FILE) from e


def _companion_names(quantizer, model_type: str | None) -> tuple[str, str, tuple[str, ...], list]:
    """(quantized param name, scale companion, every other companion, the scale renamings) as
    transformers' quantizer declares them."""
    from transformers.core_model_loading import WeightRenaming

    (param, names), *others = quantizer.serialized_names.items()
    scales = [n for n in names if n.endswith("_scale_inv")]
    if others or len(scales) != 1:
        method = quantizer.quantization_config.quant_method
        raise QuantizationError(f"quant_method {str(method)!r} is not a block-scaled format this loader reads "
                                f"(serialized names {dict(quantizer.serialized_names)})", file=_CONFIG_FILE)
    names_only = SimpleNamespace(config=SimpleNamespace(model_type=model_type or ""), named_parameters=lambda: iter(()))
    renamings = [t for t in quantizer.update_weight_conversions([], names_only) if isinstance(t, WeightRenaming)]
    return param, scales[0], tuple(n for n in names if n not in (param, scales[0])), renamings


def _renamed(key: str, renamings: list) -> str:
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    return key


def block_scaled_tensors(
    quantization_config: Mapping[str, Any],
    sources: Mapping[str, TensorSpec],
    *,
    model_type: str | None = None,
) -> tuple[dict[str, BlockScaled], frozenset[str]]:
    """The quantized weights among ``sources`` and the companion keys their dequantization consumes.

    A weight is quantized when its scale companion is in the checkpoint; a float8 weight without
    one is an error (its values cannot be known), as is a scale grid that does not fit its weight.
    """
    quantizer = _transformers_quantizer(quantization_config)
    param, scale_name, other_names, renamings = _companion_names(quantizer, model_type)
    block = getattr(quantizer.quantization_config, "weight_block_size", None)
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationError(f"weight_block_size must be two positive ints, got {block!r}", file=_CONFIG_FILE)
    block = (int(block[0]), int(block[1]))
    by_name = {_renamed(key, renamings): key for key in sources}
    found: dict[str, BlockScaled] = {}
    consumed: set[str] = set()
    for name, key in by_name.items():
        base, dot, last = name.rpartition(".")
        if last != param:
            continue
        prefix = base + dot
        scale_key = by_name.get(prefix + scale_name)
        spec = sources[key]
        if scale_key is None:
            if spec.dtype in _FP8:
                raise QuantizationError(f"{spec.dtype} weight without its scales ({prefix + scale_name})", key=key)
            continue
        _check_grid(key, spec, scale_key, sources[scale_key], block)
        found[key] = BlockScaled(key, scale_key, block)
        consumed.add(scale_key)
        consumed.update(by_name[prefix + n] for n in other_names if prefix + n in by_name)
    return found, frozenset(consumed)


def _check_grid(key: str, weight: TensorSpec, scale_key: str, scale: TensorSpec, block: tuple[int, int]) -> None:
    if len(weight.shape) < 2:
        raise QuantizationError(f"a block-scaled weight needs 2 dims or more, has shape {weight.shape}", key=key)
    grid = (*weight.shape[:-2], *(-(-size // b) for size, b in zip(weight.shape[-2:], block)))
    if tuple(scale.shape) != grid:
        raise QuantizationError(f"scale grid {tuple(scale.shape)} of {scale_key} does not fit weight "
                                f"{tuple(weight.shape)} in blocks of {block} (expected {grid})", key=key)
    if not (scale.dtype.is_floating_point or scale.dtype == torch.uint8):
        raise QuantizationError(f"scales of dtype {scale.dtype} ({scale_key})", key=key)


def dequantized_sources(
    sources: Mapping[str, TensorSpec], quantized: Mapping[str, BlockScaled], consumed: frozenset[str]
) -> dict[str, TensorSpec]:
    """``sources`` as the conversions see them: each quantized weight a float32 tensor of its shape,
    the companions gone."""
    return {
        key: TensorSpec(spec.shape, torch.float32) if key in quantized else spec
        for key, spec in sources.items()
        if key not in consumed
    }
