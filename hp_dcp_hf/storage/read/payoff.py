"""Whether cooperating pays, for a load that leaves it to the reader (``cooperate="auto"``).

Cooperating reads every needed byte once per cluster, at a cost: the gathered plan, span buffers
filled and copied out of, and the exchange. It pays where the ranks' own reads would fetch
much more (replicas: HSDP reads each byte twice directly) or would take far more requests
(DeepSeek-V3 under FSDP x EP x TP on 1024 ranks, from S3: 720-964 requests a rank reading
directly, where the busiest owner's spans take 185; 1.01x the bytes). Where it saves
little of either, it is slower: on S3 at ``dp=2,tp=2`` (1 GB MoE, 4 ranks), where it saves 6% of
the bytes (990 -> 934 MiB) and a third of the GETs (276 -> 183), the cooperative load took
1.18x the direct one (bench/results/2026-12-07-remote-round3.md; 1.17x median in the first round
of issue 33). Pure numpy: every rank decides the same from the needs all of them gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hp_dcp_hf.storage.read.needs import Needs, Tensors
from hp_dcp_hf.storage.read.union import merge

BYTES_SAVED = 1.25
"""Cooperating pays when the ranks' own reads would fetch at least this many times the bytes the
cluster reads cooperating (HSDP's two replicas: 2x; DeepSeek-V3 on 1024 ``fsdp`` ranks: 1.01x;
HSDP with 8 replicas: 8.1x)."""

REQUESTS_SAVED = 4
"""... or when the busiest rank's own reads would take at least this many times the requests of
the busiest owner's spans (DeepSeek-V3 on 1024 ``fsdp`` ranks: up to 964 against 185, 5.2x;
``dp=2,tp=2`` on the S3 benchmark's 1 GB MoE: 69 against 53, 1.3x)."""


@dataclass(frozen=True)
class ReadCost:
    """What one rank reads from storage: bytes, in how many requests."""

    nbytes: int
    requests: int


def direct_cost(needs: Needs, table: Tensors, gap: int, request_bytes: int) -> ReadCost:
    """What a rank reading ``needs`` itself would fetch, from below: its needed bytes, and its
    needs' extents merged where at most ``gap`` apart, cut at ``request_bytes``, as requests. (A
    direct read also bridges holes of at most ``gap`` and splits extents whose holes are wider:
    both only add to it, so that the estimate leans toward reading directly.)"""
    if not len(needs):
        return ReadCost(0, 0)
    starts, ends = merge(*needs.extents(table), gap)
    return ReadCost(needs.nbytes(table), int((-(-(ends - starts) // request_bytes)).sum()))


def span_costs(owner: np.ndarray, sizes: np.ndarray, world: int, request_bytes: int) -> list[ReadCost]:
    """What each of ``world`` ranks reads cooperating: the spans it owns (``owner``, ``sizes``: one
    entry a span), each cut at ``request_bytes``."""
    nbytes = np.bincount(owner, weights=sizes, minlength=world)
    requests = np.bincount(owner, weights=-(-sizes // request_bytes), minlength=world)
    return [ReadCost(int(b), int(r)) for b, r in zip(nbytes, requests, strict=True)]


def cooperation_pays(direct: Sequence[ReadCost], cooperative: Sequence[ReadCost]) -> bool:
    """Whether reading once per cluster (``cooperative``, one cost a rank) saves enough over every rank
    reading for itself (``direct``): :data:`BYTES_SAVED` of the bytes, or :data:`REQUESTS_SAVED` of
    the busiest rank's requests."""
    once = sum(c.nbytes for c in cooperative)
    busiest = max((c.requests for c in cooperative), default=0)
    if once == 0:  # nothing to read
        return False
    return (sum(d.nbytes for d in direct) >= BYTES_SAVED * once
            or max((d.requests for d in direct), default=0) >= REQUESTS_SAVED * max(busiest, 1))
