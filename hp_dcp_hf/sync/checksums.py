"""Per-slice checksums: what deltas compare between updates and what verification compares across
the wire. A digest is of the tensor's bytes, so it is exact for every dtype."""

from __future__ import annotations

import hashlib

import torch


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """``tensor``'s elements as bytes, row-major (a copy only when they are not contiguous already)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.stride(0) != 1:  # one element of stride 0: contiguous to torch (reshape and clone keep it)
        flat = flat.as_strided((1,), (1,))
    return memoryview(flat.view(torch.uint8).numpy())


def digest(tensor: torch.Tensor) -> str:
    """A hex digest of ``tensor``'s bytes (row-major)."""
    return hashlib.blake2b(tensor_bytes(tensor), digest_size=16).hexdigest()
