"""Slice checksums: a digest of a tensor's bytes, exact to the bit and independent of its memory layout,
and the comparison of two sides' digests."""

from __future__ import annotations

import hashlib

import torch

from hp_dcp_hf.sync.checksums import digest


def test_digest_is_of_the_bytes_with_dtype_and_shape():
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    expected = hashlib.blake2b(b"float32[3, 4]" + values.numpy().tobytes(), digest_size=16).hexdigest()
    assert digest(values) == expected
    assert digest(values.clone()) == expected  # the same on a copy
    assert digest(values.reshape(4, 3)) != expected  # same bytes, another shape
    assert digest(values.view(torch.int32)) != expected  # same bytes, another dtype


def test_digest_ignores_the_memory_layout():
    values = torch.randn(5, 6)
    assert digest(values.t()) == digest(values.t().contiguous())
    assert digest(values[1:4, ::2]) == digest(values[1:4, ::2].clone())


def test_digest_is_bit_exact_where_equality_is_not():
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))  # torch.equal calls them equal
    nan = torch.tensor([float("nan")])
    assert digest(nan) == digest(nan.clone())  # torch.equal calls NaN unequal to itself
    flipped = torch.tensor([1.0], dtype=torch.bfloat16)
    flipped.view(torch.int16)[0] ^= 1  # the lowest mantissa bit
    assert digest(flipped) != digest(torch.tensor([1.0], dtype=torch.bfloat16))


def test_digest_reads_every_dtype():
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.bool, torch.int64):
        values = torch.ones(3, dtype=dtype)
        assert digest(values) == digest(values.clone())
        assert digest(torch.zeros(0, dtype=dtype)) != digest(torch.zeros(0, 1, dtype=dtype))
    assert digest(torch.tensor(2.0)) != digest(torch.tensor([2.0]))  # 0-d is its own shape


def test_digest_of_one_element_of_stride_zero():
    """torch calls a one-element view of stride 0 contiguous, and its byte view refuses it."""
    values = torch.arange(4.0)
    assert digest(values[2:3].as_strided((1,), (0,), 2)) == digest(torch.tensor([2.0]))
