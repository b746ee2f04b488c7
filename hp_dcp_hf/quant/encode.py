"""FP8 block-scaled saves (``quant_method: "fp8"``): what transformers' FP8 quantizer stores.

*What* is quantized is transformers' own choice: its ``FineGrainedFP8HfQuantizer`` converts a meta
skeleton of the model (every plain ``nn.Linear`` and stacked ``experts`` but
``modules_to_not_convert``, by default the output embeddings, tied modules and the last one), and
its ``Fp8Quantize`` quantizes a converted tensor only where its last two dims are multiples of
``weight_block_size``; a tensor that is not stays in the model's dtype. The checkpoint tensors the
quantized parameters save as are the FP8 ones (per-expert weights of stacked experts each on its
own grid, as FP8 checkpoints ship them). A kept tensor is written without a scale (transformers
writes its ``FP8Linear``'s uninitialized one, which its CPU load then multiplies in) and its module
is named in the ``modules_to_not_convert`` of ``config.json``, so transformers loads it as the
plain ``nn.Linear`` it is. *How* is ``Fp8Quantize``'s arithmetic, in float32: per block of the
last two dims ``scale = 448 / amax`` (1 for a block of zeros), ``q = clamp(w * scale, -448, 448)``
as ``float8_e4m3fn``, and ``weight_scale_inv = 1 / scale``.

:class:`CeilGrids` (opt-in) quantizes the kept tensors too, on ceil grids (DeepSeek-V3's layout, as
``FP8Linear`` allocates its scales): a partial last block's amax is over the elements it has, which
is ``Fp8Quantize`` of the weight zero-padded to whole blocks. transformers' CPU dequantize derives
the block from the grid (600 rows on 5 scale rows: 120) and mis-reads such weights without an
error, hence off by default.

Each rank quantizes only the boxes it writes. A block that several ranks write parts of (a TP or
FSDP border inside it) needs the amax over all its parts: every rank finds the same such blocks
from the layout alone (:func:`split_blocks`: every rank's pieces are a pure function of its mesh
coordinate), and one ``all_reduce(MAX)`` of just those blocks' partial amaxes
(:meth:`BlockAmax.agree`) completes them before any byte is quantized. Each scale is written by the
rank that writes its block's first element (:meth:`Fp8Layout.owned_box`), so by exactly one.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp_dcp_hf.errors import ArgumentError
from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.geometry.shards import ShardPiece, shard_pieces
from hp_dcp_hf.mapping.blocks import read_blocks
from hp_dcp_hf.quant.grid import (
    bands,
    block_size,
    covering_blocks,
    scale_grid,
    scale_name,
    starting_blocks,
    whole_blocks,
)
from hp_dcp_hf.storage.write.destination import BoxWrite
from hp_dcp_hf.util.collectives import collective_device

FP8 = torch.float8_e4m3fn
FP8_MIN, FP8_MAX = torch.finfo(FP8).min, torch.finfo(FP8).max
SCALE_DTYPE = torch.float32
FORMATS = ("fp8",)
"""The names ``quantize=`` takes (``--save-quantize`` too)."""

Quantize = Any
"""``quantize=``: ``"fp8"``, a ``quantization_config`` dict with ``quant_method: "fp8"`` (a
checkpoint's own), a transformers ``FineGrainedFP8Config``, or one of these in :class:`CeilGrids`."""


@dataclass(frozen=True)
class CeilGrids:
    """``quantize=CeilGrids("fp8")`` (or of a config): that save, with the weights whose last two dims
    are not multiples of the block in FP8 too, on ceil scale grids, as DeepSeek-V3 ships them and
    hp-dcp-hf loads them (by ``weight_block_size``). transformers' CPU load mis-reads them (it
    derives the block from the grid), so this is opt-in; without it such weights keep the model's
    dtype, as transformers' quantizer keeps them."""

    quantize: Quantize = "fp8"


def fp8_config(quantize: Quantize) -> Any:
    """The ``FineGrainedFP8Config`` that ``quantize`` names (``"fp8"``: transformers' defaults,
    128 x 128 blocks; a :class:`CeilGrids`: its ``quantize``'s). What this save cannot write is an :class:`ArgumentError`: another format,
    activation scales (``static``: they need calibration), power-of-two ``ue8m0`` scales, FP4
    experts, embeddings to convert, or per-tensor scales (no ``weight_block_size``)."""
    from transformers.utils.quantization_config import FineGrainedFP8Config

    if isinstance(quantize, CeilGrids):
        return fp8_config(quantize.quantize)
    if isinstance(quantize, str):
        if quantize not in FORMATS:
            raise ArgumentError(f"quantize must be one of {list(FORMATS)} (or an FP8 quantization_config), "
                                f"got {quantize!r}")
        config = FineGrainedFP8Config()
    elif isinstance(quantize, Mapping):
        if quantize.get("quant_method") not in FORMATS:
            raise ArgumentError(f"quantize= as a quantization_config needs quant_method 'fp8', got "
                                f"{quantize.get('quant_method')!r}")
        try:
            config = FineGrainedFP8Config.from_dict(dict(quantize))
        except (ValueError, TypeError) as e:
            raise ArgumentError(f"quantize={dict(quantize)}: {e}") from e
    elif isinstance(quantize, FineGrainedFP8Config):
        config = copy.deepcopy(quantize)
    else:
        raise ArgumentError(f"quantize must be 'fp8', a quantization_config dict, a FineGrainedFP8Config or a CeilGrids, "
                            f"got {type(quantize).__name__}")
    writable = {"activation_scheme": "dynamic", "scale_fmt": "float", "expert_dtype": "fp8", "dequantize": False,
                "modules_to_convert": None}
    for name, supported in writable.items():
        value = getattr(config, name, supported)  # a field an older transformers lacks (5.19: expert_dtype) is its default
        if value != supported:
            raise ArgumentError(f"quantize=: {name}={value!r} is not written by this save (only {supported!r})")
    if block_size(config.weight_block_size) is None:
        raise ArgumentError(f"quantize=: weight_block_size must be two positive ints, got {config.weight_block_size!r}")
    return config


@dataclass(frozen=True)
class Fp8Conversion:
    """What transformers' FP8 quantizer makes of a model: the canonical (model-side) names it
    quantizes, the config it puts in ``config.json`` (``modules_to_not_convert`` normalized as it
    does, with the modules it keeps in the model's dtype), the parameter count of the quantized
    model (the index's ``total_parameters``) and whether partial blocks are quantized
    (:class:`CeilGrids`)."""

    canonical: frozenset[str]
    config: Any
    total_parameters: int
    ceil_grids: bool = False

    def quantizes(self, shape: Sequence[int]) -> bool:
        """Whether a checkpoint tensor of ``shape`` made of quantized canonical tensors is FP8: on
        its own grid, it needs whole blocks (a stacked tensor's blocks may cross the border of
        two per-expert tensors) unless ceil grids are asked for."""
        return self.ceil_grids or whole_blocks(shape, self.config.weight_block_size)


def fp8_conversion(skeleton: torch.nn.Module, config: Any, ceil_grids: bool = False) -> Fp8Conversion:
    """Run transformers' FP8 quantizer on ``skeleton`` (a fresh meta model of the class; it is
    converted in place) and read off what it converted; the converted tensors that are not whole
    blocks are kept (``Fp8Quantize`` passes them through) unless ``ceil_grids``, and their modules
    join ``modules_to_not_convert`` (with the quantizer's own list, which a given list replaces)."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    config = copy.deepcopy(config)
    quantizer = FineGrainedFP8HfQuantizer(config, pre_quantized=False)
    try:
        quantizer.preprocess_model(skeleton)
    except Exception as e:  # transformers' refusal (FP8Experts with biases, ...)
        raise ArgumentError(f"quantize=: transformers' FP8 quantizer cannot convert {type(skeleton).__name__} "
                            f"({type(e).__name__}: {e})") from e
    state = skeleton.state_dict()
    converted = {k for k, v in state.items() if v.dtype == FP8}
    canonical = {k for k in converted if ceil_grids or whole_blocks(state[k].shape, config.weight_block_size)}
    kept = sorted(converted - canonical)
    if kept:
        config.modules_to_not_convert = sorted(
            set(quantizer.modules_to_not_convert) | {k.rpartition(".")[0] for k in kept})
    unwritten = sum(state[scale_name(k)].numel() for k in kept if scale_name(k) in state)
    return Fp8Conversion(frozenset(canonical), config, skeleton.num_parameters() - unwritten, ceil_grids)


def already_quantized(model: torch.nn.Module) -> str | None:
    """Why ``model`` already holds quantized weights (FP8 parameters, a ``quantization_config``), or None."""
    config = getattr(model, "config", None)
    if getattr(config, "quantization_config", None) is not None:
        return "its config has a quantization_config"
    fp8 = next(((name, t.dtype) for name, t in model.state_dict().items()
                if t.dtype.is_floating_point and t.dtype.itemsize == 1), None)
    return f"it holds {fp8[0]} in {fp8[1]}" if fp8 is not None else None


# -- layout -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Layout:
    """The quantized tensors of a save, what every rank's writer needs to quantize its boxes."""

    config: Any  # the FineGrainedFP8Config config.json gets
    shapes: dict[str, tuple[int, ...]]  # quantized checkpoint key -> its shape
    split: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> flat indices of blocks several ranks write

    @property
    def block(self) -> tuple[int, int]:
        return int(self.config.weight_block_size[0]), int(self.config.weight_block_size[1])

    @property
    def scales(self) -> dict[str, str]:
        """Scale key -> its weight's key."""
        return {scale_name(key): key for key in self.shapes}

    def quantized_writes(self, writes: Sequence[BoxWrite], through: torch.dtype | None,
                         failure: BaseException | None) -> tuple[list[BoxWrite], BaseException | None, int]:
        """``writes`` (this rank's, ``data`` the model's values, None for scales) with quantized weights
        as :class:`Fp8Box` es and scales as their values; the amax reduction in between, on every rank
        even after a ``failure`` (then this rank's parts are zeros and the failure is returned, for the
        writer to raise once every rank knows). Also the number of blocks reduced."""
        scales = self.scales
        out: list[BoxWrite] = []
        amax, failure = self.agreed_amax(
            [(w.tensor.key, w.box, w.data) for w in writes if w.tensor.key in self.shapes], through, failure)
        if failure is not None:
            return [], failure, amax.reduced
        for write in writes:
            key = write.tensor.key
            if key in self.shapes:
                scale, _ = amax.scales(key, self.scale_box(write.box))
                out.append(dataclasses.replace(write, data=Fp8Box(write.data, write.box, self.block, scale, through)))
            elif key in scales:
                _, inverse = amax.scales(scales[key], write.box)
                out.append(dataclasses.replace(write, data=inverse.contiguous()))
            else:
                out.append(write)
        return out, None, amax.reduced

    def agreed_amax(self, parts: Sequence[tuple[str, Box, torch.Tensor]], through: torch.dtype | None,
                    failure: BaseException | None = None) -> tuple[BlockAmax, BaseException | None]:
        """The amax of every scale block this rank's ``parts`` (quantized key, box of it, its values)
        touch, the blocks other ranks hold parts of completed by :meth:`BlockAmax.agree`: a
        collective every rank calls, after a ``failure`` too (or one here, returned with it: then
        this rank's parts count as zeros, for the caller to raise once every rank met)."""
        amax = BlockAmax(self, {})
        try:
            boxes: dict[str, list[Box]] = {}
            for key, box, _ in parts:
                boxes.setdefault(key, []).append(box)
            amax = BlockAmax(self, boxes)
            for key, box, values in parts:
                amax.add(key, box, values, through)
        except Exception as e:  # noqa: BLE001 - raised by the caller once the other ranks know
            failure = failure or e
        amax.agree()
        return amax, failure

    def grid(self, key: str) -> tuple[int, ...]:
        """The ceil grid of ``key``'s scales (leading dims one to one)."""
        return scale_grid(self.shapes[key], self.block)

    def scale_box(self, box: Box) -> Box:
        """The scale blocks covering ``box`` of a weight."""
        return covering_blocks(box, self.block)

    def owned_box(self, box: Box) -> Box | None:
        """The scale blocks whose first element lies in ``box``: the ones its writer writes."""
        return starting_blocks(box, self.block)

    def ordered(self, specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """``specs`` as the files get them: quantized weights in FP8, each scale (float32) after
        the last tensor of its weight's module, where transformers' ``FP8Linear`` registers it
        (``weight``, ``bias``, ``weight_scale_inv``): ``save_pretrained`` splits files in this order."""
        out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        pending: list[tuple[str, str]] = []  # (module prefix, weight key) whose scale waits
        for key, spec in specs.items():
            while pending and not key.startswith(pending[0][0]):
                self._add_scale(out, pending.pop(0)[1])
            out[key] = (FP8, spec[1]) if key in self.shapes else spec
            if key in self.shapes:
                pending.append((key.rpartition(".")[0] + ".", key))
        for _, key in pending:
            self._add_scale(out, key)
        return out

    def _add_scale(self, out: dict, key: str) -> None:
        out[scale_name(key)] = (SCALE_DTYPE, self.grid(key))


def scale_storage(layout: Fp8Layout, storage: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """``storage`` (key -> storage group, its elements) with the scales: the scales of weights
    that share a storage (per-expert views of stacked experts) share one too, as the scales of a
    stacked FP8 parameter do, so ``save_pretrained``'s split keeps them together."""
    groups = 1 + max((group for group, _ in storage.values()), default=-1)
    sizes: dict[int, int] = {}
    for key in layout.shapes:
        group = storage[key][0]
        sizes[group] = sizes.get(group, 0) + Box.full(layout.grid(key)).numel
    return {**storage, **{scale_name(key): (groups + storage[key][0], sizes[storage[key][0]]) for key in layout.shapes}}


# -- which blocks are split between ranks ----------------------------------------------------------


def holder_classes(tensor: torch.Tensor) -> list[tuple[ShardPiece, ...]]:
    """The distinct local parts of ``tensor`` over every mesh coordinate, each written by one rank
    (replicas hold one part alike and one of them writes it): a pure function of the layout."""
    if not isinstance(tensor, DTensor):
        return [shard_pieces(tensor.shape, (), (), ())]
    if tensor.numel() == 0:
        return []
    mesh_shape, spec = tuple(tensor.device_mesh.shape), tensor._spec
    explicit = None  # a shard order carried in the spec, as layout.local_shard_pieces reads it
    if not getattr(spec, "use_strided_shard_as_shard_order", True):
        explicit = tuple((tensor_dim, tuple(mesh_dims)) for tensor_dim, mesh_dims in spec.shard_order)
    classes: dict[tuple[Box, ...], tuple[ShardPiece, ...]] = {}
    for coordinate in itertools.product(*map(range, mesh_shape)):
        pieces = shard_pieces(tensor.shape, mesh_shape, coordinate, tensor.placements, shard_order=explicit)
        classes.setdefault(tuple(p.global_box for p in pieces), pieces)
    return [pieces for pieces in classes.values() if pieces]


def split_blocks(targets: Sequence[tuple[torch.Tensor, Any]], layout: Fp8Layout) -> dict[str, torch.Tensor]:
    """Per quantized checkpoint key, the flat indices of its scale blocks that more than one
    writer writes parts of, from every rank's layout (the same answer on every rank, no data
    exchanged). ``targets``: each model tensor with its traced load composition (a ``Bound``).

    A writer is one holder class of one model tensor (:func:`holder_classes`); two of them may be
    one rank (q, k and v of one fused checkpoint tensor written by one replica), which only puts a
    block in the reduction that did not need it. Layers alike share the work: the blocks of one
    traced structure under one layout are computed once and bound to each layer's keys.
    """
    owner: dict[str, torch.Tensor] = {}  # key -> per block the first writer seen, -1 for none
    split: dict[str, torch.Tensor] = {}
    cache: dict[tuple, list[tuple[int, int, Box]]] = {}
    writer = 0
    for tensor, traced in targets:
        if not any(k in layout.shapes for k in traced.keys):
            continue
        shape_key = (id(traced.structure), tuple(tensor.shape), _layout_key(tensor))
        marks = cache.get(shape_key)
        if marks is None:
            marks = cache[shape_key] = [
                (traced.keys.index(block.key), number, layout.scale_box(block.source_box))
                for number, pieces in enumerate(holder_classes(tensor)) for piece in pieces
                for block in read_blocks(traced, piece.global_box, piece.local_offsets)
                if block.key in layout.shapes]
        for slot, number, box in marks:
            key = traced.keys[slot]
            if key not in owner:
                owner[key] = torch.full(layout.grid(key), -1, dtype=torch.int32)
                split[key] = torch.zeros(layout.grid(key), dtype=torch.bool)
            region, mine = owner[key][box.slices()], writer + number
            split[key][box.slices()] |= (region >= 0) & (region != mine)
            region[region < 0] = mine
        writer += 1 + max((number for _, number, _ in marks), default=0)
    return {key: flat for key in sorted(split) if len(flat := split[key].flatten().nonzero().flatten())}


def _layout_key(tensor: torch.Tensor) -> tuple:
    if not isinstance(tensor, DTensor):
        return ()
    spec = tensor._spec
    order = None if getattr(spec, "use_strided_shard_as_shard_order", True) else str(spec.shard_order)
    return tuple(tensor.device_mesh.shape), tuple(tensor.placements), order


# -- arithmetic -------------------------------------------------------------------------------------


def _tiles(box: Box, block: tuple[int, int]) -> Iterator[tuple[tuple[int, ...], slice, int, list]]:
    """Walk ``box`` (of a weight) one block row at a time: per leading index, the rows of one
    block row (relative to the box), its scale row and the column bands (:func:`~hp_dcp_hf.quant.grid.bands`: relative to
    the box and to its first scale column), so memory stays one block row of the box."""
    columns = bands(box.offsets[-1], box.sizes[-1], block[1])
    for lead in itertools.product(*map(range, box.sizes[:-2])):
        for r0, r1, s0, s1 in bands(box.offsets[-2], box.sizes[-2], block[0]):
            height = (r1 - r0) // (s1 - s0)
            for k in range(s1 - s0):
                yield lead, slice(r0 + k * height, r0 + (k + 1) * height), s0 + k, columns


def _float32(values: torch.Tensor, through: torch.dtype | None) -> torch.Tensor:
    """A float32 copy of ``values`` in host memory (where the writer stages bytes), rounded to
    ``through`` first (the dtype the file would otherwise hold)."""
    if through is not None and values.dtype != through:
        values = values.to(through)
    return values.to(device="cpu", dtype=torch.float32, copy=True)


def block_amax(values: torch.Tensor, box: Box, block: tuple[int, int], through: torch.dtype | None = None) -> torch.Tensor:
    """Per scale block covering ``box`` (``values`` holds that box of a weight), the amax of the
    elements of the block inside the box, in float32 (NaN where one is NaN, as ``amax``)."""
    sizes = covering_blocks(box, block).sizes
    amax = torch.empty(sizes, dtype=torch.float32)
    for lead, rows, scale_row, columns in _tiles(box, block):
        part = _float32(values[lead][rows], through).abs_()
        for c0, c1, t0, t1 in columns:
            amax[lead][scale_row, t0:t1] = part[:, c0:c1].unflatten(1, (t1 - t0, -1)).amax(dim=(0, 2))
    return amax


def fp8_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, weight_scale_inv)`` of blocks of ``amax``, as ``Fp8Quantize`` computes them."""
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    scale = FP8_MAX / safe
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    return scale, (1.0 / scale).to(torch.float32)


def quantize_box(values: torch.Tensor, box: Box, block: tuple[int, int], scale: torch.Tensor,
                 through: torch.dtype | None = None) -> torch.Tensor:
    """``box`` of a weight (``values``) in FP8, by the ``scale`` of each block covering it
    (shaped as the box's scale box): ``Fp8Quantize``'s float32 multiply, clamp and cast."""
    out = torch.empty(box.sizes, dtype=FP8)
    for lead, rows, scale_row, columns in _tiles(box, block):
        part = _float32(values[lead][rows], through)
        for c0, c1, t0, t1 in columns:
            part[:, c0:c1].unflatten(1, (t1 - t0, -1)).mul_(scale[lead][scale_row, t0:t1, None])
        out[lead][rows] = part.clamp_(min=FP8_MIN, max=FP8_MAX).to(FP8)
    return out


@dataclass(frozen=True)
class Fp8Box:
    """A box of a weight as the writer slices it (``box[slices]``, relative to the box): its values
    quantized one slice at a time, so a box costs no more memory than the writer's staging."""

    values: torch.Tensor  # the box, in the model's dtype (a view of the local shard)
    box: Box
    block: tuple[int, int]
    scale: torch.Tensor  # the scales of the box's scale box
    through: torch.dtype | None = None

    def __getitem__(self, slices: tuple[slice, ...]) -> torch.Tensor:
        offsets = tuple(s.start for s in slices)
        part = Box(tuple(o + a for o, a in zip(self.box.offsets, offsets)), tuple(s.stop - s.start for s in slices))
        mine, sub = covering_blocks(self.box, self.block), covering_blocks(part, self.block)
        scale = self.scale[sub.relative_to(mine.offsets).slices()]
        return quantize_box(self.values[slices], part, self.block, scale, self.through)


class BlockAmax:
    """This rank's amax of every scale block it writes part of, per quantized key over the hull of
    those blocks; :meth:`agree` completes the blocks other ranks write parts of."""

    def __init__(self, layout: Fp8Layout, boxes: Mapping[str, Sequence[Box]]) -> None:
        self.layout = layout
        self.hulls: dict[str, Box] = {}
        for key, of_key in boxes.items():
            covering = [layout.scale_box(b) for b in of_key]
            lo = tuple(min(c) for c in zip(*(b.offsets for b in covering)))
            hi = tuple(max(c) for c in zip(*(b.ends for b in covering)))
            self.hulls[key] = Box(lo, tuple(h - low for low, h in zip(lo, hi)))
        self.amax = {key: torch.zeros(hull.sizes, dtype=torch.float32) for key, hull in self.hulls.items()}
        self.reduced = 0  # blocks in the all_reduce

    def add(self, key: str, box: Box, values: torch.Tensor, through: torch.dtype | None = None) -> None:
        region = self.amax[key][self.layout.scale_box(box).relative_to(self.hulls[key].offsets).slices()]
        torch.maximum(region, block_amax(values, box, self.layout.block, through), out=region)

    def agree(self) -> None:
        """One ``all_reduce(MAX)`` of the split blocks' partial amaxes (zeros where this rank writes
        none of a block), every rank calling it with the same blocks. The amaxes travel as their
        int32 bits, which order non-negative floats as their values and NaN above infinity: a NaN
        part makes the block NaN, as ``amax`` of the whole tensor does (gloo's float MAX may drop it)."""
        split = self.layout.split
        if not split:
            return
        where = {key: self._positions(key, flat) for key, flat in split.items()}
        parts = []
        for key, (inside, index) in where.items():
            values = torch.zeros(len(inside), dtype=torch.float32)
            if key in self.amax:
                values[inside] = self.amax[key][index]
            parts.append(values)
        bits = torch.cat(parts).view(torch.int32).to(collective_device())
        dist.all_reduce(bits, op=dist.ReduceOp.MAX)
        reduced = bits.cpu().view(torch.float32).split([len(p) for p in parts])
        for (key, (inside, index)), values in zip(where.items(), reduced):
            if key in self.amax:
                self.amax[key][index] = values[inside]
        self.reduced = len(bits)

    def _positions(self, key: str, flat: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Which of ``key``'s split blocks ``flat`` lie in this rank's hull, and where in its grid."""
        coords = torch.unravel_index(flat, self.layout.grid(key))
        hull = self.hulls.get(key)
        if hull is None:
            return torch.zeros(len(flat), dtype=torch.bool), ()
        inside = torch.ones(len(flat), dtype=torch.bool)
        for c, lo, size in zip(coords, hull.offsets, hull.sizes):
            inside &= (c >= lo) & (c < lo + size)
        return inside, tuple(c[inside] - lo for c, lo in zip(coords, hull.offsets))

    def scales(self, key: str, box: Box) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, weight_scale_inv)`` of the blocks of ``box`` (a box of the scale grid)."""
        return fp8_scales(self.amax[key][box.relative_to(self.hulls[key].offsets).slices()])


