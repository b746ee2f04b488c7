"""From traced pieces to read blocks: one box of one checkpoint tensor into a view of a local shard."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hp_dcp_hf.box import Box
from hp_dcp_hf.mapping.symbolic import Piece, RegionTensor, restrict


@dataclass(frozen=True)
class ViewAxis:
    """One dim of the destination view: ``size`` elements, ``step`` apart along local ``dim``."""

    size: int
    dim: int
    step: int


@dataclass(frozen=True)
class ReadBlock:
    """Box ``source_box`` of checkpoint tensor ``key``, read in row-major order and reshaped to the
    sizes of ``view``, lands in the local shard at ``origin`` + sum(i * step) along each axis."""

    key: str
    source_box: Box
    origin: tuple[int, ...]
    view: tuple[ViewAxis, ...]

    @property
    def numel(self) -> int:
        return self.source_box.numel


def _is_box(piece: Piece, src_dim: int) -> bool:
    axes = sorted((a for a in piece.axes if a.src_dim == src_dim), key=lambda a: -a.src_step)
    expected = 1
    for a in reversed(axes):
        if a.src_step != expected:
            return False
        expected *= a.size
    return True


def _as_blocks(piece: Piece, src_ndim: int) -> list[ReadBlock]:
    """Split ``piece`` until its source footprint is a box, then describe each part."""
    broken = next((d for d in range(src_ndim) if not _is_box(piece, d)), None)
    if broken is not None:
        axis = max((a for a in piece.axes if a.src_dim == broken), key=lambda a: a.src_step)
        return [b for k in range(axis.size) for b in _as_blocks(piece.advance(axis, k, 1), src_ndim)]
    sizes = [1] * src_ndim
    for a in piece.axes:
        sizes[a.src_dim] *= a.size
    ordered = sorted(piece.axes, key=lambda a: (a.src_dim, -a.src_step))
    return [
        ReadBlock(
            piece.key,
            Box(piece.src_origin, tuple(sizes)),
            piece.origin,
            tuple(ViewAxis(a.size, a.dim, a.step) for a in ordered),
        )
    ]


def read_blocks(
    traced: RegionTensor, global_box: Box, local_offsets: Sequence[int], source_ndim: dict[str, int]
) -> list[ReadBlock]:
    """The reads that fill the part ``global_box`` of a target, held at ``local_offsets`` locally."""
    blocks = []
    for piece in traced.pieces:
        parts = [piece]
        for dim, (lo, size) in enumerate(zip(global_box.offsets, global_box.sizes)):
            parts = [q for p in parts for q in restrict(p, dim, lo, lo + size)]
        for part in parts:
            origin = tuple(o - g + loc for o, g, loc in zip(part.origin, global_box.offsets, local_offsets))
            blocks.extend(_as_blocks(replace(part, origin=origin), source_ndim[part.key]))
    return blocks
