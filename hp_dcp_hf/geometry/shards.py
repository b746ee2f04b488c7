"""Which regions of a parameter a rank holds, and where they sit in its local tensor.

The planner reads checkpoint bytes per rank, so it must know exactly which global indices a rank's
local shard holds. DCP's own answer (``compute_local_shape_and_global_offset``: one box per rank)
is wrong for a non-contiguous ``_StridedShard`` and then loads wrong values silently, so the index
sets are computed here, as torch 2.13 lays the data out:

- every tensor dim evolves on its own, through the shardings of the mesh dims that split it; each
  re-splits the *current* local extent of that dim and keeps this rank's part;
- ``Shard(d)`` over ``n`` ranks keeps chunk ``c`` of ``torch.chunk``: chunk size ``ceil(L / n)``,
  trailing chunks smaller or empty;
- ``_StridedShard(d, split_factor=f)`` alone chunks the extent into ``f`` pieces, chunks each into
  ``n`` and keeps chunk ``c`` of every piece, concatenated (``_StridedShard._split_tensor``);
- but where ``_StridedShard`` split factors encode a shard order (``split_factor`` = product of the
  sizes of the mesh dims sharding that tensor dim before it, as FSDP2 over TP writes them), torch's
  redistribution decodes them into that order of plain ``Shard``s, and FSDP2 lays its data out so:
  we follow that, which for some uneven sizes (FSDP2 on 3+ data-parallel ranks) differs from
  ``_split_tensor`` and so from DCP's ``compute_local_shape_and_global_offset``;
- a spec may also carry that order explicitly (``DTensorSpec.shard_order``);
- ``Replicate`` leaves the extent alone; ``Partial`` holds no loadable value and is refused.

So along each tensor dim a rank holds runs of consecutive global indices, laid end to end locally;
its pieces are the products of those runs. Runs are merged whenever they continue each other, so no
two pieces could merge into one box. Pieces are never empty: a rank whose local shard is empty gets
no pieces, and has nothing to read.

Plain local shards (torch's ``CheckpointableTensor`` protocol, torch 2.14's
``torch/distributed/checkpoint/protocol.py``, what torchtitan's ``spmd_types`` backend moves to) say
their geometry themselves: a local tensor with ``global_shape`` and, per shard, ``global_offsets``,
``local_offsets`` (where it starts in the local tensor) and ``local_sizes``; several shards per
tensor, and local elements no shard covers (padding). The protocol is duck-typed (no class to derive
from), so :func:`is_checkpointable` checks the four attributes, and every question "which global
shape, which local data, which pieces" goes through this module (:func:`global_shape`,
:func:`local_tensor`, :func:`local_shard_pieces`), for DTensors, such tensors and whole plain tensors
alike.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from hp_dcp_hf.errors import LayoutError
from hp_dcp_hf.geometry.box import Box

# One run of a dim: (first global index, length); a dim's runs follow each other in local order.
_Run = tuple[int, int]
# One sharding step: (mesh dim, tensor dim, split factor); split factor 1 is a plain Shard.
_Step = tuple[int, int, int]


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
    shard_order: Sequence[tuple[int, Sequence[int]]] | None = None,
    key: str | None = None,
) -> tuple[ShardPiece, ...]:
    """The pieces the rank at mesh ``coordinate`` holds, sorted by local offset. Pure: no process group.

    ``shard_order``: a ``DTensorSpec.shard_order`` carried explicitly (``(tensor dim, mesh dims in
    the order they split it)`` entries); None reads the order from the placements, as torch does.
    ``key`` only names the parameter in errors.
    """
    steps = _steps(len(global_shape), mesh_shape, coordinate, placements, shard_order, key)
    return _pieces(_dim_runs(global_shape, mesh_shape, coordinate, steps))


CHECKPOINTABLE_FIELDS = ("global_shape", "global_offsets", "local_offsets", "local_sizes")
"""The attributes of torch's ``CheckpointableTensor`` protocol, all four present on a tensor that follows it."""


def is_checkpointable(tensor: Any) -> bool:
    """Whether ``tensor`` is a plain local tensor following torch's ``CheckpointableTensor`` protocol.

    Duck-typed, as torch checks it (a ``runtime_checkable`` protocol: the four attributes present),
    so it works on a torch without the protocol module. A DTensor is read by its placements, which
    this module computes exactly, whatever attributes it also carries.
    """
    return (isinstance(tensor, torch.Tensor) and not isinstance(tensor, DTensor)
            and all(hasattr(tensor, name) for name in CHECKPOINTABLE_FIELDS))


def global_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape of the logical tensor: a protocol tensor's ``global_shape`` (its own shape is that of
    its local buffer), a DTensor's or a plain tensor's shape."""
    if is_checkpointable(tensor):
        return tuple(int(size) for size in tensor.global_shape)
    return tuple(tensor.shape)


def global_numel(tensor: torch.Tensor) -> int:
    """The elements of the logical tensor (see :func:`global_shape`)."""
    return math.prod(global_shape(tensor))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The data this rank holds: a DTensor's local shard (a view of it), a protocol tensor's local
    buffer (detached: a parameter handed out with ``keep_vars`` is written in place), a plain tensor
    itself."""
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor.detach() if is_checkpointable(tensor) else tensor


def held_views(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Views of the local elements that hold values of the logical tensor: one per piece of a
    protocol tensor (its padding holds none), the whole local tensor otherwise (a DTensor's pieces
    tile its local shard)."""
    local = local_tensor(tensor)
    if not is_checkpointable(tensor):
        return [local]
    return [local[piece.local_box().slices()] for piece in local_shard_pieces(tensor)]


def mark_checkpointable(
    tensor: torch.Tensor,
    global_shape: Sequence[int],
    global_offsets: Sequence[Sequence[int]],
    local_offsets: Sequence[Sequence[int]],
    local_sizes: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Give ``tensor`` (a local buffer, a parameter) the protocol's attributes, checked against its
    shape (a :class:`LayoutError` names the first shard that does not fit); returns ``tensor``."""
    fields = (tuple(int(s) for s in global_shape), _entries(global_offsets), _entries(local_offsets),
              _entries(local_sizes))
    checkpointable_pieces(*fields, tuple(tensor.shape))
    for name, value in zip(CHECKPOINTABLE_FIELDS, fields, strict=True):
        setattr(tensor, name, value)
    return tensor


def keep_shard_geometry(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model.state_dict()`` hand out its protocol tensors' geometry too.

    ``state_dict()`` detaches every parameter, and a detached tensor is a new object without the
    attributes: the four are copied over from each parameter and buffer that has them (what torch's
    ``_copy_checkpointable_tensor_metadata`` does), so ``load_hf_checkpoint(model, ...)`` and
    ``save_hf_checkpoint(model, ...)`` see the shards. Registered once per model; returns ``model``.
    """
    if getattr(model, "_hp_dcp_hf_keeps_shard_geometry", False):
        return model

    def copy_geometry(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name, tensor in (*module.named_parameters(remove_duplicate=False),
                             *module.named_buffers(remove_duplicate=False)):
            entry = state_dict.get(prefix + name)
            if entry is not None and entry is not tensor and is_checkpointable(tensor):
                for field in CHECKPOINTABLE_FIELDS:
                    setattr(entry, field, getattr(tensor, field))

    model.register_state_dict_post_hook(copy_geometry)
    model._hp_dcp_hf_keeps_shard_geometry = True
    return model


def checkpointable_pieces(
    global_shape: tuple[int, ...],
    global_offsets: tuple[tuple[int, ...], ...],
    local_offsets: tuple[tuple[int, ...], ...],
    local_sizes: tuple[tuple[int, ...], ...],
    local_shape: tuple[int, ...],
    *,
    key: str | None = None,
) -> tuple[ShardPiece, ...]:
    """The pieces of a protocol tensor: one per non-empty shard, sorted by local offset. Pure.

    Raises :class:`LayoutError` for geometry that would fill wrong places: field lists of different
    lengths or ranks, a shard outside the global shape or the local tensor, and two shards of one
    rank that overlap, globally (one value twice: a save would write it twice) or locally (two
    values in one place). Padding (local elements no shard covers) is allowed.
    """
    try:
        return _checkpointable_pieces(tuple(int(s) for s in global_shape), _entries(global_offsets),
                                      _entries(local_offsets), _entries(local_sizes), tuple(local_shape))
    except LayoutError as e:
        raise LayoutError(e.reason, key=key) from None
    except (TypeError, ValueError) as e:
        raise LayoutError(f"CheckpointableTensor geometry is not integer tuples: {e}", key=key) from None


def _entries(entries: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(i) for i in entry) for entry in entries)


@functools.lru_cache(maxsize=4096)
def _checkpointable_pieces(
    shape: tuple[int, ...],
    global_offsets: tuple[tuple[int, ...], ...],
    local_offsets: tuple[tuple[int, ...], ...],
    local_sizes: tuple[tuple[int, ...], ...],
    local_shape: tuple[int, ...],
) -> tuple[ShardPiece, ...]:
    if not len(global_offsets) == len(local_offsets) == len(local_sizes):
        raise LayoutError(f"CheckpointableTensor lists {len(global_offsets)} global_offsets, {len(local_offsets)} "
                          f"local_offsets and {len(local_sizes)} local_sizes: one each per shard")
    ndim = len(shape)
    if len(local_shape) != ndim:
        raise LayoutError(f"local tensor of shape {local_shape} and global_shape {shape} differ in rank")
    if any(size < 0 for size in shape):
        raise LayoutError(f"global_shape {shape} has a negative size")
    pieces: list[ShardPiece] = []
    for i, (g, lo, sizes) in enumerate(zip(global_offsets, local_offsets, local_sizes)):
        if not len(g) == len(lo) == len(sizes) == ndim:
            raise LayoutError(f"shard {i}: global offset {g}, local offset {lo} and size {sizes} must each have "
                              f"{ndim} entries")
        if any(v < 0 for v in (*g, *lo, *sizes)):
            raise LayoutError(f"shard {i}: negative offset or size (global {g}, local {lo}, size {sizes})")
        if any(o + s > n for o, s, n in zip(g, sizes, shape)):
            raise LayoutError(f"shard {i} at global offset {g} of size {sizes} exceeds global_shape {shape}")
        if any(o + s > n for o, s, n in zip(lo, sizes, local_shape)):
            raise LayoutError(f"shard {i} at local offset {lo} of size {sizes} exceeds the local tensor's "
                              f"shape {local_shape}")
        if all(sizes):
            pieces.append(ShardPiece(Box(g, sizes), lo))
    for a, b in itertools.combinations(pieces, 2):
        if a.global_box.intersect(b.global_box) is not None:
            raise LayoutError(f"shards {a.global_box} and {b.global_box} of one rank overlap in the global tensor")
        if a.local_box().intersect(b.local_box()) is not None:
            raise LayoutError(f"shards {a.global_box} and {b.global_box} overlap in the local tensor "
                              f"(at local offsets {a.local_offsets} and {b.local_offsets})")
    return tuple(sorted(pieces, key=lambda p: (p.local_offsets, p.global_box.offsets)))


def local_shape(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Placement]
) -> tuple[int, ...]:
    """The shape of the local tensor the rank at ``coordinate`` holds. Pure: no process group."""
    steps = _steps(len(global_shape), mesh_shape, coordinate, placements, None, None)
    return tuple(sum(size for _, size in runs) for runs in _dim_runs(global_shape, mesh_shape, coordinate, steps))


def local_shard_pieces(tensor: torch.Tensor, *, key: str | None = None) -> tuple[ShardPiece, ...]:
    """The pieces this rank holds of ``tensor``: a DTensor's by its layout, a protocol tensor's by its
    shards (:func:`checkpointable_pieces`), a plain tensor's whole."""
    if is_checkpointable(tensor):
        return checkpointable_pieces(tensor.global_shape, tensor.global_offsets, tensor.local_offsets,
                                     tensor.local_sizes, tuple(tensor.shape), key=key)
    if not isinstance(tensor, DTensor):
        return shard_pieces(tensor.shape, (), (), (), key=key)
    if tensor.numel() == 0:  # nothing to hold, whatever local shape the sharding gave (FSDP2 pads)
        return ()
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not part of the mesh: it holds nothing
        return ()
    spec = tensor._spec
    # A spec may carry its shard order explicitly rather than in _StridedShard split factors
    # (redistribution with an ordered plan): then that order is the layout.
    explicit = None
    if not getattr(spec, "use_strided_shard_as_shard_order", True):
        explicit = tuple((tensor_dim, tuple(mesh_dims)) for tensor_dim, mesh_dims in spec.shard_order)
    try:
        pieces, lengths = _layout(tuple(tensor.shape), tuple(mesh.shape), tuple(coordinate),
                                  tuple(tensor.placements), explicit)
    except LayoutError as e:
        raise LayoutError(e.reason, key=key) from None
    # A local tensor that disagrees with its layout (from_local with a wrong shape, a torch layout
    # this module does not know) would otherwise be filled at wrong offsets.
    local_shape = tuple(tensor._local_tensor.shape)
    if local_shape != lengths:
        raise LayoutError(
            f"local tensor of shape {local_shape} does not match placements {tensor.placements} "
            f"of global shape {tuple(tensor.shape)} at mesh coordinate {tuple(coordinate)}", key=key,
        )
    return pieces


@functools.lru_cache(maxsize=4096)
def _layout(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
            placements: tuple[Placement, ...], shard_order: Any) -> tuple[tuple[ShardPiece, ...], tuple[int, ...]]:
    """The pieces and local shape of one layout, computed once however many tensors share it."""
    steps = _steps(len(global_shape), mesh_shape, coordinate, placements, shard_order, None)
    runs = _dim_runs(global_shape, mesh_shape, coordinate, steps)
    return _pieces(runs), tuple(_length(r) for r in runs)


def _steps(
    ndim: int,
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    shard_order: Sequence[tuple[int, Sequence[int]]] | None,
    key: str | None,
) -> list[_Step]:
    """The sharding steps in the order torch applies them."""
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise LayoutError(
            f"mesh shape {tuple(mesh_shape)}, coordinate {tuple(coordinate)} and placements "
            f"{tuple(placements)} must have one entry per mesh dim", key=key,
        )
    left_to_right: list[_Step] = []
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
        split_factor = int(placement.split_factor) if isinstance(placement, _StridedShard) else 1
        if split_factor < 1:
            raise LayoutError(f"{placement} on mesh dim {mesh_dim} has split_factor < 1", key=key)
        left_to_right.append((mesh_dim, placement.dim % ndim, split_factor))
    if shard_order is not None:
        split_factors = {mesh_dim: split_factor for mesh_dim, _, split_factor in left_to_right}
        ordered = [(m, tensor_dim, split_factors.get(m, 0)) for tensor_dim, mesh_dims in shard_order for m in mesh_dims]
        if sorted(ordered) != sorted(left_to_right):
            raise LayoutError(f"shard order {shard_order} does not match placements {tuple(placements)}", key=key)
        return ordered
    decoded = _decode_shard_order(left_to_right, mesh_shape)
    return left_to_right if decoded is None else decoded


def _decode_shard_order(steps: list[_Step], mesh_shape: Sequence[int]) -> list[_Step] | None:
    """Plain-Shard steps in the order the split factors encode, as torch's redistribution decodes them.

    None when there is no _StridedShard, or its split factors encode no order (then
    ``_StridedShard._split_tensor`` is the layout). Mirrors
    ``DTensorSpec._maybe_convert_StridedShard_to_shard_order``.
    """
    if all(split_factor == 1 for _, _, split_factor in steps):
        return None
    orders: dict[int, list[int]] = {}
    for mesh_dim, tensor_dim, split_factor in reversed(steps):
        order = orders.setdefault(tensor_dim, [])
        before = 1
        for i in range(len(order) + 1):
            if before == split_factor:
                order.insert(i, mesh_dim)
                break
            if i < len(order):
                before *= mesh_shape[order[i]]
        else:
            return None
    return [(mesh_dim, tensor_dim, 1) for tensor_dim, order in orders.items() for mesh_dim in order]


def _dim_runs(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], steps: list[_Step]
) -> list[list[_Run]]:
    """Per tensor dim, the runs the rank holds, in local order."""
    runs: list[list[_Run]] = [[(0, int(size))] if size else [] for size in global_shape]
    for mesh_dim, dim, split_factor in steps:
        runs[dim] = _strided_chunk(runs[dim], split_factor, mesh_shape[mesh_dim], coordinate[mesh_dim])
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
    """``_StridedShard._split_tensor``: chunk ``index`` of each of ``split_factor`` chunks, concatenated.

    With ``split_factor`` 1 this is ``Shard``: chunk ``index`` of the whole.
    """
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
