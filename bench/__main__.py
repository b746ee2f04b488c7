"""``python -m bench``: generate the checkpoints, run every part, write the report.

    python -m bench                      # smoke size (~50 MB checkpoints), every part
    python -m bench --size full          # ~2 GB checkpoints (the real run)
    python -m bench --parts loads --worlds 4 --contenders limit,dcp,legacy
    python -m bench --parts remote --size 1GB                # the MoE checkpoint from a local S3 server
    python -m bench --parts remote --remote-meshes 'dp_replicate=2,tp=2'   # HSDP only
    python -m bench --parts quantized --size full            # FP8 MoE checkpoint (~1 GB) into bf16, 4 ranks
    python -m bench --render bench/results/2025-01-01.json   # re-render a report

Parts: ``loads`` (contenders side by side on 1, 2, 4 ranks), ``real`` (SmolLM2-135M with TP,
logits checked), ``simulate`` (cluster-scale planning), ``multinode`` (two torchrun launchers),
``remote`` (the MoE checkpoint from a local SeaweedFS S3 server on 4 ranks, dp=2,tp=2 and HSDP, with and without
cooperative reads, against the boto3 limit and s3fs whole files),
``quantized`` (an FP8 block-scaled MoE checkpoint into bf16 on 4 ranks: this project, torch's
quantized reader, transformers, the raw-read limit).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
README = REPO / "bench" / "README.md"
TABLE_START, TABLE_END = "<!-- bench:table:start -->", "<!-- bench:table:end -->"
PARTS = ("loads", "real", "simulate", "multinode", "remote", "quantized")


def _quiet_environment(cache_dir: Path) -> None:
    """Offline, quiet transformers; packages installed with ``--target <cache>/pydeps`` importable
    here and in every spawned rank (spawn passes ``sys.path``; torchrun gets ``PYTHONPATH``)."""
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error"),
                       ("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    paths = [str(REPO)]
    pydeps = cache_dir / "pydeps"
    if pydeps.is_dir():
        paths.append(str(pydeps.resolve()))
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    from bench.contenders import CONTENDERS
    from bench.quantized import CONTENDERS as QUANTIZED_CONTENDERS
    from bench.remote import CONTENDERS as REMOTE_CONTENDERS
    from bench.remote import MESHES as REMOTE_MESHES

    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="smoke", help="checkpoint size: smoke (~50 MB), full (~2 GB), or e.g. 500MB")
    p.add_argument("--cache-dir", default="bench/cache", help="generated checkpoints (git-ignored by default)")
    p.add_argument("--out", default="bench/results", help="where <date>.json / .md / .png go")
    p.add_argument("--name", default=None, help="report file stem (default: the date)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--kinds", default="dense,moe", help="workloads: dense (llama), moe (qwen3-moe)")
    p.add_argument("--worlds", default="1,2,4", help="rank counts of the loads part")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--mesh", action="append", default=[], metavar="WORLD:SPEC",
                   help="layout per world, e.g. 4:dp=2,tp=2 (default: 1 none, 2 tp=2, 4+ dp=world/2,tp=2)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions before them")
    p.add_argument("--threads", type=int, default=8, help="read threads per rank, every contender")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per process group")
    p.add_argument("--sim-arch", default="deepseek-v3", help="deepseek-v3 and/or qwen3-235b (comma-separated)")
    p.add_argument("--sim-worlds", default=None, help="default: 8,64,1024 (smoke) or 8,16,...,1024")
    p.add_argument("--sim-fresh", type=int, default=1, help="ranks per world planned from scratch (timed)")
    p.add_argument("--sim-cached", type=int, default=4, help="ranks per world planned with a reused composition")
    p.add_argument("--real-world", type=int, default=3, help="TP ranks of the SmolLM2 row (9/3 heads: 3)")
    p.add_argument("--remote-contenders", default=",".join(REMOTE_CONTENDERS),
                   help="contenders of the remote part (4 ranks, MoE checkpoint on a local SeaweedFS S3 server)")
    p.add_argument("--remote-meshes", default=REMOTE_MESHES,
                   help="layouts of the remote part, ';'-separated; dp_replicate=N adds N HSDP copies")
    p.add_argument("--quantized-contenders", default=",".join(QUANTIZED_CONTENDERS),
                   help="contenders of the quantized part (4 ranks, dp=2,tp=2, FP8 MoE checkpoint into bf16)")
    p.add_argument("--render", default=None, metavar="JSON", help="only re-render an existing results file")
    p.add_argument("--update-readme", action="store_true", help="put the loads table into README's Benchmarks section")
    return p


def run_multinode(workload, timeout: float) -> dict[str, Any]:
    """``bench/multinode.sh`` on the dense workload; its JSON document."""
    out = Path(workload.path).parent / "multinode.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "PYTHON": sys.executable}
    try:
        done = subprocess.run(["bash", str(REPO / "bench" / "multinode.sh"), str(workload.path), str(out), workload.kind],
                              env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"multinode smoke did not finish in {timeout:.0f} s"}
    if done.returncode or not out.exists():
        return {"error": f"multinode.sh exited {done.returncode}: {done.stderr[-1500:]}"}
    return json.loads(out.read_text())


def update_readme(summary: str) -> bool:
    """Replace what lies between the table markers of README's Benchmarks section; False without them."""
    text = README.read_text()
    if TABLE_START not in text or TABLE_END not in text:
        return False
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    README.write_text(f"{head}{TABLE_START}\n{summary}\n{TABLE_END}{tail}")
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cache_dir = Path(args.cache_dir)
    _quiet_environment(cache_dir)
    from bench import report

    if args.render:
        doc = json.loads(Path(args.render).read_text())
        doc["name"] = Path(args.render).stem
        paths = report.write_report(doc, Path(args.render).parent)
        print("\n".join(f"{k}: {v}" for k, v in paths.items()))
        if args.update_readme and doc.get("loads"):
            _readme(doc, paths["json"])
        return 0
    from bench.layouts import default_mesh, parse_mesh
    from bench.workloads import ensure_workload, parse_size, size_tag

    size = parse_size(args.size)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    meshes = {int(w): parse_mesh(spec) for w, _, spec in (m.partition(":") for m in args.mesh)}
    settings = {"size": size_tag(size), "worlds": args.worlds, "contenders": args.contenders, "reps": args.reps,
                "warmup": args.warmup, "threads": args.threads, "parts": parts,
                "meshes": {w: meshes.get(w, default_mesh(w)) for w in _ints(args.worlds)}}
    if "remote" in parts:
        settings.update(remote_meshes=args.remote_meshes, remote_contenders=args.remote_contenders)
    doc: dict[str, Any] = {"date": dt.date.today().isoformat(), "size": size, "settings": settings,
                           "load_average_start": os.getloadavg(), "not_run": []}
    if args.name:
        doc["name"] = args.name
    started = time.perf_counter()
    workloads = []
    if {"loads", "multinode"} & set(parts):
        print(f"checkpoints ({size_tag(size)}) in {cache_dir}")
        workloads = [ensure_workload(kind, size, cache_dir) for kind in args.kinds.split(",")]
        doc["workloads"] = [w.to_json() for w in workloads]
    if "loads" in parts:
        from bench.contenders import rewrites
        from bench.loads import run_loads

        print("loads (warm page cache for every contender):")
        contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
        doc["loads"] = run_loads(workloads, _ints(args.worlds), contenders,
                                 lambda w: meshes.get(w, default_mesh(w)), reps=args.reps, warmup=args.warmup,
                                 threads=args.threads, timeout=args.timeout)
        for kind in {w.kind for w in workloads}:
            _, why = rewrites(kind)
            if why and "dcp+rw" in contenders:
                doc["not_run"].append(f"{kind}: {why}")
    if "real" in parts:
        from bench.real import run_real

        print("real checkpoint (SmolLM2-135M):")
        try:
            doc["real"] = run_real(cache_dir, world=args.real_world, timeout=args.timeout)
        except Exception as e:
            doc["real"] = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
        if doc["real"].get("skipped"):
            doc["not_run"].append(doc["real"]["skipped"])
    if "simulate" in parts:
        from bench.simulate import simulate

        worlds = _ints(args.sim_worlds) if args.sim_worlds else (
            [8, 64, 1024] if size < 5 * 10**8 else [8, 16, 32, 64, 128, 256, 512, 1024])
        doc["simulate"] = []
        for arch in args.sim_arch.split(","):
            print(f"simulated planning ({arch}, worlds {worlds}):")
            doc["simulate"].append(simulate(arch, worlds, fresh_plans=args.sim_fresh, cached_plans=args.sim_cached))
    if "multinode" in parts:
        print("multi-node smoke (2 torchrun launchers x 2 ranks):")
        dense = next((w for w in workloads if w.kind == "dense"), workloads[0])
        doc["multinode"] = run_multinode(dense, args.timeout)
        print(f"  correct: {doc['multinode'].get('correct')} {doc['multinode'].get('error', '')}")
    if "remote" in parts:
        from bench.remote import parse_meshes, run_remote

        print("remote (SeaweedFS S3 server started here, 4 ranks):")
        moe = next((w for w in workloads if w.kind == "moe"), None) or ensure_workload("moe", size, cache_dir)
        doc["remote"] = run_remote(moe, parse_meshes(args.remote_meshes), reps=args.reps, warmup=args.warmup,
                                   threads=args.threads, timeout=args.timeout,
                                   contenders=[c.strip() for c in args.remote_contenders.split(",") if c.strip()])
        if doc["remote"].get("error"):
            print(f"  error: {doc['remote']['error']}")
        doc["not_run"] += [f"remote {r['contender']}: {r['skipped']}" for r in doc["remote"].get("contenders", [])
                           if r.get("skipped")]
    if "quantized" in parts:
        from bench.quantized import ensure_fp8_workload, run_quantized

        print("quantized (FP8 block-scaled MoE checkpoint into bf16, 4 ranks):")
        try:
            fp8 = ensure_fp8_workload(size, cache_dir)
            doc["quantized"] = run_quantized(
                fp8, reps=args.reps, warmup=args.warmup, threads=args.threads, timeout=args.timeout,
                contenders=[c.strip() for c in args.quantized_contenders.split(",") if c.strip()])
        except Exception as e:
            import traceback

            doc["quantized"] = {"error": f"{type(e).__name__}: {str(e)[-1500:]}", "traceback": traceback.format_exc()}
            print(f"  error: {doc['quantized']['error']}")
    doc["elapsed_s"] = time.perf_counter() - started
    from bench.report import machine

    doc["machine"] = machine()
    paths = report.write_report(doc, Path(args.out))
    if doc.get("loads"):
        print("\n" + report.loads_table(doc) + "\n")
    print("targets:")
    for t in doc["targets"]:
        print(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']} {t['note']}")
    print("\n".join(f"{k}: {v}" for k, v in paths.items()))
    if args.update_readme and doc.get("loads"):
        _readme(doc, paths["json"])
    return 0


def _readme(doc: dict[str, Any], json_path: Path) -> None:
    from bench import report

    shown = json_path.resolve().relative_to(REPO) if json_path.resolve().is_relative_to(REPO) else json_path
    if update_readme(report.readme_summary(doc, str(shown))):
        print("README.md: Benchmarks table updated")
    else:
        print(f"README.md has no {TABLE_START} / {TABLE_END} markers: not updated")


if __name__ == "__main__":
    raise SystemExit(main())
