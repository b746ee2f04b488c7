"""Checksums of slices of checkpoint tensors: what two sides compare instead of the bytes.

A trainer and an engine (or a model and its checkpoint) hold the same slice of a Hugging Face
tensor in different processes; comparing a short digest of each side's bytes is exact (a digest of
the dtype's bytes, so ``-0.0`` differs from ``0.0`` and one NaN payload from another, where
``torch.equal`` would call NaNs unequal and signed zeros equal) and costs a few bytes per slice on
the wire. Pure: no ``torch.distributed``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hp_dcp_hf.geometry.box import Box

DIGEST_BYTES = 16
"""blake2b digest length: 128 bits, far beyond any chance collision over a model's slices."""


def digest(tensor: torch.Tensor) -> str:
    """The hex blake2b digest of ``tensor``'s bytes in row-major order, its dtype and shape with them
    (the same bytes read as another dtype or shape are another slice). Deterministic across
    processes and machines; a non-contiguous or non-CPU tensor is copied to contiguous host memory
    first."""
    values = tensor.detach()
    if values.device.type != "cpu" or not values.is_contiguous():
        values = values.to("cpu", memory_format=torch.contiguous_format).contiguous()
    hasher = hashlib.blake2b(digest_size=DIGEST_BYTES)
    hasher.update(f"{str(values.dtype).removeprefix('torch.')}{list(values.shape)}".encode())
    if values.numel():
        # a byte view of the storage: hashlib reads it in place, whatever the dtype (bf16, fp8, bool)
        hasher.update(memoryview(values.reshape(-1).view(torch.uint8).numpy()))
    return hasher.hexdigest()


@dataclass(frozen=True)
class SliceDigest:
    """The digest of box ``box`` of checkpoint tensor ``name``, as one side holds it."""

    name: str
    box: Box
    digest: str


@dataclass(frozen=True)
class Mismatch:
    """A slice whose two sides differ: ``expected`` is the reference side's digest (the checkpoint's,
    the trainer's), ``actual`` the checked side's; either is None where that side lacks the slice."""

    name: str
    box: Box
    expected: str | None
    actual: str | None


def mismatches(expected: Iterable[SliceDigest], actual: Iterable[SliceDigest]) -> list[Mismatch]:
    """Every slice, keyed by ``(name, box)``, whose digests differ or which only one side has, in
    ``expected``'s order (then ``actual``'s extras). The two sides must cut tensors into the same
    boxes: a slice cut differently on the other side is two one-sided mismatches, never a match."""
    theirs = {(d.name, d.box): d.digest for d in actual}
    found = []
    for ours in expected:
        other = theirs.pop((ours.name, ours.box), None)
        if other != ours.digest:
            found.append(Mismatch(ours.name, ours.box, ours.digest, other))
    found.extend(Mismatch(name, box, None, other) for (name, box), other in theirs.items())
    return found
