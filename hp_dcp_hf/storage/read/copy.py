"""``copy_into``: ``dest.copy_(source)``, faster when the two walk memory in different orders.

A box read into a transposed destination (grouped-GEMM experts: ``w13[e] = cat(gate.T, up.T)``,
any ``.t()`` view a planner resolves) is a copy whose source is contiguous along one dim and whose
destination is contiguous along another. ``copy_`` walks it in the destination's order: each value
read comes from another source row, rows a power of two apart (2 KiB for a 1024-wide bf16 row), so
they all fall in the same few cache sets and evict each other. That copy runs at about 0.9 GB/s
for bf16 here, against 5-7 GB/s for the same bytes in the source's order, and it made the read
phase of the rewritten MoE model 4-5x that of the plain one.

The fix: copy a slab of source rows into scratch whose rows are one cache line longer (a plain
copy, at memory speed), then transpose from the scratch, whose rows no longer collide: 1.4-2x
``copy_`` on the MoE expert boxes (``python -m bench.transpose_copy``), a third off the read phase
of the rewritten MoE model at 4 ranks. Other fixes did worse: a ``copy_`` per 64x64 or 128x128
tile (Python overhead per tile), torch's own blocked transpose (contiguous destinations only;
~1.3 GB/s), moving rows as 8-byte units (~1.15x). Both steps are plain ``copy_`` calls (the cast,
if any, in the second), so values are bit-identical to ``copy_``. Pure torch, no torch.distributed.
"""

from __future__ import annotations

import math
import threading

import torch

_PAD_BYTES = 64
"""How much longer than a source row each scratch row is: one cache line, so that rows a power of
two apart in the source map to different cache sets in the scratch (16 bytes gained less)."""

_SLAB_BYTES = 2**20
"""Most source bytes per slab, which bounds each thread's scratch. Whole 1 MiB expert
boxes beat 256 KiB slabs by 3-25% and 64 KiB ones by 1.5-1.9x: a thin slab writes short runs of each
destination row (``python -m bench.transpose_copy --slabs ...``)."""

_MIN_BYTES = 64 * 2**10
"""Below this a single ``copy_``: a small box stays in cache anyway, and two calls per slab would
cost more than they save (not swept)."""

_local = threading.local()


def copy_into(dest: torch.Tensor, source: torch.Tensor) -> None:
    """``dest.copy_(source)`` for tensors of the same shape, values bit for bit the same.

    When ``source`` is contiguous along one dim and ``dest`` along another (a transposing copy),
    the copy goes through padded scratch, a slab at a time (see the module's docstring).
    """
    dims = _transposed_dims(dest, source)
    if dims is None:
        dest.copy_(source)
        return
    outer, inner = dims  # dest's contiguous dim, source's contiguous dim
    _copy_transposed(dest.movedim((outer, inner), (-2, -1)), source.movedim((outer, inner), (-2, -1)))


def _transposed_dims(dest: torch.Tensor, source: torch.Tensor) -> tuple[int, int] | None:
    """``(dest's unit-stride dim, source's unit-stride dim)`` when they differ and the copy is big
    enough to gain from :func:`_copy_transposed`; ``None`` for a plain ``copy_``."""
    if (
        type(dest) is not torch.Tensor
        or type(source) is not torch.Tensor
        or dest.device.type != "cpu"
        or source.device.type != "cpu"
        or dest.shape != source.shape
        or source.numel() == 0
        or source.numel() * source.element_size() < _MIN_BYTES
        or any(t.is_conj() or t.is_neg() for t in (dest, source))
        or dest.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()  # may overlap
    ):
        return None
    dest_dim = _unit_stride_dim(dest)
    source_dim = _unit_stride_dim(source)
    if dest_dim is None or source_dim is None or dest_dim == source_dim:
        return None
    return dest_dim, source_dim


def _unit_stride_dim(tensor: torch.Tensor) -> int | None:
    """The dim along which ``tensor`` is contiguous (stride 1, size > 1), if any."""
    return next((d for d in range(tensor.dim()) if tensor.stride(d) == 1 and tensor.shape[d] > 1), None)


def _copy_transposed(dest: torch.Tensor, source: torch.Tensor) -> None:
    """``dest[..., i, j] = source[..., i, j]`` where ``source`` is contiguous along the last dim and
    ``dest`` along the one before, a slab of rows ``i`` at a time: the slab copied into scratch rows
    padded by :data:`_PAD_BYTES`, then from the scratch into ``dest`` (casting if need be)."""
    *batch, rows, width = source.shape
    pad = -(-_PAD_BYTES // source.element_size())
    step = max(1, _SLAB_BYTES // (math.prod(batch) * width * source.element_size()))
    scratch = _scratch((*batch, min(step, rows), width + pad), source.dtype)[..., :width]
    for start in range(0, rows, step):
        slab = scratch[..., : min(step, rows - start), :]
        slab.copy_(source[..., start : start + step, :])
        dest[..., start : start + step, :].copy_(slab)


def _scratch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """This thread's scratch as a contiguous ``shape`` of ``dtype``: one buffer a thread, grown as
    needed and reused. A fresh one per copy leaves freed blocks in every reader thread's malloc
    arena, and resident memory grows (by 50 MiB a rank on the MoE benchmark at 4 ranks)."""
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = getattr(_local, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _local.buffer = torch.empty(nbytes, dtype=torch.uint8)
    return buffer[:nbytes].view(dtype).view(shape)
