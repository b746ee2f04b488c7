"""The block grid arithmetic the FP8 decode (load) and encode (save) share, against brute force."""

from __future__ import annotations

import itertools

import pytest

from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.quant.grid import (
    bands,
    block_size,
    covering_blocks,
    scale_grid,
    scale_name,
    starting_blocks,
    whole_blocks,
)


def _blocks_of(box: Box, block: tuple[int, int]) -> set[tuple[int, int]]:
    rows = range(box.offsets[0], box.ends[0])
    columns = range(box.offsets[1], box.ends[1])
    return {(r // block[0], c // block[1]) for r, c in itertools.product(rows, columns)}


def _cells(box: Box | None) -> set[tuple[int, ...]]:
    if box is None:
        return set()
    return set(itertools.product(*(range(o, e) for o, e in zip(box.offsets, box.ends))))


@pytest.mark.parametrize("block", [(4, 4), (3, 5), (1, 7)])
def test_covering_and_starting_blocks_match_brute_force(block):
    for r0, nr, c0, nc in itertools.product(range(0, 9, 2), range(1, 8, 3), range(0, 11, 3), range(1, 9, 4)):
        box = Box((r0, c0), (nr, nc))
        touched = _blocks_of(box, block)
        assert _cells(covering_blocks(box, block)) == touched
        first_elements = {(r, c) for r, c in touched if r * block[0] >= r0 and c * block[1] >= c0}
        assert _cells(starting_blocks(box, block)) == first_elements


def test_leading_dims_map_one_to_one():
    box = Box((2, 5, 9), (3, 4, 8))
    assert covering_blocks(box, (4, 8)) == Box((2, 1, 1), (3, 2, 2))
    assert starting_blocks(box, (4, 8)) == Box((2, 2, 2), (3, 1, 1))
    assert starting_blocks(Box((0, 1, 1), (1, 2, 2)), (4, 4)) is None  # no block starts inside
    assert scale_grid((8, 600, 130), (128, 128)) == (8, 5, 2)


def test_bands_cut_at_block_borders():
    assert bands(5, 14, 4) == [(0, 3, 0, 1), (3, 11, 1, 3), (11, 14, 3, 4)]
    assert bands(4, 8, 4) == [(0, 8, 0, 2)]
    assert bands(5, 2, 4) == [(0, 2, 0, 1)]
    for start, size, block in itertools.product(range(9), range(1, 13), (1, 3, 4)):
        out = bands(start, size, block)
        assert [lo for lo, *_ in out] == [0, *(hi for _, hi, *_ in out[:-1])] and out[-1][1] == size
        for lo, hi, s0, s1 in out:
            scales = {(start + i) // block - start // block for i in range(lo, hi)}
            assert scales == set(range(s0, s1)) and (hi - lo) % (s1 - s0) == 0


def test_names_and_block_sizes():
    assert scale_name("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight_scale_inv"
    assert scale_name("model.layers.0.mlp.experts.gate_up_proj") == "model.layers.0.mlp.experts.gate_up_proj_scale_inv"
    assert block_size([128, 64]) == (128, 64)
    assert block_size(None) is None and block_size([128]) is None and block_size([0, 128]) is None
    assert block_size([128.0, 128]) is None
    assert whole_blocks((256, 128), (128, 128)) and not whole_blocks((200, 128), (128, 128))
    assert not whole_blocks((128,), (128, 128))
