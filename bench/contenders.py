"""The loaders compared, each run on every rank of one spawned process group.

:func:`run_rank` is the entry point of a rank: it runs one contender ``reps`` times on the same
checkpoint and returns one row per contender name it measured (the ``transformers`` job also
measures this project's loader inside transformers' own layout). Every contender loads into the
layout of :mod:`bench.layouts` (same model class, same mesh, same placements) except
transformers, which builds and lays out its model itself.

Contenders:

* ``dcp``: this project, ``load_hf_checkpoint(model, path)``; reads only the needed bytes.
* ``dcp+rw``: the same after the performance rewrites (fused q/k/v and gate/up, grouped-GEMM
  experts) when :mod:`hp_dcp_hf.transforms` exists; checked against ``legacy`` in the same
  rewritten model.
* ``legacy``: ``loader="legacy"``: whole checkpoint tensors per rank, convert, keep the local part.
* ``torch``: torch's ``HuggingFaceStorageReader`` + ``DefaultLoadPlanner`` on a state dict with
  the checkpoint's names and shapes (the model's own DTensors where names and shapes agree). MoE
  experts go the torchtitan way (``MoEStateDictAdapter``): one plain tensor per local expert and
  checkpoint key, loaded by DCP, then stacked into the rank's local shard.
* ``transformers``: ``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=dp,
  tp_size=tp))``, transformers' shard-on-read (safetensors slices per rank); needs ``accelerate``.
* ``limit``: ``os.preadv`` of exactly this project's planned byte ranges (:mod:`bench.limit`).
* ``limit-mmap``: one strided ``copy_`` per planned box out of a mapping of its file (:mod:`bench.limit`).
"""

from __future__ import annotations

import re
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench import layouts, measure

CONTENDERS = ("limit", "limit-mmap", "dcp", "dcp+rw", "legacy", "torch", "transformers")


@dataclass
class Job:
    """What one rank runs: a contender on a checkpoint, laid out on ``mesh``."""

    contender: str
    kind: str
    path: str
    mesh: dict[str, int]
    reps: int = 3
    threads: int = 8
    warmup: int = 1


@dataclass
class Row:
    """One contender on one rank: every repetition's times, the last one's counts, memory peaks."""

    contender: str
    rank: int
    wall_s: list[float] = field(default_factory=list)
    own_s: list[float] = field(default_factory=list)
    bytes_needed: int | None = None  # this project's plan for the layout (the minimum)
    bytes_read: int | None = None
    requests: int | None = None
    ranges: int | None = None
    header_bytes: int | None = None
    deferred_bytes: int | None = None
    phases: dict[str, float] | None = None  # this project's loads: metadata, planning, reading (last rep)
    local_param_bytes: int = 0
    growth_rss: int = 0  # peak RSS during the load minus RSS before it (params already resident)
    growth_anon: int = 0
    beyond_params_rss: int | None = None  # for loaders that allocate the model themselves
    digests: dict[str, str] | None = None
    mismatched: list[str] | None = None  # set when checked in the rank itself
    skipped: str | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# -- building ------------------------------------------------------------------------------------


def load_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def rewrites(kind: str) -> tuple[list[Callable[[nn.Module], Any]], str | None]:
    """The performance rewrites for ``kind`` and None, or [] and why they are not available."""
    try:
        from hp_dcp_hf import transforms
    except ImportError as e:
        return [], f"hp_dcp_hf.transforms is not available ({e}); no rewrite row"
    names = ("fuse_qkv", "fuse_gate_up") if kind == "dense" else ("fuse_qkv", "grouped_gemm_experts")
    missing = [n for n in names if not hasattr(transforms, n)]
    if missing:
        return [], f"hp_dcp_hf.transforms lacks {missing}; no rewrite row"
    return [getattr(transforms, n) for n in names], None


def build_model(job: Job, transforms: list[Callable[[nn.Module], Any]] = ()) -> nn.Module:
    """The checkpoint's model on meta, rewritten, laid out on ``job.mesh``, local shards NaN."""
    from bench.workloads import meta_model

    model = meta_model(load_config(job.path))
    for transform in transforms:
        model = transform(model) or model
    layouts.apply_layout(model, job.mesh)
    return layouts.materialize(model)


def refill_nan(model: nn.Module) -> None:
    with torch.no_grad():
        for tensor in layouts.unique_tensors(model):
            if tensor.is_floating_point():
                layouts.local(tensor).fill_(float("nan"))


# -- the loads -----------------------------------------------------------------------------------


def project_load(model: nn.Module, job: Job, *, trace: bool) -> dict[str, Any]:
    """``load_hf_checkpoint`` (``trace=False``: the legacy loader) with its counters."""
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader, load_hf_checkpoint

    reader = HFStorageReader(job.path, num_threads=job.threads)
    planner = HFMappingPlanner(model, trace=trace)
    phases = {"metadata_s": _timed_method(reader, "read_metadata"), "plan_s": _timed_method(planner, "create_local_plan"),
              "read_s": _timed_method(reader, "read_data")}
    load_hf_checkpoint(model, job.path, reader=reader, planner=planner)
    total = reader.stats.total()
    return {"bytes_needed": planner.stats.bytes_needed, "bytes_read": total.bytes_read, "requests": total.requests,
            "ranges": total.ranges, "header_bytes": total.header_bytes, "deferred_bytes": planner.stats.deferred_bytes,
            "phases": {name: sum(seconds) for name, seconds in phases.items()}}


def legacy_digests(model: nn.Module, job: Job) -> dict[str, str]:
    """Digests of the legacy loader's result on this rank, the reference of a correctness check.

    Ranks take turns (each loads alone, with no collective, between barriers): the legacy loader
    holds whole checkpoint tensors, and every rank at once doing so after a rewrite (transposed
    stacked experts at 2 GB) does not fit in this machine's memory.
    """
    import torch.distributed.checkpoint as dcp

    from hp_dcp_hf import HFMappingPlanner, HFStorageReader

    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    digests: dict[str, str] = {}
    for turn in range(world):
        if turn == rank:
            refill_nan(model)
            reader = HFStorageReader(job.path, broadcast_metadata=False, num_threads=job.threads)
            with warnings.catch_warnings():  # "torch.distributed is disabled": no_dist is the point
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(model.state_dict(), storage_reader=reader, planner=HFMappingPlanner(model, trace=False),
                         no_dist=True)
            digests = measure.digests(model)
            measure.trim_memory()
        if world > 1:
            dist.barrier()
    return digests


def _timed_method(obj: Any, name: str) -> list[float]:
    """Time every call of ``obj.name`` (an instance attribute shadows the method); the list of seconds."""
    method, seconds = getattr(obj, name), []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(obj, name, timed)
    return seconds


_EXPERTS = re.compile(r"(?P<prefix>.*\.experts)\.(?P<which>gate_up_proj|down_proj)")


def torch_state_dict(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, list[torch.Tensor]]]]:
    """The state dict torch's reader can load (checkpoint names and shapes), and the stacking left
    to do afterwards: ``(local expert slot, per-expert tensors to concatenate into it)``."""
    from hp_dcp_hf.geometry.shards import local_shard_pieces

    state: dict[str, torch.Tensor] = {}
    stacks: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    for name, tensor in model.state_dict().items():
        match = _EXPERTS.fullmatch(name)
        if not match or tensor.ndim != 3:
            state[name] = tensor  # dense: checkpoint name == model name (llama, qwen3_moe)
            continue
        local = layouts.local(tensor)
        for piece in local_shard_pieces(tensor, key=name):
            if tuple(piece.global_box.sizes[1:]) != tuple(tensor.shape[1:]):
                raise NotImplementedError(f"{name}: the torchtitan route needs whole experts on each rank")
            for i in range(piece.global_box.sizes[0]):
                expert, slot = piece.global_box.offsets[0] + i, local[piece.local_offsets[0] + i]
                prefix = f"{match['prefix']}.{expert}"
                if match["which"] == "gate_up_proj":
                    half = slot.shape[0] // 2
                    parts = [torch.empty(half, slot.shape[1], dtype=slot.dtype) for _ in range(2)]
                    state[f"{prefix}.gate_proj.weight"], state[f"{prefix}.up_proj.weight"] = parts
                else:
                    parts = [torch.empty_like(slot)]
                    state[f"{prefix}.down_proj.weight"] = parts[0]
                stacks.append((slot, parts))
    return state, stacks


def torch_load(model: nn.Module, job: Job) -> dict[str, Any]:
    """torch's ``HuggingFaceStorageReader`` + ``DefaultLoadPlanner``, experts stacked after."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader

    state, stacks = torch_state_dict(model)
    with measure.count_safe_open() as counter:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(job.path, thread_count=job.threads),
                 planner=DefaultLoadPlanner())
    with torch.no_grad():
        for slot, parts in stacks:
            torch.cat(parts, dim=0, out=slot) if len(parts) > 1 else slot.copy_(parts[0])
    return {"bytes_read": counter.bytes, "requests": counter.slices}


# -- one contender on one rank -------------------------------------------------------------------


def repeat_loads(row: Row, job: Job, model: nn.Module, load: Callable[[nn.Module], dict[str, Any]]) -> None:
    """Run ``load(model)`` ``job.warmup`` times untimed (first imports, first-touch of the reader's
    code paths), then ``job.reps`` times timed, NaN refill before each; digests of the first timed."""
    for _ in range(job.warmup):
        load(model)
    for rep in range(job.reps):
        refill_nan(model)
        measure.trim_memory()
        with measure.memory_window() as mem, measure.timed_across_ranks() as timer:
            counts = load(model)
        row.wall_s.append(timer.wall_s)
        row.own_s.append(timer.own_s)
        row.growth_rss = max(row.growth_rss, mem.growth_rss)
        row.growth_anon = max(row.growth_anon, mem.growth_anon)
        for key, value in counts.items():
            setattr(row, key, value)
        if rep == 0:
            row.digests = measure.digests(model)
    row.local_param_bytes = layouts.local_bytes(model)


def run_dcp(job: Job, rank: int) -> list[Row]:
    row = Row("dcp", rank)
    model = build_model(job)
    repeat_loads(row, job, model, lambda m: project_load(m, job, trace=True))
    return [row]


def run_legacy(job: Job, rank: int) -> list[Row]:
    row = Row("legacy", rank)
    model = build_model(job)
    repeat_loads(row, job, model, lambda m: project_load(m, job, trace=False))
    row.extra["legacy_plan_bytes"] = row.bytes_needed
    row.bytes_needed = None  # the minimum comes from the dcp row of the same layout
    return [row]


def run_rewrites(job: Job, rank: int) -> list[Row]:
    row = Row("dcp+rw", rank)
    transforms, why = rewrites(job.kind)
    if why:
        row.skipped = why
        return [row]
    model = build_model(job, transforms)
    row.notes.append("rewrites: " + ", ".join(t.__name__ for t in transforms))
    repeat_loads(row, job, model, lambda m: project_load(m, job, trace=True))
    row.mismatched = measure.compare_digests(row.digests or {}, legacy_digests(model, job))
    row.digests = None
    return [row]


def run_torch(job: Job, rank: int) -> list[Row]:
    row = Row("torch", rank)
    model = build_model(job)
    if job.kind == "moe":
        row.notes.append("experts: per-expert HF tensors loaded by DCP, then stacked (torchtitan route)")
    repeat_loads(row, job, model, lambda m: torch_load(m, job))
    row.bytes_needed = None
    return [row]


def run_limit(job: Job, rank: int) -> list[Row]:
    """``limit`` (preadv of the planned ranges) or ``limit-mmap`` (strided copies of the planned boxes
    out of mappings): the same bytes with no loader around them."""
    from bench.limit import MappedCopies, RawReads, plan_ranges
    from hp_dcp_hf import HFMappingPlanner, HFStorageReader

    row = Row(job.contender, rank)
    model = build_model(job)
    reader = HFStorageReader(job.path)
    planner = HFMappingPlanner(model)
    items = planner.plan_reads(model.state_dict(), reader.read_metadata())
    ranges = plan_ranges(items, reader.entries)
    raw = RawReads(job.path, ranges) if job.contender == "limit" else MappedCopies(job.path, items, reader.entries)
    row.local_param_bytes = layouts.local_bytes(model)
    del model, planner
    try:
        got = time_reads(raw, job, row)
        row.bytes_needed, row.bytes_read = raw.total, got
        row.ranges = sum(len(r) for r in ranges.values())
        row.requests = raw.requests
    finally:
        raw.close()
    return [row]


def _time_convert():
    """Wrap transformers' ``convert_and_load_state_dict_in_model`` (the load part of its
    ``from_pretrained``) with a timer; returns (list of seconds, undo)."""
    import transformers.modeling_utils as mu

    original = mu.convert_and_load_state_dict_in_model
    seconds: list[float] = []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    mu.convert_and_load_state_dict_in_model = timed

    def undo() -> None:
        mu.convert_and_load_state_dict_in_model = original

    return seconds, undo


def run_transformers(job: Job, rank: int) -> list[Row]:
    """transformers' own distributed ``from_pretrained``, then this project's loader into the model
    it built (same layout, so the two can be compared byte for byte), both checked against legacy."""
    from transformers import AutoModelForCausalLM

    row, ours = Row("transformers", rank), Row("dcp@tf-layout", rank)
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16}
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(fsdp_size=job.mesh.get("dp", 1), tp_size=job.mesh.get("tp", 1))
    model = None
    for rep in range(-job.warmup, job.reps):
        model = None
        measure.trim_memory()
        seconds, undo = _time_convert()
        try:
            with measure.memory_window() as mem, measure.count_safe_open() as counter, \
                    measure.timed_across_ranks() as timer:
                model = AutoModelForCausalLM.from_pretrained(job.path, **kwargs)
        finally:
            undo()
        if rep < 0:
            continue
        row.wall_s.append(timer.wall_s)
        row.own_s.append(timer.own_s)
        row.extra.setdefault("load_part_s", []).append(sum(seconds))
        params = layouts.local_bytes(model)
        row.beyond_params_rss = max(row.beyond_params_rss or 0, mem.peak_rss - mem.start_rss - params)
        row.growth_anon = max(row.growth_anon, mem.growth_anon)
        row.growth_rss = max(row.growth_rss, mem.growth_rss)
        row.bytes_read, row.requests = counter.bytes, counter.slices
        if rep == 0:
            row.digests = measure.digests(model)
    assert model is not None
    row.local_param_bytes = layouts.local_bytes(model)
    row.notes.append("wall_s is the whole from_pretrained (model construction included); "
                     "extra.load_part_s its convert_and_load_state_dict_in_model part")
    placements = {type(getattr(p, "placements", (None,))[0]).__name__ for p in model.parameters()}
    row.extra["placements"] = sorted(placements)
    tf_digests = row.digests or {}
    refill_nan(model)
    repeat_loads(ours, job, model, lambda m: project_load(m, job, trace=True))
    ours_digests = ours.digests or {}
    reference = legacy_digests(model, job)
    row.mismatched = measure.compare_digests(tf_digests, reference)
    ours.mismatched = measure.compare_digests(ours_digests, reference)
    row.bytes_needed = ours.bytes_needed
    row.digests = ours.digests = None
    return [row, ours]


RUNNERS: dict[str, Callable[[Job, int], list[Row]]] = {
    "dcp": run_dcp, "dcp+rw": run_rewrites, "legacy": run_legacy, "torch": run_torch, "limit": run_limit,
    "limit-mmap": run_limit, "transformers": run_transformers,
}


def run_rank(rank: int, world: int, job: Job) -> list[dict[str, Any]]:
    """Entry point of a spawned rank: run ``job`` and return its rows (errors become rows too)."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    quiet_transformers()
    try:
        rows = RUNNERS[job.contender](job, rank)
    except Exception as e:
        row = Row(job.contender, rank, error=f"{type(e).__name__}: {e}")
        row.extra["traceback"] = traceback.format_exc()
        rows = [row]
    return [r.as_dict() for r in rows]


def time_reads(raw, job: Job, row: Row) -> int:
    """``raw.read`` ``job.warmup`` times untimed, then ``job.reps`` times timed across the ranks into
    ``row``; the bytes the last one read."""
    for _ in range(job.warmup):
        raw.read(job.threads)
    got = 0
    for _ in range(job.reps):
        with measure.timed_across_ranks() as timer:
            got = raw.read(job.threads)
        row.wall_s.append(timer.wall_s)
        row.own_s.append(timer.own_s)
    return got


def quiet_transformers() -> None:
    """transformers' logging at errors only, no progress bars (in a spawned rank)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
