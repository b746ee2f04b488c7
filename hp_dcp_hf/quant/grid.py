"""Block grids of block-scaled weights, and how their scales are named: the arithmetic the decode
on load (:mod:`hp_dcp_hf.quant.decode`, :mod:`hp_dcp_hf.quant.compressed`) and the FP8 encode on
save (:mod:`hp_dcp_hf.quant.encode`) share.

A weight's last two dims are cut in blocks of ``block`` (rows, columns), one scale each; leading
dims (stacked experts) map one to one. The grid is ``ceil(rows / b0) x ceil(cols / b1)``: the last
block of a dim may be partial.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hp_dcp_hf.geometry.box import Box

SCALE_SUFFIX = "_scale_inv"
"""What a weight's name takes for its scales' (``weight`` -> ``weight_scale_inv``), as
transformers' ``Fp8Quantize`` names them."""


def scale_name(key: str) -> str:
    """The scale tensor of quantized weight ``key``: ``a.weight`` -> ``a.weight_scale_inv``."""
    return key + SCALE_SUFFIX


def block_size(value: Any) -> tuple[int, int] | None:
    """``weight_block_size`` as ``(rows, columns)``; None when it is not two positive ints."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(b, int) and b > 0 for b in value):
        return int(value[0]), int(value[1])
    return None


def whole_blocks(shape: Sequence[int], block: Sequence[int]) -> bool:
    """Whether ``shape`` has two dims or more, the last two multiples of ``block``."""
    return len(shape) >= 2 and shape[-2] % block[0] == 0 and shape[-1] % block[1] == 0


def scale_grid(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """The scales' shape of a weight of ``shape``: leading dims as they are, ceil grids after."""
    return (*shape[:-2], *(-(-size // b) for size, b in zip(shape[-2:], block)))


def covering_blocks(box: Box, block: Sequence[int]) -> Box:
    """The blocks (a box of the grid) that cover ``box`` of a weight: rows
    ``[start // b0, ceil(end / b0))``, columns alike."""
    return _blocks(box, block, lambda start, b: start // b)


def starting_blocks(box: Box, block: Sequence[int]) -> Box | None:
    """The blocks whose first element lies in ``box`` (None for none): each block's once, whoever
    holds its first element."""
    blocks = _blocks(box, block, lambda start, b: -(-start // b))
    return None if blocks.is_empty() else blocks


def _blocks(box: Box, block: Sequence[int], first_of) -> Box:
    lead = box.ndim - 2
    offsets, sizes = list(box.offsets[:lead]), list(box.sizes[:lead])
    for start, size, b in zip(box.offsets[lead:], box.sizes[lead:], block):
        first, end = first_of(start, b), -(-(start + size) // b)
        offsets.append(first)
        sizes.append(end - first)
    return Box(tuple(offsets), tuple(sizes))


def bands(start: int, size: int, block: int) -> list[tuple[int, int, int, int]]:
    """``[start, start + size)`` cut at multiples of ``block``: ``(lo, hi, first scale, end scale)``
    relative to ``start`` and to its first block, for a leading partial block, the whole blocks,
    and a trailing partial block (each band holds whole blocks or one block)."""
    end, first = start + size, start // block
    cuts = sorted({start, min(end, -(-start // block) * block), max(start, end // block * block), end})
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        if hi > lo:
            out.append((lo - start, hi - start, lo // block - first, -(-hi // block) - first))
    return out
