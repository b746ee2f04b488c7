"""Checksums of slices of checkpoint tensors: what two sides compare instead of the bytes.

A trainer and an engine (or a model and its checkpoint) hold the same slice of a Hugging Face
tensor in different processes; comparing a short digest of each side's bytes is exact (a digest of
the dtype's bytes, so ``-0.0`` differs from ``0.0`` and one NaN payload from another, where
``torch.equal`` would call NaNs unequal and signed zeros equal) and costs a few bytes per slice on
the wire. Pure: no ``torch.distributed``.
"""

from __future__ import annotations

import hashlib

import torch

DIGEST_BYTES = 16
"""blake2b digest length: 128 bits, far beyond any chance collision over a model's slices."""


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """``tensor``'s elements as bytes in row-major order, whatever the dtype (bf16, fp8, bool): a view
    of its storage when it is contiguous host memory, else of a contiguous host copy."""
    flat = tensor.detach().to("cpu").reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.stride(0) != 1:  # a strided view; or one element of stride 0, which torch calls contiguous
        flat = flat.as_strided((1,), (1,)) if flat.numel() == 1 else flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy())


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"``: a dtype as digests and the wire name it."""
    return str(dtype).removeprefix("torch.")


def digest(tensor: torch.Tensor) -> str:
    """The hex blake2b digest of ``tensor``'s bytes in row-major order, its dtype and shape with them
    (the same bytes read as another dtype or shape are another slice). Deterministic across
    processes and machines."""
    hasher = hashlib.blake2b(digest_size=DIGEST_BYTES)
    hasher.update(f"{dtype_name(tensor.dtype)}{list(tensor.shape)}".encode())
    hasher.update(tensor_bytes(tensor))
    return hasher.hexdigest()
