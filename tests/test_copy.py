"""``copy_into`` writes exactly what ``copy_`` writes, bit for bit, and takes its slab route where
it should (otherwise these tests would pass through a plain ``copy_``)."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hp_dcp_hf.storage.read import copy as copy_module
from hp_dcp_hf.storage.read.copy import copy_into


@pytest.fixture
def routed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Shapes of the copies that went through the slab route, in call order."""
    calls: list[tuple[int, ...]] = []
    inner = copy_module._copy_transposed

    def spy(dest: torch.Tensor, source: torch.Tensor) -> None:
        calls.append(tuple(source.shape))
        inner(dest, source)

    monkeypatch.setattr(copy_module, "_copy_transposed", spy)
    return calls


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits viewed as ``dtype`` (NaN payloads, infinities, subnormals and all); bool as 0/1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _check(dest: torch.Tensor, source: torch.Tensor) -> None:
    """``copy_into(dest, source)`` leaves ``dest``'s whole storage as ``copy_`` does (untouched
    elements included)."""
    base = dest._base if dest._base is not None else dest
    expected_base = torch.empty_like(base).copy_(base)
    expected = expected_base.as_strided(dest.shape, dest.stride(), dest.storage_offset())
    expected.copy_(source)
    copy_into(dest, source)
    assert torch.equal(_bits(base), _bits(expected_base))


DTYPES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.float32, torch.float32),
    (torch.float8_e4m3fn, torch.float8_e4m3fn),
    (torch.float8_e4m3fn, torch.bfloat16),
    (torch.int16, torch.int16),
    (torch.uint8, torch.int32),
    (torch.bool, torch.bool),
]


@pytest.mark.parametrize(("source_dtype", "dest_dtype"), DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_expert_boxes_into_transposed_views(source_dtype, dest_dtype, routed, monkeypatch):
    """The grouped-GEMM layout: gate/up ``[I, H]`` into ``w13[e, :, :I].t()`` / ``[:, I:]``, down
    ``[H, I]`` into ``w2[e].t()``."""
    monkeypatch.setattr(copy_module, "_MIN_BYTES", 0)  # 1-byte dtypes: boxes of 32 KiB
    experts, hidden, inter = 3, 256, 128
    w13 = _random((experts, hidden, 2 * inter), dest_dtype, seed=1)
    w2 = _random((experts, inter, hidden), dest_dtype, seed=2)
    for e in range(experts):
        _check(w13[e, :, :inter].t(), _random((inter, hidden), source_dtype, seed=10 + e))
        _check(w13[e, :, inter:].t(), _random((inter, hidden), source_dtype, seed=20 + e))
        _check(w2[e].t(), _random((hidden, inter), source_dtype, seed=30 + e))
    assert len(routed) == 3 * experts


def test_many_slabs(monkeypatch, routed):
    """A slab smaller than the copy: several slabs, the last one partial."""
    monkeypatch.setattr(copy_module, "_MIN_BYTES", 0)
    monkeypatch.setattr(copy_module, "_SLAB_BYTES", 3 * 104 * 2)  # 3 rows of the source a slab
    source = _random((64, 104), torch.bfloat16)  # 21 full slabs and one of 1 row
    _check(torch.zeros(104, 64, dtype=torch.bfloat16).t(), source)
    assert routed == [(64, 104)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float64], ids=str)
def test_batched_and_strided_boxes(monkeypatch, routed, dtype):
    """3-D boxes (a batch dim copied whole), sources cut from a larger tensor at odd offsets and
    widths (row stride above the row length), destinations whose transposed dims are not the last
    two, and a batch too large for one row a slab."""
    monkeypatch.setattr(copy_module, "_MIN_BYTES", 0)
    full = _random((4, 40, 99), dtype)
    source = full[1:3, 8:40, 17:80]  # [2, 32, 63], strides (3960, 99, 1)
    _check(torch.zeros(63, 2, 32, dtype=torch.float32).permute(1, 2, 0), source)  # unit stride on dim 1
    _check(torch.zeros(63, 2, 32, dtype=dtype), source.permute(2, 0, 1))  # dims 2 and 0
    _check(torch.zeros(63, 32, 2, dtype=dtype), source.transpose(0, 2))  # a batch dim between them
    monkeypatch.setattr(copy_module, "_SLAB_BYTES", 1)
    _check(torch.zeros(63, 2, 32, dtype=dtype).permute(1, 2, 0), source)
    assert len(routed) == 4


@pytest.mark.parametrize("case", ["small", "same order", "overlap", "conj", "subclass"])
def test_plain_copy_otherwise(case, routed):
    """Every copy the slab route does not take is one ``copy_``, with the same values."""
    source = _random((130, 512), torch.bfloat16)
    dest = torch.zeros(512, 130, dtype=torch.bfloat16).t()
    if case == "small":
        source, dest = source[:8, :8], torch.zeros(8, 8, dtype=torch.bfloat16).t()
    elif case == "same order":
        dest = torch.zeros(130, 512, dtype=torch.bfloat16)
    elif case == "overlap":
        storage = torch.zeros(2 * 130 * 512, dtype=torch.bfloat16)
        storage[: 130 * 512].view(130, 512).copy_(source)
        source, dest = storage[: 130 * 512].view(130, 512), storage[130 * 512 :].view(512, 130).t()
    elif case == "conj":
        source = torch.randn(130, 512, dtype=torch.complex64).conj()
        dest = torch.zeros(512, 130, dtype=torch.complex64).t()
    else:
        source = torch.nn.Parameter(source.float(), requires_grad=False)
        dest = torch.zeros(512, 130).t()
    _check(dest, source)
    assert routed == []


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 24), min_size=2, max_size=4),
    data=st.data(),
    dtypes=st.sampled_from(DTYPES),
)
def test_any_layout(sizes, data, dtypes):
    """Random boxes of random tensors copied into random permutations of a destination."""
    ndim = len(sizes)
    source_dtype, dest_dtype = dtypes
    full = [s + data.draw(st.integers(0, 8)) for s in sizes]
    offsets = [data.draw(st.integers(0, f - s)) for f, s in zip(full, sizes)]
    source = _random(tuple(full), source_dtype, seed=data.draw(st.integers(0, 99)))
    source = source[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    order = data.draw(st.permutations(range(ndim)))
    dest = torch.zeros([sizes[d] for d in order], dtype=dest_dtype).permute(*[order.index(d) for d in range(ndim)])
    with patch.object(copy_module, "_MIN_BYTES", 0):
        _check(dest, source)
