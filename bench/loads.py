"""Side-by-side loads: every contender, every world size, same checkpoint, aggregated per case.

For each workload and world size, each contender runs in its own freshly spawned process group
(so memory peaks are its own), right after every checkpoint file was read once (warm page cache
for all: the benchmark measures loaders, not the disk). Rows of all ranks are aggregated into one
record per (workload, world, contender): median wall time over the repetitions (the slowest rank's
time per repetition), bytes per rank and in total, read amplification against this project's
plan for the same layout, requests, memory growth, and correctness (every rank's local shards
equal, byte for byte, to the legacy loader's in the same layout).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from bench.contenders import Job, run_rank
from bench.workloads import Workload, warm_page_cache
from hp_dcp_hf.tools.launch import run_ranks


def run_case(workload: Workload, world: int, contender: str, mesh: dict[str, int], *, reps: int, warmup: int,
             threads: int, timeout: float) -> list[dict[str, Any]]:
    """One contender on ``world`` ranks: its raw rows (one per rank and contender name)."""
    warm_page_cache(workload.path)
    job = Job(contender, workload.kind, str(workload.path), mesh, reps=reps, threads=threads, warmup=warmup)
    try:
        per_rank = run_ranks(world, run_rank, job, timeout=timeout)
    except Exception as e:  # a rank died or hung: the whole case failed
        return [{"contender": contender, "rank": 0, "error": f"{type(e).__name__}: {str(e)[-2000:]}"}]
    return [row for rows in per_rank for row in rows]


def aggregate(rows: list[dict[str, Any]], *, checkpoint_bytes: int) -> list[dict[str, Any]]:
    """Rows of one (workload, world) -> one record per contender name, cross-checked."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_name.setdefault(row["contender"], []).append(row)
    for group in by_name.values():
        group.sort(key=lambda r: r["rank"])
    minimum = {r["rank"]: r.get("bytes_needed") for r in by_name.get("dcp", []) if r.get("bytes_needed") is not None}
    legacy = {r["rank"]: r.get("digests") for r in by_name.get("legacy", []) if r.get("digests")}
    return [_record(name, group, minimum, legacy, checkpoint_bytes) for name, group in by_name.items()]


def _record(name: str, group: list[dict[str, Any]], minimum: dict[int, int], legacy: dict[int, dict[str, str]],
            checkpoint_bytes: int) -> dict[str, Any]:
    record: dict[str, Any] = {"contender": name, "ranks": len(group)}
    errors = [r["error"] for r in group if r.get("error")]
    skipped = next((r["skipped"] for r in group if r.get("skipped")), None)
    if errors or skipped:
        record["error" if errors else "skipped"] = errors[0] if errors else skipped
        tb = next((r.get("extra", {}).get("traceback") for r in group if r.get("extra", {}).get("traceback")), None)
        if tb:
            record["traceback"] = tb
        return record
    reps = min(len(r["wall_s"]) for r in group)
    walls = [max(r["wall_s"][i] for r in group) for i in range(reps)]
    record.update(wall_s=statistics.median(walls), wall_runs=walls,
                  own_max_s=statistics.median([max(r["own_s"][i] for r in group) for i in range(reps)]))
    parts = [r.get("extra", {}).get("load_part_s") for r in group]
    if all(parts):
        record["load_part_s"] = statistics.median([max(p[i] for p in parts) for i in range(reps)])
    needed = [r.get("bytes_needed") if r.get("bytes_needed") is not None else minimum.get(r["rank"]) for r in group]
    read = [r.get("bytes_read") for r in group]
    record.update(bytes_needed=needed, bytes_read=read, requests=[r.get("requests") for r in group],
                  local_param_bytes=[r.get("local_param_bytes") for r in group])
    if None not in read:
        record["bytes_read_total"] = sum(read)
        record["cluster_read_factor"] = sum(read) / checkpoint_bytes
        if None not in needed and sum(needed):
            record["amplification"] = sum(read) / sum(needed)
            record["amplification_max_rank"] = max(r / n for r, n in zip(read, needed) if n)
    growth = [r["beyond_params_rss"] if r.get("beyond_params_rss") is not None else r.get("growth_rss") for r in group]
    record.update(rss_growth_max=max(g or 0 for g in growth), anon_growth_max=max(r.get("growth_anon") or 0 for r in group))
    phases = [r.get("phases") for r in group if r.get("phases")]
    if phases:
        record["phases_max_s"] = {k: max(p[k] for p in phases) for k in phases[0]}
    if name.startswith("limit"):
        record["correct"] = None
        record["check"] = "reads bytes only (no model)"
    elif any(r.get("mismatched") is not None for r in group):
        bad = sorted({m for r in group for m in (r.get("mismatched") or [])})
        record["correct"], record["check"] = not bad, "against legacy, same model and layout, in-process"
        record["mismatched"] = bad[:20]
    elif name == "legacy":
        unfilled = sorted({k for r in group for k in (r.get("digests") or {}) if k.startswith("nan:")})
        record["correct"], record["check"] = not unfilled, "the reference (checked for unfilled elements)"
        record["mismatched"] = unfilled[:20]
    elif legacy and all(r.get("digests") for r in group):
        from bench.measure import compare_digests

        bad = sorted({m for r in group for m in compare_digests(r["digests"], legacy.get(r["rank"], {}))})
        record["correct"], record["check"] = not bad, "against legacy, same layout, byte for byte"
        record["mismatched"] = bad[:20]
    else:
        record["correct"], record["check"] = None, "no legacy run to compare with"
    notes = sorted({n for r in group for n in r.get("notes") or []})
    if notes:
        record["notes"] = notes
    extra = {k: v for k, v in group[0].get("extra", {}).items() if k not in ("load_part_s", "traceback")}
    if extra:
        record["extra"] = extra
    return record


def add_ratios(records: list[dict[str, Any]]) -> None:
    """``vs_limit`` and ``vs_dcp``: wall time over the limit's and over this project's, same case."""
    base = {r["contender"]: r.get("wall_s") for r in records}
    for r in records:
        if r.get("wall_s"):
            if base.get("limit"):
                r["vs_limit"] = r["wall_s"] / base["limit"]
            if base.get("dcp"):
                r["vs_dcp"] = r["wall_s"] / base["dcp"]


def run_loads(workloads: Sequence[Workload], worlds: Sequence[int], contenders: Sequence[str],
              meshes: Callable[[int], dict[str, int]], *, reps: int, warmup: int, threads: int, timeout: float,
              log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every (workload, world) case: its aggregated records, limit and dcp first."""
    from bench.layouts import mesh_label

    cases = []
    for workload in workloads:
        for world in worlds:
            mesh = meshes(world)
            rows: list[dict[str, Any]] = []
            for contender in contenders:
                log(f"  {workload.kind} x {world} rank(s) [{mesh_label(mesh)}]: {contender} ...")
                rows += run_case(workload, world, contender, mesh, reps=reps, warmup=warmup, threads=threads,
                                 timeout=timeout)
            records = aggregate(rows, checkpoint_bytes=workload.checkpoint_bytes)
            add_ratios(records)
            for r in records:
                log("    " + summary_line(r))
            cases.append({"workload": workload.kind, "checkpoint_bytes": workload.checkpoint_bytes, "world": world,
                          "mesh": mesh_label(mesh), "records": records})
    return cases


def summary_line(r: dict[str, Any]) -> str:
    if r.get("error") or r.get("skipped"):
        return f"{r['contender']:<14} {'ERROR' if r.get('error') else 'skipped'}: {(r.get('error') or r.get('skipped'))[:300]}"
    amp = f"amp {r['amplification']:.3f}" if r.get("amplification") else "amp -"
    ratio = f"x{r['vs_limit']:.2f} limit" if r.get("vs_limit") else ""
    ok = {True: "ok", False: "WRONG", None: "n/a"}[r.get("correct")]
    return (f"{r['contender']:<14} {r['wall_s']:8.3f} s {ratio:>12}  {amp}  rss+ {r['rss_growth_max'] / 2**20:7.1f} MiB  "
            f"{ok}")
