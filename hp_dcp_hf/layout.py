"""Which regions of a parameter a rank holds, and where they sit in its local tensor.

The planner reads checkpoint bytes per rank, so it must know exactly which global indices a rank's
local shard holds. DCP's own answer (``compute_local_shape_and_global_offset``: one box per rank)
is wrong for a non-contiguous ``_StridedShard`` and then loads wrong values silently, so the index
sets are computed here from torch's placement semantics:

- placements act left to right over the mesh dims; each ``Shard``/``_StridedShard`` re-splits the
  *current* local extent of its tensor dim, so every tensor dim evolves independently;
- ``Shard(d)`` over ``n`` ranks keeps chunk ``c`` of ``torch.chunk``: chunk size ``ceil(L / n)``,
  trailing chunks smaller or empty;
- ``_StridedShard(d, split_factor=f)`` chunks the extent into ``f`` pieces, chunks each piece into
  ``n``, and keeps chunk ``c`` of every piece, concatenated in order (``_StridedShard._split_tensor``);
- ``Replicate`` leaves the extent alone; ``Partial`` holds no loadable value and is refused.

So along each tensor dim a rank holds a list of runs of consecutive global indices, laid end to end
locally; its pieces are the products of those runs. Runs are merged whenever they continue each
other, so no two pieces could merge into one box. Pieces are never empty: a rank whose local shard
is empty gets no pieces, and has nothing to read.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from hp_dcp_hf.box import Box
from hp_dcp_hf.errors import LayoutError

# One run of a dim: (first global index, length); a dim's runs follow each other in local order.
_Run = tuple[int, int]


@dataclass(frozen=True)
class ShardPiece:
    """``global_box`` of the logical tensor lies at ``local_offsets`` of the local tensor (same sizes)."""

    global_box: Box
    local_offsets: tuple[int, ...]

    def local_box(self) -> Box:
        return Box(self.local_offsets, self.global_box.sizes)


def shard_pieces(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    *,
    key: str | None = None,
) -> tuple[ShardPiece, ...]:
    """The pieces the rank at mesh ``coordinate`` holds, sorted by local offset. Pure: no process group.

    ``key`` only names the parameter in errors.
    """
    return _pieces(_dim_runs(global_shape, mesh_shape, coordinate, placements, key))


def local_shard_pieces(tensor: torch.Tensor, *, key: str | None = None) -> tuple[ShardPiece, ...]:
    """The pieces this rank holds of ``tensor``: a DTensor's by its placements, a plain tensor's whole."""
    if not isinstance(tensor, DTensor):
        return shard_pieces(tensor.shape, (), (), (), key=key)
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not part of the mesh: it holds nothing
        return ()
    spec = tensor._spec
    # Internal redistribution can record a non-default shard order on plain Shard placements; the
    # placements then no longer say the layout, so refuse rather than load wrong values.
    if not getattr(spec, "use_strided_shard_as_shard_order", True) and (
        False
    ):
        raise LayoutError(f"non-default shard order {spec.shard_order} is not supported", key=key)
    runs = _dim_runs(tensor.shape, mesh.shape, coordinate, tensor.placements, key)
    # A local tensor that disagrees with its placements (from_local with a wrong shape) would
    # otherwise be filled at wrong offsets.
    local_shape = tuple(tensor.to_local().shape)
    if local_shape != tuple(_length(r) for r in runs):
        raise LayoutError(
            f"local tensor of shape {local_shape} does not match placements {tensor.placements} "
            f"of global shape {tuple(tensor.shape)} at mesh coordinate {tuple(coordinate)}", key=key,
        )
    return _pieces(runs)


def _dim_runs(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    key: str | None,
) -> list[list[_Run]]:
    """Per tensor dim, the runs the rank holds, in local order."""
    ndim = len(global_shape)
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise LayoutError(
            f"mesh shape {tuple(mesh_shape)}, coordinate {tuple(coordinate)} and placements "
            f"{tuple(placements)} must have one entry per mesh dim", key=key,
        )
    runs: list[list[_Run]] = [[(0, int(size))] if size else [] for size in global_shape]
    for mesh_dim, (n, c, placement) in enumerate(zip(mesh_shape, coordinate, placements, strict=True)):
        if not 0 <= c < n:
            raise LayoutError(f"coordinate {tuple(coordinate)} is outside mesh {tuple(mesh_shape)}", key=key)
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard | _StridedShard):
            raise LayoutError(
                f"placement {placement} on mesh dim {mesh_dim} cannot be loaded into "
                "(only Shard, _StridedShard and Replicate can)", key=key,
            )
        if not -ndim <= placement.dim < ndim:
            raise LayoutError(f"{placement} on mesh dim {mesh_dim} names no dim of a {ndim}-d tensor", key=key)
        dim = placement.dim % ndim
        if isinstance(placement, _StridedShard):
            split_factor = int(placement.split_factor)
            if split_factor < 1:
                raise LayoutError(f"{placement} on mesh dim {mesh_dim} has split_factor < 1", key=key)
            runs[dim] = _strided_chunk(runs[dim], split_factor, n, c)
        else:
            runs[dim] = _take(runs[dim], *_chunk_bounds(_length(runs[dim]), n, c))
    return runs


def _pieces(runs: list[list[_Run]]) -> tuple[ShardPiece, ...]:
    """The products of one run per dim, in row-major (= local offset) order."""
    return tuple(
        ShardPiece(Box(tuple(g for g, _, _ in combo), tuple(s for _, s, _ in combo)), tuple(lo for _, _, lo in combo))
        for combo in itertools.product(*(_with_local_starts(r) for r in runs))
    )


def _chunk_bounds(length: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Positions ``[start, stop)`` of chunk ``index`` as ``torch.chunk`` cuts ``length`` items."""
    size = -(-length // num_chunks)
    start = min(index * size, length)
    return start, min(start + size, length)


def _strided_chunk(runs: list[_Run], split_factor: int, num_chunks: int, index: int) -> list[_Run]:
    """``_StridedShard._split_tensor``: chunk ``index`` of each of ``split_factor`` chunks, concatenated."""
    length = _length(runs)
    out: list[_Run] = []
    for j in range(split_factor):
        first, last = _chunk_bounds(length, split_factor, j)
        start, stop = _chunk_bounds(last - first, num_chunks, index)
        out.extend(_take(runs, first + start, first + stop))
    return _merge(out)


def _take(runs: list[_Run], start: int, stop: int) -> list[_Run]:
    """The runs of local positions ``[start, stop)``."""
    out: list[_Run] = []
    pos = 0
    for first, size in runs:
        lo, hi = max(start, pos), min(stop, pos + size)
        if lo < hi:
            out.append((first + lo - pos, hi - lo))
        pos += size
    return out


def _merge(runs: list[_Run]) -> list[_Run]:
    """Join runs that continue each other, so that pieces are as few and large as possible."""
    out: list[_Run] = []
    for first, size in runs:
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + size)
        else:
            out.append((first, size))
    return out


def _length(runs: list[_Run]) -> int:
    return sum(size for _, size in runs)


def _with_local_starts(runs: list[_Run]) -> list[tuple[int, int, int]]:
    """``(global start, size, local start)`` per run."""
    out = []
    local = 0
    for first, size in runs:
        out.append((first, size, local))
        local += size
    return out
