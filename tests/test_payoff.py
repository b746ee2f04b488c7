"""Whether cooperating pays (``cooperate="auto"``): what a rank would read on its own, what it reads
cooperating, and the decision on the layouts that motivate it: replicas (pays in bytes), many
slices of many tensors (pays in requests), disjoint row shards (does not pay)."""

from __future__ import annotations

from hp_dcp_hf.geometry.box import Box
from hp_dcp_hf.storage.read.needs import Need, Needs, StoredTensor, Tensors
from hp_dcp_hf.storage.read.payoff import (
    BYTES_SAVED,
    REQUESTS_SAVED,
    ReadCost,
    cooperation_pays,
    direct_cost,
    span_costs,
)
from hp_dcp_hf.storage.read.spans import ClusterPlan

MiB = 2**20
REQUEST = 8 * MiB
GAP = MiB  # a remote store's coalescing gap


def _decide(tensors: list[StoredTensor], needs_by_rank: list[list[Need]]) -> tuple[bool, list[ReadCost], list[ReadCost]]:
    table = Tensors(tensors)
    needs = [Needs.of(n, table) for n in needs_by_rank]
    plan = ClusterPlan.build(table, needs, ["a.safetensors"], gap=GAP)
    direct = [direct_cost(n, table, GAP, REQUEST) for n in needs]
    shared = span_costs(plan.owner, plan.end - plan.start, plan.world, REQUEST)
    return cooperation_pays(direct, shared), direct, shared


def _rows(tensor: int, shape: tuple[int, int], part: int, parts: int) -> Need:
    rows = shape[0] // parts
    return Need(tensor, Box((part * rows, 0), (rows, shape[1])))


def test_a_direct_read_costs_its_needed_bytes_in_its_merged_extents_cut_at_the_request_size():
    tensors = [StoredTensor(0, 0, (4, 1024), 1), StoredTensor(0, 4096 + 16, (3 * REQUEST,), 1)]
    table = Tensors(tensors)
    two_rows = Needs.of([Need(0, Box((0, 0), (1, 1024))), Need(0, Box((2, 0), (1, 1024)))], table)
    assert direct_cost(two_rows, table, gap=1024, request_bytes=REQUEST) == ReadCost(2048, 1)  # one request
    assert direct_cost(two_rows, table, gap=1023, request_bytes=REQUEST) == ReadCost(2048, 2)  # a hole too wide
    # the last row and, 16 bytes on, a tensor three requests long: one extent, cut in four
    tail = Needs.of([Need(0, Box((3, 0), (1, 1024))), Need(1, Box((0,), (3 * REQUEST,)))], table)
    assert direct_cost(tail, table, gap=16, request_bytes=REQUEST) == ReadCost(1024 + 3 * REQUEST, 4)
    assert direct_cost(Needs.of([], table), table, GAP, REQUEST) == ReadCost(0, 0)


def test_replicas_pay_in_bytes():
    """HSDP: two replicas of each half of every tensor; cooperating reads each byte once, not twice."""
    shape = (1024, 4096)
    tensors = [StoredTensor(0, i * 4 * MiB, shape, 1) for i in range(8)]
    needs = [[_rows(t, shape, rank % 2, 2) for t in range(8)] for rank in range(4)]
    pays, direct, shared = _decide(tensors, needs)
    assert sum(d.nbytes for d in direct) == 2 * sum(s.nbytes for s in shared) == 2 * 32 * MiB
    assert pays


def test_disjoint_row_shards_read_directly():
    """FSDP alone over a few large tensors: every byte is one rank's, in as many requests either way."""
    shape = (1024, 8192)
    tensors = [StoredTensor(0, i * 8 * MiB, shape, 1) for i in range(8)]
    needs = [[_rows(t, shape, rank, 4) for t in range(8)] for rank in range(4)]
    pays, direct, shared = _decide(tensors, needs)
    assert sum(d.nbytes for d in direct) == sum(s.nbytes for s in shared) == 64 * MiB
    assert max(d.requests for d in direct) < REQUESTS_SAVED * max(s.requests for s in shared)
    assert not pays


def test_slices_of_many_tensors_pay_in_requests():
    """FSDP over many ranks: each rank needs a slice of every tensor, holes wider than the gap apart,
    a request each when reading directly; the spans owners read are few and large."""
    shape, world = (64, 65536), 32
    tensors = [StoredTensor(0, i * 4 * MiB, shape, 1) for i in range(64)]
    needs = [[_rows(t, shape, rank, world) for t in range(64)] for rank in range(world)]
    pays, direct, shared = _decide(tensors, needs)
    assert sum(d.nbytes for d in direct) == sum(s.nbytes for s in shared)  # no byte saved
    assert min(d.requests for d in direct) == 64  # one per tensor
    assert max(d.requests for d in direct) >= REQUESTS_SAVED * max(s.requests for s in shared)
    assert pays


def test_the_thresholds():
    once = [ReadCost(100, 4), ReadCost(100, 4)]  # 200 bytes read cooperating; the busiest owner: 4 requests
    enough = int(200 * BYTES_SAVED)
    assert cooperation_pays([ReadCost(enough - 100, 1), ReadCost(100, 1)], once)
    assert not cooperation_pays([ReadCost(enough - 101, 1), ReadCost(100, 1)], once)
    assert cooperation_pays([ReadCost(100, 4 * REQUESTS_SAVED), ReadCost(100, 1)], once)
    assert not cooperation_pays([ReadCost(100, 4 * REQUESTS_SAVED - 1), ReadCost(100, 1)], once)
    assert not cooperation_pays([ReadCost(0, 0)] * 2, [ReadCost(0, 0)] * 2)  # nothing to read
