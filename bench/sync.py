"""``python -m bench.sync``: the weight-sync benchmark (issue 32). Run it with the vLLM venv:

    PYTHONPATH=$PWD .venv-vllm/bin/python -m bench.sync               # ~1 GB float32 MoE
    PYTHONPATH=$PWD .venv-vllm/bin/python -m bench.sync --size 60MB   # smoke

A standalone part, not one of ``python -m bench``'s: the engine needs vLLM's venv, the trainers the
main one (``--trainer-python``), as in ``tests/vllm/test_sync_engine.py``. Two Qwen3-MoE-shaped
float32 checkpoints of ``--size`` (A and B, different seeds); an in-process vLLM CPU engine
(backend ``hp_dcp_hf``) starts on A; 4 trainer ranks (:mod:`bench.sync_trainer`, ``ep=4``) load B
and push it with each contender in turn, the engine put back on A before each run:

* ``hp_dcp_hf``: this project's update, each rank sends the boxes it holds;
* ``gather``: every rank materializes every full tensor, rank 0 sends everything (vLLM's
  ``ModuleSource`` recipe);
* ``files``: ``save_hf_checkpoint`` on every rank, then the engine reloads the directory through
  vLLM's loader and this project's CPU reload fixes (``integrations/vllm/reload``);
* ``files-vllm``: the same files through vLLM's own ``reload_weights`` (its CPU fused-MoE experts
  keep the old packing: the check below shows it).

After each run the engine's effective weights (what its kernels compute with) and greedy
generations are compared with the first run's: every contender must leave the same engine.
Writes ``bench/results/sync-<date>-<size>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.workloads import ensure_workload, human, parse_size, size_tag
from tests.support.rl_server import RLServer

REPO = Path(__file__).resolve().parent.parent
CONTENDERS = ("hp_dcp_hf", "gather", "files", "files-vllm")
SENDS = ("hp_dcp_hf", "gather")


class BenchServer(RLServer):
    """vLLM's RL routes plus the benchmark's own: ``reset`` (back to checkpoint A), ``reload`` (a
    directory, by ``how``), ``snapshot`` (record and compare what the engine computes with)."""

    def __init__(self, llm, initial: Path) -> None:
        from tests.support.engine import effective_weights

        super().__init__(llm)
        self.initial = initial
        self.initial_weights = effective_weights(llm)
        self.reference: tuple[str, dict[str, torch.Tensor], list[list[int]]] | None = None
        self.runs: dict[str, dict[str, Any]] = {}
        self._run: dict[str, Any] = {}  # the run since the last reset

    def call(self, route: str, body: dict[str, Any]) -> None:
        if route == "reset":
            self._run = self.runs[body["run"]] = {"reset_seconds": self._reload(self.initial, "hp_dcp_hf"),
                                                  "route_seconds": {}}
        elif route == "reload":
            run = self.runs[body["run"]]
            run["reload_seconds"] = self._reload(Path(body["path"]), body["how"])
            run["bytes_read"] = sum(f.stat().st_size for f in Path(body["path"]).glob("*.safetensors"))
        elif route == "snapshot":
            self._snapshot(body["run"], body["contender"])
        else:  # the RL routes, timed: where an update's engine time goes
            start = time.perf_counter()
            super().call(route, body)
            seconds = self._run["route_seconds"]  # update_weights comes twice: receive, then commit
            seconds[route] = seconds.get(route, 0.0) + time.perf_counter() - start

    def _reload(self, path: Path, how: str) -> float:
        """Load the checkpoint at ``path`` into the running engine; its wall seconds."""
        start = time.perf_counter()
        if how == "vllm":
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        else:
            from vllm.model_executor.model_loader import get_model_loader

            from hp_dcp_hf.integrations.vllm.reload import begin_update, finish_update

            runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
            model, config = runner.get_model(), runner.vllm_config
            config.model_config.model = str(path)  # what vLLM's reload_weights(weights_path=) sets
            weights = get_model_loader(config.load_config).get_all_weights(config.model_config, model)
            begin_update(model)
            model.load_weights(weights)
            finish_update(model, config.model_config)
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def _snapshot(self, run: str, contender: str) -> None:
        from tests.support.engine import differing, effective_weights, generate

        weights, generations = effective_weights(self.llm), generate(self.llm)
        record = self.runs[run]
        record["changed_from_initial"] = len(differing(weights, self.initial_weights))
        record["tensors"] = len(weights)
        if self.reference is None:
            self.reference = (run, weights, generations)
        record["reference"] = self.reference[0]
        record["differing"] = differing(weights, self.reference[1])
        record["same_generations"] = generations == self.reference[2]
        if contender in SENDS:
            receiver = self.llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine.receiver
            record.update(bytes_received=receiver.stats.bytes_received, needed_bytes=receiver.needed_bytes,
                          receive_seconds=receiver.stats.seconds)


def run_trainers(args, checkpoint: Path, server: BenchServer, workdir: Path) -> list[dict[str, Any]]:
    """The trainer ranks under ``torchrun`` (main venv); every rank's figures of every run."""
    shutil.rmtree(workdir, ignore_errors=True)  # an earlier run's figures
    workdir.mkdir(parents=True)
    from hp_dcp_hf.tools.launch import free_port

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):
        env.pop(name, None)
    command = [args.trainer_python, "-m", "torch.distributed.run", "--nproc-per-node", str(args.world),
               "--master-port", str(free_port()), "-m", "bench.sync_trainer", "--checkpoint", str(checkpoint),
               "--engine", server.url, "--workdir", str(workdir), "--contenders", args.contenders,
               "--reps", str(args.reps), "--bucket-bytes", str(args.bucket_mb << 20)]
    log = workdir / "trainers.log"
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout)
    if done.returncode:
        raise RuntimeError(f"trainers exited {done.returncode}; engine errors {server.errors!r}; "
                           f"log tail:\n{log.read_text()[-4000:]}")
    return [json.loads(p.read_text()) for p in sorted(workdir.glob("*-rank*.json"))]


def summarize(ranks: list[dict[str, Any]], engine_runs: dict[str, dict[str, Any]], world: int,
              contenders: list[str]) -> list[dict[str, Any]]:
    """One row per contender: medians over repetitions of the slowest rank, maxima over ranks."""
    rows = []
    for contender in contenders:
        runs = sorted({r["rep"] for r in ranks if r["contender"] == contender})
        per_run = []
        for rep in runs:
            mine = sorted((r for r in ranks if r["contender"] == contender and r["rep"] == rep), key=lambda r: r["rank"])
            engine = engine_runs[f"{contender}-{rep}"]
            moved = [r.get("bytes_sent", 0) + r.get("gathered_bytes", 0) + r.get("bytes_written", 0) for r in mine]
            per_run.append({
                "seconds": max(r["seconds"] for r in mine), "moved_per_rank": moved,
                "rss_growth_per_rank": [r["rss_growth"] for r in mine],
                "engine_bytes": engine.get("bytes_received", engine.get("bytes_read")),
                "needed_bytes": engine.get("needed_bytes"), "engine": engine, "ranks": mine})
        row = {"contender": contender, "world": world, "reps": len(runs), "runs": per_run,
               "seconds": statistics.median(r["seconds"] for r in per_run),
               "moved_per_rank_max": max(max(r["moved_per_rank"]) for r in per_run),
               "moved_all_ranks": sum(per_run[0]["moved_per_rank"]),
               "rss_growth_max": max(max(r["rss_growth_per_rank"]) for r in per_run),
               "engine_bytes": per_run[0]["engine_bytes"],
               "identical": all(not r["engine"]["differing"] and r["engine"]["same_generations"] for r in per_run),
               "differing": sorted({n for r in per_run for n in r["engine"]["differing"]})}
        rows.append(row)
    return rows


def render(doc: dict[str, Any]) -> str:
    rows, needed = doc["rows"], doc["needed_bytes"]
    ours = next((r for r in rows if r["contender"] == "hp_dcp_hf"), None)
    lines = [f"# Weight sync: {doc['size']} float32 Qwen3-MoE, {doc['world']} trainer ranks (ep={doc['world']}) into "
             "one vLLM CPU engine", "",
             f"{doc['date']}, git {doc['machine'].get('git_commit')}; {doc['machine'].get('cores')} cores; "
             f"load average {doc['load_average_start']} at the start, {doc['machine'].get('load_average')} at the end; "
             f"checkpoint {human(doc['checkpoint_bytes'])} ({doc['checkpoint_bytes']} bytes) in {doc['files']} files, "
             f"{doc['tensors']} tensors; the engine needs {human(needed)} ({needed} bytes); bucket "
             f"{doc['bucket_mb']} MiB; {doc['reps']} repetition(s) per contender, medians; "
             f"whole run {doc['elapsed_s']:.0f} s.", "",
             "| contender | wall s | vs hp_dcp_hf | bytes moved / trainer rank (max) | all ranks | "
             "engine received | engine / needed | peak extra RSS / trainer rank (max) | engine identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['seconds'] / ours['seconds']:.2f}x" if ours else "n/a"
        engine = f"{r['engine_bytes'] / needed:.3f}x" if r["engine_bytes"] else "n/a"
        identical = "yes" if r["identical"] else f"**no** ({len(r['differing'])} tensors differ)"
        lines.append(f"| {r['contender']} | {r['seconds']:.3f} | {ratio} | {human(r['moved_per_rank_max'])} | "
                     f"{human(r['moved_all_ranks'])} | {human(r['engine_bytes'] or 0)} | {engine} | "
                     f"{human(r['rss_growth_max'])} | {identical} |")
    lines += ["", "Per run and rank (seconds; bytes moved; peak RSS growth):", ""]
    for r in rows:
        for i, run in enumerate(r["runs"]):
            e = run["engine"]
            parts = [f"- `{r['contender']}` run {i}: {run['seconds']:.3f} s"]
            ranks = run["ranks"]
            if "gather_seconds" in ranks[0]:
                parts.append(f"all-gather {max(x['gather_seconds'] for x in ranks):.3f} s")
            if "save_seconds" in ranks[0]:
                parts.append(f"save {max(x['save_seconds'] for x in ranks):.3f} s, engine reload "
                             f"{e.get('reload_seconds', 0):.3f} s")
            if "receive_seconds" in e:
                routes = e["route_seconds"]
                parts.append(f"engine: receive {e['receive_seconds']:.3f} s of update_weights "
                             f"{routes.get('update_weights', 0):.3f} s (the rest: load_weights), "
                             f"finish_weight_update {routes.get('finish_weight_update', 0):.3f} s, "
                             f"start_weight_update {routes.get('start_weight_update', 0):.3f} s")
            parts.append("moved " + ", ".join(human(b) for b in run["moved_per_rank"]))
            parts.append("RSS growth " + ", ".join(human(b) for b in run["rss_growth_per_rank"]))
            parts.append(f"{e['changed_from_initial']} of {e['tensors']} engine tensors changed from checkpoint A; "
                         f"against `{e['reference']}`: {len(e['differing'])} differ, generations "
                         f"{'same' if e['same_generations'] else 'DIFFERENT'}")
            lines.append("; ".join(parts))
    lines += ["", "Bytes moved per trainer rank: `hp_dcp_hf` and `gather` count the tensor bytes the rank sent "
              "to the engine; `gather` adds what its all-gathers brought in (each full tensor's bytes the rank "
              "did not hold: the least any all-gather receives); `files` counts the bytes the rank passed to "
              "write calls (`/proc/self/io` wchar) during the save. Engine received: the worker's receiver "
              "stats, or the saved files' size (vLLM's loader reads every tensor of every file). Peak extra "
              "RSS: each rank's resident set sampled every 2 ms during the run, minus before it.", ""]
    lines += [f"- {note}" for note in doc["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sync", description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1GB", help="float32 checkpoint size, e.g. 1GB or 60MB")
    parser.add_argument("--world", type=int, default=4, help="trainer ranks (ep=WORLD)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--bucket-mb", type=int, default=64, help="TrainerWeightSync bucket_bytes, MiB")
    parser.add_argument("--cache-dir", default="bench/cache")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default=None, help="report file stem (default sync-<date>-<size>)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--trainer-python", default=os.environ.get("HP_DCP_HF_TRAINER_PYTHON",
                                                                   str(REPO / ".venv" / "bin" / "python")))
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    started, load_start = time.perf_counter(), os.getloadavg()
    cache = Path(args.cache_dir)
    initial = ensure_workload("moe", size, cache, seed=0, dtype=torch.float32)
    trained = ensure_workload("moe", size, cache, seed=1, dtype=torch.float32)

    from hp_dcp_hf.integrations.vllm import plugin
    from tests.support.engine import shutdown_engine, start_engine

    plugin.register()
    print(f"engine on {initial.path} ({human(initial.checkpoint_bytes)})", flush=True)
    llm = start_engine(initial.path, weight_transfer_config={"backend": "hp_dcp_hf"})
    server = BenchServer(llm, initial.path)
    workdir = cache / f"sync-run-{size_tag(size)}"
    try:
        print(f"trainers: {args.world} ranks, contenders {args.contenders} x {args.reps}", flush=True)
        ranks = run_trainers(args, trained.path, server, workdir)
    finally:
        server.close()
        shutdown_engine(llm)
    rows = summarize(ranks, server.runs, args.world, args.contenders.split(","))
    needed = next((r["needed_bytes"] for row in rows for r in row["runs"] if r["needed_bytes"]), trained.checkpoint_bytes)
    from bench.report import machine

    notes = []
    for row in rows:
        if not row["identical"]:
            notes.append(f"`{row['contender']}` left an engine that differs from the first run's in "
                         f"{len(row['differing'])} tensors, e.g. {row['differing'][:4]}")
    doc = {"date": dt.date.today().isoformat(), "size": size_tag(size), "world": args.world, "reps": args.reps,
           "bucket_mb": args.bucket_mb, "checkpoint_bytes": trained.checkpoint_bytes, "files": trained.files,
           "tensors": trained.tensors, "needed_bytes": needed, "rows": rows, "notes": notes,
           "load_average_start": load_start, "elapsed_s": time.perf_counter() - started, "machine": machine()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"sync-{doc['date']}-{doc['size']}"
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    text = render(doc)
    (out / f"{stem}.md").write_text(text)
    print(text)
    print(f"written: {out / stem}.json, .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
