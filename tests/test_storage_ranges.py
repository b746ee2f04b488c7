"""Box -> byte ranges against real tensor bytes, box splitting, and coalescing into requests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hp_dcp_hf.geometry.box import Box, disjoint_cover, flat_range_boxes
from hp_dcp_hf.storage.format.ranges import (
    Piece,
    box_byte_ranges,
    box_span,
    coalesce,
    count_requests,
    split_box,
)
from tests.support.boxes import tensor_and_box


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _source(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bytes]:
    """A tensor whose every byte differs from its neighbours, and its bytes in memory order."""
    numel = math.prod(shape)
    raw = (torch.arange(numel * dtype.itemsize) % 251).to(torch.uint8)
    tensor = raw.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)
    return tensor, _bytes(tensor)


@settings(max_examples=150, deadline=None)
@given(tensor_and_box())
def test_ranges_read_exactly_the_slice(case) -> None:
    shape, box, dtype = case
    tensor, data = _source(shape, dtype)
    ranges = box_byte_ranges(shape, dtype.itemsize, box)
    assert b"".join(data[s:e] for s, e in ranges) == _bytes(tensor[box.slices()])
    # Fewest runs: contiguous boxes are one range, and runs never touch (else they would be one).
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(ranges, ranges[1:], strict=False))
    cut = [d for d in range(len(shape)) if box.sizes[d] < shape[d]]
    expected = 0 if box.is_empty() else math.prod(box.sizes[: cut[-1]]) if cut else 1
    assert len(ranges) == expected


@settings(max_examples=200, deadline=None)
@given(tensor_and_box(), st.integers(-3, 700), st.integers(-3, 700))
def test_flat_range_boxes_are_exactly_the_flat_range(case, start, stop) -> None:
    shape = case[0]
    numel = math.prod(shape)
    boxes = flat_range_boxes(shape, start, stop)
    flat = torch.arange(numel).reshape(shape) if numel else torch.empty(shape, dtype=torch.int64)
    covered = [i for b in boxes for i in flat[b.slices()].reshape(-1).tolist()]
    assert covered == list(range(max(start, 0), min(stop, numel)))  # each once, in flat order
    assert all(not b.is_empty() for b in boxes) and len(boxes) <= max(1, 2 * len(shape) - 1)


@settings(max_examples=150, deadline=None)
@given(tensor_and_box())
def test_box_span_summarises_the_ranges(case) -> None:
    shape, box, dtype = case
    ranges = box_byte_ranges(shape, dtype.itemsize, box)
    expected = (ranges[0][0], ranges[-1][1], len(ranges)) if ranges else (0, 0, 0)
    assert box_span(shape, dtype.itemsize, box) == expected


@settings(max_examples=150, deadline=None)
@given(st.lists(tensor_and_box(), min_size=1, max_size=4), st.integers(0, 3))
def test_count_requests_matches_coalescing(cases, same_tensor: int) -> None:
    """Boxes of one tensor (maybe interleaving) or of tensors laid end to end, as in a file."""
    shape = cases[0][0]
    itemsize = 2
    boxes = [box for s, box, _ in cases if s == shape] if same_tensor else [box for _, box, _ in cases]
    shapes = [shape] * len(boxes) if same_tensor else [s for s, _, _ in cases]
    starts = [0] * len(boxes) if same_tensor else [sum(math.prod(s) * itemsize for s in shapes[:i]) for i in range(len(shapes))]
    spans, pieces = [], []
    for start, s, box in zip(starts, shapes, boxes, strict=True):
        first, last, count = box_span(s, itemsize, box)
        spans.append((start + first, start + last, count))
        pieces += [Piece(start + a, start + b, len(pieces), 0) for a, b in box_byte_ranges(s, itemsize, box)]
    counted = count_requests(spans)
    if counted is None:  # only when spans overlap
        assert any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1 :] if a[2] and b[2])
    else:
        assert counted == len(coalesce(pieces, 0))


def test_count_requests_examples() -> None:
    assert count_requests([(0, 10, 1), (10, 20, 1), (30, 40, 2)]) == 3  # the first two touch: one request
    assert count_requests([(30, 40, 2), (0, 10, 1)]) == 3
    assert count_requests([(0, 0, 0)]) == 0
    assert count_requests([(0, 40, 4), (5, 35, 3)]) is None  # interleaving rows: coalesce them


def test_contiguous_and_row_examples() -> None:
    shape = (4, 6, 5)
    assert box_byte_ranges(shape, 4, Box((1, 0, 0), (2, 6, 5))) == [(120, 360)]
    assert box_byte_ranges(shape, 4, Box((1, 2, 0), (1, 3, 5))) == [(160, 220)]
    assert box_byte_ranges(shape, 2, Box((0, 0, 1), (2, 1, 2))) == [(2, 6), (62, 66)]
    assert box_byte_ranges((), 8, Box((), ())) == [(0, 8)]
    assert box_byte_ranges(shape, 4, Box((0, 0, 0), (0, 6, 5))) == []
    with pytest.raises(ValueError, match="not inside"):
        box_byte_ranges(shape, 4, Box((3, 0, 0), (2, 6, 5)))


@settings(max_examples=100, deadline=None)
@given(tensor_and_box(min_size=1), st.integers(1, 64), st.booleans())
def test_split_box_bounds_bytes_and_keeps_row_major_order(case, budget_elements: int, bound_span: bool) -> None:
    shape, box, dtype = case
    budget = budget_elements * dtype.itemsize
    parts = split_box(box, dtype.itemsize, budget, shape if bound_span else None)
    assert all(p.numel * dtype.itemsize <= budget for p in parts)
    if bound_span:  # first to last byte, holes included: what a mapped copy of the part touches
        spans = [box_span(shape, dtype.itemsize, p) for p in parts]
        assert all(last - first <= budget for first, last, _ in spans)
    assert disjoint_cover([p.relative_to(box.offsets) for p in parts], box.sizes)
    # Parts in order are the box's bytes in order: a staged part can be copied as it arrives.
    _, data = _source(shape, dtype)
    whole = b"".join(data[s:e] for s, e in box_byte_ranges(shape, dtype.itemsize, box))
    pieces = [data[s:e] for p in parts for s, e in box_byte_ranges(shape, dtype.itemsize, p)]
    assert b"".join(pieces) == whole


def test_split_box_cuts_rows_then_columns() -> None:
    assert split_box(Box((0, 0), (4, 8)), 4, 64) == [Box((0, 0), (2, 8)), Box((2, 0), (2, 8))]
    assert split_box(Box((0, 0), (1, 8)), 4, 12) == [
        Box((0, 0), (1, 3)),
        Box((0, 3), (1, 3)),
        Box((0, 6), (1, 2)),
    ]
    with pytest.raises(ValueError, match="smaller than one"):
        split_box(Box((0,), (4,)), 8, 4)
    # half the columns of 4 rows of 8: 16 bytes of data, but each row starts 32 bytes after the last
    assert split_box(Box((0, 0), (4, 4)), 4, 64) == [Box((0, 0), (4, 4))]
    assert split_box(Box((0, 0), (4, 4)), 4, 64, shape=(4, 8)) == [Box((0, 0), (2, 4)), Box((2, 0), (2, 4))]


def _pieces(spans: list[tuple[int, int]]) -> list[Piece]:
    return [Piece(s, e, owner=i, offset=0) for i, (s, e) in enumerate(spans)]


def test_coalesce_gap_zero_merges_only_touching() -> None:
    requests = coalesce(_pieces([(10, 20), (0, 10), (25, 30), (30, 31)]))
    assert [(r.start, r.end) for r in requests] == [(0, 20), (25, 31)]
    assert [[p.owner for p in r.pieces] for r in requests] == [[1, 0], [2, 3]]


def test_coalesce_with_gap_reads_and_drops_gap_bytes() -> None:
    spans = [(0, 10), (14, 20), (30, 40), (100, 110)]
    assert [(r.start, r.end) for r in coalesce(_pieces(spans), gap=4)] == [(0, 20), (30, 40), (100, 110)]
    assert [(r.start, r.end) for r in coalesce(_pieces(spans), gap=10)] == [(0, 40), (100, 110)]
    assert coalesce(_pieces(spans), gap=10)[0].nbytes == 40


def test_coalesce_keeps_overlapping_pieces_apart() -> None:
    requests = coalesce(_pieces([(0, 10), (5, 8), (10, 12)]), gap=100)
    assert [[p.owner for p in r.pieces] for r in requests] == [[0], [1, 2]]
    with pytest.raises(ValueError):
        coalesce([], gap=-1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 20)), max_size=30), st.integers(0, 30))
def test_coalesce_invariants(spans, gap: int) -> None:
    pieces = _pieces([(s, s + n) for s, n in spans])
    requests = coalesce(pieces, gap=gap)
    served = [p for r in requests for p in r.pieces]
    assert sorted(served, key=lambda p: p.owner) == pieces
    for r in requests:
        assert r.start == r.pieces[0].start and r.end == r.pieces[-1].end
        for a, b in zip(r.pieces, r.pieces[1:], strict=False):
            assert 0 <= b.start - a.end <= gap
