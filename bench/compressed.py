"""The compressed part: compressed-tensors MoE checkpoints (INT4 pack-quantized, NVFP4) loaded into bf16 on 4 ranks.

The checkpoints are the ``moe`` workload of :mod:`bench.workloads` (a ``Qwen3MoeForCausalLM`` of
``--size`` bytes of random bf16 weights, the files ``save_pretrained`` writes), compressed file by
file by compressed-tensors' own compressors, as llm-compressor does and as ``tests/support/compressed.py``
does for the tests (:func:`tests.support.compressed.compress_modules`: the checkpoint's ``Linear`` weights
as ``nn.Linear`` modules, ``apply_quantization_config``, a min-max observer through
compressed-tensors' ``calculate_qparams`` / ``generate_gparam``, ``ModelCompressor.compress_model``,
``update_config``). Quantized: every attention and expert projection (``.layers.*_proj``);
embeddings, norms, routers (``mlp.gate``) and ``lm_head`` stay bf16 (``ignore``). Formats:

* ``w4a16``: the ``W4A16`` preset (INT4 symmetric, groups of 128, ``pack-quantized``: int32 words of
  8 values, bf16 ``weight_scale`` per group, ``weight_shape``);
* ``nvfp4``: the ``NVFP4`` preset (``nvfp4-pack-quantized``: two E2M1 per byte, an E4M3 scale per 16
  values, a ``weight_global_scale``, and an ``input_global_scale`` the load consumes).

Generated once into ``<cache>/moe-<format>-<size>``. Contenders, each in its own process group of 4
gloo ranks after a warm page cache, ``warmup`` untimed then ``reps`` timed loads:

* ``limit``: ``os.preadv`` of exactly the byte ranges this project's plan reads on each rank
  (:func:`hp_dcp_hf.tools.rank_plans.plan_ranks`), into a touched buffer (:class:`bench.limit.RawReads`):
  no planning, no dequantization. The floor.
* ``dcp``: this project: the bf16 model ``hp_dcp_hf.from_pretrained(path, dtype=bf16,
  distributed_config="dp=2,tp=2")`` builds (built once), then ``load_hf_checkpoint(model, path)``
  timed. ``CompressedWeight.values`` (one box of a compressed weight computed from its packed
  words and scales) is wrapped in the ranks (the library is not changed): ``values_sum_s`` adds the
  calls, ``values_busy_s`` is the wall time during which at least one ran (reader threads run them
  in parallel); ``dequant_*`` the same for the planner's ``_dequantize`` (``values`` plus the copy
  into the shard).
* ``peer``: compressed-tensors on every rank, the best CPU path there is: every file read whole
  (``safetensors.torch.load_file``), the full state dict decompressed by
  ``ModelCompressor.decompress_model`` (:func:`tests.support.compressed.decompress_tensors`, the tests'
  oracle), then each of the rank's parameters built from it (the model's weight conversions:
  stacked experts) and sliced to its shard (``distribute_tensor(..., src_data_rank=None)``: local
  slicing, no communication). compressed-tensors runs as in one process (``torch.distributed.
  is_initialized`` reads False around its calls: with a process group it would split the modules
  between the ranks and broadcast pickled state dicts). Timed phases: ``read_s``, ``decompress_s``, ``slice_s``. The
  conversion of checkpoint keys to parameters is planned before the timer (an index map made by
  ``revert_weight_conversion`` of an ``arange``), so ``slice_s`` is only the copying.

Correctness: every rank's local shards after ``dcp`` are compared, byte for byte, with the same
rank's shards after ``peer`` (blake2b digests of every state-dict entry).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench import measure
from bench.contenders import Job, Row, quiet_transformers, refill_nan, repeat_loads
from bench.quantized import _busy, _dcp_model, _limit, _median, _ranges
from bench.workloads import Workload, human, size_tag

MESH = "dp=2,tp=2"
WORLD = 4
CONTENDERS = ("limit", "dcp", "peer")
GENERATOR_VERSION = 1
STAMP = "bench_workload.json"
IGNORE = ("lm_head", "re:.*mlp.gate$")
#: format name -> compressed-tensors config groups (presets, as llm-compressor's recipes name them)
FORMATS: dict[str, dict[str, Any]] = {
    "w4a16": {"W4A16": ["Linear"]},
    "nvfp4": {"NVFP4": ["Linear"]},
}


# -- the checkpoints -----------------------------------------------------------------------------


def _compressible(key: str, tensor: torch.Tensor) -> bool:
    return tensor.ndim == 2 and ".layers." in key and key.endswith("_proj.weight")


def ensure_compressed_workload(fmt: str, size: int, cache_dir: Path, *, seed: int = 0,
                               log: Callable[[str], None] = print) -> Workload:
    """The ``fmt`` compressed-tensors MoE checkpoint of ``size`` bytes of bf16 weights before
    compression, under ``cache_dir``."""
    from safetensors.torch import load_file, save_file

    from bench.workloads import make_config, verify_layout, write_checkpoint
    from tests.support.compressed import compress_modules

    groups = FORMATS[fmt]
    config = make_config("moe", size)
    path = Path(cache_dir) / f"moe-{fmt}-{size_tag(size)}"
    wanted = {"version": GENERATOR_VERSION, "kind": f"moe-{fmt}", "size": size, "seed": seed,
              "config_groups": groups, "ignore": list(IGNORE)}
    stamp = path / STAMP
    if stamp.exists():
        found = json.loads(stamp.read_text())
        if {k: found.get(k) for k in wanted} == wanted:
            return Workload(**found["workload"], path=path)
    log(f"generating the {fmt} moe checkpoint of ~{size_tag(size)} bf16 in {path} (compressed-tensors)")
    verify_layout(config)
    tmp = path.with_name(path.name + ".tmp")
    for stale in (path, tmp):
        if stale.exists():
            shutil.rmtree(stale)
    written = write_checkpoint(config, tmp, max_shard_bytes=max(4 * 10**6, size // 4), seed=seed)
    index_file = tmp / "model.safetensors.index.json"
    if not index_file.exists():
        raise RuntimeError(f"{tmp}: one file only; use a larger --size")
    index = json.loads(index_file.read_text())
    start = time.perf_counter()
    quantization_config, shapes, weight_map = None, {}, {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(tmp / file)
        weights = {k.removesuffix(".weight"): v for k, v in tensors.items() if _compressible(k, v)}
        shapes.update({name: list(w.shape) for name, w in weights.items()})
        compressed, written_config = compress_modules(weights, groups, IGNORE)
        quantization_config = quantization_config or written_config
        out = {k: v for k, v in tensors.items() if k.removesuffix(".weight") not in compressed}
        for module, params in compressed.items():
            out.update({f"{module}.{p}": t.contiguous() for p, t in params.items()})
        del tensors, weights, compressed
        save_file(out, tmp / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in out})
    compress_s = time.perf_counter() - start
    total = sum(os.path.getsize(tmp / f) for f in set(weight_map.values()))
    index["weight_map"] = dict(sorted(weight_map.items()))
    index["metadata"]["total_size"] = total
    index_file.write_text(json.dumps(index, indent=2))
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    info = {"kind": f"moe-{fmt}", "size": size, "model_class": config.architectures[0],
            "num_layers": config.num_hidden_layers, "checkpoint_bytes": total,
            "files": len(set(weight_map.values())), "tensors": len(weight_map)}
    (tmp / STAMP).write_text(json.dumps({**wanted, "workload": info, "bf16_bytes": written["checkpoint_bytes"],
                                         "compress_s": compress_s, "shapes": shapes}, indent=2, default=str))
    os.replace(tmp, path)
    return Workload(**info, path=path)


# -- on every rank -------------------------------------------------------------------------------


def _wrap(owner: type, name: str, spans: list[tuple[float, float]]) -> Callable[[], None]:
    """``owner.name`` timed into ``spans`` (start, end) per call; returns the undo."""
    original = getattr(owner, name)

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spans.append((start, time.perf_counter()))

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, original)


def _dcp(job: Job, rank: int) -> list[Row]:
    from bench.contenders import _timed_method
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader, load_hf_checkpoint
    from hp_dcp_hf.quant.compressed import CompressedWeight

    row = Row("dcp", rank)
    model, mapping = _dcp_model(job.path)
    values: list[tuple[float, float]] = []
    dequant: list[tuple[float, float]] = []
    undo = [_wrap(CompressedWeight, "values", values), _wrap(HFMappingPlanner, "_dequantize", dequant)]

    def load(m) -> dict[str, Any]:
        values.clear()
        dequant.clear()
        reader = HFStorageReader(job.path, num_threads=job.threads)
        planner = HFMappingPlanner(m, weights_mapping=mapping)
        phases = {"metadata_s": _timed_method(reader, "read_metadata"),
                  "plan_s": _timed_method(planner, "create_local_plan"), "read_s": _timed_method(reader, "read_data")}
        start = time.perf_counter()
        load_hf_checkpoint(m, job.path, reader=reader, planner=planner)
        own = time.perf_counter() - start
        total, stats = reader.stats.total(), planner.stats
        for key, value in (("values_sum_s", sum(e - s for s, e in values)), ("values_busy_s", _busy(values)),
                           ("dequant_sum_s", sum(e - s for s, e in dequant)), ("dequant_busy_s", _busy(dequant)),
                           ("load_s", own)):
            row.extra.setdefault(key, []).append(value)
        row.extra.update(values_calls=len(values), dequant_calls=len(dequant),
                         quantized_bytes=stats.quantized_bytes, scale_bytes=stats.scale_bytes)
        return {"bytes_needed": stats.bytes_needed, "bytes_read": total.bytes_read, "requests": total.requests,
                "ranges": total.ranges, "header_bytes": total.header_bytes,
                "phases": {name: sum(seconds) for name, seconds in phases.items()}}

    try:
        repeat_loads(row, job, model, load)
    finally:
        for u in undo:
            u()
    for key in ("values_sum_s", "values_busy_s", "dequant_sum_s", "dequant_busy_s", "load_s"):
        row.extra[key] = row.extra[key][job.warmup:]
    row.extra["digests"], row.digests = row.digests, None
    return [row]


def _conversions(model, params: Sequence[str]) -> dict[str, tuple[list[str], torch.Tensor | None]]:
    """Per parameter: the checkpoint keys it is made of, in the order whose flattened concatenation
    is the parameter, and None, or (when no order is) a flat index per key's elements."""
    from transformers.core_model_loading import revert_weight_conversion

    from hp_dcp_hf.model.config import read_config, resolve_model_class
    from hp_dcp_hf.model.skeleton import build_skeleton

    state = model.state_dict()
    config = read_config(model._bench_path)
    skeleton = build_skeleton(config, resolve_model_class(config), dtype=torch.bfloat16)
    out: dict[str, tuple[list[str], torch.Tensor | None]] = {}
    for name in params:
        shape = tuple(state[name].shape)
        index = torch.arange(int(torch.Size(shape).numel()), dtype=torch.int64).view(shape)
        parts = revert_weight_conversion(skeleton, {name: index})
        keys = sorted(parts, key=lambda k: int(parts[k].reshape(-1)[0]))
        flat = torch.cat([parts[k].reshape(-1) for k in keys])
        out[name] = (keys, None) if torch.equal(flat, torch.arange(flat.numel())) else (keys, flat)
    return out


def _meta_container(shapes, quantization_config):
    """compressed-tensors' modules for a checkpoint's compressed ``Linear`` weights, as transformers
    prepares them for ``run_compressed=False`` (``apply_quantization_config`` + ``compress_model``),
    built on the meta device (what compressed-tensors itself does on the ranks that do not compress
    a module), and the ``ModelCompressor``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from tests.support.compressed import _container

    compressor = ModelCompressor.from_compression_config(CompressedTensorsConfig.from_dict(dict(quantization_config)))
    with torch.device("meta"):
        container = _container(shapes, torch.bfloat16)
    apply_quantization_config(container, compressor.quantization_config, show_progress=False)
    compressor.compress_model(container)
    return container, compressor


def _peer(job: Job, rank: int) -> list[Row]:
    """compressed-tensors' decompression of the whole checkpoint on this rank, then its shards."""
    from unittest import mock

    from compressed_tensors.quantization import QuantizationMetadata
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor, distribute_tensor

    from bench import layouts

    row = Row("peer", rank)
    model, _ = _dcp_model(job.path)
    model._bench_path = job.path
    stamp = json.loads(Path(job.path, STAMP).read_text())
    shapes = {k: tuple(v) for k, v in stamp["shapes"].items()}
    quantization_config = json.loads(Path(job.path, "config.json").read_text())["quantization_config"]
    files = sorted(set(json.loads(Path(job.path, "model.safetensors.index.json").read_text())["weight_map"].values()))
    conversions = _conversions(model, list(model.state_dict()))
    qparams = set(QuantizationMetadata.all_qparam_names()) | {"weight_packed", "q_scale"}
    # Every rank decompresses every module as one process would: with a process group initialized,
    # compressed-tensors splits the modules between the ranks, broadcasts pickled state dicts and
    # makes its offload caches distributed (3.6x slower here at 50 MB than 4 lone processes).
    sequential = mock.patch("torch.distributed.is_initialized", lambda: False)

    def load(m, container, compressor) -> None:
        start = time.perf_counter()
        stored: dict[str, torch.Tensor] = {}
        for file in files:
            stored.update(load_file(os.path.join(job.path, file)))
        read = time.perf_counter()
        for module in shapes:
            sub = container.get_submodule(module)
            for name, _ in list(sub.named_parameters(recurse=False)):
                sub.register_parameter(name, torch.nn.Parameter(stored[f"{module}.{name}"], requires_grad=False))
        with sequential:
            compressor.decompress_model(container)
        values = {k: v for k, v in stored.items() if k.rpartition(".")[0] not in shapes
                  and k.rpartition(".")[2] not in qparams}
        values.update({f"{module}.weight": container.get_submodule(module).weight.data for module in shapes})
        del stored
        decompressed = time.perf_counter()
        with torch.no_grad():
            for name, tensor in m.state_dict().items():
                keys, flat = conversions[name]
                if flat is None:
                    full = values[keys[0]] if len(keys) == 1 else torch.cat([values[k].reshape(-1) for k in keys])
                else:
                    full = torch.empty(flat.numel(), dtype=values[keys[0]].dtype)
                    full[flat] = torch.cat([values[k].reshape(-1) for k in keys])
                full = full.reshape(tensor.shape).to(tensor.dtype)
                if isinstance(tensor, DTensor):
                    part = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)
                    tensor.to_local().copy_(part.to_local())
                else:
                    tensor.copy_(full)
        done = time.perf_counter()
        for key, value in (("read_s", read - start), ("decompress_s", decompressed - read),
                           ("slice_s", done - decompressed)):
            row.extra.setdefault(key, []).append(value)

    # bench.contenders.repeat_loads, with the (untimed) meta modules made before each load.
    for rep in range(-job.warmup, job.reps):
        with sequential:
            container, compressor = _meta_container(shapes, quantization_config)
        refill_nan(model)
        measure.trim_memory()
        with measure.memory_window() as mem, measure.timed_across_ranks() as timer:
            load(model, container, compressor)
        del container, compressor
        if rep < 0:
            continue
        row.wall_s.append(timer.wall_s)
        row.own_s.append(timer.own_s)
        row.growth_rss = max(row.growth_rss, mem.growth_rss)
        row.growth_anon = max(row.growth_anon, mem.growth_anon)
        if rep == 0:
            row.extra["digests"] = measure.digests(model)
    row.local_param_bytes = layouts.local_bytes(model)
    row.bytes_read = sum(os.path.getsize(os.path.join(job.path, f)) for f in files)
    row.requests = len(files)
    for key in ("read_s", "decompress_s", "slice_s"):
        row.extra[key] = row.extra[key][job.warmup:]
    return [row]


def run_rank(rank: int, world: int, job: Job, ranges: list[dict[str, list[tuple[int, int]]]]) -> list[dict[str, Any]]:
    """Entry point of a spawned rank: one contender, its rows (an error becomes the row)."""
    quiet_transformers()
    try:
        from loguru import logger

        logger.disable("compressed_tensors")
    except ImportError:
        pass
    try:
        if job.contender == "limit":
            rows = _limit(job, rank, ranges[rank])
        else:
            rows = {"dcp": _dcp, "peer": _peer}[job.contender](job, rank)
    except Exception as e:
        row = Row(job.contender, rank, error=f"{type(e).__name__}: {e}")
        row.extra["traceback"] = traceback.format_exc()
        rows = [row]
    return [r.as_dict() for r in rows]


# -- in the bench process ------------------------------------------------------------------------


def _record(name: str, rows: list[dict[str, Any]], plans: list[Any]) -> dict[str, Any]:
    rows = sorted(rows, key=lambda r: r["rank"])
    record: dict[str, Any] = {"contender": name, "ranks": len(rows)}
    errors = {r["rank"]: r["error"] for r in rows if r.get("error")}
    if errors:
        record["errors"] = {str(k): v[:1500] for k, v in errors.items()}
        tb = next((r["extra"].get("traceback") for r in rows if r.get("extra", {}).get("traceback")), None)
        if tb:
            record["traceback"] = tb[-4000:]
    reps = min((len(r["wall_s"]) for r in rows), default=0)
    if reps:
        walls = [max(r["wall_s"][i] for r in rows) for i in range(reps)]
        record.update(wall_s=statistics.median(walls), wall_runs=walls)
    per_rank = []
    for r in rows:
        extra, plan = r.get("extra", {}), plans[r["rank"]]
        rank: dict[str, Any] = {"rank": r["rank"], "own_s": _median(r["own_s"]), "bytes_read": r.get("bytes_read"),
                                "requests": r.get("requests"), "rss_growth": r.get("growth_rss"),
                                "anon_growth": r.get("growth_anon"), "local_param_bytes": r.get("local_param_bytes"),
                                "bytes_needed": plan.bytes_needed, "quantized_bytes": plan.quantized_bytes,
                                "scale_bytes": plan.scale_bytes}
        if name == "dcp":
            rank.update(phases=r.get("phases"), values_calls=extra.get("values_calls"),
                        dequant_calls=extra.get("dequant_calls"), quantized_bytes_read=extra.get("quantized_bytes"),
                        scale_bytes_read=extra.get("scale_bytes"))
            for key in ("values_sum_s", "values_busy_s", "dequant_sum_s", "dequant_busy_s", "load_s"):
                rank[key] = _median(extra.get(key, []))
            for share, key in (("values_share", "values_busy_s"), ("dequant_share", "dequant_busy_s")):
                rank[share] = _median([b / t for b, t in zip(extra.get(key, []), extra.get("load_s", [])) if t])
        if name == "peer":
            for key in ("read_s", "decompress_s", "slice_s"):
                rank[key] = _median(extra.get(key, []))
        per_rank.append(rank)
    record["per_rank"] = per_rank
    record["_digests"] = {r["rank"]: r.get("extra", {}).get("digests") for r in rows}
    return record


def _check(records: list[dict[str, Any]]) -> dict[str, Any]:
    """dcp's local shards against peer's, rank by rank, byte for byte."""
    by = {r["contender"]: r.pop("_digests", None) for r in records}
    ours, theirs = by.get("dcp"), by.get("peer")
    if not ours or not theirs or not all(ours.values()) or not all(theirs.values()):
        return {"equal": None, "why": "dcp or peer has no digests (an error)"}
    bad = {rank: measure.compare_digests(ours[rank], theirs[rank]) for rank in ours}
    count = sum(len(v) for v in bad.values())
    return {"equal": count == 0, "compared_per_rank": {str(k): len(v) for k, v in theirs.items()},
            "differing": {str(k): v[:10] for k, v in bad.items() if v}, "differing_count": count,
            "how": "every state-dict entry's local bytes (blake2b), dcp against peer, on each rank"}


def run_compressed(fmt: str, workload: Workload, *, reps: int = 3, warmup: int = 1, threads: int = 8,
                   timeout: float = 1800, contenders: Sequence[str] = CONTENDERS,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """One format's part for ``workload`` (a checkpoint of :func:`ensure_compressed_workload`)."""
    from bench.layouts import parse_mesh
    from bench.workloads import warm_page_cache
    from hp_dcp_hf.tools.inspection import inspect_checkpoint
    from hp_dcp_hf.tools.launch import run_ranks
    from hp_dcp_hf.tools.rank_plans import plan_ranks

    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise ValueError(f"unknown compressed contenders {unknown}; known: {', '.join(CONTENDERS)}")
    path = str(workload.path)
    info = inspect_checkpoint(path)
    stamp = json.loads(Path(path, STAMP).read_text())
    start = time.perf_counter()
    plan = plan_ranks(path, MESH, dtype=torch.bfloat16, with_items=True)
    plans = plan["ranks"]
    doc: dict[str, Any] = {
        "format": fmt, "checkpoint": path, "model_class": workload.model_class, "num_layers": workload.num_layers,
        "checkpoint_bytes": workload.checkpoint_bytes, "bf16_bytes": stamp.get("bf16_bytes"),
        "compress_s": stamp.get("compress_s"), "files": workload.files, "tensors": workload.tensors,
        "quantization": info.get("quantization"), "dtypes": info.get("dtypes"), "world": WORLD, "mesh": MESH,
        "threads": threads, "reps": reps, "warmup": warmup, "plan_s": time.perf_counter() - start,
        "plan": [{"rank": p.rank, "coordinate": list(p.coordinate), "bytes_needed": p.bytes_needed,
                  "bytes_to_read": p.bytes_to_read, "quantized_bytes": p.quantized_bytes, "scale_bytes": p.scale_bytes,
                  "requests": p.requests, "ranges": p.ranges} for p in plans]}
    ranges = [_ranges(p.reads) for p in plans]
    mesh = parse_mesh(MESH)
    records = []
    for name in [c for c in CONTENDERS if c in contenders]:
        log(f"  moe-{fmt} x {WORLD} ranks [{MESH}]: {name} ...")
        warm_page_cache(workload.path)
        job = Job(name, f"moe-{fmt}", path, mesh, reps=reps, threads=threads, warmup=warmup)
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
    doc["check"] = _check(records)
    doc["contenders"] = records
    doc["ratios"] = ratios(records)
    log(f"    ours == peer (bit-identical): {doc['check'].get('equal')}; ratios {doc['ratios']}")
    return doc


def ratios(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    wall = {r["contender"]: r.get("wall_s") for r in records}
    out: dict[str, float] = {}
    if wall.get("dcp"):
        if wall.get("limit"):
            out["dcp_vs_limit"] = wall["dcp"] / wall["limit"]
        if wall.get("peer"):
            out["peer_vs_dcp"] = wall["peer"] / wall["dcp"]
            # The peer without its slicing (a lower bound: read + decompression, slowest rank).
            peer = next(r for r in records if r["contender"] == "peer")
            unsliced = [p["read_s"] + p["decompress_s"] for p in peer.get("per_rank", [])
                        if p.get("read_s") is not None and p.get("decompress_s") is not None]
            if unsliced:
                out["peer_unsliced_vs_dcp"] = max(unsliced) / wall["dcp"]
    return out


def summary_line(r: dict[str, Any]) -> str:
    wall = f"{r['wall_s']:8.3f} s" if r.get("wall_s") else "       - s"
    reads = [p["bytes_read"] for p in r.get("per_rank", []) if p.get("bytes_read") is not None]
    text = f"{r['contender']:<6} {wall}  bytes/rank {human(max(reads)) if reads else '-':>11}"
    if r.get("errors"):
        first = next(iter(r["errors"].items()))
        text += f"  errors on ranks {sorted(map(int, r['errors']))}: rank {first[0]}: {first[1].splitlines()[0][:200]}"
    shares = [p["values_share"] for p in r.get("per_rank", []) if p.get("values_share") is not None]
    if shares:
        text += f"  values() {min(shares):.0%}-{max(shares):.0%} of the load"
    return text


def render(doc: dict[str, Any]) -> str:
    """The markdown summary of a compressed run (``doc["compressed"]``: format -> part)."""
    lines = ["# compressed-tensors checkpoints into bf16, 4 gloo ranks (dp=2,tp=2)", ""]
    env = doc.get("environment", {})
    if env:
        lines += [f"{env.get('cpus')} CPUs, torch {env.get('torch')}, compressed-tensors "
                  f"{env.get('compressed_tensors')}, git {env.get('git')}; load average {env.get('load_end')} "
                  f"at the end. Command: `{doc.get('command')}`.", ""]
    lines += ["| format | checkpoint | bf16 before | contender | wall s (median) | runs | ours/raw | peer/ours "
              "| bytes read / rank (max) | needed / rank (max) | values() share of our load (busy, per rank) "
              "| values() calls / rank | bit-identical to peer |", "|" + "---|" * 13]
    for fmt, part in doc.get("compressed", {}).items():
        if part.get("error"):
            lines.append(f"| {fmt} | error: {part['error'][:200]} |" + " |" * 11)
            continue
        r = part.get("ratios", {})
        for rec in part["contenders"]:
            name = rec["contender"]
            per = rec.get("per_rank", [])
            reads = [p["bytes_read"] for p in per if p.get("bytes_read") is not None]
            need = [p["bytes_needed"] for p in per if p.get("bytes_needed") is not None]
            shares = [p["values_share"] for p in per if p.get("values_share") is not None]
            calls = [p["values_calls"] for p in per if p.get("values_calls") is not None]
            wall = f"{rec['wall_s']:.3f}" if rec.get("wall_s") else ("error" if rec.get("errors") else "-")
            runs = ", ".join(f"{w:.2f}" for w in rec.get("wall_runs", []))
            lines.append("| " + " | ".join([
                fmt, human(part["checkpoint_bytes"]), human(part.get("bf16_bytes") or 0), name, wall, runs,
                f"{r['dcp_vs_limit']:.2f}x" if name == "dcp" and "dcp_vs_limit" in r else "",
                (f"{r['peer_vs_dcp']:.2f}x" + (f" ({r['peer_unsliced_vs_dcp']:.2f}x unsliced)"
                                              if "peer_unsliced_vs_dcp" in r else ""))
                if name == "peer" and "peer_vs_dcp" in r else "",
                human(max(reads)) if reads else "-", human(max(need)) if need else "-",
                f"{min(shares):.0%}-{max(shares):.0%}" if shares else "",
                f"{min(calls)}-{max(calls)}" if calls else "",
                {True: "yes", False: "**no**", None: "n/a"}[part["check"].get("equal")] if name == "dcp" else "",
            ]) + " |")
    lines += ["", "ours/raw: dcp's wall time over `limit`'s (the same byte ranges read into a buffer); peer/ours: "
              "the peer's over dcp's, and in parentheses the peer's read + decompression alone (slowest rank, "
              "its slicing left out: a lower bound). values() share: the time during which at least one "
              "`CompressedWeight.values` call ran, over the rank's `load_hf_checkpoint` time."]
    lines += ["", "Per rank (median of the timed repetitions): our load's phases and dequantization, the peer's "
              "phases.", "", "| format | rank | dcp load s | metadata s | plan s | read s | values() busy s "
              "| values() sum s | _dequantize busy s | peer read s | peer decompress s | peer slice s |",
              "|" + "---|" * 12]
    for fmt, part in doc.get("compressed", {}).items():
        recs = {rec["contender"]: rec for rec in part.get("contenders", [])}
        ours, peer = recs.get("dcp", {}).get("per_rank", []), recs.get("peer", {}).get("per_rank", [])
        for i, p in enumerate(ours):
            ph = p.get("phases") or {}
            q = peer[i] if i < len(peer) else {}

            def f(v):
                return f"{v:.3f}" if isinstance(v, (int, float)) else "-"
            lines.append("| " + " | ".join([fmt, str(p["rank"]), f(p.get("load_s")), f(ph.get("metadata_s")),
                                            f(ph.get("plan_s")), f(ph.get("read_s")), f(p.get("values_busy_s")),
                                            f(p.get("values_sum_s")), f(p.get("dequant_busy_s")),
                                            f(q.get("read_s")), f(q.get("decompress_s")), f(q.get("slice_s"))]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import platform
    import subprocess

    from bench.workloads import parse_size

    p = argparse.ArgumentParser(prog="python -m bench.compressed", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GB", help="bf16 bytes of the MoE model before compression")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"of {', '.join(FORMATS)}")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--cache", default=os.environ.get("BENCH_CACHE", str(Path.home() / ".cache" / "hp-dcp-hf-bench")))
    p.add_argument("--out", default=None, help="result stem (default bench/results/<date>-compressed-<size>)")
    p.add_argument("--render", default=None, metavar="FILE.json", help="re-render FILE.json's markdown (ratios recomputed)")
    args = p.parse_args(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        for part in doc.get("compressed", {}).values():
            if part.get("contenders"):
                part["ratios"] = ratios(part["contenders"])
        Path(args.render).write_text(json.dumps(doc, indent=2, default=str))
        Path(args.render).with_suffix(".md").write_text(render(doc))
        return 0
    size = parse_size(args.size)
    stem = Path(args.out or f"bench/results/{time.strftime('%Y-%m-%d')}-compressed-{size_tag(size)}")
    import compressed_tensors

    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc: dict[str, Any] = {"command": "python -m bench.compressed " + " ".join(argv if argv is not None else
                                                                                 __import__("sys").argv[1:]),
                           "environment": {"cpus": os.cpu_count(), "torch": torch.__version__, "git": git,
                                           "compressed_tensors": compressed_tensors.__version__,
                                           "python": platform.python_version(), "load_start": os.getloadavg()},
                           "compressed": {}}
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        print(f"compressed ({fmt}, MoE ~{size_tag(size)} bf16, 4 ranks {MESH}):", flush=True)
        try:
            workload = ensure_compressed_workload(fmt, size, Path(args.cache))
            doc["compressed"][fmt] = run_compressed(fmt, workload, reps=args.reps, warmup=args.warmup,
                                                    threads=args.threads, contenders=contenders)
        except Exception as e:
            doc["compressed"][fmt] = {"error": f"{type(e).__name__}: {str(e)[-1500:]}",
                                      "traceback": traceback.format_exc()}
            print(f"  error: {doc['compressed'][fmt]['error']}")
        doc["environment"]["load_end"] = [round(x, 2) for x in os.getloadavg()]
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=2, default=str))
        stem.with_suffix(".md").write_text(render(doc))
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
