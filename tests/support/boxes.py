"""A tensor and a box inside it, drawn by hypothesis, for the byte-range tests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from hp_dcp_hf.geometry.box import Box

# Only the itemsize matters to the arithmetic; bool is left out since copies canonicalise its bytes.
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float8_e4m3fn]


@st.composite
def tensor_and_box(draw, min_size: int = 0) -> tuple[tuple[int, ...], Box, torch.dtype]:
    shape = tuple(draw(st.lists(st.integers(min_size, 5), min_size=0, max_size=4)))
    offsets, sizes = [], []
    for extent in shape:
        lo = draw(st.integers(0, extent))
        offsets.append(lo)
        sizes.append(draw(st.integers(min(min_size, extent - lo), extent - lo)))
    return shape, Box(tuple(offsets), tuple(sizes)), draw(st.sampled_from(DTYPES))
