"""Quantized checkpoints, read as the values they stand for.

compressed-tensors checkpoints (``quant_method: "compressed-tensors"``: INT4/INT8 packed, FP8,
NVFP4, MXFP4/6/8, per group, channel, tensor or block) are :mod:`hp_dcp_hf.quant.compressed`'s.
Two formats as transformers' quantizers define them are here:

* **FP8 block-scaled** (``quant_method: "fp8"``; DeepSeek-V3/R1, Qwen3-FP8): a weight ``W`` is stored
  as float8 with one scale per block of ``weight_block_size`` (128 x 128) in ``W_scale_inv``; the
  value of element ``[..., i, j]`` is ``float32(W[..., i, j]) * float32(S[..., i // b0, j // b1])``
  (transformers' ``Fp8Dequantize``). The grid is ``ceil(rows / b0) x ceil(cols / b1)``: the last
  blocks of a dim may be partial. The block size comes from ``weight_block_size``, never the grid.
* **MXFP4** (``quant_method: "mxfp4"``; gpt-oss): an expert tensor ``X`` is stored as ``X_blocks``
  ``[E, R, G, 16]`` (two FP4 E2M1 values a byte, low nibble first) and ``X_scales`` ``[E, R, G]``
  (E8M0 exponents, one per 32 values); its value is ``[E, G * 32, R]``, the unpacked rows scaled by
  ``2 ** (scale - 127)`` and transposed (transformers' ``convert_moe_packed_tensors``).

When the model's parameters are floating point, the planner treats each quantized tensor as a
checkpoint tensor of its values (:func:`dequantized_sources`): the conversion mapping and the
recorded rewrites compose on it as on any tensor, and a box of it is read as the checkpoint boxes
that make it (:meth:`QuantizedTensor.reads`: the box's quantized bytes and the scales covering it),
turned into values on arrival (:meth:`QuantizedTensor.values`). Which checkpoint names are
companions comes from transformers' own quantizer (its ``serialized_names`` and the scale renamings
it adds to every model's conversions).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np
import torch
from transformers.utils import CONFIG_NAME as _CONFIG_FILE

from hp_dcp_hf.errors import QuantizationError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.mapping.compose import TensorSpec
from hp_dcp_hf.quant.grid import SCALE_SUFFIX, bands, block_size, covering_blocks, scale_grid

_FP8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                 if hasattr(torch, n))


class QuantizedTensor(Protocol):
    """A tensor of values the checkpoint stores quantized, under the name ``key`` conversions see."""

    key: str

    def shape(self, sources: Mapping[str, TensorSpec]) -> tuple[int, ...]:
        """The shape of the values, from the stored tensors' specs."""

    def reads(self, box: Box) -> tuple[tuple[str, Box], ...]:
        """The checkpoint boxes that make ``box`` of the values: the quantized data first, then
        its scales."""

    def values(self, parts: Mapping[str, torch.Tensor], box: Box, dtype: torch.dtype) -> torch.Tensor:
        """The values of ``box`` from ``parts`` (each :meth:`reads` box as read, by key), in
        ``dtype``, in float32 or in the dtype the format's own decompression ends in (cast on the
        copy into the destination in every case)."""


@dataclass(frozen=True)
class BlockScaled:
    """Checkpoint tensor ``weight`` holds quantized values, scaled per ``block`` of its last two dims
    by checkpoint tensor ``scale`` (leading dims, such as stacked experts, match one to one)."""

    weight: str
    scale: str
    block: tuple[int, int]

    @property
    def key(self) -> str:
        return self.weight

    def shape(self, sources: Mapping[str, TensorSpec]) -> tuple[int, ...]:
        return tuple(sources[self.weight].shape)

    def reads(self, box: Box) -> tuple[tuple[str, Box], ...]:
        return (self.weight, box), (self.scale, self.scale_box(box))

    def values(self, parts: Mapping[str, torch.Tensor], box: Box, dtype: torch.dtype) -> torch.Tensor:
        # float32, then one rounding to the model's dtype: transformers' (q * s).to(dtype)
        return self.dequantize(parts[self.weight], parts[self.scale], box)

    def scale_box(self, box: Box) -> Box:
        """The scale blocks that cover ``box`` of the weight."""
        return covering_blocks(box, self.block)

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, box: Box) -> torch.Tensor:
        """float32 values of ``box`` from its quantized ``weight`` and the :meth:`scale_box` part of
        the scales, at the box's global offsets.

        Decoded once, then scaled in place band by band: rows and columns cut at block borders
        (a partial block at each end, whole blocks between), each band of blocks multiplied by
        its scales in one broadcast multiply, with no per-element scale tensor.
        """
        values = as_float32(weight)
        if values is weight:  # a float32 "quantized" weight: keep the read buffer as read
            values = values.clone()
        scales = scale_values(scale)
        lead = values.shape[:-2]
        for r0, r1, s0, s1 in bands(box.offsets[-2], box.sizes[-2], self.block[0]):
            for c0, c1, t0, t1 in bands(box.offsets[-1], box.sizes[-1], self.block[1]):
                band = values[..., r0:r1, c0:c1].view(*lead, s1 - s0, (r1 - r0) // (s1 - s0), t1 - t0, (c1 - c0) // (t1 - t0))
                band.mul_(scales[..., s0:s1, None, t0:t1, None])
        return values


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""FP4 E2M1 by nibble, as transformers' MXFP4 integration lists them."""
MXFP4_GROUP = 32
"""Values per E8M0 scale (16 packed bytes)."""


@dataclass(frozen=True)
class Mxfp4:
    """Expert tensor ``key`` stored as packed FP4 ``blocks`` ``[E, R, G, 16]`` and E8M0 ``scales``
    ``[E, R, G]``; its values are ``[E, G * 32, R]``."""

    key: str
    blocks: str
    scales: str

    def shape(self, sources: Mapping[str, TensorSpec]) -> tuple[int, ...]:
        experts, rows, groups, _ = sources[self.blocks].shape
        return experts, groups * MXFP4_GROUP, rows

    def _groups(self, box: Box) -> tuple[int, int]:
        start, size = box.offsets[1], box.sizes[1]
        first = start // MXFP4_GROUP
        return first, -(-(start + size) // MXFP4_GROUP) - first

    def reads(self, box: Box) -> tuple[tuple[str, Box], ...]:
        """Whole 32-value groups of the box's columns (a border inside a group or a byte reads that
        group), its rows, its experts."""
        (e0, _, r0), (ne, _, nr) = box.offsets, box.sizes
        g0, ng = self._groups(box)
        return (
            (self.blocks, Box((e0, r0, g0, 0), (ne, nr, ng, MXFP4_GROUP // 2))),
            (self.scales, Box((e0, r0, g0), (ne, nr, ng))),
        )

    def values(self, parts: Mapping[str, torch.Tensor], box: Box, dtype: torch.dtype) -> torch.Tensor:
        """In ``dtype``, as transformers computes them: the FP4 table in the model's dtype, ``ldexp``
        by the exponent, low nibble first."""
        blocks, scales = parts[self.blocks], parts[self.scales]
        lut = torch.tensor(FP4_VALUES, dtype=dtype)
        unpacked = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)
        scaled = torch.ldexp(unpacked.flatten(-2), (scales.to(torch.int32) - 127)[..., None])
        g0, _ = self._groups(box)
        start = box.offsets[1] - g0 * MXFP4_GROUP
        columns = scaled.flatten(-2)[..., start : start + box.sizes[1]]  # [E, R, C]
        return columns.transpose(1, 2)


@functools.cache
def _decode_table(dtype: torch.dtype) -> np.ndarray:
    """float32 value of each of the 256 bit patterns of a one-byte float dtype, as torch converts them."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32).numpy()


def as_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.to(torch.float32)``, bit for bit; one-byte floats (FP8) through a 256-entry table,
    about 3x faster than torch's own CPU conversion."""
    if tensor.dtype in _FP8 and tensor.is_contiguous():
        return torch.from_numpy(_decode_table(tensor.dtype)[tensor.view(torch.uint8).numpy()])
    return tensor.to(torch.float32)


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


def _scale_renamings(quantizer, model_type: str | None) -> list:
    """The renamings transformers' quantizer puts before every model's conversions (``.scale`` ->
    ``.weight_scale_inv``, ...)."""
    from transformers.core_model_loading import WeightRenaming

    names_only = SimpleNamespace(config=SimpleNamespace(model_type=model_type or ""), named_parameters=lambda: iter(()))
    return [t for t in quantizer.update_weight_conversions([], names_only) if isinstance(t, WeightRenaming)]


def _renamed(key: str, renamings: list) -> str:
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    return key


def quantized_tensors(
    quantization_config: Mapping[str, Any],
    sources: Mapping[str, TensorSpec],
    *,
    model_type: str | None = None,
) -> tuple[dict[str, QuantizedTensor], frozenset[str]]:
    """The quantized tensors among ``sources`` by the name conversions see, and the checkpoint keys
    that are read only through them (never reported unexpected).

    A weight is quantized when its companions are in the checkpoint; a float8 weight without its
    scales, blocks without scales and a grid that does not fit its weight are errors, as is a
    ``quant_method`` other than block-scaled FP8, MXFP4 and compressed-tensors.
    """
    from hp_dcp_hf.quant import compressed

    if quantization_config.get("quant_method") == compressed.QUANT_METHOD:
        return compressed.compressed_tensors(quantization_config, sources)
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer

    quantizer = _transformers_quantizer(quantization_config)
    if isinstance(quantizer, FineGrainedFP8HfQuantizer):
        return _block_scaled(quantizer, sources, _scale_renamings(quantizer, model_type))
    if isinstance(quantizer, Mxfp4HfQuantizer):
        return _mxfp4(quantizer, sources)
    raise QuantizationError(f"quant_method {quantization_config.get('quant_method')!r} is not a format this loader "
                            "reads as values (block-scaled fp8, mxfp4, compressed-tensors)", file=_CONFIG_FILE)


def _block_scaled(
    quantizer, sources: Mapping[str, TensorSpec], renamings: list
) -> tuple[dict[str, QuantizedTensor], frozenset[str]]:
    (param, names), = quantizer.serialized_names.items()  # {"weight": [weight, weight_scale_inv, ...]}
    scale_name = next(n for n in names if n.endswith(SCALE_SUFFIX))
    other_names = [n for n in names if n not in (param, scale_name)]
    configured = getattr(quantizer.quantization_config, "weight_block_size", None)
    block = block_size(configured)
    if block is None:
        raise QuantizationError(f"weight_block_size must be two positive ints, got {configured!r}", file=_CONFIG_FILE)
    by_name = {_renamed(key, renamings): key for key in sources}
    found: dict[str, QuantizedTensor] = {}
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


def _mxfp4(quantizer, sources: Mapping[str, TensorSpec]) -> tuple[dict[str, QuantizedTensor], frozenset[str]]:
    found: dict[str, QuantizedTensor] = {}
    for param, (blocks_name, scales_name) in quantizer.serialized_names.items():
        for key in sources:
            base, dot, last = key.rpartition(".")
            if last != blocks_name:
                continue
            name, scales = base + dot + param, base + dot + scales_name
            blocks_spec, scales_spec = sources[key], sources.get(scales)
            if scales_spec is None:
                raise QuantizationError(f"MXFP4 blocks without their scales ({scales})", key=key)
            if (len(blocks_spec.shape) != 4 or blocks_spec.shape[-1] != MXFP4_GROUP // 2
                    or tuple(scales_spec.shape) != tuple(blocks_spec.shape[:-1])
                    or blocks_spec.dtype != torch.uint8 or scales_spec.dtype != torch.uint8):
                raise QuantizationError(
                    f"MXFP4 blocks {tuple(blocks_spec.shape)} {blocks_spec.dtype} and scales "
                    f"{tuple(scales_spec.shape)} {scales_spec.dtype}: expected uint8 [E, R, G, 16] and [E, R, G]", key=key)
            found[name] = Mxfp4(name, key, scales)
    return found, frozenset(k for q in found.values() for k in (q.blocks, q.scales))


def uncovered_weight_boxes(weight_boxes: Sequence[Box], scale_boxes: Sequence[Box], block: tuple[int, int]) -> list[Box]:
    """For a model that keeps a block-scaled weight with its scales (both sharded), the boxes of the
    weight this rank holds whose covering scale blocks it does not all hold: its layout cannot use
    the scales it would load."""
    uncovered = []
    for box in weight_boxes:
        need = covering_blocks(box, block)
        held = sum(part.numel for part in (need.intersect(s) for s in scale_boxes) if part is not None)
        if held != need.numel:
            uncovered.append(box)
    return uncovered


def _check_grid(key: str, weight: TensorSpec, scale_key: str, scale: TensorSpec, block: tuple[int, int]) -> None:
    if len(weight.shape) < 2:
        raise QuantizationError(f"a block-scaled weight needs 2 dims or more, has shape {weight.shape}", key=key)
    grid = scale_grid(weight.shape, block)
    if tuple(scale.shape) != grid:
        raise QuantizationError(f"scale grid {tuple(scale.shape)} of {scale_key} does not fit weight "
                                f"{tuple(weight.shape)} in blocks of {block} (expected {grid})", key=key)
    if not (scale.dtype.is_floating_point or scale.dtype == torch.uint8):
        raise QuantizationError(f"scales of dtype {scale.dtype} ({scale_key})", key=key)


def dequantized_sources(
    sources: Mapping[str, TensorSpec], quantized: Mapping[str, QuantizedTensor], consumed: frozenset[str]
) -> dict[str, TensorSpec]:
    """``sources`` as the conversions see them: each quantized tensor a float32 tensor of its
    values' shape, the keys read only through them gone."""
    if not quantized and not consumed:
        return dict(sources)
    out = {key: spec for key, spec in sources.items() if key not in consumed}
    out.update({key: TensorSpec(q.shape(sources), torch.float32) for key, q in quantized.items()})
    return out
