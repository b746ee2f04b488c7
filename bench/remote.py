"""The remote row: the MoE checkpoint on a local S3 server (moto), loaded by 4 gloo ranks.

The bench process starts moto's ``ThreadedMotoServer`` on 127.0.0.1 (:class:`tests.servers.s3.MotoS3`),
uploads the checkpoint to ``s3://bench/moe-<size>`` and records every request the server gets.
Contenders, each in its own process group, ``warmup`` untimed and ``reps`` timed loads:

* ``dcp-s3``: this project, ``load_hf_checkpoint(model, "s3://...")`` with
  ``HFStorageReader(url, storage_options=..., num_threads=threads)`` and its remote default
  ``coalesce_gap`` of 1 MiB: ranges up to 1 MiB apart are one GET (gap bytes fetched and dropped),
  so a row-sharded box is one request per staging batch;
* ``dcp-s3-gap0``: the same with ``coalesce_gap=0``: ranged GETs of exactly the bytes each rank's
  shards need (a row-sharded box is one GET per row);
* ``s3fs-whole``: every rank fetches every ``.safetensors`` file whole with
  ``s3fs.S3FileSystem.cat_file`` (``threads`` files at a time), the pattern of loaders that
  download whole files before slicing; no model, so a lower bound of that pattern's cost.

Every load labels its requests (``user_agent_extra="rank/R load/N"``), so moto's recording gives,
per rank and load, the requests and bytes the server saw: the independent check of the reader's
own counters, and the only count for s3fs (which turns a ``cat_file`` into a HEAD and 50 MiB
ranged GETs). This project's loads are checked, rank by rank, against the legacy loader reading
the local copy of the checkpoint into the same layout.

moto reads the whole object for every GET and slices the range out of it, so a request costs it
time in proportion to the object's size, not the range's (``probe.ranged_get_s`` measures this
before the row): wall times here charge many small requests far more than S3 does. So
``dcp-s3`` runs first, and ``dcp-s3-gap0`` is skipped, with the reason, when its GETs (one per
range of that run's plan) would keep moto busy longer than ``budget_s``.
"""

from __future__ import annotations

import itertools
import re
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import measure
from bench.contenders import Job, Row, build_model, legacy_digests, repeat_loads
from bench.layouts import mesh_label
from bench.loads import aggregate
from bench.workloads import Workload, size_tag
from hp_dcp_hf.launch import run_ranks

BUCKET = "bench"
GAPS = {"dcp-s3": None, "dcp-s3-gap0": 0}  # None: the reader's default for remote stores (1 MiB)
CONTENDERS = (*GAPS, "s3fs-whole")
_LABEL = re.compile(r"\brank/(\d+) load/(\d+)\b")


def _labelled(options: dict[str, Any], rank: int, load: int) -> dict[str, Any]:
    """``options`` whose botocore client tags every request with ``rank/R load/N`` (User-Agent)."""
    return {**options, "config_kwargs": {"user_agent_extra": f"rank/{rank} load/{load}"}}


# -- on every rank -------------------------------------------------------------------------------


def _dcp_s3(job: Job, rank: int, url: str, options: dict[str, Any]) -> Row:
    """This project from S3, then the legacy loader from the local copy as the reference."""
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader, load_hf_checkpoint

    row = Row(job.contender, rank)
    model = build_model(job)
    loads = itertools.count()

    def load(m) -> dict[str, Any]:
        reader = HFStorageReader(url, storage_options=_labelled(options, rank, next(loads)),
                                 coalesce_gap=GAPS[job.contender], num_threads=job.threads)
        planner = HFMappingPlanner(m)
        load_hf_checkpoint(m, url, reader=reader, planner=planner)
        total = reader.stats.total()
        row.extra.update(header_requests=total.header_requests, reader_bytes_needed=total.bytes_needed)
        return {"bytes_needed": planner.stats.bytes_needed, "bytes_read": total.bytes_read,
                "requests": total.requests, "ranges": total.ranges, "header_bytes": total.header_bytes}

    repeat_loads(row, job, model, load)
    row.mismatched = measure.compare_digests(row.digests or {}, legacy_digests(model, job))
    row.digests = None
    return row


def _s3fs_whole(job: Job, rank: int, options: dict[str, Any], files: list[str]) -> Row:
    """Every file whole through a fresh ``S3FileSystem`` per load (as each load's reader is fresh)."""
    import s3fs

    row = Row(job.contender, rank)
    for load in range(job.warmup + job.reps):
        with measure.memory_window() as mem, measure.timed_across_ranks() as timer:
            fs = s3fs.S3FileSystem(**_labelled(options, rank, load))
            with ThreadPoolExecutor(job.threads) as pool:
                got = sum(map(len, pool.map(fs.cat_file, files)))
        if load >= job.warmup:
            row.wall_s.append(timer.wall_s)
            row.own_s.append(timer.own_s)
            row.growth_rss = max(row.growth_rss, mem.growth_rss)
            row.growth_anon = max(row.growth_anon, mem.growth_anon)
            row.bytes_read = got
    return row


def run_rank(rank: int, world: int, job: Job, url: str, options: dict[str, Any], files: list[str]) -> dict[str, Any]:
    """Entry point of a spawned rank: one remote contender, its row (an error becomes the row)."""
    try:
        row = _s3fs_whole(job, rank, options, files) if job.contender == "s3fs-whole" else \
            _dcp_s3(job, rank, url, options)
    except Exception as e:
        row = Row(job.contender, rank, error=f"{type(e).__name__}: {e}")
        row.extra["traceback"] = traceback.format_exc()
    return row.as_dict()


# -- in the bench process ------------------------------------------------------------------------


def _server_counts(recording, world: int, load: int, sizes: dict[str, int]) -> dict[str, list[int]]:
    """Per rank, from moto's recording of one load: every request, the object GETs, their bytes (a
    GET without ``Range`` is the whole object)."""
    out: dict[str, list[int]] = {"server_requests": [0] * world, "server_gets": [0] * world,
                                 "server_bytes": [0] * world}
    for request in recording:
        label = _LABEL.search(request.user_agent)
        if not label or int(label.group(2)) != load:
            continue
        rank = int(label.group(1))
        out["server_requests"][rank] += 1
        if request.method == "GET" and not request.query:
            out["server_gets"][rank] += 1
            nbytes = request.nbytes
            out["server_bytes"][rank] += nbytes if nbytes is not None else sizes[request.path]
    return out


def _probe(moto, key: str, size: int, tries: int = 3) -> dict[str, Any]:
    """What one 4 KiB ranged GET of the largest object costs moto (median seconds)."""
    seconds = []
    for _ in range(tries):
        start = time.perf_counter()
        moto.client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={size // 2}-{size // 2 + 4095}")["Body"].read()
        seconds.append(time.perf_counter() - start)
    return {"object_bytes": size, "ranged_get_s": statistics.median(seconds)}


def _contender(moto, job: Job, url: str, world: int, files: list[str], sizes: dict[str, int],
               timeout: float) -> list[dict[str, Any]]:
    """One contender on ``world`` ranks: its rows, each with the server's counts of its last load."""
    options = moto.storage_options()
    moto.start_recording()
    try:
        rows = run_ranks(world, run_rank, job, url, options, files, timeout=timeout)
    except Exception as e:  # a rank died or hung
        return [{"contender": job.contender, "rank": 0, "error": f"{type(e).__name__}: {str(e)[-2000:]}"}]
    finally:
        moto.stop_recording()
    server = _server_counts(moto.recording(), world, job.warmup + job.reps - 1, sizes)
    for row in rows:
        row["extra"].update({k: v[row["rank"]] for k, v in server.items()})
    return rows


def _too_slow(rows: list[dict[str, Any]], probe: dict[str, Any], loads: int, budget_s: float) -> str | None:
    """Why ``dcp-s3-gap0`` is not run, or None: its GETs (one per range of the plan, known from the
    ``dcp-s3`` run) times what one costs moto, over all its loads, exceed ``budget_s``."""
    ranges = [r.get("ranges") for r in rows if r["contender"] == "dcp-s3"]
    if not ranges or None in ranges:
        return None
    estimate = sum(ranges) * probe["ranged_get_s"] * loads
    if estimate <= budget_s:
        return None
    return (f"~{sum(ranges)} GETs per load on {len(ranges)} ranks x {probe['ranged_get_s'] * 1e3:.0f} ms per moto GET "
            f"x {loads} loads = ~{estimate / 60:.0f} min, over the {budget_s / 60:.0f} min budget (one GET per planned "
            "range, one per row of a row-sharded box; moto reads the whole object for every GET)")


def _with_server(record: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``aggregate``'s record plus the per-rank counts it does not know: header bytes and requests,
    the reader's own bytes needed (the plan's are ``bytes_needed``), the server's requests, GETs and
    bytes, and whether they equal the reader's counters."""
    rows = sorted(rows, key=lambda r: r["rank"])
    record.pop("extra", None)
    record["header_bytes"] = [r.get("header_bytes") for r in rows]
    for key in ("reader_bytes_needed", "header_requests", "server_requests", "server_gets", "server_bytes"):
        record[key] = [r["extra"].get(key) for r in rows]
    if record["contender"] in GAPS:
        record["check"] = "against legacy reading the local copy, same model and layout, in-process"
        record["server_matches_reader"] = all(
            r["extra"]["server_gets"] == r["requests"] + r["extra"]["header_requests"]
            and r["extra"]["server_bytes"] == r["bytes_read"] + r["header_bytes"] for r in rows)
    else:
        record["correct"], record["check"] = None, "fetches bytes only (no model)"
    return record


def run_remote(workload: Workload, mesh: dict[str, int], *, world: int = 4, contenders: Sequence[str] = CONTENDERS,
               reps: int = 3, warmup: int = 1, threads: int = 8, timeout: float = 1800, budget_s: float = 600,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """The remote row for ``workload``; ``{"error": ...}`` when the server or a step fails. ``dcp-s3``
    ``dcp-s3-gap0`` is skipped (with the reason) when moto would need more than ``budget_s`` for its loads."""
    try:
        return _run(workload, mesh, world, contenders, reps, warmup, threads, timeout, budget_s, log)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[-1500:]}", "traceback": traceback.format_exc()}


def _run(workload: Workload, mesh: dict[str, int], world: int, contenders: Sequence[str], reps: int, warmup: int,
         threads: int, timeout: float, budget_s: float, log: Callable[[str], None]) -> dict[str, Any]:
    import moto

    from tests.servers.s3 import MotoS3

    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise ValueError(f"unknown remote contenders {unknown}; known: {', '.join(CONTENDERS)}")
    prefix = f"{workload.kind}-{size_tag(workload.size)}"
    scratch = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    server = MotoS3(scratch / "recording.jsonl")
    try:
        server.create_bucket(BUCKET)
        start = time.perf_counter()
        keys = server.upload_dir(workload.path, BUCKET, prefix)
        upload_s = time.perf_counter() - start
        sizes = {f"/{BUCKET}/{k}": (workload.path / k.removeprefix(prefix + "/")).stat().st_size for k in keys}
        files = sorted(f"{BUCKET}/{k}" for k in keys if k.endswith(".safetensors"))
        largest = max(files, key=lambda f: sizes["/" + f])
        doc: dict[str, Any] = {
            "server": f"moto {moto.__version__}, in-process ThreadedMotoServer on 127.0.0.1",
            "url": f"s3://{BUCKET}/{prefix}", "workload": workload.kind, "checkpoint_bytes": workload.checkpoint_bytes,
            "files": len(files), "world": world, "mesh": mesh_label(mesh), "threads": threads, "reps": reps,
            "warmup": warmup, "upload_s": upload_s,
            "probe": _probe(server, largest.removeprefix(BUCKET + "/"), sizes["/" + largest])}
        rows: list[dict[str, Any]] = []
        for name in sorted(contenders, key=lambda c: c != "dcp-s3"):  # its plan sizes dcp-s3-gap0's cost
            why = _too_slow(rows, doc["probe"], warmup + reps, budget_s) if name == "dcp-s3-gap0" else None
            if why:
                log(f"  {name} skipped: {why}")
                rows.append({"contender": name, "rank": 0, "skipped": why})
                continue
            log(f"  {workload.kind} x {world} ranks [{mesh_label(mesh)}] from {doc['url']}: {name} ...")
            job = Job(name, workload.kind, str(workload.path), mesh, reps=reps, threads=threads, warmup=warmup)
            rows += _contender(server, job, doc["url"], world, files, sizes, timeout)
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    needed = {r["rank"]: r["bytes_needed"] for r in rows if r["contender"] in GAPS and r.get("bytes_needed")}
    for row in rows:  # s3fs-whole's amplification is against this project's plan, as legacy's is
        if row.get("bytes_needed") is None and row["rank"] in needed:
            row["bytes_needed"] = needed[row["rank"]]
    records = sorted(aggregate(rows, checkpoint_bytes=workload.checkpoint_bytes),
                     key=lambda r: CONTENDERS.index(r["contender"]))
    doc["contenders"] = [r if r.get("error") or r.get("skipped") else
                         _with_server(r, [row for row in rows if row["contender"] == r["contender"]]) for r in records]
    _ratios(doc)
    for r in doc["contenders"]:
        log("    " + summary_line(r))
    return doc


def _ratios(doc: dict[str, Any]) -> None:
    """``s3fs-whole`` against each of this project's rows: wall time and bytes, both as whole / ours."""
    by_name = {r["contender"]: r for r in doc["contenders"] if r.get("wall_s")}
    whole = by_name.get("s3fs-whole")
    if whole:
        doc["ratios"] = {name: {"wall": whole["wall_s"] / r["wall_s"],
                                "bytes": sum(whole["server_bytes"]) / sum(r["server_bytes"])}
                         for name, r in by_name.items() if name in GAPS}


def summary_line(r: dict[str, Any]) -> str:
    if r.get("error") or r.get("skipped"):
        return f"{r['contender']:<14} {'ERROR' if r.get('error') else 'skipped'}: {(r.get('error') or r.get('skipped'))[:300]}"
    ok = {True: "ok", False: "WRONG", None: "n/a"}[r.get("correct")]
    return (f"{r['contender']:<14} {r['wall_s']:8.3f} s  bytes/rank {max(r['server_bytes']) / 2**20:8.1f} MiB  "
            f"GETs/rank {max(r['server_gets'])}  {ok}")
