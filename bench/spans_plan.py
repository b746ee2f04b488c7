"""The cooperative span plan of a simulated cluster, timed from cached needs alone.

``python -m bench --parts simulate`` plans every rank's items before it times the span plan
(minutes); once it has left every rank's needs in ``BENCH_CACHE``, this times what one rank pays
in ``read_data`` (:func:`bench.simulate.rank_spans`: decode, build, route own, route others) in
seconds, on any checkout, so that two checkouts can be timed alternately on one noisy machine::

    python -m bench.spans_plan --save-table                 # once: the checkpoint's byte layout
    python -m bench.spans_plan --layouts fsdp,hsdp --ranks 0,513 --reps 3 --digest
    python -m bench.spans_plan --payoff                     # what cooperate="auto" weighs, per layout
    python -m bench.spans_plan --traffic                    # bytes each rank reads, receives, sends

One JSON line per layout and rank: the best of ``reps`` of each step, ``first_spans_s`` the first
rep's (the first plan in a process pays for fresh memory), and with ``--digest`` a hash of the
plan, the rank's route and its sends (equal digests: the same plan, byte for byte).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

NODE = 8  # ranks per node, as bench.simulate


def _cache() -> Path:
    return Path(os.environ.get("BENCH_CACHE", Path.home() / ".cache" / "hp-dcp-hf-bench"))


def save_table(arch: str) -> Path:
    """The stored tensors and files of ``arch``'s simulated checkpoint, as bench.simulate builds them."""
    from bench.simulate import build_checkpoint, stored_table

    table = stored_table(build_checkpoint(arch))
    tensors = table.tensors
    path = _cache() / f"table-{arch}.npz"
    np.savez(path, file_of=tensors.file, data_start=tensors.data_start, itemsize=tensors.itemsize,
             shape=tensors.shape, rank=tensors.rank, files=np.array(table.files))
    return path


def load_table(arch: str) -> tuple[Any, tuple[str, ...]]:
    from hp_dcp_hf.storage.read.needs import StoredTensor, Tensors

    with np.load(_cache() / f"table-{arch}.npz") as saved:
        stored = [StoredTensor(int(f), int(s), tuple(int(x) for x in shape[len(shape) - int(r):]) if r else (), int(i))
                  for f, s, i, shape, r in zip(saved["file_of"], saved["data_start"], saved["itemsize"], saved["shape"],
                                               saved["rank"])]
        return Tensors(stored), tuple(str(f) for f in saved["files"])


def load_needs(layout: str, world: int) -> list[np.ndarray]:
    """Every rank's encoded needs, as :func:`bench.simulate.cached_needs` left them."""
    (path,) = sorted(_cache().glob(f"needs-*-{layout}-{world}-*.npz"))
    with np.load(path) as saved:
        return [saved[f"r{rank}"] for rank in range(world)]


def _digest(plan: Any, arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in [plan.file, plan.start, plan.end, plan.owner, plan.needed, *arrays]:
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def _routed(routed: Any) -> list[np.ndarray]:
    return [getattr(routed, f) for f in ("owner", "span", "file", "start", "end", "need", "offset")]


def _spans_s(seconds: dict[str, float]) -> float:
    return seconds["build_s"] + seconds["route_own_s"] + seconds["route_others_s"]


def time_rank(layout: str, world: int, rank: int, reps: int, digest: bool, tensors: Any, files: tuple[str, ...],
              encoded: list[np.ndarray]) -> dict[str, Any]:
    from bench.simulate import rank_spans
    from hp_dcp_hf.storage.read.needs import decode_needs

    mine = decode_needs(encoded[rank], tensors)
    nodes = [r // NODE for r in range(world)]
    runs = [rank_spans(rank, mine, encoded, tensors, files, nodes) for _ in range(reps)]
    best = {k: min(seconds[k] for _, seconds, _ in runs) for k in runs[0][1]}
    plan, _, sent = runs[0]
    row: dict[str, Any] = {"layout": layout, "world": world, "rank": rank, **best, "sent": sent,
                           "spans_s": _spans_s(best), "first_spans_s": _spans_s(runs[0][1]), "spans": len(plan)}
    if digest:
        incoming = plan.route(mine)
        sends = plan.sends(rank, incoming, plan.owned(rank))
        arrays = _routed(incoming)
        for peer, routed in enumerate(sends):
            arrays += [np.array([peer, -1 if routed is None else len(routed.start)]),
                       *(_routed(routed) if routed is not None else [])]
        row["digest"] = _digest(plan, arrays)
    return row


def payoff(layout: str, world: int, tensors: Any, files: tuple[str, ...], encoded: list[np.ndarray]) -> dict[str, Any]:
    """What ``cooperate="auto"`` weighs for this cluster on a remote store (its coalescing gap,
    span gap and request size): every rank's direct reads against the spans' owners', and its choice."""
    from hp_dcp_hf.storage.read.needs import decode_needs
    from hp_dcp_hf.storage.read.options import REMOTE_BATCH_BYTES
    from hp_dcp_hf.storage.read.payoff import cooperation_pays, direct_cost, span_costs
    from hp_dcp_hf.storage.read.spans import SPAN_GAP, ClusterPlan
    from hp_dcp_hf.storage.transport.backend import REMOTE_COALESCE_GAP

    needs = [decode_needs(e, tensors) for e in encoded]
    plan = ClusterPlan.build(tensors, needs, files, nodes=[r // NODE for r in range(world)], gap=SPAN_GAP)
    direct = [direct_cost(n, tensors, REMOTE_COALESCE_GAP, REMOTE_BATCH_BYTES) for n in needs]
    shared = span_costs(plan.owner, plan.end - plan.start, plan.world, REMOTE_BATCH_BYTES)
    return {"layout": layout, "world": world,
            "direct_bytes_over_once": sum(d.nbytes for d in direct) / sum(c.nbytes for c in shared),
            "direct_requests_min": min(d.requests for d in direct), "direct_requests_max": max(d.requests for d in direct),
            "busiest_owner_requests": max(c.requests for c in shared), "cooperates": cooperation_pays(direct, shared)}


def flows(layout: str, world: int, tensors: Any, files: tuple[str, ...], encoded: list[np.ndarray]) -> dict[str, Any]:
    """Every rank's share of the cooperative load (:func:`~hp_dcp_hf.storage.read.spans.traffic`,
    16 MiB requests): the busiest and the mean rank's bytes read, received and sent."""
    from hp_dcp_hf.storage.read.needs import decode_needs
    from hp_dcp_hf.storage.read.spans import ClusterPlan, traffic

    needs = [decode_needs(e, tensors) for e in encoded]
    plan = ClusterPlan.build(tensors, needs, files, nodes=[r // NODE for r in range(world)])
    shares = traffic(plan, needs, 16 * 2**20)
    row: dict[str, Any] = {"layout": layout, "world": world, "spans": len(plan)}
    for name in ("storage_bytes", "received", "sent"):
        values = np.array([getattr(t, name) for t in shares], dtype=np.float64)
        row[f"{name}_max_gib"] = values.max() / 2**30
        row[f"{name}_mean_gib"] = values.mean() / 2**30
        row[f"{name}_max_over_mean"] = values.max() / values.mean() if values.mean() else None
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="deepseek-v3")
    p.add_argument("--world", type=int, default=1024)
    p.add_argument("--layouts", default="fsdp,hsdp")
    p.add_argument("--ranks", default="0,513")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--digest", action="store_true", help="hash the plan, the route and the sends")
    p.add_argument("--save-table", action="store_true", help="build and cache the checkpoint's byte layout")
    p.add_argument("--payoff", action="store_true", help="what cooperate='auto' weighs on a remote store, per layout")
    p.add_argument("--traffic", action="store_true", help="the busiest and the mean rank's bytes read, received, sent")
    args = p.parse_args()
    if args.save_table:
        print(save_table(args.arch))
        return
    tensors, files = load_table(args.arch)
    for layout in args.layouts.split(","):
        encoded = load_needs(layout, args.world)
        if args.payoff or args.traffic:
            measure = payoff if args.payoff else flows
            print(json.dumps(measure(layout, args.world, tensors, files, encoded)), flush=True)
            continue
        for rank in map(int, args.ranks.split(",")):
            started = time.perf_counter()
            row = time_rank(layout, args.world, rank, args.reps, args.digest, tensors, files, encoded)
            row["wall_s"] = time.perf_counter() - started
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
