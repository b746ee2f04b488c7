"""The cold part: loads that start from an empty page cache, as a real load of a large model does.

    python -m bench.cold                                  # 1 GB dense + MoE, 2 and 4 ranks, 3 reps
    python -m bench.cold --size 50MB --reps 2             # smoke
    python -m bench.cold --worlds 4 --kinds moe --contenders floor,dcp,dcp+willneed
    python -m bench.cold --worlds 4 --kinds moe --contenders floor,dcp --phases   # each rank's phases

Checkpoints: the ``dense`` and ``moe`` workloads of :mod:`bench.workloads`, cached under ``--cache``
(outside the repository). Every contender of one (workload, world) runs in one process group of
gloo ranks, side by side: each repetition runs every contender once (the order rotated from one
repetition to the next), and before each load rank 0 evicts every file of the checkpoint from the
page cache (``os.fsync``, then ``posix_fadvise(POSIX_FADV_DONTNEED)``) and counts the pages still
resident (``mincore`` of a mapping of each file, through ctypes) between two barriers: the
``resident_before`` of every record, 0 when the eviction worked. After the load it counts them again
(``resident_after``: what the load brought into the page cache, readahead included). Each rank's
``/proc/self/io`` ``read_bytes`` before and after gives the bytes it made the kernel fetch from the
block device (``storage_bytes``; with one page cache on this one machine, a page another rank brought
in first counts for that one). Layouts: :mod:`bench.layouts` (2 ranks ``tp=2``, 4 ranks
``dp=2,tp=2``), the model built once per rank and refilled with NaN before every load.

Contenders (``--contenders``):

* ``floor``: ``os.preadv`` of exactly the byte ranges of the rank's plan (:class:`bench.limit.RawReads`,
  ranges from :func:`bench.limit.plan_ranges` of ``HFMappingPlanner.plan_reads``: what ``limit`` of
  the loads part reads, and what :func:`hp_dcp_hf.tools.rank_plans.plan_ranks` counts), into a touched buffer.
* ``whole``: every safetensors file read whole on every rank (the same ``RawReads``, one range per file).
* ``torch``: torch's ``HuggingFaceStorageReader`` + ``DefaultLoadPlanner`` on the identity-named model
  (:func:`bench.contenders.torch_load`, experts stacked after, as in the loads part).
* ``dcp``: this project, ``load_hf_checkpoint`` with an ``HFStorageReader`` (mapped local files).
* ``dcp+spans``: the same with ``cooperate="always"``: span ownership, every needed byte read by one
  rank (spans of at least 8 MiB, ranged reads) and the raw bytes exchanged over gloo.
* ``dcp+willneed``: the same with ``prefetch=True`` (``posix_fadvise(WILLNEED)`` of the batches'
  ranges ahead of the reads); ``dcp+odirect``: ``direct_io=True`` (``O_DIRECT`` ranged reads);
  ``dcp+preadv``: ``map_local_files=False`` (buffered ranged reads, the baseline of ``O_DIRECT``).

Every ``dcp*`` and ``torch`` load's local shards are checked against ``dcp``'s (blake2b digests of
every state-dict entry, first timed repetition).

Multi-host simulation (``--multihost``, 4 ranks): the ranks grouped into ``--nodes`` nodes of
consecutive ranks that do not share a page cache. Every load's reads are taken node by node: before a
node's turn its first rank evicts the files and checks residency, then only that node's ranks read
(``floor``: its ranges; ``dcp``: the reader's ``read_data``, metadata and planning ran on every rank
at once before), then the next node. Reported per node: ``storage_bytes`` (its ranks' ``read_bytes``)
and ``resident_after`` (pages in the cache after its turn), against the bytes its ranks need (the
union of their ranges) and the cluster's one copy (the union over every rank). ``dcp+spans`` reads
on every rank at once (its exchange is collective), each rank telling the reader its node
(``node=``): a span's owner is preferably on a node that needs it, and each node's storage bytes are
its ranks' own reads, which no page cache of another node serves (one cache on this machine: its
residency is reported once, on node 0). Meshes: ``dp=2,tp=2`` (the nodes need different rows) and
``dp_replicate=2,tp=2`` (HSDP: each node is one replica and needs the whole checkpoint: one copy per
node for direct reads, one per cluster with span ownership).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.workloads import Workload, human, size_tag

CONTENDERS = ("floor", "whole", "torch", "dcp", "dcp+spans", "dcp+willneed", "dcp+preadv", "dcp+odirect")
MULTIHOST_CONTENDERS = ("floor", "dcp", "dcp+spans")
MULTIHOST_MESHES = "dp=2,tp=2;dp_replicate=2,tp=2"
OPTIONS: dict[str, dict[str, Any]] = {
    "dcp": {}, "dcp+spans": {"cooperate": "always"}, "dcp+willneed": {"prefetch": True},
    "dcp+preadv": {"map_local_files": False}, "dcp+odirect": {"direct_io": True},
}
PAGE = mmap.PAGESIZE


# -- the page cache ------------------------------------------------------------------------------


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """Every plain file of the checkpoint directory (safetensors, index, config)."""
    return sorted(p for p in Path(path).iterdir() if p.is_file())


def evict(files: Sequence[Path]) -> None:
    """Drop every page of ``files`` from the page cache (written back first if dirty)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_bytes(files: Sequence[Path]) -> int:
    """Bytes of ``files`` in the page cache (``mincore`` of a read-only mapping of each; the last
    page counts whole)."""
    total = 0
    for file in files:
        size = file.stat().st_size
        if not size:
            continue
        with open(file, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
            data = np.frombuffer(m, dtype=np.uint8)
            vec = np.zeros(-(-size // PAGE), dtype=np.uint8)
            if _libc.mincore(ctypes.c_void_p(data.ctypes.data), size, ctypes.c_void_p(vec.ctypes.data)):
                raise OSError(ctypes.get_errno(), f"mincore {file}")
            del data
            total += int(np.count_nonzero(vec & 1)) * PAGE
    return total


def storage_read_bytes() -> int:
    """Bytes this process (every thread) made the kernel fetch from storage (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes (no task I/O accounting)")


def union_bytes(ranges: Sequence[tuple[int, int]], *, page: int = 1) -> int:
    """Bytes covered by ``[start, end)`` ranges, overlaps once; with ``page``, whole pages."""
    covered, end = 0, 0
    for lo, hi in sorted((lo - lo % page, -(-hi // page) * page) for lo, hi in ranges):
        covered += max(0, hi - max(lo, end))
        end = max(end, hi)
    return covered


# -- on every rank -------------------------------------------------------------------------------


@dataclass
class ColdJob:
    """One process group's work: ``contenders`` cold, side by side, then the multi-host pass."""

    kind: str
    path: str
    mesh: dict[str, int]
    contenders: list[str]
    reps: int = 3
    warmup: int = 1
    threads: int = 8
    nodes: int = 1  # > 1: the multi-host pass, ``multihost`` contenders
    multihost: list[str] = field(default_factory=list)


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


class _Cache:
    """Eviction and residency, done by one rank between barriers."""

    def __init__(self, files: list[Path], leader: bool) -> None:
        self.files, self.leader = files, leader

    def evict(self) -> int | None:
        """Evict (the leader), then every rank waits; the resident bytes the leader found after."""
        _barrier()
        found = None
        if self.leader:
            evict(self.files)
            found = resident_bytes(self.files)
        _barrier()
        return found

    def resident(self) -> int | None:
        _barrier()
        return resident_bytes(self.files) if self.leader else None


def _dcp_load(model, path: str, threads: int, reader_cls=None, **options) -> dict[str, Any]:
    """``load_hf_checkpoint`` with an ``HFStorageReader`` of ``options``; its counts."""
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader, load_hf_checkpoint

    reader = (reader_cls or HFStorageReader)(path, num_threads=threads, **options)
    planner = HFMappingPlanner(model)
    report = load_hf_checkpoint(model, path, reader=reader, planner=planner)
    total = reader.stats.total()
    return {"bytes_read": total.bytes_read, "bytes_needed": planner.stats.bytes_needed, "requests": total.requests,
            "read_s": reader.seconds.get("read"), "phases": dict(report.seconds)}


def _turns(rank: int, world: int, nodes: int):
    """Node-serialized reads: a ``read(fn)`` that runs ``fn`` on this rank in its node's turn only
    (the node's first rank evicts before it, every rank waits for every turn), and the turns' log."""
    per = world // nodes
    node, files_holder, log = rank // per, {}, []

    def read(fn: Callable[[], Any]) -> Any:
        cache: _Cache = files_holder["cache"]
        out = None
        for turn in range(nodes):
            cache.leader = rank == turn * per
            before = cache.evict()
            io0 = storage_read_bytes()
            start = time.perf_counter()
            if turn == node:
                out = fn()
            own = time.perf_counter() - start
            io1 = storage_read_bytes()
            after = cache.resident()
            if turn == node:
                log.append({"node": node, "own_s": own, "storage_bytes": io1 - io0})
            if cache.leader:
                log.append({"node": turn, "leader": True, "resident_before": before, "resident_after": after})
        cache.leader = rank == 0
        return out

    return read, files_holder, log


def run_rank(rank: int, world: int, job: ColdJob) -> dict[str, Any]:
    """Entry point of a spawned rank: every contender cold, ``job.reps`` times; its measurements."""
    try:
        return _run_rank(rank, world, job)
    except Exception as e:
        return {"rank": rank, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def _run_rank(rank: int, world: int, job: ColdJob) -> dict[str, Any]:
    import torch.distributed as dist

    from bench import measure
    from bench.contenders import Job, quiet_transformers, refill_nan, torch_load
    from bench.limit import RawReads, plan_ranges
    from bench.remote import build
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader

    quiet_transformers()
    files = checkpoint_files(job.path)
    cache = _Cache(files, rank == 0)
    bench_job = Job("dcp", job.kind, job.path, job.mesh, reps=job.reps, threads=job.threads, warmup=job.warmup)
    model = build(bench_job)
    reader = HFStorageReader(job.path, broadcast_metadata=False)
    ranges = plan_ranges(HFMappingPlanner(model).plan_reads(model.state_dict(), reader.read_metadata()), reader.entries)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, ranges)
    out: dict[str, Any] = {"rank": rank, "ranges": {f: len(r) for f, r in ranges.items()},
                           "needed": sum(e - s for rs in ranges.values() for s, e in rs), "contenders": {}}
    if rank == 0:
        out["every_ranges"] = every
    raws: dict[str, RawReads] = {}
    if "floor" in job.contenders or "floor" in job.multihost:
        raws["floor"] = RawReads(job.path, ranges)
    if "whole" in job.contenders:
        whole = {f.name: [(0, f.stat().st_size)] for f in files if f.suffix == ".safetensors"}
        raws["whole"] = RawReads(job.path, whole)

    def load(name: str, reader_cls=None) -> dict[str, Any]:
        if name in raws:
            return {"bytes_read": raws[name].read(job.threads), "requests": raws[name].requests}
        if name == "torch":
            return torch_load(model, bench_job)
        return _dcp_load(model, job.path, job.threads, reader_cls, **OPTIONS[name])

    reference: dict[str, str] | None = None
    names = list(job.contenders)
    for rep in range(-job.warmup, job.reps):
        shift = rep % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            record = out["contenders"].setdefault(name, {"wall_s": [], "own_s": [], "storage_bytes": [],
                                                         "resident_before": [], "resident_after": []})
            refill_nan(model)
            measure.trim_memory()
            before = cache.evict()
            io0 = storage_read_bytes()
            with measure.timed_across_ranks() as timer:
                counts = load(name)
            io1 = storage_read_bytes()
            after = cache.resident()
            if rep < 0:
                continue
            record["wall_s"].append(timer.wall_s)
            record["own_s"].append(timer.own_s)
            record["storage_bytes"].append(io1 - io0)
            record["resident_before"].append(before)
            record["resident_after"].append(after)
            record.update({k: v for k, v in counts.items() if k not in ("read_s", "phases")})
            record.setdefault("read_s", []).append(counts.get("read_s"))
            if "phases" in counts:
                record.setdefault("phases", []).append(measure.phase_seconds(counts["phases"], timer.own_s))
            if rep == 0 and name not in raws:
                digests = measure.digests(model)
                if name == "dcp":
                    reference = digests
                record["_digests"] = digests
    for record in out["contenders"].values():
        digests = record.pop("_digests", None)
        if digests is not None and reference is not None:
            record["mismatched"] = measure.compare_digests(digests, reference)[:20]
    if job.nodes > 1:
        out["multihost"] = _multihost(rank, world, job, model, raws, cache)
    for raw in raws.values():
        raw.close()
    return out


def _multihost(rank: int, world: int, job: ColdJob, model, raws, cache: _Cache) -> dict[str, Any]:
    """Each ``job.multihost`` contender ``job.reps`` times, its reads node by node (see the module)."""
    from bench import measure
    from bench.contenders import refill_nan
    from hp_dcp_hf import HFStorageReader

    read, holder, log = _turns(rank, world, job.nodes)
    holder["cache"] = cache

    class NodeReader(HFStorageReader):
        """Its ``read_data`` in its node's turn only (every rank takes part in every turn's barriers)."""

        def read_data(self, plan, planner):
            return read(lambda: super(NodeReader, self).read_data(plan, planner))

    out: dict[str, Any] = {}
    for name in job.multihost:
        runs = []
        for rep in range(-job.warmup, job.reps):
            refill_nan(model)
            measure.trim_memory()
            log.clear()
            with measure.timed_across_ranks() as timer:
                if name == "floor":
                    read(lambda: raws["floor"].read(job.threads))
                elif name == "dcp+spans":
                    _spans_turn(rank, world, job, model, cache, log)
                else:
                    _dcp_load(model, job.path, job.threads, NodeReader, **OPTIONS[name])
            if rep >= 0:
                runs.append({"wall_s": timer.wall_s, "turns": list(log)})
        out[name] = runs
    return out


def _spans_turn(rank: int, world: int, job: ColdJob, model, cache: _Cache, log: list[dict[str, Any]]) -> None:
    """A cooperative load on every rank at once, each naming its node; logged as one turn per node."""
    node = rank // (world // job.nodes)
    before = cache.evict()
    io0 = storage_read_bytes()
    start = time.perf_counter()
    _dcp_load(model, job.path, job.threads, node=f"node{node}", **OPTIONS["dcp+spans"])
    own = time.perf_counter() - start
    io1 = storage_read_bytes()
    after = cache.resident()
    log.append({"node": node, "own_s": own, "storage_bytes": io1 - io0})
    if cache.leader:
        log.extend({"node": n, "leader": True, "resident_before": before, "resident_after": after if n == 0 else 0}
                   for n in range(job.nodes))


# -- in the bench process ------------------------------------------------------------------------


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    values = [v for v in values if v is not None]
    return {"median": statistics.median(values) if values else None, "min": min(values) if values else None}


def aggregate(rows: list[dict[str, Any]], world: int, nodes: int) -> dict[str, Any]:
    """The ranks' measurements -> one record per contender and the multi-host summary."""
    from bench import measure

    rows = sorted(rows, key=lambda r: r["rank"])
    errors = {r["rank"]: r["error"] for r in rows if r.get("error")}
    if errors:
        return {"errors": errors, "traceback": next(r.get("traceback") for r in rows if r.get("error"))}
    every = rows[0]["every_ranges"]
    per_rank_needed = [sum(e - s for rs in r.values() for s, e in rs) for r in every]

    def union(ranks: Sequence[int], page: int = 1) -> int:
        files = {f for r in ranks for f in every[r]}
        return sum(union_bytes([x for r in ranks for x in every[r].get(f, ())], page=page) for f in files)

    everyone = list(range(world))
    out: dict[str, Any] = {"needed_per_rank": per_rank_needed, "needed_sum": sum(per_rank_needed),
                           "needed_union": union(everyone), "needed_union_pages": union(everyone, PAGE),
                           "contenders": []}
    for name in [n for n in CONTENDERS if n in rows[0]["contenders"]]:
        recs = [r["contenders"][name] for r in rows]
        reps = min(len(c["wall_s"]) for c in recs)
        walls = [max(c["wall_s"][i] for c in recs) for i in range(reps)]
        storage = [sum(c["storage_bytes"][i] for c in recs) for i in range(reps)]
        record = {"contender": name, "wall_runs": walls, "wall_s": _stats(walls),
                  "bytes_read_per_rank": [c.get("bytes_read") for c in recs],
                  "requests_per_rank": [c.get("requests") for c in recs],
                  "storage_bytes_per_rank": [statistics.median(c["storage_bytes"]) for c in recs],
                  "storage_bytes_all_ranks": _stats(storage),
                  "resident_before": recs[0]["resident_before"], "resident_after": recs[0]["resident_after"],
                  "read_s_max": _stats([max(c["read_s"][i] or 0 for c in recs) for i in range(reps)])
                  if recs[0].get("read_s") and recs[0]["read_s"][0] is not None else None,
                  "own_s_per_rank": [statistics.median(c["own_s"]) for c in recs]}
        if recs[0].get("phases"):
            record["phases_per_rank"] = [measure.median_phases(c["phases"]) for c in recs]
        if any("mismatched" in c for c in recs):
            bad = sorted({m for c in recs for m in c.get("mismatched", [])})
            record["correct"], record["mismatched"] = not bad, bad
        out["contenders"].append(record)
    floor = next((r for r in out["contenders"] if r["contender"] == "floor"), None)
    for r in out["contenders"]:
        if floor and floor["wall_s"]["median"] and r["wall_s"]["median"]:
            r["vs_floor"] = r["wall_s"]["median"] / floor["wall_s"]["median"]
            r["vs_floor_min"] = r["wall_s"]["min"] / floor["wall_s"]["min"]
            pairs = [w / f for w, f in zip(r["wall_runs"], floor["wall_runs"], strict=False)]
            r["vs_floor_paired"] = statistics.median(pairs)
    if nodes > 1 and rows[0].get("multihost"):
        out["multihost"] = _multihost_summary(rows, world, nodes, union)
    return out


def _multihost_summary(rows, world: int, nodes: int, union) -> dict[str, Any]:
    per = world // nodes
    node_ranks = [list(range(n * per, (n + 1) * per)) for n in range(nodes)]
    summary: dict[str, Any] = {"nodes": nodes, "ranks_per_node": per,
                               "needed_per_node": [union(r) for r in node_ranks],
                               "needed_per_node_pages": [union(r, PAGE) for r in node_ranks],
                               "needed_cluster_one_copy": union(list(range(world))), "contenders": []}
    for name in rows[0]["multihost"]:
        runs = [r["multihost"][name] for r in rows]
        reps = min(len(x) for x in runs)
        node_storage = [[0] * nodes for _ in range(reps)]
        node_time = [[0.0] * nodes for _ in range(reps)]
        node_resident = [[None] * nodes for _ in range(reps)]
        resident_before = []
        for rank_runs in runs:
            for i in range(reps):
                for turn in rank_runs[i]["turns"]:
                    if turn.get("leader"):
                        node_resident[i][turn["node"]] = turn["resident_after"]
                        resident_before.append(turn["resident_before"])
                    else:
                        node_storage[i][turn["node"]] += turn["storage_bytes"]
                        node_time[i][turn["node"]] = max(node_time[i][turn["node"]], turn["own_s"])
        med = [int(statistics.median(node_storage[i][n] for i in range(reps))) for n in range(nodes)]
        res = [int(statistics.median(node_resident[i][n] or 0 for i in range(reps))) for n in range(nodes)]
        cluster = sum(med)
        summary["contenders"].append({
            "contender": name, "storage_bytes_per_node": med, "resident_after_per_node": res,
            "storage_bytes_cluster": cluster, "resident_cluster": sum(res),
            "cluster_vs_one_copy": cluster / summary["needed_cluster_one_copy"],
            "resident_vs_one_copy": sum(res) / summary["needed_cluster_one_copy"],
            "node_read_s": [_stats([node_time[i][n] for i in range(reps)]) for n in range(nodes)],
            "resident_before_max": max(resident_before) if resident_before else None,
            "storage_runs": node_storage})
    return summary


def run_case(workload: Workload, world: int, mesh: dict[str, int], contenders: list[str], *, reps: int,
             warmup: int, threads: int, nodes: int = 1, multihost: Sequence[str] = (), timeout: float = 1800,
             phases: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    from bench.layouts import mesh_label
    from hp_dcp_hf.tools.launch import run_ranks

    label = mesh_label(mesh)
    log(f"  {workload.kind} x {world} ranks [{label}]: {','.join(contenders) or '-'}"
        + (f"; multi-host {nodes} nodes: {','.join(multihost)}" if nodes > 1 else ""))
    job = ColdJob(workload.kind, str(workload.path), mesh, list(contenders), reps=reps, warmup=warmup,
                  threads=threads, nodes=nodes, multihost=list(multihost))
    begun = time.perf_counter()
    try:
        rows = run_ranks(world, run_rank, job, timeout=timeout)
    except Exception as e:
        rows = [{"rank": 0, "error": f"{type(e).__name__}: {str(e)[-2000:]}"}]
    case = {"workload": workload.kind, "checkpoint_bytes": workload.checkpoint_bytes, "files": workload.files,
            "world": world, "mesh": label, **aggregate(rows, world, nodes), "group_s": time.perf_counter() - begun}
    for r in case.get("contenders", []):
        log("    " + summary_line(r))
    if phases and case.get("contenders"):
        for line in phase_lines(case):
            log("    " + line)
    for r in case.get("multihost", {}).get("contenders", []):
        log(f"    multi-host {r['contender']:<6} storage per node {[human(b) for b in r['storage_bytes_per_node']]} "
            f"cluster {human(r['storage_bytes_cluster'])} = {r['cluster_vs_one_copy']:.2f}x one copy")
    if case.get("errors"):
        log(f"    errors: {case['errors']}")
    return case


def summary_line(r: dict[str, Any]) -> str:
    ratio = f"x{r['vs_floor']:.2f} floor" if r.get("vs_floor") else ""
    ok = {True: "ok", False: "WRONG", None: ""}[r.get("correct")]
    return (f"{r['contender']:<13} {r['wall_s']['median']:7.3f} s (min {r['wall_s']['min']:.3f}) {ratio:>12}  "
            f"storage {human(r['storage_bytes_all_ranks']['median'] or 0)}  resident before "
            f"{max(x or 0 for x in r['resident_before'])} B  {ok}")


# -- the report ----------------------------------------------------------------------------------


def phase_lines(case: dict[str, Any]) -> list[str]:
    """The case's per-rank phase table (:func:`bench.measure.phase_table`): every contender with
    phases, each rank beside the floor's own time on it."""
    from bench.measure import phase_table

    recs = case["contenders"]
    floor = next((r["own_s_per_rank"] for r in recs if r["contender"] == "floor" and r.get("own_s_per_rank")), [])
    rows = [(r["contender"], rank, r["own_s_per_rank"][rank], phases)
            for r in recs for rank, phases in enumerate(r.get("phases_per_rank") or [])]
    return phase_table(rows, dict(enumerate(floor)))


def _f(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def render(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = [f"# Cold page cache: {doc['size']} checkpoints, local files", "",
             f"{env['cpus']} CPUs, torch {env['torch']}, git {env['git']}, {env['threads']} read threads per rank; "
             f"load average {env['load_start']} at the start, {env.get('load_end')} at the end; "
             f"{doc.get('elapsed_s', 0):.0f} s. Command: `{doc['command']}`.", "",
             "Every load starts from an evicted page cache (`posix_fadvise(DONTNEED)` on every file, `mincore` "
             "checked: *resident before*); contenders side by side in one process group per case, the order "
             "rotated per repetition. Wall: slowest rank, median and min over the repetitions. *vs floor*: "
             "median over median (min over min; median of the per-repetition ratios). *storage*: the ranks' "
             "`/proc/self/io` `read_bytes` (what the block device delivered; one page cache for all ranks "
             "here); *cache after*: what the load left resident (readahead included).", ""]
    lines += [line for note in doc.get("notes", []) for line in (f"Note: {note}", "")]
    lines += ["| workload | ranks | mesh | contender | wall s median | wall s min | vs floor (median) | vs floor (min) "
              "| vs floor (paired) | bytes read / rank (max) | storage bytes, all ranks | cache after | "
              "resident before (max) | requests / rank (max) | correct |", "|" + "---|" * 15]
    for case in doc["cases"]:
        if case.get("errors"):
            lines.append(f"| {case['workload']} | {case['world']} | {case['mesh']} | error: "
                         f"{str(case['errors'])[:200]} |" + " |" * 11)
            continue
        for r in case["contenders"]:
            reads = [b for b in r["bytes_read_per_rank"] if b is not None]
            reqs = [b for b in r["requests_per_rank"] if b is not None]
            lines.append("| " + " | ".join([
                case["workload"], str(case["world"]), case["mesh"], f"`{r['contender']}`",
                _f(r["wall_s"]["median"]), _f(r["wall_s"]["min"]),
                f"{r['vs_floor']:.2f}x" if r.get("vs_floor") else "-",
                f"{r['vs_floor_min']:.2f}x" if r.get("vs_floor_min") else "-",
                f"{r['vs_floor_paired']:.2f}x" if r.get("vs_floor_paired") else "-",
                human(max(reads)) if reads else "-", human(r["storage_bytes_all_ranks"]["median"] or 0),
                human(statistics.median(x or 0 for x in r["resident_after"])),
                f"{max(x or 0 for x in r['resident_before'])} B", str(max(reqs)) if reqs else "-",
                {True: "yes", False: "**no**", None: "n/a"}[r.get("correct")],
            ]) + " |")
    lines += ["", "Needed bytes (the plan's ranges; union: each byte once over the ranks):", "",
              "| workload | ranks | mesh | needed / rank | sum over ranks | union | union in whole pages |",
              "|---|---|---|---|---|---|---|"]
    for case in doc["cases"]:
        if not case.get("errors"):
            lines.append(f"| {case['workload']} | {case['world']} | {case['mesh']} | "
                         f"{', '.join(human(b) for b in case['needed_per_rank'])} | {human(case['needed_sum'])} | "
                         f"{human(case['needed_union'])} | {human(case['needed_union_pages'])} |")
    if doc["settings"].get("phases"):
        from bench.measure import PHASES_NOTE

        lines += ["", "## Phases per rank", "", PHASES_NOTE]
        for case in doc["cases"]:
            if not case.get("errors") and case.get("contenders"):
                lines += ["", f"{case['workload']} x {case['world']} ({case['mesh']}):", "", *phase_lines(case)]
    hosts = [c for c in doc["cases"] if c.get("multihost")]
    if hosts:
        lines += ["", "## Multi-host simulation", "",
                  "Ranks in nodes of consecutive ranks that do not share a page cache: node by node, the node's first "
                  "rank evicts, then only its ranks read. *storage per node*: its ranks' `read_bytes`; *cache per "
                  "node*: resident after its turn; *one copy*: the union of every rank's ranges (what the cluster "
                  "needs, each byte once).", "",
                  "| workload | mesh | nodes x ranks | contender | needed per node | storage per node | cache per node "
                  "| storage, cluster | one copy | cluster / one copy | cache, cluster / one copy | node read s (median) |",
                  "|" + "---|" * 12]
        for case in hosts:
            m = case["multihost"]
            for r in m["contenders"]:
                lines.append("| " + " | ".join([
                    case["workload"], case["mesh"], f"{m['nodes']} x {m['ranks_per_node']}", f"`{r['contender']}`",
                    ", ".join(human(b) for b in m["needed_per_node"]),
                    ", ".join(human(b) for b in r["storage_bytes_per_node"]),
                    ", ".join(human(b) for b in r["resident_after_per_node"]),
                    human(r["storage_bytes_cluster"]), human(m["needed_cluster_one_copy"]),
                    f"{r['cluster_vs_one_copy']:.2f}x", f"{r['resident_vs_one_copy']:.2f}x",
                    ", ".join(_f(s["median"]) for s in r["node_read_s"])]) + " |")
    lines += ["", "## Targets", "", "| target | met | value |", "|---|---|---|"]
    for t in doc.get("targets", []):
        lines.append(f"| {t['target']} | {'yes' if t['met'] else '**no**'} | {t['value']} |")
    return "\n".join(lines) + "\n"


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 23's: every ``dcp*`` load within 1.1x of the floor; the cluster's storage bytes one copy."""
    out = []

    def target(case: dict[str, Any], name: str, what: str, met: bool, value: str) -> None:
        out.append({"target": f"{case['workload']} x {case['world']} ({case['mesh']}), `{name}`: {what}",
                    "met": met, "value": value})

    for case in doc["cases"]:
        if case.get("errors"):
            continue
        recs = {r["contender"]: r for r in case["contenders"]}
        for name, r in recs.items():
            if name.startswith("dcp") and r.get("vs_floor"):
                target(case, name, "within 1.1x of the raw cold read of each rank's spans", r["vs_floor"] <= 1.1,
                       f"{r['vs_floor']:.2f}x median ({r['vs_floor_min']:.2f}x min, {r['vs_floor_paired']:.2f}x "
                       f"paired; {r['wall_s']['median']:.3f} s vs {recs['floor']['wall_s']['median']:.3f} s)")
        m = case.get("multihost", {})
        for r in m.get("contenders", []):
            if r["contender"] == "dcp+spans":  # direct reads read a copy per node that needs one
                target(case, r["contender"], f"multi-host ({m['nodes']} nodes), storage bytes one copy of the "
                       "needed bytes per cluster", r["cluster_vs_one_copy"] <= 1.01,
                       f"{r['cluster_vs_one_copy']:.2f}x ({human(r['storage_bytes_cluster'])} vs "
                       f"{human(m['needed_cluster_one_copy'])}; per node "
                       f"{', '.join(human(b) for b in r['storage_bytes_per_node'])})")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    import torch

    from bench.__main__ import _quiet_environment
    from bench.layouts import default_mesh
    from bench.remote import parse_meshes
    from bench.workloads import ensure_workload, parse_size

    p = argparse.ArgumentParser(prog="python -m bench.cold", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GB", help="bytes of bf16 weights per checkpoint (smoke, 50MB, 1GB, full)")
    p.add_argument("--kinds", default="dense,moe")
    p.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"of {', '.join(CONTENDERS)}")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed cold rounds first (imports, first calls)")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--nodes", type=int, default=2, help="nodes of the multi-host simulation (at 4 ranks)")
    p.add_argument("--multihost", default=",".join(MULTIHOST_CONTENDERS), help="its contenders ('' for none)")
    p.add_argument("--multihost-meshes", default=MULTIHOST_MESHES, help="';'-separated, 4 ranks")
    p.add_argument("--cache", default=os.environ.get("BENCH_CACHE", str(Path.home() / ".cache" / "hp-dcp-hf-bench")))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None, help="result stem (default bench/results/<date>-cold-<size>)")
    p.add_argument("--render", default=None, metavar="FILE.json", help="only re-render FILE.json's markdown")
    p.add_argument("--phases", action="store_true",
                   help="print and write each rank's load phases (LoadReport.seconds) beside the floor's time")
    args = p.parse_args(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        doc["targets"] = targets(doc)
        Path(args.render).with_suffix(".md").write_text(render(doc))
        return 0
    cache_dir = Path(args.cache)
    _quiet_environment(cache_dir)
    size = parse_size(args.size)
    stem = Path(args.out or f"bench/results/{time.strftime('%Y-%m-%d')}-cold-{size_tag(size)}")
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}; known: {', '.join(CONTENDERS)}")
    multihost = [c.strip() for c in args.multihost.split(",") if c.strip()]
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "hp_dcp_hf"], capture_output=True,
                           text=True).stdout.strip()
    doc: dict[str, Any] = {
        "command": "python -m bench.cold " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "size": size_tag(size), "environment": {
            "cpus": os.cpu_count(), "torch": torch.__version__, "git": git + ("+dirty" if dirty else ""),
            "python": platform.python_version(), "threads": args.threads, "page": PAGE,
            "load_start": [round(x, 2) for x in os.getloadavg()]},
        "settings": vars(args), "cases": []}
    started = time.perf_counter()
    for kind in [k.strip() for k in args.kinds.split(",") if k.strip()]:
        workload = ensure_workload(kind, size, cache_dir)
        doc.setdefault("workloads", []).append(workload.to_json())
        print(f"cold {kind} ({human(workload.checkpoint_bytes)} in {workload.files} files):", flush=True)
        for world in args.worlds:
            mesh = default_mesh(world)
            nodes = args.nodes if world == 4 and multihost and mesh in parse_meshes(args.multihost_meshes) else 1
            doc["cases"].append(run_case(workload, world, mesh, contenders, reps=args.reps, warmup=args.warmup,
                                         threads=args.threads, nodes=nodes, multihost=multihost if nodes > 1 else (),
                                         timeout=args.timeout, phases=args.phases))
        if 4 in args.worlds and multihost:
            for mesh in parse_meshes(args.multihost_meshes):
                if mesh != default_mesh(4):
                    doc["cases"].append(run_case(workload, 4, mesh, [], reps=args.reps, warmup=args.warmup,
                                                 threads=args.threads, nodes=args.nodes, multihost=multihost,
                                                 timeout=args.timeout))
        _write(doc, stem, started)
    _write(doc, stem, started)
    print(f"wrote {stem}.json and {stem}.md")
    for t in doc["targets"]:
        print(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']}")
    return 0


def _write(doc: dict[str, Any], stem: Path, started: float) -> None:
    doc["elapsed_s"] = time.perf_counter() - started
    doc["environment"]["load_end"] = [round(x, 2) for x in os.getloadavg()]
    for case in doc["cases"]:
        case.pop("every_ranges", None)
    doc["targets"] = targets(doc)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2, default=str))
    stem.with_suffix(".md").write_text(render(doc))


if __name__ == "__main__":
    raise SystemExit(main())
