"""The CPU a rank spends before its first read, step by step, on a real layout.

``python -m bench.before_read [--kind moe] [--world 2] [--mesh dp=2] [--reps 7] [--cache DIR]``

Every rank builds the workload's model on its mesh, reads the metadata once, then times, ``reps``
times each and in one process: the local plan (``set_up_planner`` + ``create_local_plan``), the
destinations (``resolve_tensor`` of every item), the chunks (``Chunker.all``) and their batches:
what ``read_data`` does before a direct read's first request. Medians per rank, in milliseconds,
one JSON line each, with the number of items and chunks. No collective runs while timing, so two
trees can be timed in turn by the same command on a noisy machine and their steps compared
(``load_hf_checkpoint``'s phases, in ``bench/warm.py``, add DCP's collectives and the other ranks'
skew). Not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.layouts import parse_mesh

STEPS = ("plan", "destinations", "chunks", "batches")


def _rank(rank: int, world: int, path: str, kind: str, mesh: dict[str, int], reps: int) -> dict[str, Any]:
    from bench.contenders import Job, build_model, quiet_transformers
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader
    from hp_dcp_hf.storage.read.chunks import batches, destination
    from hp_dcp_hf.util.perf import paused_gc

    quiet_transformers()
    model = build_model(Job("dcp", kind, path, mesh))
    reader = HFStorageReader(path)
    metadata = reader.read_metadata()
    seconds: dict[str, list[float]] = {step: [] for step in STEPS}
    for _ in range(reps):
        with paused_gc():  # as in a load
            marks = [time.perf_counter()]
            planner = HFMappingPlanner(model)
            planner.set_up_planner(model.state_dict(), metadata, rank == 0)
            plan = planner.create_local_plan()
            marks.append(time.perf_counter())
            dests = [destination(item, planner) for item in plan.items]
            marks.append(time.perf_counter())
            chunks = reader._chunker().all(plan.items, dests)
            marks.append(time.perf_counter())
            batches(chunks, reader.settings.batch_bytes)
            marks.append(time.perf_counter())
        for step, start, end in zip(STEPS, marks, marks[1:]):
            seconds[step].append(end - start)
    return {"rank": rank, "items": len(plan.items), "chunks": len(chunks),
            **{f"{step}_ms": round(statistics.median(v) * 1e3, 2) for step, v in seconds.items()}}


def main(argv: list[str] | None = None) -> int:
    from bench.workloads import ensure_workload, parse_size
    from hp_dcp_hf.tools.launch import run_ranks

    p = argparse.ArgumentParser(prog="python -m bench.before_read", description=__doc__.split("\n")[0])
    p.add_argument("--kind", default="moe")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--mesh", default="dp=2")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--cache", default=os.environ.get("BENCH_CACHE", str(Path.home() / ".cache" / "hp-dcp-hf-bench")))
    args = p.parse_args(argv)
    workload = ensure_workload(args.kind, parse_size("full"), Path(args.cache))
    for result in run_ranks(args.world, _rank, str(workload.path), args.kind, parse_mesh(args.mesh), args.reps,
                            timeout=900):
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
