"""Symbolic tensors: run transformers' real conversion ops on index space instead of data.

A :class:`RegionTensor` stands for a tensor built from checkpoint tensors by views and
concatenations. It holds no data, only :class:`Piece` s: each piece is a small index space whose
every axis walks one dim of the traced tensor and one dim of a checkpoint tensor with fixed steps.
Running ``torch.cat``, ``torch.stack``, ``chunk``, ``split``, ``transpose``, ``view``/``reshape``
... on region tensors (through ``__torch_function__``) keeps that description exact, so the ops of
transformers stay the single source of truth for what a conversion does. Anything else raises
:class:`UntraceableOp`; the caller then falls back to running the real op on real data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch


class UntraceableOp(Exception):
    """An op that index-space tracing cannot express (math on values, unknown torch calls)."""


@dataclass(frozen=True)
class Axis:
    """One axis of a piece: ``size`` steps of ``step`` along traced ``dim`` and of ``src_step``
    along source ``src_dim``."""

    size: int
    dim: int
    step: int
    src_dim: int
    src_step: int


@dataclass(frozen=True)
class Piece:
    """Traced index ``origin + sum(i_a * step_a)`` holds source element ``src_origin + sum(i_a *
    src_step_a)`` of checkpoint tensor ``key``, for every ``i_a < axis.size``."""

    key: str
    origin: tuple[int, ...]
    src_origin: tuple[int, ...]
    axes: tuple[Axis, ...]

    @property
    def numel(self) -> int:
        return math.prod(a.size for a in self.axes)

    def extent(self, dim: int) -> int:
        """Distance from the first to the last traced index of this piece along ``dim``."""
        return sum((a.size - 1) * a.step for a in self.axes if a.dim == dim)

    def advance(self, axis: Axis, start: int, size: int) -> Piece:
        """Keep indices ``start .. start+size-1`` of ``axis`` (dropping it when one is left)."""
        origin = list(self.origin)
        origin[axis.dim] += start * axis.step
        src_origin = list(self.src_origin)
        src_origin[axis.src_dim] += start * axis.src_step
        axes = tuple(
            a for a in (replace(b, size=size) if b is axis else b for b in self.axes) if a.size > 1
        )
        return Piece(self.key, tuple(origin), tuple(src_origin), axes)


def restrict(piece: Piece, dim: int, lo: int, hi: int) -> list[Piece]:
    """The parts of ``piece`` whose traced index along ``dim`` lies in ``[lo, hi)``.

    An axis alone is cut to an interval. Several axes on one dim (after a reshape merged dims)
    are cut on the outermost: the whole blocks inside stay one piece, the at most two partial
    blocks recurse; interleaved blocks split into single indices.
    """
    first = piece.origin[dim]
    last = first + piece.extent(dim)
    if lo <= first and last < hi:
        return [piece]
    if last < lo or first >= hi:
        return []
    outer = max((a for a in piece.axes if a.dim == dim), key=lambda a: a.step)
    inner = last - first - (outer.size - 1) * outer.step
    if inner >= outer.step:
        return [part for k in range(outer.size) for part in restrict(piece.advance(outer, k, 1), dim, lo, hi)]
    k_lo = max(0, -((first - lo) // outer.step))  # ceil((lo - first) / step)
    k_hi = min(outer.size - 1, (hi - 1 - inner - first) // outer.step)
    parts = [piece.advance(outer, k_lo, k_hi - k_lo + 1)] if k_hi >= k_lo else []
    for k in {k_lo - 1, k_hi + 1} if k_hi >= k_lo else set(range(outer.size)):
        if 0 <= k < outer.size:
            parts.extend(restrict(piece.advance(outer, k, 1), dim, lo, hi))
    return parts


def _row_strides(sizes: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= s
    return strides[::-1]


def _reshape_groups(old: Sequence[int], new: Sequence[int]) -> list[tuple[range, range]]:
    """Pair runs of old and new dims with equal products (size-1 dims join any neighbour run)."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        i0, j0 = i, j
        p_old = old[i] if i < len(old) else 1
        p_new = new[j] if j < len(new) else 1
        i, j = i + 1, j + 1
        while p_old != p_new or (i < len(old) and old[i] == 1) or (j < len(new) and new[j] == 1):
            if p_old <= p_new and i < len(old):
                p_old *= old[i]
                i += 1
            elif j < len(new):
                p_new *= new[j]
                j += 1
            else:
                p_old *= old[i]
                i += 1
        groups.append((range(i0, min(i, len(old))), range(j0, min(j, len(new)))))
    return groups


Placement = tuple[list[int], list[Axis], tuple[tuple[int, int], ...]]


def _place_axes(
    flat_origin: int, axes: list[tuple[int, Axis]], new_sizes: Sequence[int], new_dims: range
) -> list[Placement]:
    """Express axes given by flat steps in the row-major digits of ``new_sizes``.

    Returns ``(digits of the origin, axes on new dims, source shifts)`` for each resulting part.
    An axis that would carry from one digit into the next is split in two where the split is
    clean, else into single indices whose source offsets become the part's source shifts.
    """
    axes = sorted(axes, key=lambda fa: -fa[0])
    strides = _row_strides(new_sizes)
    digits = [(flat_origin // r) % s for r, s in zip(strides, new_sizes)]
    placed: list[Axis] = []
    for position, (flat_step, axis) in enumerate(axes):
        u = next((u for u, r in enumerate(strides) if r <= flat_step and flat_step % r == 0), None)
        if u is not None:
            step = flat_step // strides[u]
            used = digits[u] + sum((a.size - 1) * a.step for a in placed if a.dim == new_dims[u])
            if used + (axis.size - 1) * step < new_sizes[u]:
                placed.append(replace(axis, dim=new_dims[u], step=step))
                continue
            fits = new_sizes[u] // step
            if used == 0 and new_sizes[u] % step == 0 and 1 < fits < axis.size and axis.size % fits == 0:
                inner = replace(axis, size=fits)
                outer = replace(axis, size=axis.size // fits, src_step=axis.src_step * fits)
                rest = [(flat_step * fits, outer), (flat_step, inner)]
                return _place_axes(flat_origin, axes[:position] + rest + axes[position + 1 :], new_sizes, new_dims)
        others = axes[:position] + axes[position + 1 :]
        return [
            (d, a, ((axis.src_dim, k * axis.src_step), *shift))
            for k in range(axis.size)
            for d, a, shift in _place_axes(flat_origin + k * flat_step, others, new_sizes, new_dims)
        ]
    return [(digits, placed, ())]


def _reshape_piece(piece: Piece, old: Sequence[int], new: Sequence[int]) -> list[Piece]:
    parts: list[tuple[list[int], list[Axis], tuple[int, ...]]] = [([], [], piece.src_origin)]
    for old_dims, new_dims in _reshape_groups(old, new):
        old_strides = _row_strides([old[d] for d in old_dims])
        flat_origin = sum(piece.origin[d] * r for d, r in zip(old_dims, old_strides))
        flat_axes = [
            (a.step * old_strides[a.dim - old_dims.start], a) for a in piece.axes if a.dim in old_dims
        ]
        placements = _place_axes(flat_origin, flat_axes, [new[d] for d in new_dims], new_dims)
        grown = []
        for digits, axes, src_origin in parts:
            for new_digits, new_axes, shifts in placements:
                src = list(src_origin)
                for src_dim, delta in shifts:
                    src[src_dim] += delta
                grown.append((digits + new_digits, axes + new_axes, tuple(src)))
        parts = grown
    return [Piece(piece.key, tuple(d), src, tuple(axes)) for d, axes, src in parts]


class RegionTensor(torch.Tensor):
    """A tensor of ``shape`` whose elements are described by ``pieces`` (see module docstring).

    A ``torch.Tensor`` subclass over a meta tensor, so conversion code that checks
    ``isinstance(x, torch.Tensor)`` or reads ``shape``/``ndim``/``dtype`` sees a tensor; every op
    it runs comes back here through ``__torch_function__``.
    """

    pieces: tuple[Piece, ...]
    _dims: tuple[int, ...]

    @staticmethod
    def __new__(cls, shape: Sequence[int], pieces: Sequence[Piece], dtype: torch.dtype) -> RegionTensor:
        dims = tuple(int(s) for s in shape)
        tensor = torch.Tensor._make_subclass(cls, torch.empty(dims, dtype=dtype, device="meta"))
        tensor.pieces = tuple(pieces)
        tensor._dims = dims
        return tensor

    # Shape queries answered in Python: conversion code asks them often, and through
    # __torch_function__ each would cost a dispatch (planning a 671B-parameter MoE asks ~10^6).
    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return torch.Size(self._dims)

    @property
    def ndim(self) -> int:  # type: ignore[override]
        return len(self._dims)

    def dim(self) -> int:  # type: ignore[override]
        return len(self._dims)

    def size(self, dim: int | None = None):  # type: ignore[override]
        return self.shape if dim is None else self._dims[dim]

    def numel(self) -> int:  # type: ignore[override]
        return math.prod(self._dims)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    @classmethod
    def source(cls, key: str, shape: Sequence[int], dtype: torch.dtype) -> RegionTensor:
        """The whole checkpoint tensor ``key``."""
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) == 0:
            return cls(shape, (), dtype)
        axes = tuple(Axis(s, d, 1, d, 1) for d, s in enumerate(shape) if s > 1)
        return cls(shape, (Piece(key, (0,) * len(shape), (0,) * len(shape), axes),), dtype)

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return f"RegionTensor(shape={self._dims}, pieces={len(self.pieces)})"

    def source_keys(self) -> set[str]:
        """Checkpoint keys this tensor reads from."""
        return {p.key for p in self.pieces}

    def _norm(self, dim: int) -> int:
        if not -self.ndim <= dim < max(self.ndim, 1):
            raise IndexError(f"dim {dim} out of range for shape {self._dims}")
        return dim % self.ndim if self.ndim else 0

    def narrow(self, dim: int, start: int, length: int) -> RegionTensor:
        dim = self._norm(dim)
        if start < 0:
            start += self._dims[dim]
        if not (start >= 0 and length >= 0 and start + length <= self._dims[dim]):
            raise IndexError(f"narrow({dim}, {start}, {length}) outside shape {self._dims}")
        pieces = []
        for piece in self.pieces:
            for part in restrict(piece, dim, start, start + length):
                origin = list(part.origin)
                origin[dim] -= start
                pieces.append(replace(part, origin=tuple(origin)))
        shape = list(self._dims)
        shape[dim] = length
        return RegionTensor(shape, pieces, self.dtype)

    def permute(self, *dims) -> RegionTensor:
        order = [self._norm(d) for d in (dims[0] if len(dims) == 1 and isinstance(dims[0], Sequence) else dims)]
        if sorted(order) != list(range(self.ndim)):
            raise ValueError(f"permute({order}) is not a permutation of {self.ndim} dims")
        where = {old: new for new, old in enumerate(order)}
        pieces = [
            Piece(p.key, tuple(p.origin[d] for d in order), p.src_origin,
                  tuple(replace(a, dim=where[a.dim]) for a in p.axes))
            for p in self.pieces
        ]
        return RegionTensor([self._dims[d] for d in order], pieces, self.dtype)

    def transpose(self, dim0: int, dim1: int) -> RegionTensor:
        order = list(range(self.ndim))
        d0, d1 = self._norm(dim0), self._norm(dim1)
        order[d0], order[d1] = order[d1], order[d0]
        return self.permute(order)

    def t(self) -> RegionTensor:
        return self.transpose(0, 1) if self.ndim == 2 else self

    def reshape(self, *shape) -> RegionTensor:
        new = list(shape[0] if len(shape) == 1 and isinstance(shape[0], Sequence) else shape)
        if new.count(-1) > 1:
            raise ValueError(f"reshape{tuple(new)}: only one dim can be inferred")
        if -1 in new:
            known = math.prod(s for s in new if s != -1)
            new[new.index(-1)] = self.numel() // known if known else 0
        if math.prod(new) != self.numel():
            raise ValueError(f"cannot reshape {self._dims} into {tuple(new)}")
        pieces = [part for p in self.pieces for part in _reshape_piece(p, self._dims, new)]
        return RegionTensor(new, pieces, self.dtype)

    view = reshape

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> RegionTensor:
        if self.ndim == 0:
            return self.reshape(1)
        s, e = self._norm(start_dim), self._norm(end_dim)
        return self.reshape([*self._dims[:s], math.prod(self._dims[s : e + 1]), *self._dims[e + 1 :]])

    def unflatten(self, dim: int, sizes: Sequence[int]) -> RegionTensor:
        d = self._norm(dim)
        return self.reshape([*self._dims[:d], *sizes, *self._dims[d + 1 :]])

    def unsqueeze(self, dim: int) -> RegionTensor:
        d = dim % (self.ndim + 1)
        return RegionTensor([*self._dims[:d], 1, *self._dims[d:]], _inserted_dim(self.pieces, d, 0), self.dtype)

    def squeeze(self, dim: int | Sequence[int] | None = None) -> RegionTensor:
        dims = range(self.ndim) if dim is None else [dim] if isinstance(dim, int) else dim
        drop = sorted({self._norm(d) for d in dims if self._dims[d] == 1}, reverse=True)
        result = self
        for d in drop:
            pieces = [
                Piece(p.key, p.origin[:d] + p.origin[d + 1 :], p.src_origin,
                      tuple(replace(a, dim=a.dim - (a.dim > d)) for a in p.axes))
                for p in result.pieces
            ]
            result = RegionTensor([*result._dims[:d], *result._dims[d + 1 :]], pieces, self.dtype)
        return result

    def split(self, split_size_or_sections, dim: int = 0) -> tuple[RegionTensor, ...]:
        dim = self._norm(dim)
        length = self._dims[dim]
        if isinstance(split_size_or_sections, int):
            step = split_size_or_sections
            sizes = [min(step, length - s) for s in range(0, length, step)] or [0]
        else:
            sizes = list(split_size_or_sections)
            if sum(sizes) != length:
                raise ValueError(f"split sizes {sizes} do not sum to dim {dim} of size {length}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(self.narrow(dim, s, n) for s, n in zip(starts, sizes))

    def chunk(self, chunks: int, dim: int = 0) -> tuple[RegionTensor, ...]:
        length = self._dims[self._norm(dim)]
        return self.split(max(1, -(-length // chunks)), dim)

    def contiguous(self, *args, **kwargs) -> RegionTensor:
        return self

    def clone(self, *args, **kwargs) -> RegionTensor:
        return self

    def detach(self) -> RegionTensor:
        return self

    def to(self, *args, **kwargs) -> RegionTensor:
        """Device moves are no-ops; a dtype change is recorded (the reader casts on copy)."""
        dtype = kwargs.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
        return self if dtype is None else RegionTensor(self._dims, self.pieces, dtype)

    def __getitem__(self, index) -> RegionTensor:
        index = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis for i in index):
            at = next(k for k, i in enumerate(index) if i is Ellipsis)
            fill = self.ndim - (len(index) - 1 - sum(i is None for i in index))
            index = index[:at] + (slice(None),) * fill + index[at + 1 :]
        result, dim = self, 0
        for item in index:
            if item is None:
                result, dim = result.unsqueeze(dim), dim + 1
            elif isinstance(item, int):
                size = result._dims[dim]
                result = result.narrow(dim, item % size if size else 0, 1).squeeze(dim)
            elif isinstance(item, slice) and item.step in (None, 1):
                start, stop, _ = item.indices(result._dims[dim])
                result, dim = result.narrow(dim, start, max(0, stop - start)), dim + 1
            else:
                raise UntraceableOp(f"indexing with {item!r}")
        return result

    # -- torch functions ------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func: Callable, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        handler = _TORCH_FUNCTIONS.get(name)
        if handler is None:
            raise UntraceableOp(f"torch.{name or func}")
        return handler(*args, **kwargs)


def _inserted_dim(pieces: Sequence[Piece], dim: int, at: int) -> list[Piece]:
    """``pieces`` with a new traced dim ``dim`` in which they sit at index ``at``."""
    return [
        Piece(p.key, (*p.origin[:dim], at, *p.origin[dim:]), p.src_origin,
              tuple(a if a.dim < dim else Axis(a.size, a.dim + 1, a.step, a.src_dim, a.src_step) for a in p.axes))
        for p in pieces
    ]


def _shifted(pieces: Sequence[Piece], dim: int, offset: int) -> list[Piece]:
    if not offset:
        return list(pieces)
    return [
        Piece(p.key, (*p.origin[:dim], p.origin[dim] + offset, *p.origin[dim + 1 :]), p.src_origin, p.axes)
        for p in pieces
    ]


def _symbolic(tensors: Sequence[torch.Tensor]) -> list[RegionTensor]:
    if not all(isinstance(t, RegionTensor) for t in tensors):
        raise UntraceableOp("an op mixing symbolic and real tensors")
    return list(tensors)  # type: ignore[arg-type]


def _cat(tensors: Sequence[RegionTensor], dim: int = 0) -> RegionTensor:
    tensors = _symbolic([t for t in tensors if t.shape != (0,)] or list(tensors[:1]))
    first = tensors[0]
    dim = first._norm(dim)
    for t in tensors:
        if t.ndim != first.ndim or any(a != b for d, (a, b) in enumerate(zip(t._dims, first._dims)) if d != dim):
            raise ValueError(f"cat: shapes {[t._dims for t in tensors]} do not agree off dim {dim}")
    pieces, offset = [], 0
    for t in tensors:
        pieces.extend(_shifted(t.pieces, dim, offset))
        offset += t._dims[dim]
    shape = list(first._dims)
    shape[dim] = offset
    return RegionTensor(shape, pieces, first.dtype)


def _stack(tensors: Sequence[RegionTensor], dim: int = 0) -> RegionTensor:
    tensors = _symbolic(tensors)
    first = tensors[0]
    dim = dim % (first.ndim + 1)
    if any(t._dims != first._dims for t in tensors):
        raise ValueError(f"stack: shapes {[t._dims for t in tensors]} differ")
    pieces = [p for at, t in enumerate(tensors) for p in _inserted_dim(t.pieces, dim, at)]
    return RegionTensor([*first._dims[:dim], len(tensors), *first._dims[dim:]], pieces, first.dtype)


def _method(name: str) -> Callable[..., Any]:
    return lambda tensor, *args, **kwargs: getattr(RegionTensor, name)(tensor, *args, **kwargs)


# Reading a tensor's metadata (``shape``, ``dtype``, ... go through ``__get__``) needs no tracing.
_METADATA = frozenset({"__get__", "size", "dim", "numel", "__len__", "stride", "is_contiguous", "element_size"})

_TORCH_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "cat": _cat,
    "concat": _cat,
    "concatenate": _cat,
    "stack": _stack,
    **{
        name: _method(name)
        for name in ("narrow", "permute", "transpose", "reshape", "flatten", "unflatten", "unsqueeze",
                     "squeeze", "split", "chunk", "t")
    },
}
