"""Replicas' shares, in one process: every replica's share of a tensor, restricted from the same
shard pieces, covers each local element exactly once, and its bytes are the share's elements."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hp_dcp_hf.box import Box
from hp_dcp_hf.layout import ShardPiece
from hp_dcp_hf.parallel.cooperation import ReadProgress, SharedTarget, _Stream


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=0, max_size=3), st.integers(1, 9), st.integers(0, 3))
def test_replica_shares_partition_the_local_shard(shape, replicas, split):
    """A local shard made of two pieces (split along dim 0 where it can be) at some global offset."""
    local = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    cut = min(split, shape[0]) if shape else 0
    pieces = [ShardPiece(Box((7 + lo, *(3,) * (len(shape) - 1)), (hi - lo, *shape[1:])), (lo, *(0,) * (len(shape) - 1)))
              for lo, hi in ((0, cut), (cut, shape[0]))] if shape else [ShardPiece(Box((), ()), ())]
    pieces = [p for p in pieces if p.global_box.numel]
    target = SharedTarget("w", local, tuple(range(replicas)))
    seen = []
    for rank in range(replicas):
        lo, hi = target.elements(rank)
        mine = target.restrict(pieces, rank)
        elements = sorted(int(v) for p in mine for v in local[p.local_box().slices()].reshape(-1))
        assert elements == list(range(lo, hi))  # the share, no more
        for p in mine:  # global and local boxes still correspond, as in the pieces they came from
            source = next(q for q in pieces if q.local_box().contains(p.local_box()))
            assert tuple(g - q for g, q in zip(p.global_box.offsets, source.global_box.offsets)) == \
                tuple(a - b for a, b in zip(p.local_offsets, source.local_offsets))
        assert target.slice_bytes(rank).numel() == (hi - lo) * 4
        seen += elements
    assert sorted(seen) == list(range(local.numel()))  # every element by exactly one replica


def test_a_sender_stops_at_the_first_tensor_its_reads_have_not_finished():
    progress = ReadProgress()
    progress.expect("a", 1)
    stream = _Stream([("b", torch.zeros(4, dtype=torch.uint8)), ("a", torch.ones(4, dtype=torch.uint8))],
                     progress.ready)
    assert sum(p.numel() for p in stream.take(100)) == 4 and not stream.finished  # b, then waits for a
    progress.complete("a")
    assert [p.tolist() for p in stream.take(100)] == [[1, 1, 1, 1]] and stream.finished
