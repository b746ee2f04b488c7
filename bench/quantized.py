"""The quantized part: an FP8 block-scaled MoE checkpoint loaded into bf16 on 4 ranks (``dp=2,tp=2``).

The checkpoint is the ``moe`` workload of :mod:`bench.workloads` (a ``Qwen3MoeForCausalLM`` of
``--size`` bytes of random bf16 weights, the files ``save_pretrained`` writes), then FP8-quantized
file by file by transformers' own ``Fp8Quantize`` exactly as the demo does
(:func:`hp_dcp_hf.tools.demo._quantize_fp8`: blocks of 128 x 128, float32 ``weight_scale_inv``, every
2-D ``.layers.`` weight but the routers; embeddings, norms and routers stay bf16). Widths are
multiples of 128, so every such weight is quantized. Generated once into ``<cache>/moe-fp8-<size>``.

Contenders, each in its own process group of 4 gloo ranks after a warm page cache, ``warmup``
untimed then ``reps`` timed loads:

* ``limit``: ``os.preadv`` of exactly the byte ranges this project's plan reads on each rank
  (:func:`hp_dcp_hf.tools.rank_plans.plan_ranks` for the same layout, planned in the bench process), same
  threads, into a touched buffer (:class:`bench.limit.RawReads`): no planning, no dequantization.
* ``dcp``: this project: the bf16 model laid out by transformers' plans over ``dp=2,tp=2`` (what
  ``hp_dcp_hf.from_pretrained(path, dtype=torch.bfloat16, distributed_config="dp=2,tp=2")``
  builds), built once, then ``load_hf_checkpoint(model, path)`` timed; quantized weight boxes and
  the scale blocks covering them are read apart and dequantized per box. The planner's
  ``_dequantize`` is timed (per call, on the reader threads): ``dequant_sum_s`` adds the calls,
  ``dequant_busy_s`` is the wall time during which at least one ran. Checked against the legacy
  loader (whole tensors, dequantized whole, local part kept) in the same model and layout.
* ``torch``: torch's ``QuantizedHuggingFaceStorageReader(path, thread_count, target_dtype=bf16,
  block_size=128)`` + ``DefaultLoadPlanner`` on a plain state dict keyed by the checkpoint's
  weight names (identity layout: every rank loads every tensor whole; scales are not keys, the
  reader reads the whole scale tensor for each weight). Checked against ``dcp``'s full tensors
  (gathered, reverted to the checkpoint's names) on rank 0.
* ``transformers``: ``AutoModelForCausalLM.from_pretrained(path, dtype=bf16, distributed_config=
  DistributedConfig(fsdp_size=2, tp_size=2))`` (on CPU transformers dequantizes FP8 to bf16 while
  loading); wall time is the whole call. An error is recorded per rank; values are compared with
  ``dcp``'s, parameter by parameter, as full tensors (``full_tensor()`` of both models).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench import measure
from bench.contenders import Job, Row, quiet_transformers, refill_nan, repeat_loads, time_reads
from bench.workloads import Workload, human, size_tag

MESH = "dp=2,tp=2"
WORLD = 4
CONTENDERS = ("limit", "dcp", "torch", "transformers")
GENERATOR_VERSION = 1
STAMP = "bench_workload.json"
BLOCK = 128


# -- the checkpoint ------------------------------------------------------------------------------


def ensure_fp8_workload(size: int, cache_dir: Path, *, seed: int = 0, log: Callable[[str], None] = print) -> Workload:
    """The FP8 MoE checkpoint of ``size`` bytes of bf16 weights before quantization, under ``cache_dir``."""
    from bench.workloads import make_config, verify_layout, write_checkpoint
    from hp_dcp_hf.tools.demo import FP8_CONFIG, _quantize_fp8

    config = make_config("moe", size)
    path = Path(cache_dir) / f"moe-fp8-{size_tag(size)}"
    wanted = {"version": GENERATOR_VERSION, "kind": "moe-fp8", "size": size, "seed": seed, "quantization": FP8_CONFIG}
    stamp = path / STAMP
    if stamp.exists():
        found = json.loads(stamp.read_text())
        if {k: found.get(k) for k in wanted} == wanted:
            return Workload(**found["workload"], path=path)
    log(f"generating the FP8 moe checkpoint of ~{size_tag(size)} bf16 in {path} (layout verified, then quantized)")
    verify_layout(config)
    tmp = path.with_name(path.name + ".tmp")
    for stale in (path, tmp):
        if stale.exists():
            shutil.rmtree(stale)
    written = write_checkpoint(config, tmp, max_shard_bytes=max(4 * 10**6, size // 4), seed=seed)
    if not (tmp / "model.safetensors.index.json").exists():
        raise RuntimeError(f"{tmp}: one file only; the FP8 step needs an index (use a larger --size)")
    start = time.perf_counter()
    _quantize_fp8(tmp)
    quantize_s = time.perf_counter() - start
    index = json.loads((tmp / "model.safetensors.index.json").read_text())
    info = {"kind": "moe-fp8", "size": size, "model_class": config.architectures[0],
            "num_layers": config.num_hidden_layers, "checkpoint_bytes": index["metadata"]["total_size"],
            "files": len(set(index["weight_map"].values())), "tensors": len(index["weight_map"])}
    (tmp / STAMP).write_text(json.dumps({**wanted, "workload": info, "bf16_bytes": written["checkpoint_bytes"],
                                         "quantize_s": quantize_s}, indent=2, default=str))
    os.replace(tmp, path)
    return Workload(**info, path=path)


# -- on every rank -------------------------------------------------------------------------------


def _dcp_model(path: str):
    """The bf16 model ``hp_dcp_hf.from_pretrained(path, dtype=bf16, distributed_config=MESH)``
    builds (transformers' plans over the mesh), local shards NaN, and its checkpoint mapping."""
    from torch import nn

    from hp_dcp_hf.model.config import read_config, resolve_model_class
    from hp_dcp_hf.model.finalize import materialize
    from hp_dcp_hf.model.skeleton import build_skeleton, checkpoint_mapping
    from hp_dcp_hf.tools.rank_plans import parallelize_for

    config = read_config(path)
    model = build_skeleton(config, resolve_model_class(config), dtype=torch.bfloat16)
    mapping = checkpoint_mapping(model)  # before FSDP renames the class
    out = parallelize_for(MESH)(model)
    model = out if isinstance(out, nn.Module) else model
    materialize(model)
    refill_nan(model)
    return model, mapping


def _timed_planner(model, mapping, spans: list[tuple[float, float]]):
    """An ``HFMappingPlanner`` whose ``_dequantize`` (one box of a quantized tensor: scale, cast,
    copy into the shard; called on the reader's threads) appends its ``(start, end)`` to ``spans``."""
    from hp_dcp_hf import HFMappingPlanner

    class DequantTimedPlanner(HFMappingPlanner):
        def _dequantize(self, dequantization) -> None:
            start = time.perf_counter()
            try:
                super()._dequantize(dequantization)
            finally:
                spans.append((start, time.perf_counter()))

    return DequantTimedPlanner(model, weights_mapping=mapping)


def _busy(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds during which at least one span ran (the union of the intervals)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _dcp(job: Job, rank: int) -> list[Row]:
    from bench.contenders import _timed_method
    from hp_dcp_hf import HFStorageReader, load_hf_checkpoint

    row = Row("dcp", rank)
    model, mapping = _dcp_model(job.path)

    def load(m) -> dict[str, Any]:
        spans: list[tuple[float, float]] = []
        reader = HFStorageReader(job.path, num_threads=job.threads)
        planner = _timed_planner(m, mapping, spans)
        phases = {"metadata_s": _timed_method(reader, "read_metadata"),
                  "plan_s": _timed_method(planner, "create_local_plan"), "read_s": _timed_method(reader, "read_data")}
        start = time.perf_counter()
        load_hf_checkpoint(m, job.path, reader=reader, planner=planner)
        own = time.perf_counter() - start
        total, stats = reader.stats.total(), planner.stats
        for key, value in (("dequant_sum_s", sum(e - s for s, e in spans)), ("dequant_busy_s", _busy(spans)),
                           ("load_s", own)):
            row.extra.setdefault(key, []).append(value)
        row.extra.update(dequant_calls=len(spans), quantized_bytes=stats.quantized_bytes, scale_bytes=stats.scale_bytes)
        return {"bytes_needed": stats.bytes_needed, "bytes_read": total.bytes_read, "requests": total.requests,
                "ranges": total.ranges, "header_bytes": total.header_bytes,
                "phases": {name: sum(seconds) for name, seconds in phases.items()}}

    repeat_loads(row, job, model, load)
    # The warm-up appended too: keep the timed repetitions only.
    for key in ("dequant_sum_s", "dequant_busy_s", "load_s"):
        row.extra[key] = row.extra[key][job.warmup:]
    row.mismatched = measure.compare_digests(row.digests or {}, _legacy_digests(model, mapping, job))
    row.digests = None
    return [row]


def _legacy_digests(model, mapping, job: Job) -> dict[str, str]:
    """This rank's shards as the legacy loader fills them (whole tensors read, dequantized whole,
    local part kept); ranks take turns, as :func:`bench.contenders.legacy_digests` does."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from hp_dcp_hf import HFMappingPlanner, HFStorageReader

    world, rank = dist.get_world_size(), dist.get_rank()
    digests: dict[str, str] = {}
    for turn in range(world):
        if turn == rank:
            refill_nan(model)
            reader = HFStorageReader(job.path, broadcast_metadata=False, num_threads=job.threads)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(model.state_dict(), storage_reader=reader,
                         planner=HFMappingPlanner(model, weights_mapping=mapping, trace=False), no_dist=True)
            digests = measure.digests(model)
            measure.trim_memory()
        dist.barrier()
    return digests


def _dcp_reference(job: Job):
    """The ``dcp`` model, loaded once (untimed): the values the other contenders are compared with."""
    from hp_dcp_hf import load_hf_checkpoint

    model, mapping = _dcp_model(job.path)
    load_hf_checkpoint(model, job.path, weights_mapping=mapping, num_threads=job.threads)
    return model


def _compare(theirs: torch.Tensor, ours: torch.Tensor) -> dict[str, Any] | None:
    """None when equal (bit for bit); else what differs."""
    if theirs.shape != ours.shape:
        return {"shape": [list(theirs.shape), list(ours.shape)]}
    if torch.equal(theirs, ours):
        return None
    diff = (theirs.float() - ours.float()).abs()
    return {"max_abs_diff": float(diff.nan_to_num(float("inf")).max()), "fraction_differing": float((diff != 0).float().mean()),
            "max_abs_value": float(ours.float().abs().max())}


def _torch_state(path: str) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor but the scales, whole, bf16 (the identity layout)."""
    from safetensors import safe_open

    index = json.loads(Path(path, "model.safetensors.index.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(Path(path, file)), framework="pt") as f:
            for key in (k for k, name in index["weight_map"].items() if name == file and not k.endswith("_scale_inv")):
                state[key] = torch.full(f.get_slice(key).get_shape(), float("nan"), dtype=torch.bfloat16)
    return dict(sorted(state.items()))


def _torch(job: Job, rank: int) -> list[Row]:
    """torch's ``QuantizedHuggingFaceStorageReader`` + ``DefaultLoadPlanner``, whole tensors on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, QuantizedHuggingFaceStorageReader

    from hp_dcp_hf.model.config import read_config, resolve_model_class
    from hp_dcp_hf.model.skeleton import build_skeleton

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # full_tensor() below
    row = Row("torch", rank)
    state = _torch_state(job.path)
    row.notes.append("identity layout: every rank loads every checkpoint tensor whole (no DTensor), "
                     "dequantized by the reader (target_dtype=bf16, block_size=128)")

    def load() -> None:
        reader = QuantizedHuggingFaceStorageReader(job.path, thread_count=job.threads, target_dtype=torch.bfloat16,
                                                   block_size=BLOCK)
        dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner())

    for _ in range(job.warmup):
        load()
    for _ in range(job.reps):
        for tensor in state.values():
            tensor.fill_(float("nan"))
        measure.trim_memory()
        with measure.memory_window() as mem, measure.count_safe_open() as counter, \
                measure.timed_across_ranks() as timer:
            load()
        row.wall_s.append(timer.wall_s)
        row.own_s.append(timer.own_s)
        row.growth_rss = max(row.growth_rss, mem.growth_rss)
        row.growth_anon = max(row.growth_anon, mem.growth_anon)
        row.bytes_read, row.requests = counter.bytes, counter.slices
    row.local_param_bytes = sum(t.numel() * t.element_size() for t in state.values())
    unfilled = sorted(k for k, t in state.items() if bool(torch.isnan(t).any()))
    # Against dcp: its full tensors (every rank gathers, rank 0 compares), reverted to checkpoint names.
    from transformers.core_model_loading import revert_weight_conversion

    reference = _dcp_reference(job)
    config = read_config(job.path)
    skeleton = build_skeleton(config, resolve_model_class(config), dtype=torch.bfloat16)
    differing: dict[str, Any] = {}
    compared = 0
    for name, tensor in reference.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if rank == 0:
            for key, value in revert_weight_conversion(skeleton, {name: full}).items():
                compared += 1
                if key not in state:
                    differing[key] = {"missing": "not in torch's state dict"}
                elif (found := _compare(state[key], value)) is not None:
                    differing[key] = found
        del full
    if rank == 0:
        row.mismatched = sorted(set(differing) | {f"nan:{k}" for k in unfilled})
        row.extra.update(compared_tensors=compared, differing=dict(list(differing.items())[:10]))
    return [row]


def _transformers(job: Job, rank: int) -> list[Row]:
    """transformers' distributed ``from_pretrained`` of the FP8 checkpoint into bf16; errors per rank."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from bench.contenders import _time_convert
    from bench.layouts import local, local_bytes

    row = Row("transformers", rank)
    sizes = dict(part.split("=") for part in MESH.split(","))
    config = DistributedConfig(fsdp_size=int(sizes["dp"]), tp_size=int(sizes["tp"]))
    model, errors, first_error = None, [None] * dist.get_world_size(), None
    for rep in range(-job.warmup, job.reps):
        model, error = None, None
        measure.trim_memory()
        seconds, undo = _time_convert()
        dist.barrier()
        start = time.perf_counter()
        try:
            with measure.memory_window() as mem, measure.count_safe_open() as counter:
                model = AutoModelForCausalLM.from_pretrained(job.path, dtype=torch.bfloat16, distributed_config=config)
        except Exception as e:  # every rank still reaches the barrier below
            error = f"{type(e).__name__}: {e}"
            if first_error is None:
                first_error = error
                row.extra["traceback"] = traceback.format_exc()[-4000:]
        finally:
            undo()
        own = time.perf_counter() - start
        dist.barrier()
        wall = time.perf_counter() - start
        dist.all_gather_object(errors, error)
        if any(errors):  # per rank, the first attempt that failed anywhere
            row.extra.setdefault("errors", errors)
            row.extra.setdefault("failed_at", "warm-up" if rep < 0 else f"repetition {rep}")
        if rep < 0:
            continue
        # Every attempt is timed on every rank (until it returned or raised), so the ranks that do
        # load have times to show; the row's wall time needs all ranks to have loaded.
        row.extra.setdefault("outcome_s", []).append(own)
        row.bytes_read, row.requests = counter.bytes, counter.slices
        if model is None:
            continue
        row.extra.setdefault("own_part_s", []).append(sum(seconds))
        row.beyond_params_rss = max(row.beyond_params_rss or 0, mem.peak_rss - mem.start_rss - local_bytes(model))
        row.growth_anon = max(row.growth_anon, mem.growth_anon)
        if not any(errors):
            row.wall_s.append(wall)
            row.own_s.append(own)
            row.extra.setdefault("load_part_s", []).append(sum(seconds))
    row.notes.append("wall_s is the whole from_pretrained (model construction included); "
                     "extra.load_part_s its convert_and_load_state_dict_in_model part")
    # Against dcp, rank by rank (no collective: ranks where transformers failed have no model):
    # local shards where the layouts agree.
    reference = _dcp_reference(job)
    if model is not None:
        row.local_param_bytes = local_bytes(model)
        ours = reference.state_dict()
        differing: dict[str, Any] = {}
        layout_differs: list[str] = []
        for name, tensor in model.state_dict().items():
            mine = ours.get(name)
            same_layout = mine is not None and str(getattr(tensor, "placements", None)) == str(
                getattr(mine, "placements", None)) and local(tensor).shape == local(mine).shape
            if not same_layout:
                layout_differs.append(name)
                continue
            found = _compare(local(tensor).detach(), local(mine).detach())
            if found is not None:
                differing[name] = found
        row.mismatched = sorted(differing)
        row.extra.update(compared_tensors=len(ours) - len(layout_differs), layout_differs=layout_differs[:10],
                         differing=dict(list(differing.items())[:10]))
    return [row]


def _limit(job: Job, rank: int, ranges: dict[str, list[tuple[int, int]]]) -> list[Row]:
    """``os.preadv`` of the ranges this project's plan reads on this rank (planned by the parent)."""
    from bench.limit import RawReads

    row = Row("limit", rank)
    raw = RawReads(job.path, ranges)
    try:
        got = time_reads(raw, job, row)
        row.bytes_needed, row.bytes_read, row.requests = raw.total, got, raw.requests
        row.ranges = raw.ranges
    finally:
        raw.close()
    return [row]


def run_rank(rank: int, world: int, job: Job, ranges: list[dict[str, list[tuple[int, int]]]]) -> list[dict[str, Any]]:
    """Entry point of a spawned rank: one contender, its rows (an error becomes the row)."""
    quiet_transformers()
    try:
        if job.contender == "limit":
            rows = _limit(job, rank, ranges[rank])
        else:
            rows = {"dcp": _dcp, "torch": _torch, "transformers": _transformers}[job.contender](job, rank)
    except Exception as e:
        row = Row(job.contender, rank, error=f"{type(e).__name__}: {e}")
        row.extra["traceback"] = traceback.format_exc()
        rows = [row]
    return [r.as_dict() for r in rows]


# -- in the bench process ------------------------------------------------------------------------


def _ranges(reads: Sequence[tuple[str, int, int]]) -> dict[str, list[tuple[int, int]]]:
    """A rank's planned reads as file -> sorted ``[start, end)`` ranges, touching ones merged."""
    per_file: dict[str, list[tuple[int, int]]] = {}
    for file, start, end in sorted(reads):
        out = per_file.setdefault(file, [])
        if out and start == out[-1][1]:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return per_file


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _record(name: str, rows: list[dict[str, Any]], plans: list[Any]) -> dict[str, Any]:
    """One contender's rows (one per rank) -> its record: wall time (slowest rank, median over the
    repetitions), and per rank its own time, bytes, and for ``dcp`` the dequantize share."""
    rows = sorted(rows, key=lambda r: r["rank"])
    record: dict[str, Any] = {"contender": name, "ranks": len(rows)}
    errors = {r["rank"]: r["error"] for r in rows if r.get("error")}
    tf_errors = next((r["extra"].get("errors") for r in rows if r.get("extra", {}).get("errors")), None)
    if tf_errors:
        errors = {rank: e for rank, e in enumerate(tf_errors) if e}
        record["failed_at"] = rows[0]["extra"].get("failed_at")
    if errors:
        record["errors"] = {str(k): v[:1500] for k, v in errors.items()}
        tb = next((r["extra"].get("traceback") for r in rows if r.get("extra", {}).get("traceback")), None)
        if tb:
            record["traceback"] = tb
            frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', tb)
            if frames:
                file, line, fn = frames[-1]
                record["raised_in"] = f"{fn} ({'/'.join(Path(file).parts[-3:])}:{line})"
    reps = min((len(r["wall_s"]) for r in rows), default=0)
    if reps:
        walls = [max(r["wall_s"][i] for r in rows) for i in range(reps)]
        record.update(wall_s=statistics.median(walls), wall_runs=walls)
        parts = [r["extra"].get("load_part_s") for r in rows]
        if all(parts):
            record["load_part_s"] = statistics.median([max(p[i] for p in parts) for i in range(reps)])
    per_rank = []
    for r in rows:
        extra, plan = r.get("extra", {}), plans[r["rank"]]
        rank: dict[str, Any] = {"rank": r["rank"], "own_s": _median(r["own_s"]) or _median(extra.get("outcome_s", [])),
                                "bytes_read": r.get("bytes_read"), "requests": r.get("requests"),
                                "rss_growth": r["beyond_params_rss"] if r.get("beyond_params_rss") is not None
                                else r.get("growth_rss"), "anon_growth": r.get("growth_anon"),
                                "local_param_bytes": r.get("local_param_bytes"), "error": errors.get(r["rank"])}
        if extra.get("own_part_s"):
            rank["load_part_s"] = _median(extra["own_part_s"])
        if name in ("dcp", "limit"):
            rank.update(bytes_needed=plan.bytes_needed, quantized_bytes=plan.quantized_bytes,
                        scale_bytes=plan.scale_bytes, plain_bytes=plan.bytes_needed - plan.quantized_bytes - plan.scale_bytes)
        if name == "dcp":
            rank.update(quantized_bytes_read=extra.get("quantized_bytes"), scale_bytes_read=extra.get("scale_bytes"),
                        phases=r.get("phases"), dequant_calls=extra.get("dequant_calls"),
                        dequant_sum_s=_median(extra.get("dequant_sum_s", [])),
                        dequant_busy_s=_median(extra.get("dequant_busy_s", [])), load_s=_median(extra.get("load_s", [])))
            shares = [b / t for b, t in zip(extra.get("dequant_busy_s", []), extra.get("load_s", [])) if t]
            rank["dequant_share"] = _median(shares)
        per_rank.append(rank)
    record["per_rank"] = per_rank
    checked = [r for r in rows if r.get("mismatched") is not None]
    if name == "limit":
        record["correct"], record["check"] = None, "reads bytes only (no model)"
    elif checked:
        bad = sorted({m for r in checked for m in r["mismatched"]})
        record["correct"] = not bad and not errors
        record["mismatched"] = bad[:20]
        record["mismatched_count"] = len(bad)
        record["check"] = {"dcp": "against the legacy loader, same model and layout, byte for byte",
                           "torch": "rank 0's whole tensors against dcp's full tensors (gathered, checkpoint names)",
                           "transformers": "each rank's local shards against dcp's on the same rank (same placements)",
                           }[name]
        record["checked_ranks"] = [r["rank"] for r in checked]
        differing = {}
        for r in checked:
            for key, value in (r.get("extra", {}).get("differing") or {}).items():
                differing.setdefault(f"rank {r['rank']}: {key}", value)
        if differing:
            record["differing"] = dict(list(differing.items())[:12])
        compared = [r["extra"].get("compared_tensors") for r in checked if r.get("extra", {}).get("compared_tensors")]
        if compared:
            record["compared_tensors"] = compared
        layout = sorted({n for r in checked for n in r.get("extra", {}).get("layout_differs") or []})
        if layout:
            record["layout_differs"] = layout
    else:
        record["correct"], record["check"] = (False if errors else None), "no model to compare"
    notes = sorted({n for r in rows for n in r.get("notes") or []})
    if notes:
        record["notes"] = notes
    return record


def run_quantized(workload: Workload, *, reps: int = 3, warmup: int = 1, threads: int = 8, timeout: float = 1800,
                  contenders: Sequence[str] = CONTENDERS, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The quantized part for ``workload`` (an FP8 checkpoint of :func:`ensure_fp8_workload`)."""
    from bench.layouts import parse_mesh
    from bench.workloads import warm_page_cache
    from hp_dcp_hf.tools.inspection import inspect_checkpoint
    from hp_dcp_hf.tools.launch import run_ranks
    from hp_dcp_hf.tools.rank_plans import plan_ranks

    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise ValueError(f"unknown quantized contenders {unknown}; known: {', '.join(CONTENDERS)}")
    path = str(workload.path)
    info = inspect_checkpoint(path)
    stamp = json.loads(Path(path, STAMP).read_text())
    start = time.perf_counter()
    plan = plan_ranks(path, MESH, dtype=torch.bfloat16, with_items=True)
    plans = plan["ranks"]
    doc: dict[str, Any] = {
        "checkpoint": path, "model_class": workload.model_class, "num_layers": workload.num_layers,
        "checkpoint_bytes": workload.checkpoint_bytes, "bf16_bytes": stamp.get("bf16_bytes"),
        "files": workload.files, "tensors": workload.tensors, "quantization": info["quantization"],
        "dtypes": info["dtypes"], "world": WORLD, "mesh": MESH, "threads": threads, "reps": reps, "warmup": warmup,
        "plan_s": time.perf_counter() - start, "layout": plan["layout"],
        "plan": [{"rank": p.rank, "coordinate": list(p.coordinate), "bytes_needed": p.bytes_needed,
                  "bytes_to_read": p.bytes_to_read, "quantized_bytes": p.quantized_bytes, "scale_bytes": p.scale_bytes,
                  "requests": p.requests, "ranges": p.ranges} for p in plans]}
    ranges = [_ranges(p.reads) for p in plans]
    mesh = parse_mesh(MESH)
    records = []
    for name in [c for c in CONTENDERS if c in contenders]:
        log(f"  moe-fp8 x {WORLD} ranks [{MESH}]: {name} ...")
        warm_page_cache(workload.path)
        job = Job(name, "moe-fp8", path, mesh, reps=reps, threads=threads, warmup=warmup)
        begun = time.perf_counter()
        try:
            per_rank = run_ranks(WORLD, run_rank, job, ranges, timeout=timeout)
            rows = [row for rows in per_rank for row in rows]
        except Exception as e:  # a rank died or hung
            rows = [{"contender": name, "rank": 0, "error": f"{type(e).__name__}: {str(e)[-2000:]}", "wall_s": [],
                     "own_s": [], "extra": {}}]
        record = _record(name, rows, plans)
        record["group_s"] = time.perf_counter() - begun
        records.append(record)
        log("    " + summary_line(record))
    doc["contenders"] = records
    doc["ratios"] = ratios(records)
    return doc


def ratios(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Wall-time ratios of the same run: dcp over the limit, torch and transformers over dcp."""
    wall = {r["contender"]: r.get("wall_s") for r in records}
    out: dict[str, float] = {}
    if wall.get("dcp"):
        if wall.get("limit"):
            out["dcp_vs_limit"] = wall["dcp"] / wall["limit"]
        for peer in ("torch", "transformers"):
            if wall.get(peer):
                out[f"{peer}_vs_dcp"] = wall[peer] / wall["dcp"]
        tf = next((r for r in records if r["contender"] == "transformers"), {})
        if tf.get("load_part_s"):
            out["transformers_load_part_vs_dcp"] = tf["load_part_s"] / wall["dcp"]
        dcp = next(r for r in records if r["contender"] == "dcp")
        loaded = [p for p in tf.get("per_rank", []) if not p.get("error") and p.get("own_s")]
        if tf and not tf.get("wall_s") and loaded:
            # transformers failed on some ranks: the ranks that loaded, each against dcp's same rank.
            ours = {p["rank"]: p.get("own_s") for p in dcp.get("per_rank", [])}
            out["transformers_loaded_ranks_vs_dcp"] = max(p["own_s"] for p in loaded) / max(
                ours[p["rank"]] for p in loaded)
    return out


def summary_line(r: dict[str, Any]) -> str:
    wall = f"{r['wall_s']:8.3f} s" if r.get("wall_s") else "       - s"
    reads = [p["bytes_read"] for p in r.get("per_rank", []) if p.get("bytes_read") is not None]
    ok = {True: "ok", False: "WRONG", None: "n/a"}[r.get("correct")]
    text = f"{r['contender']:<13} {wall}  bytes/rank {human(max(reads)) if reads else '-':>11}  {ok}"
    if r.get("errors"):
        first = next(iter(r["errors"].items()))
        text += f"  errors on ranks {sorted(map(int, r['errors']))}: rank {first[0]}: {first[1].splitlines()[0][:200]}"
    if r.get("mismatched"):
        text += f"  {r.get('mismatched_count')} tensors differ from the reference"
    shares = [p["dequant_share"] for p in r.get("per_rank", []) if p.get("dequant_share") is not None]
    if shares:
        text += f"  dequantize {min(shares):.0%}-{max(shares):.0%} of the load"
    return text

