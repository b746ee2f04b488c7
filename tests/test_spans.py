"""Span ownership in one process: the union of every rank's needed bytes, the spans cut from it,
their owners, and the streams sender and receiver derive apart, checked against byte bitmaps."""

from __future__ import annotations

import math
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.storage.format.ranges import box_byte_runs
from hp_dcp_hf.storage.read import spans as spans_module
from hp_dcp_hf.storage.read.exchange import ReadProgress, Region, Stream
from hp_dcp_hf.storage.read.needs import Need, Needs, StoredTensor, Tensors, decode_needs, encode_needs
from hp_dcp_hf.storage.read.routing import runs
from hp_dcp_hf.storage.read.spans import ClusterPlan, traffic
from hp_dcp_hf.storage.read.union import needed_union

FILES = ("a.safetensors", "b.safetensors")


def _layout(shapes: list[tuple[int, ...]], itemsize: int = 2) -> list[StoredTensor]:
    """Tensors packed one after the other after a 100-byte header, alternating between two files."""
    tensors, position = [], [100, 100]
    for index, shape in enumerate(shapes):
        file = index % 2
        tensors.append(StoredTensor(file, position[file], shape, itemsize))
        position[file] += math.prod(shape) * itemsize
    return tensors


def _bitmaps(tensors, needs_by_rank) -> list[np.ndarray]:
    """Per file, how many ranks need each byte (from the boxes' elements, not their ranges)."""
    size = max(t.data_start + t.nbytes for t in tensors) + 1
    maps = [np.zeros(size, dtype=np.int64) for _ in FILES]
    for needs in needs_by_rank:
        for need in needs:
            t = tensors[need.tensor]
            flat = torch.arange(math.prod(t.shape)).reshape(t.shape)[need.box.slices()].reshape(-1).numpy()
            for k in range(t.itemsize):
                np.add.at(maps[t.file], t.data_start + flat * t.itemsize + k, 1)
    return maps


@st.composite
def _cluster(draw):
    shapes = draw(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), min_size=1, max_size=5))
    tensors = _layout(shapes)
    world = draw(st.integers(1, 5))
    needs_by_rank = []
    for _ in range(world):
        needs = []
        for index in draw(st.lists(st.integers(0, len(shapes) - 1), max_size=6)):
            shape = shapes[index]
            lo = [draw(st.integers(0, s - 1)) for s in shape]
            size = [draw(st.integers(1, s - o)) for s, o in zip(shape, lo)]
            needs.append(Need(index, Box(tuple(lo), tuple(size))))
        needs.sort(key=lambda n: (tensors[n.tensor].file, tensors[n.tensor].data_start))
        needs_by_rank.append(needs)
    return tensors, needs_by_rank, draw(st.sampled_from([1, 16, 64]))


@settings(max_examples=200, deadline=None)
@given(_cluster(), st.sampled_from([2, 16, 2**20]))
def test_spans_cover_exactly_the_bytes_some_rank_needs_and_streams_agree(cluster, own_run):
    """``own_run``: the shortest stretch one rank alone needs that gets spans of its own (spans
    on byte, not page, bounds, so that tiny tensors get such cuts too)."""
    tensors, needs_by_rank, span_bytes = cluster
    world = len(needs_by_rank)
    with mock.patch.object(spans_module, "OWN_RUN_BYTES", own_run), mock.patch.object(spans_module, "_PAGE", 1):
        plan = ClusterPlan.build(tensors, needs_by_rank, FILES, span_bytes=span_bytes)
    needed = _bitmaps(tensors, needs_by_rank)
    covered = [np.zeros_like(m) for m in needed]
    for f, s, e in zip(plan.file.tolist(), plan.start.tolist(), plan.end.tolist()):
        assert s < e
        covered[f][s:e] += 1
    for f in range(len(FILES)):  # each needed byte in one span, no unneeded byte in any (gap 0)
        assert np.array_equal(covered[f], (needed[f] > 0).astype(np.int64))
    assert plan.bytes_read() == sum(int((m > 0).sum()) for m in needed) == int(plan.needed.sum())
    keys = list(zip(plan.file.tolist(), plan.start.tolist()))
    assert keys == sorted(keys) and set(plan.owner.tolist()) <= set(range(world))
    for needs in needs_by_rank:
        routed = plan.route(needs)
        assert routed.nbytes == sum(n.box.numel * tensors[n.tensor].itemsize for n in needs)
        # every part lies in its span, and lands where its bytes sit in the need's buffer
        for part in range(len(routed.start)):
            span = routed.span[part]
            assert plan.start[span] <= routed.start[part] < routed.end[part] <= plan.end[span]
            assert routed.owner[part] == plan.owner[span]
        for owner in range(world):  # the sender's stream, from the receiver's needs alone, is the receiver's
            mine = routed.select(routed.owner == owner)
            theirs = plan.route(needs, within=plan.owned(owner))
            for field in ("span", "file", "start", "end", "need", "offset"):
                assert np.array_equal(getattr(mine, field), getattr(theirs, field)), field
    shares = traffic(plan, needs_by_rank, request_bytes=32)
    assert sum(t.sent for t in shares) == sum(t.received for t in shares)
    assert sum(t.storage_bytes for t in shares) == plan.bytes_read()


@settings(max_examples=150, deadline=None)
@given(_cluster(), st.sampled_from([1, 5, 64, 4096]))
def test_runs_carry_every_needed_byte_from_the_spans_into_the_needs_buffers(cluster, cap):
    """Files of random bytes: every need's buffer, filled from the owners' span buffers through
    merged runs (strided on the sender, contiguous on the receiver), holds its box's bytes."""
    tensors, needs_by_rank, span_bytes = cluster
    plan = ClusterPlan.build(tensors, needs_by_rank, FILES, span_bytes=span_bytes)
    size = max(t.data_start + t.nbytes for t in tensors)
    generator = torch.Generator().manual_seed(cap)
    files = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator) for _ in FILES]
    spans = [files[f][s:e] for f, s, e in zip(plan.file.tolist(), plan.start.tolist(), plan.end.tolist())]
    for needs in needs_by_rank:
        buffers = [torch.zeros(n.box.numel * tensors[n.tensor].itemsize, dtype=torch.uint8) for n in needs]
        merged = runs(plan.route(needs), cap)
        assert all(r.nbytes <= cap for r in merged)
        for r in merged:
            sent = Region(r.span, r.start - int(plan.start[r.span]), r.nbytes, r.rows, r.stride).view(spans[r.span])
            Region(r.need, r.offset, r.nbytes).view(buffers[r.need]).copy_(sent.reshape(1, -1))
        for need, buffer in zip(needs, buffers):
            t = tensors[need.tensor]
            stored = files[t.file][t.data_start : t.data_start + t.nbytes].view(*t.shape, t.itemsize)
            assert torch.equal(buffer, stored[need.box.slices()].reshape(-1))


def test_a_need_lands_at_the_offsets_of_its_own_buffer():
    """A column block: one range per row, each at the next offset of the need's buffer."""
    tensors = [StoredTensor(0, 8, (4, 6), 4)]
    need = Need(0, Box((1, 2), (3, 2)))
    plan = ClusterPlan.build(tensors, [[need]], FILES[:1], span_bytes=1)
    routed = plan.route([need])
    assert routed.start.tolist() == [8 + (6 * r + 2) * 4 for r in (1, 2, 3)]
    assert routed.offset.tolist() == [0, 8, 16] and routed.end.tolist() == [s + 8 for s in routed.start.tolist()]


def test_boxes_that_tile_a_tensor_make_one_range_without_listing_rows():
    tensors = [StoredTensor(0, 100, (1000, 64), 2)]
    columns = [[Need(0, Box((0, 32 * r), (1000, 32)))] for r in range(2)]
    starts, ends = needed_union(tensors, columns, 1)[0]
    assert starts.tolist() == [100] and ends.tolist() == [100 + 1000 * 64 * 2]
    rows = [[Need(0, Box((0, 0), (400, 64)))], [Need(0, Box((600, 0), (400, 64)))]]  # a hole nobody needs
    starts, ends = needed_union(tensors, rows, 1)[0]
    assert starts.tolist() == [100, 100 + 600 * 128] and ends.tolist() == [100 + 400 * 128, 100 + 1000 * 128]


def test_owners_are_balanced_and_prefer_ranks_then_nodes_that_need_the_span():
    mib = 2**20
    tensors = [StoredTensor(0, 0, (64 * mib,), 1)]
    halves = [[Need(0, Box((0,), (32 * mib,)))], [Need(0, Box((32 * mib,), (32 * mib,)))]]
    needs = [*halves, [], []]  # ranks 2 and 3 need nothing
    plan = ClusterPlan.build(tensors, needs, FILES[:1], span_bytes=8 * mib)
    loads = [plan.bytes_read(r) for r in range(4)]
    # balanced by bytes: nobody above a fair share plus a span, the ranks needing nothing own spans too
    assert sum(loads) == 64 * mib and max(loads) <= 16 * mib + 8 * mib and min(loads) > 0
    # Ranks 0 and 2 on one node, 1 and 3 on another: a span goes to a rank of a node that needs it.
    plan = ClusterPlan.build(tensors, needs, FILES[:1], nodes=[0, 1, 0, 1], span_bytes=8 * mib)
    nodes = [0, 1, 0, 1]
    for span in range(len(plan)):
        node = nodes[int(plan.owner[span])]
        assert (plan.end[span] <= 32 * mib and node == 0) or (plan.start[span] >= 32 * mib and node == 1)
    assert all(plan.bytes_read(r) > 0 for r in range(4))


def _greedy_owners(sizes, indptr, needers, needed, sending, nodes, target) -> list[int]:
    """Owners as ``_assign``'s docstring states them, one span at a time in plain Python."""
    world, fair = len(nodes), int(sum(sizes)) / len(nodes) + target
    owners, load, sent = [-1] * len(sizes), [0] * world, [0] * world
    spans = [list(zip(needers[lo:hi].tolist(), needed[lo:hi].tolist())) for lo, hi in zip(indptr[:-1], indptr[1:])]
    for rank in range(world):  # spans one rank alone needs: to it, in span order, within its share
        alone = [s for s, pairs in enumerate(spans) if [r for r, _ in pairs] == [rank]]
        for s in alone:
            if load[rank] + sizes[s] <= fair and all(owners[t] >= 0 for t in alone if t < s):
                owners[s], load[rank] = rank, load[rank] + int(sizes[s])
    left = [s for s in range(len(sizes)) if owners[s] < 0]
    spread = [s for s in left if 2 * max(n for _, n in spans[s]) < sending[s]]
    for s in sorted(spread, key=lambda s: -sending[s]) + [s for s in left if s not in spread]:
        size = int(sizes[s])
        ranked = sorted(spans[s], key=lambda pair: -pair[1])  # most needed first, then in rank order
        fits = [i for i, (r, _) in enumerate(ranked) if load[r] + size <= fair]
        if fits and s in spread:  # the needer that has sent least, then the least loaded
            owner = min((sent[r], load[r], i, r) for i, (r, _) in enumerate(ranked) if i in fits)[3]
        elif fits:
            most = ranked[fits[0]][1]
            owner = min((load[r], i, r) for i, (r, n) in enumerate(ranked) if i in fits and n == most)[2]
        else:
            local = [r for r in range(world) if nodes[r] in {nodes[q] for q, _ in spans[s]}]
            owner = min(local, key=lambda r: (load[r], r)) if local else -1
            if owner < 0 or load[owner] + size > fair:
                owner = min(range(world), key=lambda r: (load[r], r))
        owners[s], load[owner] = owner, load[owner] + size
        if s in spread:  # the spread spans come first: only their sends are ever compared
            sent[owner] += int(sending[s]) - (sum(n for r, n in spans[s] if r == owner) if fits else 0)
    return owners


@pytest.mark.parametrize("seed", range(20))
def test_owners_are_those_of_a_plain_greedy_one_span_at_a_time(seed):
    """``_assign``'s lists, runs and single-key sort give the owners its docstring states: twins
    needing equal bytes (ties), spans needed by more than 16 ranks, spans no needer can take,
    spans whose owner sends most of them (classes of twins counted once: below the needers' sum)."""
    rng = np.random.default_rng(seed)
    world, count = 48, 300
    sizes = rng.integers(1, 9, count) * 2**20
    per_span = [np.sort(rng.choice(world, size=int(rng.choice([1, 1, 3, 8, 24, 40])), replace=False))
                for _ in range(count)]
    indptr = np.concatenate(([0], np.cumsum([len(r) for r in per_span])))
    needers = np.concatenate(per_span)
    needed = rng.integers(1, 3, len(needers)) * 2**18  # two amounts: many ties, runs of more than 16
    sending = spans_module._per_span(indptr, needed) // rng.integers(1, 3, count)
    nodes = np.arange(world) // 8
    target = int(rng.choice([2**20, 2**23]))
    owners = spans_module._assign(sizes, indptr, needers, needed, sending, nodes, target)
    assert owners.tolist() == _greedy_owners(sizes, indptr, needers, needed, sending, nodes, target)


def test_spans_holding_bytes_needed_more_than_once_are_cut_to_half_the_mean_wherever_empty_tensors_lie():
    """The spans of a tensor holding 3 MiB needed more than once are cut so that none holds more
    than half the mean rank's bytes needed again, no piece below the smallest span; an empty
    tensor stored where another starts changes nothing, listed before it or after."""
    mib = 2**20
    full = Tensors([StoredTensor(0, 0, (4 * mib,), 1), StoredTensor(0, 4 * mib, (4 * mib,), 1)])
    again = np.array([3 * mib, 0])  # tensor 0: 3 MiB needed more than once; tensor 1: none
    lows, highs = np.array([0, 2 * mib, 4 * mib]), np.array([2 * mib, 4 * mib, 8 * mib])
    # mean: 3 MiB over 2 ranks; half of it 0.75 MiB; each span of tensor 0 holds 1.5 MiB: 2 pieces
    pieces = spans_module._send_pieces(lows, highs, full, again, 2, 4096)
    assert pieces.tolist() == [2, 2, 1]
    for empty_at in (0, 1, 2):
        stored = [StoredTensor(0, 0, (4 * mib,), 1), StoredTensor(0, 4 * mib, (4 * mib,), 1)]
        stored.insert(empty_at, StoredTensor(0, 0 if empty_at < 2 else 4 * mib, (0,), 1))
        with_empty = np.insert(again, empty_at, 0)
        assert spans_module._send_pieces(lows, highs, Tensors(stored), with_empty, 2, 4096).tolist() == [2, 2, 1]
    assert spans_module._send_pieces(lows, highs, full, again, 2, 2 * mib).tolist() == [1, 1, 1]  # none below 2 MiB


def test_a_stretch_one_rank_alone_needs_is_read_by_that_rank_and_never_sent():
    """Uneven row blocks of a 64 MiB weight (FSDP on 3 ranks: 22, 21, 21 rows) and a norm every
    rank needs: each rank reads its own block, whatever the span size; only the norm travels, and
    the page where two blocks meet (spans start on pages). Column halves of the weight (a
    row-parallel TP split) interleave: those bytes are shared, and an owner sends the other half."""
    mib = 2**20
    tensors = [StoredTensor(0, 80, (64, mib), 1), StoredTensor(0, 80 + 64 * mib, (4096,), 2)]
    norm = Need(1, Box((0,), (4096,)))
    rows = [(0, 22), (22, 21), (43, 21)]
    blocks = [[Need(0, Box((lo, 0), (count, mib))), norm] for lo, count in rows]
    plan = ClusterPlan.build(tensors, blocks, FILES[:1], span_bytes=8 * mib)
    shares = traffic(plan, blocks, request_bytes=8 * mib)
    for (_, count), share in zip(rows, shares):
        assert count * mib - 4096 <= share.storage_bytes <= count * mib + 8192 + 4096
    assert sum(t.received for t in shares) <= 2 * 8192 + 2 * 4096  # the norm to two ranks, 2 seams
    halves = [[Need(0, Box((32 * (r // 2), (r % 2) * mib // 2), (32, mib // 2)))] for r in range(4)]
    plan = ClusterPlan.build(tensors, halves, FILES[:1], span_bytes=8 * mib)
    shares = traffic(plan, halves, request_bytes=8 * mib)
    assert plan.bytes_read() == 64 * mib and sum(t.received for t in shares) >= 16 * mib


def test_spans_are_large_page_aligned_and_bridge_only_small_holes():
    mib = 2**20
    tensors = [StoredTensor(0, 80, (100 * mib,), 1)]
    needs = [[Need(0, Box((0,), (40 * mib,))), Need(0, Box((40 * mib + 1000,), (60 * mib - 1000,)))]]
    plan = ClusterPlan.build(tensors, needs, FILES[:1], gap=4096, span_bytes=8 * mib)
    assert plan.bytes_read() == 100 * mib and int(plan.needed.sum()) == 100 * mib - 1000  # the hole bridged
    assert all((e - s) >= 8 * mib for s, e in zip(plan.start.tolist(), plan.end.tolist()))
    assert all(s % 4096 == 0 for s in plan.start.tolist()[1:])
    apart = ClusterPlan.build(tensors, needs, FILES[:1], gap=0, span_bytes=8 * mib)
    assert apart.bytes_read() == 100 * mib - 1000


def test_needs_travel_as_integers():
    tensors = [StoredTensor(0, 0, (4, 5, 6), 2), StoredTensor(1, 0, (), 4)]
    needs = [Need(0, Box((1, 0, 2), (2, 5, 3))), Need(1, Box((), ())), Need(0, Box((0, 0, 0), (4, 5, 6)))]
    encoded = encode_needs(needs, tensors)
    decoded = decode_needs(encoded, tensors)
    table = Tensors(tensors)
    assert encoded.dtype == np.int64 and encoded.size == len(needs) * (1 + 2 * 3)  # fixed width: no parsing
    assert [Need(int(decoded.tensor[i]), decoded.box(i, table)) for i in range(len(needs))] == needs


@settings(max_examples=200, deadline=None)
@given(_cluster())
def test_every_needs_byte_ranges_at_once_are_each_boxs_ranges_in_order(cluster):
    """:meth:`Needs.byte_runs` (every box of a rank at once) lists what ``box_byte_runs`` lists box by box."""
    tensors, needs_by_rank, _ = cluster
    table = Tensors(tensors)
    for needs in needs_by_rank:
        expected = []
        for i, need in enumerate(needs):
            t = tensors[need.tensor]
            starts, run = box_byte_runs(t.shape, t.itemsize, need.box)
            expected += [(i, t.data_start + s, run, k * run) for k, s in enumerate(starts.tolist())]
        got = Needs.of(needs, table).byte_runs(table)
        assert list(zip(*(a.tolist() for a in got))) == expected


def test_a_box_outside_its_tensor_is_refused():
    table = Tensors([StoredTensor(0, 0, (4, 4), 1)])
    with pytest.raises(ValueError, match="not inside its tensor"):
        Needs.of([Need(0, Box((2, 0), (3, 4)))], table).byte_runs(table)


def test_a_need_outside_every_span_is_refused():
    tensors = [StoredTensor(0, 0, (16,), 1)]
    plan = ClusterPlan.build(tensors, [[Need(0, Box((0,), (8,)))]], FILES[:1])
    with pytest.raises(ValueError, match="outside every span"):
        plan.route([Need(0, Box((8,), (8,)))])


def test_a_sender_stops_at_the_first_span_not_read_yet():
    progress = ReadProgress()
    spans = {0: torch.arange(4, dtype=torch.uint8), 1: torch.arange(4, 8, dtype=torch.uint8)}
    moved = []
    stream = Stream([Region(0, 1, 3), Region(1, 0, 2)], lambda r: spans[r.key], lambda r: moved.append((r.key, r.nbytes)),
                    lambda r: progress.ready(r.key))
    out = torch.zeros(8, dtype=torch.uint8)
    assert stream.take_into(out, 8) == 0  # span 0 not read
    progress.read(0)
    assert stream.take_into(out, 8) == 3 and out[:3].tolist() == [1, 2, 3] and not stream.finished
    progress.read(1)
    assert stream.take_into(out, 8) == 2 and out[:2].tolist() == [4, 5] and stream.finished
    assert moved == [(0, 3), (1, 2)]


def test_the_span_arithmetic_imports_neither_torch_nor_its_distributed_package():
    code = ("import sys\n"
            "import hp_dcp_hf.storage.read.needs, hp_dcp_hf.storage.read.union\n"
            "import hp_dcp_hf.storage.read.routing, hp_dcp_hf.storage.read.spans\n"
            "print(sorted(m for m in ('torch', 'torch.distributed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _relayed(plan: ClusterPlan, needs_by_rank) -> None:
    """Every rank receives each part of its route once, from its owner or from a twin that has it
    (the chain of senders reaches the owner without a loop), and the sender's streams, derived
    from the plan alone, are the receiver's."""
    routes = [plan.route(needs) for needs in needs_by_rank]
    senders = [plan.senders(rank, routed) for rank, routed in enumerate(routes)]
    for rank, routed in enumerate(routes):
        twins = set(plan.members(rank).tolist())
        for part in range(len(routed.start)):
            at, seen = rank, set()
            while at != routed.owner[part]:  # walk up the chain
                assert at not in seen and at in twins
                seen.add(at)
                at = int(senders[at][part])
        sent = plan.sends(rank, routed, plan.owned(rank))
        for peer, routed_peer in enumerate(routes):
            mine = sent[peer]
            theirs = routed_peer.select(senders[peer] == rank) if peer != rank else None
            if mine is None or theirs is None:
                assert theirs is None or theirs.nbytes == 0 or mine is not None
                continue
            for field in ("span", "file", "start", "end", "need", "offset"):
                assert np.array_equal(getattr(mine, field), getattr(theirs, field)), field


@settings(max_examples=100, deadline=None)
@given(_cluster(), st.lists(st.integers(0, 4), min_size=1, max_size=6), st.integers(1, 3))
def test_relayed_routes_give_every_rank_its_bytes_once_from_a_rank_that_has_them(cluster, copies, per_node):
    """Ranks repeated (twins: replicas) on nodes of ``per_node`` ranks: see :func:`_relayed`."""
    tensors, needs_by_rank, span_bytes = cluster
    needs_by_rank = [needs_by_rank[i % len(needs_by_rank)] for i in copies]
    nodes = [rank // per_node for rank in range(len(needs_by_rank))]
    plan = ClusterPlan.build(tensors, needs_by_rank, FILES, nodes=nodes, span_bytes=span_bytes)
    _relayed(plan, needs_by_rank)
    shares = traffic(plan, needs_by_rank, request_bytes=32)
    assert sum(t.sent for t in shares) == sum(t.received for t in shares)
    for rank, (t, needs) in enumerate(zip(shares, needs_by_rank)):
        routed = plan.route(needs)
        assert t.received == routed.select(routed.owner != rank).nbytes


def test_a_send_tree_keeps_the_busiest_of_1024_hsdp_ranks_within_twice_the_mean():
    """8 replicas x 128 ranks, 8 ranks a node, shaped like DeepSeek-V3's HSDP: every replica shards
    each matrix by rows over its 128 ranks, and every rank needs the whole of the small replicated
    tensors (norms, a small share of the bytes)."""
    shapes = [(4096, 1024)] * 8 + [(256,)] * 2
    tensors = _layout(shapes)
    needs_by_shard = [[Need(i, Box((s * 32, 0), (32, 1024))) if len(shape) == 2 else Need(i, Box((0,), shape))
                       for i, shape in enumerate(shapes)] for s in range(128)]
    for needs in needs_by_shard:
        needs.sort(key=lambda n: (tensors[n.tensor].file, tensors[n.tensor].data_start))
    needs_by_rank = [needs_by_shard[rank % 128] for rank in range(1024)]
    plan = ClusterPlan.build(tensors, needs_by_rank, FILES, nodes=[rank // 8 for rank in range(1024)],
                             span_bytes=4096)
    assert len(set(plan.twins.tolist())) == 128
    shares = traffic(plan, needs_by_rank, request_bytes=4096)
    sent = np.array([t.sent for t in shares])
    assert sent.max() <= 2 * sent.mean()
    for rank in (0, 1, 129, 1023):  # each rank receives exactly what it needs and did not read
        routed = plan.route(needs_by_rank[rank])
        assert shares[rank].received == routed.select(routed.owner != rank).nbytes
    assert sum(t.sent for t in shares) == sum(t.received for t in shares)


def test_sends_of_1024_fsdp_ranks_over_tensor_parallel_groups_stay_within_twice_the_mean():
    """128 dp groups x 8 tensor-parallel ranks, shaped like DeepSeek-V3's 1024 FSDP ranks: most
    matrices are sharded by rows over all ranks, a small one is left whole by tensor parallelism,
    so the 8 ranks of a group need the same rows of it (ranks needing the same bytes that are not
    twins: nobody forwards for them). Whole spans put 7 copies of their bytes on one owner each,
    2.5x the mean rank's sends (2.48x); cut to half the mean and given out by sends, 1.27x."""
    shapes = [(4096, 4096)] * 15 + [(2048, 1024)]
    tensors = _layout(shapes)
    needs_by_rank = []
    for rank in range(1024):
        needs = [Need(i, Box((rank * 4, 0), (4, shape[1]))) if i < 15 else Need(i, Box((rank // 8 * 16, 0), (16, 1024)))
                 for i, shape in enumerate(shapes)]
        needs.sort(key=lambda n: (tensors[n.tensor].file, tensors[n.tensor].data_start))
        needs_by_rank.append(needs)
    plan = ClusterPlan.build(tensors, needs_by_rank, FILES, nodes=[rank // 8 for rank in range(1024)],
                             span_bytes=4096)
    assert len(set(plan.twins.tolist())) == 1024
    shares = traffic(plan, needs_by_rank, request_bytes=4096)
    sent = np.array([t.sent for t in shares])
    assert sent.max() <= 2 * sent.mean()
    assert plan.bytes_read() == sum(t.nbytes for t in tensors)  # every byte read once
    for rank in (0, 1, 9, 1023):  # each rank receives exactly what it needs and did not read
        routed = plan.route(needs_by_rank[rank])
        assert shares[rank].received == routed.select(routed.owner != rank).nbytes
    assert sum(t.sent for t in shares) == sum(t.received for t in shares)


def test_a_landing_span_reads_into_destinations_cut_anywhere_with_holes_dropped():
    """A span only its owner needs is read straight into the destinations: the views of any cut of
    it are the parts' bytes in place, and scratch for the holes between them."""
    from hp_dcp_hf.storage.read.routing import Run
    from hp_dcp_hf.storage.read.span_reads import _landing, _landing_views, _Needs

    class Chunk:  # a chunk whose destination takes the file's bytes as stored
        def __init__(self, nbytes: int) -> None:
            self.dest, self.nbytes, self.direct = torch.zeros(nbytes, dtype=torch.uint8), nbytes, True

    chunks = [Chunk(10), Chunk(30)]
    written: list[int] = []
    target = _Needs(chunks, lambda index: None, {}, written.append)
    # need 0: file bytes [110, 120) at 0; need 1: three rows of 5 bytes from 130, 10 apart, at 5
    own = {7: [Run(7, 0, 0, 110, 10, 1, 0), Run(7, 1, 5, 130, 15, 3, 10)]}
    landing = _landing(own, {7: 25}, target)
    assert list(landing) == [7]
    assert _landing({7: own[7]}, {7: 26}, target) == {}  # a byte of the span goes to another rank
    file = torch.arange(100, 200, dtype=torch.uint8)  # byte i of the file holds i
    for cuts in ([100, 200], [100, 115, 133, 200], [100, 111, 112, 141, 200]):
        for start, end in zip(cuts, cuts[1:]):
            views = _landing_views(landing[7], start, end, target)
            assert sum(len(v) for v in views) == end - start
            position = start
            for view in views:  # as RangeFile.read_into fills them
                view[:] = file[position - 100 : position - 100 + len(view)].numpy().tobytes()
                position += len(view)
        assert chunks[0].dest.tolist() == list(range(110, 120))
        assert chunks[1].dest[5:20].tolist() == [*range(130, 135), *range(140, 145), *range(150, 155)]
        assert chunks[1].dest[:5].tolist() + chunks[1].dest[20:].tolist() == [0] * 15  # nothing outside the parts
        for chunk in chunks:
            chunk.dest.zero_()
    # the views name no destination (a landing read names those it wrote once it has); a buffer
    # handed out to be written now names its destination, once
    assert written == []
    for index in (1, 0, 1):
        assert target.buffer(index) is not None
    assert written == [1, 0]
