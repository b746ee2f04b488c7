"""The needs of a cooperative load in the integer form ranks gather: every stored tensor by index
(:class:`Tensors`) and each rank's boxes of them (:class:`Needs`), one int64 row a box; and the
one sortable integer a (file, byte) pair becomes (:func:`byte_key`). Pure numpy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hp_dcp_hf.geometry.box import Box


@dataclass(frozen=True)
class StoredTensor:
    """Where one stored tensor's bytes are: ``file`` (an index into the plan's files), its first
    byte, shape and element size."""

    file: int
    data_start: int
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Need:
    """A box (in the stored tensor's coordinates) of stored tensor ``tensor`` that a rank reads."""

    tensor: int
    box: Box


class Tensors:
    """The stored tensors as arrays, shapes padded at the front to the largest rank (a padded box
    starts at 0 and spans 1 there: its bytes are the same)."""

    def __init__(self, tensors: Sequence[StoredTensor]) -> None:
        self.stored = list(tensors)
        self.ndim = max([len(t.shape) for t in self.stored] + [1])
        count, ndim = len(self.stored), self.ndim
        self.file = np.asarray([t.file for t in self.stored], dtype=np.int64)
        self.data_start = np.asarray([t.data_start for t in self.stored], dtype=np.int64)
        self.itemsize = np.asarray([t.itemsize for t in self.stored], dtype=np.int64)
        self.rank = np.asarray([len(t.shape) for t in self.stored], dtype=np.int64)
        self.shape = np.ones((count, ndim), dtype=np.int64)
        for i, t in enumerate(self.stored):
            if t.shape:
                self.shape[i, ndim - len(t.shape) :] = t.shape
        # byte strides: each dim's step is the bytes of one index of it (the product of the dims
        # after it: no division, so a tensor with an empty dim has them too)
        inner = np.ones_like(self.shape)
        inner[:, :-1] = np.flip(np.cumprod(np.flip(self.shape[:, 1:], 1), 1), 1)
        self.strides = inner * self.itemsize[:, None]
        self.nbytes = self.shape.prod(1) * self.itemsize
        self.key = byte_key(self.file, self.data_start)  # each tensor's first byte as a key

    def __len__(self) -> int:
        return len(self.stored)


@dataclass(frozen=True)
class Needs:
    """One rank's needs as one int64 array, in its order: row ``i`` is need ``i``'s stored tensor,
    then its box's offsets and sizes (padded at the front, as :class:`Tensors` pads shapes): the
    form ranks gather, kept as is."""

    rows: np.ndarray

    @classmethod
    def of(cls, needs: Sequence[Need] | Needs, table: Tensors) -> Needs:
        if isinstance(needs, Needs):
            return needs
        rows = np.zeros((len(needs), 1 + 2 * table.ndim), dtype=np.int64)
        rows[:, 1 + table.ndim :] = 1
        for i, need in enumerate(needs):
            pad = table.ndim - need.box.ndim
            rows[i, 0] = need.tensor
            rows[i, 1 + pad : 1 + table.ndim] = need.box.offsets
            rows[i, 1 + table.ndim + pad :] = need.box.sizes
        return cls(rows)

    @classmethod
    def from_rows(cls, rows: np.ndarray, table: Tensors) -> Needs:
        return cls(rows.reshape(-1, 1 + 2 * table.ndim))

    @property
    def tensor(self) -> np.ndarray:
        return self.rows[:, 0]

    @property
    def offsets(self) -> np.ndarray:
        return self.rows[:, 1 : 1 + self.rows.shape[1] // 2]

    @property
    def sizes(self) -> np.ndarray:
        return self.rows[:, 1 + self.rows.shape[1] // 2 :]

    def __len__(self) -> int:
        return len(self.tensor)

    def box(self, i: int, table: Tensors) -> Box:
        """Need ``i``'s box in its tensor's own rank."""
        rank = int(table.rank[self.tensor[i]])
        offsets, sizes = self.offsets[i].tolist(), self.sizes[i].tolist()
        return Box(tuple(offsets[len(offsets) - rank :]), tuple(sizes[len(sizes) - rank :])) if rank else Box((), ())

    def nbytes(self, table: Tensors) -> int:
        """The bytes of every need, summed."""
        return int(self.byte_counts(table).sum())

    def byte_counts(self, table: Tensors) -> np.ndarray:
        """Each need's bytes (a column at a time: numpy multiplies short rows slowly, a million of them)."""
        counts = table.itemsize[self.tensor]
        for d in range(table.ndim):
            counts *= self.rows[:, 1 + table.ndim + d]
        return counts

    def extents(self, table: Tensors) -> tuple[np.ndarray, np.ndarray]:
        """Each need's first and last byte (exclusive) as sortable keys (:func:`byte_key`: file, byte)."""
        t, ndim = self.tensor, table.ndim
        first, last = table.key[t], table.itemsize[t]  # last: the extent's length until first is added
        for d in range(ndim):  # a column at a time: numpy sums short rows slowly, a million of them
            stride = table.strides[:, d][t]
            first += self.rows[:, 1 + d] * stride  # in place: fewer fresh arrays of a million entries
            last += (self.rows[:, 1 + ndim + d] - 1) * stride
        last += first
        return first, last

    def byte_runs(self, table: Tensors) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every need's byte ranges at once, as :func:`~hp_dcp_hf.storage.format.ranges.box_byte_runs`
        gives them one box at a time (a call per need costs more than the arithmetic at a thousand
        needs a rank, and the plan routes a thousand ranks): per range, its need, its first byte in
        the file, its length and where it lands in the need's buffer; in need, then row-major order.
        Raises ``ValueError`` when a box is not inside its tensor."""
        t, offsets, sizes = self.tensor, self.offsets, self.sizes
        shape, strides = table.shape[t], table.strides[t]
        if len(t) and (np.any(offsets < 0) or np.any(sizes < 0) or np.any(offsets + sizes > shape)):
            raise ValueError("a needed box is not inside its tensor")
        ndim = shape.shape[1]
        cuts = sizes < shape
        # the last dim a box cuts: it is one range per index of the dims before it (-1: one range)
        cut = np.where(cuts.any(1), ndim - 1 - np.argmax(cuts[:, ::-1], 1), -1)
        outer = np.where(np.arange(ndim) < cut[:, None], sizes, 1)
        counts = np.where((sizes == 0).any(1), 0, outer.prod(1))
        at = np.maximum(cut, 0)
        run = np.where(cut >= 0, sizes[np.arange(len(t)), at] * strides[np.arange(len(t)), at], table.nbytes[t])
        need = np.repeat(np.arange(len(t)), counts)
        index = np.arange(len(need)) - np.repeat(np.cumsum(counts) - counts, counts)  # a range's index in its need
        start = (table.data_start[t] + (offsets * strides).sum(1))[need]
        rest = index
        for d in range(ndim - 1, -1, -1):  # the index's digits in row-major order, outer dims only
            size = outer[need, d]
            start = start + rest % size * strides[need, d]
            rest = rest // size
        return need, start, run[need], index * run[need]


def encode_needs(needs: Sequence[Need] | Needs, tensors: Sequence[StoredTensor] | Tensors) -> np.ndarray:
    """``needs`` as one flat int64 array (tensor index, padded offsets, padded sizes each): what
    ranks gather."""
    return Needs.of(needs, table_of(tensors)).rows.reshape(-1)


def decode_needs(flat: np.ndarray, tensors: Sequence[StoredTensor] | Tensors) -> Needs:
    """The inverse of :func:`encode_needs`."""
    return Needs.from_rows(np.asarray(flat, dtype=np.int64), table_of(tensors))


def table_of(tensors: Sequence[StoredTensor] | Tensors) -> Tensors:
    return tensors if isinstance(tensors, Tensors) else Tensors(tensors)



FILE_SHIFT = 43
BYTE_MASK = (1 << FILE_SHIFT) - 1


def byte_key(file, position):
    """One sortable integer per (file, byte): files are far below 2**20, bytes below 2**43 (a page
    of a key is a page of its byte)."""
    return np.asarray(file, dtype=np.int64) * (1 << FILE_SHIFT) + np.asarray(position, dtype=np.int64)

