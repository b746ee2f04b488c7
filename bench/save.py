"""Saving a sharded model back to Hugging Face format, side by side on 4 ranks (``dp=2,tp=2``).

    python -m bench.save                 # smoke size (~50 MB checkpoints)
    python -m bench.save --size full     # the benchmark's 2 GB dense and MoE workloads

Each rank loads the workload once with ``hp_dcp_hf.from_pretrained`` (bf16, transformers' plans),
then every contender saves that same model, ``reps`` times after ``warmup`` untimed runs, into
its own directory:

* ``dcp``: ``save_hf_checkpoint``: every rank writes its own bytes at their final offsets, once.
* ``torch``: torch's ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``
  with its ``DefaultSavePlanner``: per-rank shard files, then consolidation reads them back and
  rewrites whole files (the model's own names: it does not revert conversions).
* ``transformers``: ``model.save_pretrained``: gathers every tensor to rank 0, reverts conversions
  there, rank 0 writes.
* ``limit``: ``os.pwrite`` of exactly the byte ranges ``dcp`` wrote, by the same ranks, into
  pre-sized files, from a buffer already in memory: no planning, no casting, no gathering.

Reported per contender: wall time (slowest rank, median over reps), bytes written per rank and in
all, and each rank's peak RSS growth during the save. Writes go to ``<cache-dir>/save-out`` (page
cache, fsync'd by ``dcp`` and ``limit``), which is removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

CONTENDERS = ("limit", "dcp", "torch", "transformers")


def _recording_writer(out: str):
    """An ``HFStorageWriter`` to ``out`` that keeps every (file, offset, length) it writes, for the
    limit to replay (``writer.destination.ranges``)."""
    from hp_dcp_hf.storage import HFStorageWriter
    from hp_dcp_hf.storage.format.ranges import box_byte_ranges
    from hp_dcp_hf.storage.write.destination import Directory

    class RecordingDirectory(Directory):
        ranges: list[tuple[str, int, int]] = []

        def write(self, token, files, writes, staging_bytes, failure=None):
            for w in writes:
                self.ranges.extend((w.tensor.file, w.tensor.start + s, e - s)
                                   for s, e in box_byte_ranges(w.tensor.shape, w.tensor.dtype.itemsize, w.box))
            return super().write(token, files, writes, staging_bytes, failure)

    writer = HFStorageWriter(out)
    writer.destination = RecordingDirectory(out)
    writer.destination.ranges = []
    return writer


def _limit(ranges: list[tuple[str, int, int]], directory: str, sizes: dict[str, int]) -> int:
    """pwrite ``ranges`` into pre-sized files under ``directory``; bytes written."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        for name, size in sizes.items():
            with open(os.path.join(directory, name), "wb") as f:
                f.truncate(size)
    dist.barrier()
    buffer = memoryview(bytearray(max((n for _, _, n in ranges), default=0)))
    fds = {name: os.open(os.path.join(directory, name), os.O_WRONLY) for name in sizes}
    try:
        written = sum(os.pwrite(fds[name], buffer[:n], offset) for name, offset, n in ranges)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return written


def _save_once(contender: str, model, out: str, state: dict[str, Any]) -> int:
    """One save by ``contender`` into ``out``; bytes this rank wrote (None where not counted)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if contender == "dcp":
        from hp_dcp_hf.save.api import save_hf_checkpoint

        writer = _recording_writer(out)
        save_hf_checkpoint(model, out, writer=writer)
        state["ranges"], state["sizes"] = writer.destination.ranges, {f.name: f.size for f in writer.files}
        return writer.bytes_written
    if contender == "limit":
        return _limit(state["ranges"], out, state["sizes"])
    if contender == "torch":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        writer = HuggingFaceStorageWriter(out, save_distributed=True, enable_consolidation=True)
        dcp.save(model.state_dict(), storage_writer=writer)
        return sum(f.stat().st_size for f in Path(out).rglob("*.safetensors") if dist.get_rank() == 0) or 0
    if contender == "transformers":
        model.save_pretrained(out)
        dist.barrier()
        return sum(f.stat().st_size for f in Path(out).glob("*.safetensors")) if dist.get_rank() == 0 else 0
    raise ValueError(contender)


def run_rank(rank: int, world: int, path: str, mesh: str, out_root: str, contenders: list[str], reps: int,
             warmup: int) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from bench.measure import memory_window
    from hp_dcp_hf import from_pretrained

    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = from_pretrained(path, dtype=torch.bfloat16, distributed_config=mesh)
    state: dict[str, Any] = {}
    rows = {}
    for contender in contenders:
        times, written, growth = [], 0, 0
        try:
            for rep in range(warmup + reps):
                out = os.path.join(out_root, contender)
                if rank == 0:
                    shutil.rmtree(out, ignore_errors=True)
                dist.barrier()
                with memory_window() as window:
                    start = time.perf_counter()
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        written = _save_once(contender, model, out, state)
                    dist.barrier()
                    elapsed = time.perf_counter() - start
                if rep >= warmup:
                    times.append(elapsed)
                    growth = max(growth, window.peak_rss - window.start_rss)
            rows[contender] = {"wall_s": times, "bytes_written": written, "rss_growth": growth}
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - recorded, the others still run
            if isinstance(e, CheckpointException):
                from hp_dcp_hf.util.dcp import unwrap_checkpoint_exception

                e = unwrap_checkpoint_exception(e)
            rows[contender] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
            dist.barrier()
    return rows


def run_save(workload, *, contenders=CONTENDERS, mesh: str = "dp=2,tp=2", world: int = 4, reps: int = 3,
             warmup: int = 1, timeout: float = 1800, out_root: Path) -> dict[str, Any]:
    from hp_dcp_hf.tools.launch import run_ranks

    contenders = [c for c in contenders if c != "limit" or "dcp" in contenders]
    if "limit" in contenders:  # the limit replays dcp's writes: dcp first
        contenders = ["dcp", "limit", *[c for c in contenders if c not in ("dcp", "limit")]]
    try:
        per_rank = run_ranks(world, run_rank, str(workload.path), mesh, str(out_root), contenders, reps, warmup,
                             timeout=timeout)
    finally:
        shutil.rmtree(out_root, ignore_errors=True)
    result: dict[str, Any] = {"workload": workload.kind, "checkpoint_bytes": workload.checkpoint_bytes,
                              "mesh": mesh, "world": world, "contenders": {}}
    for contender in contenders:
        rows = [r[contender] for r in per_rank]
        errors = [r["error"] for r in rows if "error" in r]
        if errors:
            result["contenders"][contender] = {"error": errors[0]}
            continue
        walls = [max(r["wall_s"][i] for r in rows) for i in range(len(rows[0]["wall_s"]))]
        result["contenders"][contender] = {
            "wall_s": statistics.median(walls), "walls": walls,
            "bytes_written": [r["bytes_written"] for r in rows],
            "rss_growth": [r["rss_growth"] for r in rows],
        }
    done = result["contenders"]
    for other in ("limit", "torch", "transformers"):
        if "wall_s" in done.get("dcp", {}) and "wall_s" in done.get(other, {}):
            result[f"dcp_vs_{other}"] = done["dcp"]["wall_s"] / done[other]["wall_s"]
    return result


def markdown(results: list[dict[str, Any]]) -> str:
    from bench.workloads import human

    lines = ["| workload | contender | wall s | vs dcp | bytes written per rank | total | RSS growth per rank |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        dcp = r["contenders"].get("dcp", {}).get("wall_s")
        for name, c in r["contenders"].items():
            if "error" in c:
                lines.append(f"| {r['workload']} | {name} | error: {c['error'][:120]} | | | | |")
                continue
            ratio = f"{c['wall_s'] / dcp:.2f}x" if dcp else ""
            lines.append(f"| {r['workload']} | {name} | {c['wall_s']:.3f} | {ratio} | "
                         + ", ".join(human(b) for b in c["bytes_written"]) + f" | {human(sum(c['bytes_written']))} | "
                         + ", ".join(human(g) for g in c["rss_growth"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.save", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="smoke", help="checkpoint size: smoke (~50 MB), full (~2 GB), or e.g. 500MB")
    p.add_argument("--kinds", default="dense,moe")
    p.add_argument("--cache-dir", default="bench/cache")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--name", default=None, help="report file stem (default: <date>-save-<size>)")
    args = p.parse_args(argv)
    from bench.__main__ import _quiet_environment
    from bench.report import machine
    from bench.workloads import ensure_workload, parse_size, size_tag

    cache = Path(args.cache_dir)
    _quiet_environment(cache)
    size = parse_size(args.size)
    load_start = os.getloadavg()
    results = []
    for kind in args.kinds.split(","):
        workload = ensure_workload(kind, size, cache)
        print(f"save {kind} ({size_tag(size)}) on 4 ranks, dp=2,tp=2 ...", flush=True)
        results.append(run_save(workload, contenders=args.contenders.split(","), reps=args.reps, warmup=args.warmup,
                                timeout=args.timeout, out_root=cache / "save-out"))
        print(markdown(results[-1:]), flush=True)
    stem = Path(args.out) / (args.name or f"{time.strftime('%Y-%m-%d')}-save-{size_tag(size)}")
    stem.parent.mkdir(parents=True, exist_ok=True)
    doc = {"size": size, "results": results, "machine": machine(), "load_average": [load_start, os.getloadavg()]}
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    stem.with_suffix(".md").write_text(f"# save, {size_tag(size)}, 4 ranks dp=2,tp=2\n\n{markdown(results)}\n\n"
                                       f"load average {load_start} at the start, {os.getloadavg()} at the end\n")
    print(f"wrote {stem}.json / .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
