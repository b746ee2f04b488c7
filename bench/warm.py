"""Warm local loads against the raw reads of the same bytes, with every rank's phases.

``python -m bench.warm [--kinds dense,moe] [--cases "4:dp=2,tp=2;2:dp=2"] [--reps 3] [--threads N]
[--cache DIR] [--label TEXT] [--name NAME]``

Per case (ranks and mesh; ``2:dp=2`` is FSDP2 over two ranks), in one process group: this rank's
planned byte ranges read with ``os.preadv`` by 1 and by 4 threads (``bench/limit.py``'s
``RawReads``, the limit of issue 33 being the faster of the two), then the same checkpoint loaded
by ``load_hf_checkpoint`` (``--threads``; by default the reader's own choice), ``--warmup`` + ``--reps``
times, warm page cache throughout. Reported: the load's wall (slowest rank, median), its ratio to
the limit, each rank's phases (``LoadReport.seconds``, median per phase) and the bytes read and
needed; and the first load's wall and phases (the process's first: what a job that loads once pays,
transformers' table of conversion mappings built included). Meant to be run in two trees in turn (before / after) by the same command; not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from bench import measure
from bench.layouts import mesh_label, parse_mesh

LIMIT_THREADS = (1, 4)


def _rank(rank: int, world: int, path: str, kind: str, mesh: dict[str, int], reps: int, warmup: int,
          threads: int | None) -> dict[str, Any]:
    """One rank: a first load, the raw-read limits, then the loads; its times, phases and counts."""
    from bench.contenders import Job, build_model, quiet_transformers, refill_nan
    from bench.limit import RawReads, plan_ranges
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader, load_hf_checkpoint

    quiet_transformers()
    model = build_model(Job("dcp", kind, path, mesh))
    options = {} if threads is None else {"num_threads": threads}

    def load() -> tuple[float, dict[str, float], Any, Any]:
        refill_nan(model)
        reader, planner = HFStorageReader(path, **options), HFMappingPlanner(model)
        with measure.timed_across_ranks() as timer:
            report = load_hf_checkpoint(model, path, reader=reader, planner=planner)
        return timer.wall_s, measure.phase_seconds(report.seconds, timer.own_s), reader, planner

    # the process's first load before anything else plans: what a job that loads once pays
    first_wall, first_phases, *_ = load()
    reader = HFStorageReader(path, **options)
    items = HFMappingPlanner(model).plan_reads(model.state_dict(), reader.read_metadata())
    raw = RawReads(path, plan_ranges(items, reader.entries))
    limits: dict[int, list[float]] = {t: [] for t in LIMIT_THREADS}
    try:
        for t in LIMIT_THREADS:
            raw.read(t)
            for _ in range(reps):
                with measure.timed_across_ranks() as timer:
                    raw.read(t)
                limits[t].append(timer.wall_s)
    finally:
        raw.close()
    walls, phases = [], []
    for rep in range(warmup + reps):
        wall, seconds, reader, planner = load()
        if rep >= warmup:
            walls.append(wall)
            phases.append(seconds)
    total = reader.stats.total()
    return {"rank": rank, "wall_s": walls, "first": {"wall_s": first_wall, "phases": first_phases},
            "limit_s": {str(t): v for t, v in limits.items()}, "phases": measure.median_phases(phases), "own_s": statistics.median(_own(p) for p in phases),
            "bytes_read": total.bytes_read, "bytes_needed": planner.stats.bytes_needed,
            # a reader from before the choice of threads (a baseline tree) has only its option
            "threads": getattr(reader.settings, "threads", reader.options.num_threads)}


def _own(phases: dict[str, float]) -> float:
    """A rank's own time in a load: its sequential phases and the rest."""
    return sum(phases[k] for k in measure.SEQUENTIAL) + phases["other"]


def run_case(kind: str, world: int, mesh: dict[str, int], *, cache: Path, reps: int, warmup: int,
             threads: int | None) -> dict[str, Any]:
    from bench.workloads import ensure_workload, parse_size, warm_page_cache
    from hp_dcp_hf.tools.launch import run_ranks

    workload = ensure_workload(kind, parse_size("full"), cache)
    warm_page_cache(workload.path)
    ranks = run_ranks(world, _rank, str(workload.path), kind, mesh, reps, warmup, threads, timeout=900)
    wall = statistics.median(ranks[0]["wall_s"])
    limits = {t: statistics.median(ranks[0]["limit_s"][str(t)]) for t in LIMIT_THREADS}
    return {"kind": kind, "world": world, "mesh": mesh_label(mesh), "wall_s": wall, "limit_s": limits,
            "vs_limit": wall / min(limits.values()), "first_s": ranks[0]["first"]["wall_s"], "ranks": ranks}


def markdown(cases: list[dict[str, Any]], label: str) -> str:
    from hp_dcp_hf.load.api import PHASES

    lines = [f"## {label}", "", "| workload | ranks | mesh | threads | load s | limit s (1 / 4 threads) | vs limit | "
             "first load s | bytes read = needed (max rank) |", "|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        reads = max(r["bytes_read"] for r in c["ranks"])
        same = all(r["bytes_read"] == r["bytes_needed"] for r in c["ranks"])
        lines.append(f"| {c['kind']} | {c['world']} | {c['mesh']} | {c['ranks'][0]['threads']} | {c['wall_s']:.3f} | "
                     + " / ".join(f"{v:.3f}" for v in c["limit_s"].values())
                     + f" | {c['vs_limit']:.2f}x | {c['first_s']:.3f} | {reads} {'yes' if same else 'NO'} |")
    names = [*PHASES, "other"]
    lines += ["", "Phases of each rank (median per phase), seconds:", "",
              "| workload | mesh | rank | load | own s | " + " | ".join(names) + " |", "|" + "---|" * (5 + len(names))]
    for c in cases:
        for r in c["ranks"]:
            first = r["first"]["phases"]
            for load, own, seconds in (("median", r["own_s"], r["phases"]), ("first", _own(first), first)):
                lines.append(f"| {c['kind']} | {c['mesh']} | {r['rank']} | {load} | {own:.3f} | "
                             + " | ".join(f"{seconds.get(n, 0.0):.3f}" for n in names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.warm", description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="dense,moe")
    p.add_argument("--cases", default="4:dp=2,tp=2;2:dp=2", help="';'-separated WORLD:MESH")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="the reader's num_threads (default: its own choice)")
    p.add_argument("--cache", default=os.environ.get("BENCH_CACHE", str(Path.home() / ".cache" / "hp-dcp-hf-bench")))
    p.add_argument("--label", default="warm local loads")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--name", default=None, help="write <out>/<name>.md and .json")
    args = p.parse_args(argv)
    load_start = os.getloadavg()
    cases = []
    for spec in args.cases.split(";"):
        world, _, mesh = spec.partition(":")
        for kind in args.kinds.split(","):
            cases.append(run_case(kind, int(world), parse_mesh(mesh), cache=Path(args.cache), reps=args.reps,
                                  warmup=args.warmup, threads=args.threads))
            print(f"{kind} {spec}: load {cases[-1]['wall_s']:.3f} s, {cases[-1]['vs_limit']:.2f}x the limit",
                  flush=True)
    text = markdown(cases, args.label) + f"\n\nload average {load_start} at the start, {os.getloadavg()} at the end\n"
    print(text)
    if args.name:
        stem = Path(args.out) / args.name
        stem.with_suffix(".json").write_text(json.dumps({"label": args.label, "cases": cases,
                                                          "load_average": [load_start, os.getloadavg()]}, indent=2))
        stem.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
