"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``), read as the values they stand for.

llm-compressor writes them and vLLM serves them: each ``Linear`` layer a config group targets is
stored in its group's format, as compressed-tensors' compressors write it:

* ``naive-quantized`` / ``float-quantized`` / ``int-quantized``: ``weight`` as FP8 E4M3 or INT8
  values, ``weight_scale`` (and ``weight_zero_point`` when asymmetric) per tensor, per output row
  (channel), per ``group_size`` input columns (group) or per ``block_structure`` block (block);
* ``mxfp8-quantized``: the same, per group of 32, with E8M0 exponents (``uint8``) as scales;
* ``pack-quantized``: ``bits``-bit integers packed densely into int32 along the input dim
  (``weight_packed``, 32 values in ``bits`` words), ``weight_shape`` the unpacked shape; asymmetric
  zero points packed the same way along the *output* rows (``[ceil(rows * bits / 32), groups]``);
* ``nvfp4-pack-quantized``: two FP4 E2M1 values a byte (``weight_packed``, low nibble first), an
  FP8 E4M3 ``weight_scale`` per 16 values and a float32 ``weight_global_scale`` the scales are
  divided by (stored as the reciprocal of the scale it stands for);
* ``mxfp4-pack-quantized`` / ``mxfp6-pack-quantized``: FP4 pairs a byte / four FP6 values in three
  bytes, one E8M0 exponent per 32 values.

Which layer has which format comes from the config, as compressed-tensors decides it: the groups'
``targets`` (exact names, ``re:`` regexes, class names such as ``Linear``; an exact name first, then
regexes, then classes), minus ``ignore``. A class name can only be matched against a checkpoint
module that stores compressed tensors (the checkpoint has no classes; compressed-tensors compresses
only ``Linear`` and ``Embedding`` weights, so those are what such a module is). Every other tensor
loads as stored. Activation and KV-cache parameters (``input_scale``, ``input_global_scale``,
``k_scale``, ...) have no place in an unquantized model: they are consumed, never reported.

A box of values reads the stored elements that hold it (a border inside an int32 word, a byte or
a packing unit reads that unit once) and the scale and zero-point entries covering it (never the
whole scale tensor); the values are compressed-tensors' own ``dequantize`` of those parts, given
one scale per value, after its own unpacking helpers, so they are bit for bit what its
decompression gives, in the dtype it gives them (the scale's for the integer and FP8 formats,
bfloat16 for NVFP4, MXFP4, MXFP6 and MXFP8).

Shapes come from the metadata alone (``weight_shape`` is data, read by no plan): a packed row holds
``groups * group_size`` values, or per channel or tensor as many as its words hold; a row of
packed integers whose length is not a multiple of ``32 / bits`` is then longer than the model's
and the load stops at planning with a shape mismatch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import CONFIG_NAME as CONFIG_FILE

from hp_dcp_hf.errors import QuantizationError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.mapping.compose import TensorSpec
from hp_dcp_hf.quant.grid import covering_blocks, scale_grid

QUANT_METHOD = "compressed-tensors"
NAIVE = frozenset({"naive-quantized", "float-quantized", "int-quantized", "mxfp8-quantized"})
PACKED = frozenset({"pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp6-pack-quantized"})
DENSE = "dense"
MX_FORMATS = frozenset({"mxfp8-quantized", "mxfp4-pack-quantized", "mxfp6-pack-quantized"})
ACTIVATION_PARAMS = frozenset({f"{base}_{suffix}" for base in ("input", "output")
                               for suffix in ("scale", "zero_point", "global_scale")}
                              | {"k_scale", "v_scale", "q_scale"})
"""Per-module parameters of activation and KV-cache quantization: consumed, never loaded."""
_QUANTIZED_DTYPES = frozenset({torch.int8, torch.float8_e4m3fn, torch.float8_e5m2})
WEIGHT_PARAMS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_global_scale", "weight_shape")


@dataclass(frozen=True)
class Packing:
    """How ``values`` consecutive values of a row lie in ``elements`` consecutive stored elements
    (one unit; a box reads whole units), and how a run of units from a unit border is unpacked."""

    values: int = 1
    elements: int = 1
    unpack: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None  # (part, values, dim) -> values

    def stored(self, count: int) -> int:
        """Stored elements of ``count`` values (the last unit may be cut short)."""
        return -(-count * self.elements // self.values)

    def span(self, start: int, stop: int, count: int) -> tuple[int, int]:
        """Stored elements ``[lo, hi)`` holding values ``[start, stop)`` of ``count``: whole units."""
        end = min(-(-stop // self.values) * self.elements, self.stored(count))
        return start // self.values * self.elements, end

    def values_of(self, part: torch.Tensor, start: int, size: int, dim: int) -> torch.Tensor:
        """Values ``[start, start + size)`` along ``dim`` of ``part``, whose first element opens the
        unit holding value ``start``."""
        if self.unpack is None:
            return part
        skip = start % self.values
        return self.unpack(part, skip + size, dim).narrow(dim, skip, size)


def _int32(bits: int) -> Packing:
    """compressed-tensors' dense packing: 32 values in ``bits`` int32 words (``unpack_from_int32``)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    def unpack(part: torch.Tensor, count: int, dim: int) -> torch.Tensor:
        # Along rows as along columns of the transpose, laid out anew: compressed-tensors transposes
        # itself, but its byte view fails on the transpose of a single row (a box's one zero-point
        # word row), whose strides ``contiguous()`` keeps.
        words = (part.t() if dim == 0 else part).clone(memory_format=torch.contiguous_format)
        values = unpack_from_int32(words, bits, torch.Size((words.shape[0], count)))
        return values.t() if dim == 0 else values

    common = math.gcd(32, bits)
    return Packing(32 // common, bits // common, unpack)


def _bytes(values: int, elements: int, unpack_rows: Callable[..., torch.Tensor]) -> Packing:
    """FP4 (2 values a byte) and FP6 (4 values in 3 bytes) along a row, as compressed-tensors unpacks
    them (into bfloat16)."""

    def unpack(part: torch.Tensor, count: int, dim: int) -> torch.Tensor:
        rows, stored = part.shape
        return unpack_rows(part.contiguous(), rows, stored // elements * values)[:, :count]

    return Packing(values, elements, unpack)


@dataclass(frozen=True)
class CompressedWeight:
    """A ``Linear`` weight ``key`` of ``size`` (rows, columns) stored compressed: ``data`` (packed
    along columns by ``packing``), ``scale`` (one per ``grid`` rows x columns of values), an optional
    ``zero_point`` (packed along rows by ``zero_point_packing``) and ``global_scale``."""

    key: str
    size: tuple[int, int]
    data: str
    packing: Packing
    scale: str
    scale_ndim: int
    grid: tuple[int, int]
    decode_scale: Callable[[torch.Tensor], torch.Tensor]
    zero_point: str | None = None
    zero_point_packing: Packing = Packing()
    global_scale: str | None = None
    unpacked_dtype: torch.dtype | None = None  # the dtype of the unpacked values (and so the result)

    def shape(self, sources: Mapping[str, TensorSpec]) -> tuple[int, ...]:
        return self.size

    def _spans(self, box: Box) -> tuple[int, int, int, int, tuple[int, int], tuple[int, int]]:
        """The box's rows and columns, and the scale rows and columns covering them."""
        (r0, c0), (nr, nc) = box.offsets, box.sizes
        scales = covering_blocks(box, self.grid)
        (s0, g0), (s1, g1) = scales.offsets, scales.ends
        return r0, nr, c0, nc, (s0, s1), (g0, g1)

    def reads(self, box: Box) -> tuple[tuple[str, Box], ...]:
        """The stored elements holding ``box`` (whole packing units), then the scale entries covering
        it, the zero points (whole packed words of the scale rows), the global scale."""
        r0, nr, c0, nc, (s0, s1), (g0, g1) = self._spans(box)
        lo, hi = self.packing.span(c0, c0 + nc, self.size[1])
        out = [(self.data, Box((r0, lo), (nr, hi - lo)))]
        scale = Box((s0, g0), (s1 - s0, g1 - g0)) if self.scale_ndim == 2 else Box((0,), (1,))
        out.append((self.scale, scale))
        if self.zero_point is not None:
            if self.scale_ndim == 1:
                out.append((self.zero_point, scale))
            else:
                zlo, zhi = self.zero_point_packing.span(s0, s1, -(-self.size[0] // self.grid[0]))
                out.append((self.zero_point, Box((zlo, g0), (zhi - zlo, g1 - g0))))
        if self.global_scale is not None:
            out.append((self.global_scale, Box((0,), (1,))))
        return tuple(out)

    def values(self, parts: Mapping[str, torch.Tensor], box: Box, dtype: torch.dtype) -> torch.Tensor:
        """compressed-tensors' ``dequantize`` of the box, each value with its own scale (and zero
        point, global scale): the arithmetic, dtypes and rounding of its decompression."""
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        r0, nr, c0, nc, (s0, s1), (g0, g1) = self._spans(box)
        values = self.packing.values_of(parts[self.data], c0, nc, dim=1)
        rows, columns = _entry_index(r0, nr, self.grid[0]), _entry_index(c0, nc, self.grid[1])

        def per_value(entries: torch.Tensor) -> torch.Tensor:  # broadcast where one entry covers a dim
            if self.scale_ndim == 1:
                return entries.reshape(1, 1)
            return entries.index_select(0, rows).index_select(1, columns)

        scale = per_value(self.decode_scale(parts[self.scale]))
        zero_point = None
        if self.zero_point is not None:
            stored = parts[self.zero_point]
            if self.scale_ndim == 2:
                stored = self.zero_point_packing.values_of(stored, s0, s1 - s0, dim=0)
            zero_point = per_value(stored)
        global_scale = parts[self.global_scale] if self.global_scale is not None else None
        out = dequantize(values, scale, zero_point, args=_elementwise(), global_scale=global_scale)
        return out if self.unpacked_dtype is None else out.to(self.unpacked_dtype)


def _entry_index(start: int, size: int, per: int) -> torch.Tensor:
    """The entry (of those read, ``per`` values each) of each of ``size`` values from ``start``; a
    single index when one entry covers them all (it then broadcasts)."""
    first = start // per
    if (start + size - 1) // per == first:
        return torch.zeros(1, dtype=torch.long)
    return torch.arange(start, start + size) // per - first


@functools.cache
def _elementwise():
    """Arguments under which compressed-tensors' ``dequantize`` broadcasts one scale per value."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(strategy="tensor")


# -- the config ----------------------------------------------------------------------------------------


def _import_compressed_tensors():
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as e:
        raise QuantizationError("a compressed-tensors checkpoint needs the compressed-tensors package: "
                                "pip install 'hp-dcp-hf[quant]'", file=CONFIG_FILE) from e


def _parse(quantization_config: Mapping[str, Any]):
    """compressed-tensors' ``QuantizationConfig`` of the checkpoint. Sparse weights and transforms
    (rotations an unquantized model does not apply) are refused: their values alone are not the
    model's weights."""
    from compressed_tensors.quantization import QuantizationConfig

    for part in ("sparsity_config", "transform_config"):
        if quantization_config.get(part):
            raise QuantizationError(f"compressed-tensors {part} {dict(quantization_config[part])}: only "
                                    "quantized (not sparse or transformed) weights are read as values",
                                    file=CONFIG_FILE)
    fields = set(QuantizationConfig.model_fields)
    try:
        known = {k: v for k, v in quantization_config.items() if k in fields}  # not version, ...
        return QuantizationConfig.model_validate(known)
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        raise QuantizationError(f"compressed-tensors quantization_config: {e}", file=CONFIG_FILE) from e


def _group_format(name: str, scheme, config) -> str:
    """The group's format: its own, else the config's, else the one compressed-tensors infers."""
    from compressed_tensors.compressors.format import infer_module_format

    value = scheme.format or config.format
    value = str(getattr(value, "value", value))
    if value in (None, "None", "mixed-precision"):
        value = infer_module_format(torch.nn.Linear, scheme).value
    if value != DENSE and value not in NAIVE | PACKED:
        raise QuantizationError(f"config group {name!r}: format {value!r} is not one this loader reads as "
                                f"values ({', '.join(sorted(NAIVE | PACKED))})", file=CONFIG_FILE)
    return value


def compressed_tensors(
    quantization_config: Mapping[str, Any], sources: Mapping[str, TensorSpec]
) -> tuple[dict[str, CompressedWeight], frozenset[str]]:
    """The compressed weights among ``sources`` by their value names (``<module>.weight``), and
    the checkpoint keys read only through them or consumed (activation parameters).

    Every stored compressed module must be targeted by a group, and every group with weights must
    target a stored compressed module; formats, dtypes and shapes must fit (else
    :class:`QuantizationError`, at planning).
    """
    _import_compressed_tensors()
    from compressed_tensors.utils.match import is_match, match_targets

    config = _parse(quantization_config)
    groups = {name: (scheme, _group_format(name, scheme, config))
              for name, scheme in config.config_groups.items()}
    target_group = {target: name for name, (scheme, _) in groups.items() for target in scheme.targets}
    modules: dict[str, dict[str, str]] = {}
    for key in sources:
        module, _, leaf = key.rpartition(".")
        modules.setdefault(module, {})[leaf] = key
    linear = _linear()
    found: dict[str, CompressedWeight] = {}
    consumed = {key for key in sources if key.rpartition(".")[2] in ACTIVATION_PARAMS}
    used: set[str] = set()
    for module, leaves in modules.items():
        if "weight_packed" not in leaves and not ("weight" in leaves and "weight_scale" in leaves):
            weight = sources[leaves["weight"]].dtype if "weight" in leaves else None
            if weight is not None and (weight in _QUANTIZED_DTYPES):
                raise QuantizationError(f"{weight} weight without its weight_scale", key=leaves["weight"])
            continue
        targets = match_targets(module, linear, target_group)
        root = leaves.get("weight_packed", leaves.get("weight"))
        if not targets or is_match(module, linear, config.ignore or ()):
            stored = ", ".join(sorted(set(leaves) & {"weight_packed", "weight_scale"}))
            why = "in the config's ignore list" if targets else "no config group targets it"
            raise QuantizationError(f"stored compressed ({stored}) but {why}", key=root)
        group = target_group[targets[0]]
        used.add(group)
        scheme, fmt = groups[group]
        consumed.update(leaves[n] for n in WEIGHT_PARAMS if n in leaves)
        if fmt == DENSE:
            continue
        if scheme.weights is None:
            raise QuantizationError(f"stored compressed but its config group {group!r} quantizes no weights",
                                    key=root)
        tensor = _weight(module, leaves, sources, scheme.weights, fmt)
        found[tensor.key] = tensor
    for name, (scheme, fmt) in groups.items():
        if scheme.weights is not None and fmt != DENSE and name not in used:
            raise QuantizationError(f"config group {name!r} (targets {list(scheme.targets)}) matches no "
                                    "stored compressed tensor", file=CONFIG_FILE)
    return found, frozenset(consumed)


@functools.cache
def _linear() -> torch.nn.Module:
    """What a stored compressed module is, for class-name targets (compressed-tensors compresses the
    weights of ``Linear`` layers)."""
    return torch.nn.Linear(1, 1, bias=False, device="meta")


# -- one weight ------------------------------------------------------------------------------------------


def _weight(
    module: str, leaves: Mapping[str, str], sources: Mapping[str, TensorSpec], args, fmt: str
) -> CompressedWeight:
    """The :class:`CompressedWeight` of ``module`` in format ``fmt`` under weight arguments ``args``,
    its stored tensors checked against them."""
    key = f"{module}.weight"
    data = leaves.get("weight" if fmt in NAIVE else "weight_packed")
    if data is None:
        raise QuantizationError(f"{fmt} stores {'weight' if fmt in NAIVE else 'weight_packed'}; found "
                                f"{sorted(leaves)}", key=leaves.get("weight", leaves.get("weight_packed")))
    scale = leaves.get("weight_scale")
    if scale is None:
        raise QuantizationError(f"{fmt} weight without its weight_scale", key=data)
    rows, stored = _matrix(data, sources[data].shape)
    packing, expected, cols = _layout(fmt, args, stored, sources[scale].shape, leaves, sources)
    if sources[data].dtype != expected:
        raise QuantizationError(f"{fmt} data of dtype {sources[data].dtype}, expected {expected}", key=data)
    if packing.stored(cols) != stored:
        raise QuantizationError(f"packed data of {stored} columns does not hold {cols} values a row "
                                f"({packing.values} values in {packing.elements} elements)", key=data)
    grid, scale_shape = _grid(args, rows, cols, key)
    _check_shape(scale, sources[scale].shape, scale_shape, args)
    decode, scale_dtypes = _scale_decoding(fmt)
    if sources[scale].dtype not in scale_dtypes:
        raise QuantizationError(f"scales of dtype {sources[scale].dtype}, expected one of {scale_dtypes}",
                                key=scale)
    zero_point, zero_point_packing = _zero_point(fmt, args, leaves, sources, scale_shape, data)
    global_scale = None
    if fmt == "nvfp4-pack-quantized":
        global_scale = leaves.get("weight_global_scale")
        if global_scale is None:
            raise QuantizationError("nvfp4 weight without its weight_global_scale", key=data)
        if math.prod(sources[global_scale].shape) != 1:
            raise QuantizationError(f"global scale of shape {tuple(sources[global_scale].shape)}, "
                                    "expected (1,)", key=global_scale)
    unpacked_dtype = None if fmt in NAIVE or fmt == "pack-quantized" else torch.bfloat16
    return CompressedWeight(key, (rows, cols), data, packing, scale, len(scale_shape), grid, decode,
                            zero_point, zero_point_packing, global_scale, unpacked_dtype)


def _matrix(key: str, shape) -> tuple[int, int]:
    if len(shape) != 2:
        raise QuantizationError(f"a compressed Linear weight is 2-D, this one has shape {tuple(shape)}",
                                key=key)
    return int(shape[0]), int(shape[1])


def _layout(fmt: str, args, stored: int, scale_shape, leaves, sources) -> tuple[Packing, torch.dtype, int]:
    """The packing of ``fmt``, the stored dtype and the number of values a row: FP4 and FP6 from
    the packed width; packed integers from the group count (groups divide a row) or, per channel
    or tensor, from the width (``32 / bits`` values a word: the one width the metadata fixes)."""
    from compressed_tensors.compressors.mxfp6.helpers import unpack_fp6_from_uint8
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    if fmt in NAIVE:
        return Packing(), args.pytorch_dtype(), stored
    if fmt == "mxfp6-pack-quantized":
        return _bytes(4, 3, unpack_fp6_from_uint8), torch.uint8, stored * 4 // 3
    if fmt != "pack-quantized":
        return _bytes(2, 1, unpack_fp4_from_uint8), torch.uint8, stored * 2
    shape = leaves.get("weight_shape")
    if shape is None or tuple(sources[shape].shape) != (2,) or sources[shape].dtype.is_floating_point:
        raise QuantizationError("pack-quantized weight without an integer weight_shape of 2 values",
                                key=leaves["weight_packed"])
    packing = _int32(args.num_bits)
    if args.strategy in ("group", "tensor_group") and len(scale_shape) == 2:
        return packing, torch.int32, scale_shape[-1] * args.group_size
    return packing, torch.int32, stored * packing.values // packing.elements


def _scale_decoding(fmt: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], tuple[torch.dtype, ...]]:
    """How ``fmt``'s decompression turns stored scales into multipliers, and the dtypes they have:
    E8M0 exponents to bfloat16 powers of two (MX), E4M3 to bfloat16 (NVFP4), floats as stored."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale

    if fmt == "mxfp8-quantized":
        return decompress_mx_scale, (torch.uint8,)
    if fmt in MX_FORMATS:
        return (lambda s: decompress_mx_scale(s).to(torch.bfloat16)), (torch.uint8,)
    if fmt == "nvfp4-pack-quantized":
        return (lambda s: s.to(torch.bfloat16)), (torch.float8_e4m3fn,)
    return (lambda s: s), (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _grid(args, rows: int, cols: int, key: str) -> tuple[tuple[int, int], tuple[int, ...]]:
    """Values per scale (rows, columns) under ``args.strategy``, and the scales' shape."""
    strategy = args.strategy
    if strategy == "tensor":
        return (rows, cols), (1,)
    if strategy == "channel":
        return (1, cols), (rows, 1)
    if strategy in ("group", "tensor_group"):
        per = (1, args.group_size)
        return per, scale_grid((rows, cols), per)
    if strategy == "block":
        per = tuple(args.block_structure)
        return per, scale_grid((rows, cols), per)
    raise QuantizationError(f"weights quantized per {strategy!r}: not a weight strategy", key=key)


def _check_shape(key: str, shape, expected: tuple[int, ...], args) -> None:
    if tuple(shape) != expected and not (expected == (1,) and math.prod(shape) == 1 and len(shape) <= 2):
        detail = {"group": f"group_size {args.group_size}", "tensor_group": f"group_size {args.group_size}",
                  "block": f"block_structure {args.block_structure}"}.get(args.strategy, "")
        raise QuantizationError(f"shape {tuple(shape)} does not fit strategy {args.strategy!r} {detail} "
                                f"(expected {expected})".replace("  ", " "), key=key)


def _zero_point(
    fmt: str, args, leaves, sources, scale_shape: tuple[int, ...], data: str
) -> tuple[str | None, Packing]:
    """The zero points compressed-tensors' decompression uses: the naive formats use a stored one;
    packed integers use it when asymmetric, packed along the scale rows for groups and channels."""
    key = leaves.get("weight_zero_point")
    if fmt in NAIVE:
        if key is None and not args.symmetric:
            raise QuantizationError("asymmetric weight without its weight_zero_point", key=data)
        if key is not None:
            _check_shape(key, sources[key].shape, scale_shape, args)
        return key, Packing()
    if args.symmetric:
        return None, Packing()
    if fmt != "pack-quantized":
        raise QuantizationError(f"{fmt} is symmetric only", key=data)
    if key is None:
        raise QuantizationError("asymmetric weight without its weight_zero_point", key=data)
    if args.strategy not in ("group", "channel"):
        _check_shape(key, sources[key].shape, scale_shape, args)
        return key, Packing()
    packing = _int32(args.num_bits)
    packed = (packing.stored(scale_shape[0]), scale_shape[1])
    if tuple(sources[key].shape) != packed or sources[key].dtype != torch.int32:
        raise QuantizationError(f"zero points {tuple(sources[key].shape)} {sources[key].dtype}: expected "
                                f"int32 {packed} ({scale_shape[0]} rows, {packing.values} in "
                                f"{packing.elements} words)", key=key)
    return key, packing
