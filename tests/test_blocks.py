"""Read blocks fill a shard's box exactly once, from exactly the source boxes it needs."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.mapping.blocks import read_blocks
from hp_dcp_hf.mapping.structure import Bound, Structure


def _traced(fn, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Bound:
    """``fn`` traced over one slot per source, bound to the sources' keys."""
    inputs = [Structure.source(shape, dtype).shifted(i) for i, (shape, dtype) in enumerate(specs.values())]
    return Bound(Structure(fn(*inputs), tuple(len(shape) for shape, _ in specs.values())), tuple(specs))


def _fill(traced, real, box):
    local = torch.full(box.sizes, float("nan"), dtype=torch.float64)
    blocks = read_blocks(traced, box, (0,) * box.ndim)
    assert read_blocks(traced, box, (0,) * box.ndim) == blocks  # the second time from the structure's cache
    for block in blocks:
        src = real[block.key][block.source_box.slices()]
        assert tuple(src.shape) == tuple(a.size for a in block.view)
        dest = local.as_strided(
            [a.size for a in block.view],
            [a.step * local.stride(a.dim) for a in block.view],
            sum(o * s for o, s in zip(block.origin, local.stride())),
        )
        assert not dest.isfinite().any(), "an element is read twice"
        dest.copy_(src)
    return local, blocks


CASES = {
    "rope": ([(24, 6)], lambda t: t.view(3, 4, 2, 6).transpose(1, 2).reshape(24, 6)),
    "qkv": ([(8, 6), (4, 6), (4, 6)], lambda q, k, v: torch.cat([q, k, v], dim=0)),
    "experts_t": (
        [(5, 6)] * 3 + [(5, 6)] * 3,
        lambda *w: torch.cat([torch.stack(w[:3]), torch.stack(w[3:])], dim=1).transpose(1, 2),
    ),
    "interleave": ([(10, 4)], lambda t: t.reshape(5, 2, 4).transpose(0, 1).reshape(10, 4)),
    "chunk": ([(12, 5)], lambda t: t.chunk(3, dim=0)[1].t()),
}


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.data())
def test_blocks_fill_random_boxes(name, data):
    shapes, fn = CASES[name]
    real = {f"k{i}": torch.randn(s, dtype=torch.float64) for i, s in enumerate(shapes)}
    traced = _traced(fn, {k: (tuple(v.shape), v.dtype) for k, v in real.items()})
    full = fn(*real.values())
    offsets, sizes = [], []
    for length in full.shape:
        start = data.draw(st.integers(0, length - 1))
        offsets.append(start)
        sizes.append(data.draw(st.integers(1, length - start)))
    box = Box(tuple(offsets), tuple(sizes))
    local, blocks = _fill(traced, real, box)
    assert torch.equal(local, full[box.slices()])
    assert sum(b.numel for b in blocks) == box.numel


def test_contiguous_shard_of_fused_qkv_is_one_block_per_source():
    shapes, fn = CASES["qkv"]
    traced = _traced(fn, {f"k{i}": (s, torch.float32) for i, s in enumerate(shapes)})
    blocks = read_blocks(traced, Box((6, 0), (5, 6)), (0, 0))
    assert [(b.key, b.source_box) for b in blocks] == [("k0", Box((6, 0), (2, 6))), ("k1", Box((0, 0), (3, 6)))]


def test_rope_shard_reads_its_rows_once_in_pairs():
    shapes, fn = CASES["rope"]
    traced = _traced(fn, {"k0": (shapes[0], torch.float32)})
    blocks = read_blocks(traced, Box((8, 0), (8, 6)), (0, 0))
    assert sorted(b.source_box.offsets[0] for b in blocks) == [8, 10, 12, 14]
    assert {b.source_box.sizes for b in blocks} == {(2, 6)}
