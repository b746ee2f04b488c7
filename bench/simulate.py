"""Cluster-scale planning by simulation: no tensor data, no cluster, one process.

The model is a real large architecture built from its transformers config in code (no Hub):
DeepSeek-V3 (671B, 61 layers, 256 routed experts; bf16 here, the release is FP8) or
Qwen3-235B-A22B, on the meta device. Its checkpoint is the *original* key layout
(``revert_weight_conversion`` of the meta state dict: one tensor per expert and projection, 45k
keys for DeepSeek-V3), split as ``save_pretrained`` would into files of the released checkpoint's
average size (175 files for DeepSeek-V3: the split keeps the experts of one projection of a layer
together); that gives the DCP metadata and every tensor's byte offsets without a byte of data.

Layouts (``world`` ranks; ``tp`` 8 inside a node; experts never tensor-parallel):

* ``fsdp``: no replicas. Dense parameters on ``(dp = world/8, tp = 8)`` with the rules of
  :mod:`bench.layouts` (FSDP2 over TP); stacked experts on ``(efsdp, ep)`` with ``ep =
  min(experts, world)``: ``(Shard(1), Shard(0))``: EP picks experts, expert-FSDP splits their rows.
* ``hsdp``: the same inside replica groups of 128 ranks, ``Replicate()`` across groups (the data-
  parallel replicas every large job has): the checkpoint is read once per replica.

Per world and layout:

* every rank's bytes, exactly and cheaply: a traced mapping sends each element of a rank's local
  shards to one checkpoint element, so a rank needs ``sum(local numel x itemsize)``, from
  :func:`hp_dcp_hf.layout.shard_pieces` alone (pure); the legacy pattern reads, for every model
  tensor it holds any part of, all the checkpoint tensors that make it;
* the same with cooperative reads (:mod:`hp_dcp_hf.parallel.cooperation`): the ranks holding the
  same local values of a tensor (its ``Replicate`` mesh dims) each read one ``1/g`` flat share of
  its local elements and receive the others' shares, so per rank the bytes read, received and sent follow
  from the placements alone, and the cluster reads each needed byte once;
* sampled ranks are planned for real by :class:`~hp_dcp_hf.HFMappingPlanner` (meta DTensors under
  torch's ``fake`` process group at that rank's number): plan time (fresh, as a real rank pays it,
  and split into the rank-independent composition and the rank's own items), plan memory
  (tracemalloc peak), pickled plan size (what DCP gathers on the coordinator), read items and
  byte ranges, and a check that the planner's bytes equal the closed form; then planned again
  cooperatively, with the replica groups given explicitly (``replicas=``, every rank's mesh
  coordinates from the layout: a fake process group exchanges nothing), checking its
  ``PlanStats`` (bytes read, received, sent) against the cooperative closed form.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from bench import layouts

ARCHS = ("deepseek-v3", "qwen3-235b")
NODE = 8  # tp size: ranks per node
REPLICA = 128  # ranks per replica group in the hsdp layout
FILES = {"deepseek-v3": 163, "qwen3-235b": 118}  # files of the released checkpoints


def make_config(arch: str):
    """The transformers config of ``arch``, built in code."""
    if arch == "deepseek-v3":
        from transformers import DeepseekV3Config

        config = DeepseekV3Config()  # transformers' defaults are DeepSeek-V3's
        config.architectures = ["DeepseekV3ForCausalLM"]
        return config
    if arch == "qwen3-235b":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                              num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                              num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False,
                              max_position_embeddings=40960, architectures=["Qwen3MoeForCausalLM"])
    raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}")


# -- the checkpoint, without data -------------------------------------------------------------------


@dataclass
class Checkpoint:
    """A checkpoint's metadata (DCP) and byte layout (file, offsets) with no data anywhere."""

    model: torch.nn.Module
    metadata: Any  # torch.distributed.checkpoint.metadata.Metadata
    entries: dict[str, Any]  # key -> hp_dcp_hf.storage.TensorEntry
    files: int
    nbytes: int
    experts: int


def build_checkpoint(arch: str) -> Checkpoint:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from bench.workloads import checkpoint_layout, meta_model, split_files
    from hp_dcp_hf.storage import TensorEntry

    config = make_config(arch)
    model = meta_model(config)
    layout = checkpoint_layout(config)
    nbytes = sum(t.numel() * t.dtype.itemsize for t in layout.values())
    files = split_files(layout, math.ceil(nbytes / FILES[arch]))
    entries = {}
    for name, keys in files.items():
        offset = 4096  # a header's worth
        for key in sorted(keys):
            t = layout[key]
            size = t.numel() * t.dtype.itemsize
            entries[key] = TensorEntry(key=key, file=name, dtype_name="BF16", dtype=t.dtype, shape=tuple(t.shape),
                                       data_start=offset, nbytes=size)
            offset += size
    metadata = Metadata(state_dict_metadata={
        key: TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.shape,
                                   [ChunkStorageMetadata(torch.Size([0] * t.ndim), t.shape)])
        for key, t in layout.items()})
    experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", 0)
    return Checkpoint(model, metadata, entries, len(files), nbytes, experts)


# -- layouts -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Mesh shapes per kind and the rank -> coordinate maps of a simulated world."""

    name: str
    world: int
    dense: tuple[int, ...]  # (rep?, dp, tp)
    experts: tuple[int, ...]  # (rep?, efsdp, ep)
    replicas: int

    def describe(self) -> str:
        rep = f"{self.replicas} replicas x " if self.replicas > 1 else ""
        return (f"{rep}dp={self.dense[-2]} x tp={self.dense[-1]}; experts efsdp={self.experts[-2]} x "
                f"ep={self.experts[-1]}")

    def coordinate(self, kind: str, rank: int) -> tuple[int, ...]:
        shape = self.dense if kind == "dense" else self.experts
        out = []
        for size in reversed(shape):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def placements(self, name: str, ndim: int) -> tuple[str, tuple[Placement, ...]]:
        rep = (Replicate(),) if self.replicas > 1 else ()
        if layouts.role(name, ndim) == "experts":
            return "experts", (*rep, Shard(1), Shard(0))
        _, places = layouts.placements(name, ndim, {"dp": self.dense[-2], "tp": self.dense[-1]})
        return "dense", (*rep, *places)


def make_layout(name: str, world: int, experts: int) -> Layout:
    group = min(world, REPLICA) if name == "hsdp" else world
    replicas = world // group
    tp = min(NODE, group)
    ep = min(experts, group)
    rep = (replicas,) if replicas > 1 else ()
    return Layout(name, world, (*rep, group // tp, tp), (*rep, group // ep, ep), replicas)


# -- closed form -----------------------------------------------------------------------------------------


@cache
def _local_shape(shape: tuple[int, ...], mesh: tuple[int, ...], coord: tuple[int, ...],
                 places: tuple[Placement, ...]) -> tuple[tuple[int, ...], int]:
    """The rank's local shape and how many elements of it its pieces cover (all, or none)."""
    from hp_dcp_hf.layout import local_shape, shard_pieces

    return local_shape(shape, mesh, coord, places), sum(p.global_box.numel for p in shard_pieces(shape, mesh, coord, places))


def replica_slot(layout: Layout, kind: str, rank: int, places: Sequence[Placement]) -> tuple[int, int]:
    """``(index, count)``: the rank's place among the ranks holding its local values (those that
    differ from it only on ``Replicate`` dims; in rank order, which is row-major order of those
    coordinates) and how many they are."""
    mesh, coord = (layout.dense if kind == "dense" else layout.experts), layout.coordinate(kind, rank)
    index, count = 0, 1
    for size, c, place in zip(mesh, coord, places):
        if place.is_replicate():
            index, count = index * size + c, count * size
    return index, count


def closed_form(ckpt: Checkpoint, layout: Layout, sources: dict[str, tuple[int, ...]]) -> dict[str, list[int]]:
    """Per rank: bytes this project reads, and bytes the legacy pattern reads (whole sources); and
    cooperating: bytes read (the rank's flat share of each replicated tensor's local elements, as
    :meth:`~hp_dcp_hf.parallel.cooperation.SharedTarget.elements` cuts them), received and sent."""
    targets = [(name, tuple(t.shape), t.dtype.itemsize, layout.placements(name, t.ndim))
               for name, t in ckpt.model.state_dict().items()]
    source_bytes = {name: sum(ckpt.entries[k].nbytes for k in keys) for name, keys in sources.items()}
    out: dict[str, list[int]] = {"ours": [], "legacy": [], "coop": [], "peer_in": [], "peer_out": []}
    for rank in range(layout.world):
        coords = {"dense": layout.coordinate("dense", rank), "experts": layout.coordinate("experts", rank)}
        mine = theirs = coop = peer_in = peer_out = 0
        for name, shape, itemsize, (kind, places) in targets:
            mesh = layout.dense if kind == "dense" else layout.experts
            _, numel = _local_shape(shape, mesh, coords[kind], places)
            mine += numel * itemsize
            theirs += source_bytes[name] if numel else 0
            index, count = replica_slot(layout, kind, rank, places)
            if numel and count > 1 and numel >= count:
                part = ((index + 1) * numel // count - index * numel // count) * itemsize
                coop += part
                peer_in += numel * itemsize - part
                peer_out += part * (count - 1)
            else:
                coop += numel * itemsize
        for key, value in zip(out, (mine, theirs, coop, peer_in, peer_out)):
            out[key].append(value)
    return out


# -- the planner on one simulated rank --------------------------------------------------------------------


@contextmanager
def fake_rank(rank: int, world: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_state_dict(ckpt: Checkpoint, layout: Layout, rank: int) -> dict[str, torch.Tensor]:
    """The rank's state dict as meta DTensors (inside :func:`fake_rank`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from hp_dcp_hf.layout import local_shape

    meshes = {"dense": init_device_mesh("cpu", layout.dense), "experts": init_device_mesh("cpu", layout.experts)}
    state = {}
    for name, t in ckpt.model.state_dict().items():
        kind, places = layout.placements(name, t.ndim)
        mesh_shape = layout.dense if kind == "dense" else layout.experts
        shape = local_shape(tuple(t.shape), mesh_shape, layout.coordinate(kind, rank), places)
        local = torch.empty(shape, dtype=t.dtype, device="meta")
        state[name] = DTensor.from_local(local, meshes[kind], places, run_check=False, shape=t.shape, stride=t.stride())
    return state


def build_composition(ckpt: Checkpoint):
    """The rank-independent tracing of the conversion, as the planner builds it for ``ckpt``."""
    from hp_dcp_hf.mapping.compose import Composition, TensorSpec
    from hp_dcp_hf.mapping.stages import model_stages

    sources = {k: TensorSpec(tuple(md.size), md.properties.dtype) for k, md in ckpt.metadata.state_dict_metadata.items()}
    model = ckpt.model
    return Composition(model_stages(model, None), sources, set(model.state_dict()), model=model,
                       config=model.config, base_model_prefix=model.base_model_prefix)


_COMPOSITIONS: dict[int, Any] = {}


def composition_of(ckpt: Checkpoint):
    """:func:`build_composition`, built once per checkpoint (what one process planning many ranks pays)."""
    if id(ckpt) not in _COMPOSITIONS:
        _COMPOSITIONS[id(ckpt)] = build_composition(ckpt)
    return _COMPOSITIONS[id(ckpt)]


def replica_groups(layout: Layout, rank: int):
    """The :class:`~hp_dcp_hf.parallel.replicas.ReplicaGroups` a real rank would gather, from the
    layout's coordinates of every rank (:func:`rank_state_dict`'s meshes have no dim names, so a
    mesh kind is ``(None, shape)``; two kinds of the same shape have the same coordinates)."""
    from hp_dcp_hf.parallel.replicas import ReplicaGroups

    kinds = {(None, layout.dense): "dense", (None, layout.experts): "experts"}
    every = [{kind: layout.coordinate(which, r) for kind, which in kinds.items()} for r in range(layout.world)]
    return ReplicaGroups(rank, layout.world, every)


def plan_rank(ckpt: Checkpoint, layout: Layout, rank: int, *, composition: Any = None, memory: bool = False,
              cooperate: bool = False) -> dict[str, Any]:
    """Plan one rank with the real planner (``composition``: traced already, or None to trace it
    in the timed plan, as every real rank does; ``cooperate``: as a cooperative reader asks, the
    replica groups given, not gathered); times, sizes and counts."""
    from bench.limit import plan_ranges
    from hp_dcp_hf import HFMappingPlanner
    from hp_dcp_hf.parallel.cooperation import COOPERATE

    metadata = dataclasses.replace(ckpt.metadata, planner_data={COOPERATE: True}) if cooperate else ckpt.metadata
    with fake_rank(rank, layout.world):
        state = rank_state_dict(ckpt, layout, rank)
        replicas = replica_groups(layout, rank) if cooperate else None
        planner = HFMappingPlanner(ckpt.model, composition=composition, replicas=replicas)
        if memory:
            tracemalloc.start()
        start = time.perf_counter()
        items = planner.plan_reads(state, metadata)
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1] if memory else None
        if memory:
            tracemalloc.stop()
    ranges = plan_ranges(items, ckpt.entries)
    return {"rank": rank, "plan_s": seconds, "plan_peak_bytes": peak, "read_items": len(items),
            "ranges": sum(len(r) for r in ranges.values()), "files": len(ranges),
            "pickled_plan_bytes": len(pickle.dumps(items)), "bytes_needed": planner.stats.bytes_needed,
            "deferred_bytes": planner.stats.deferred_bytes, "shared_targets": planner.stats.shared_targets,
            "peer_bytes_in": planner.stats.peer_bytes_in, "peer_bytes_out": planner.stats.peer_bytes_out}


def sample_ranks(world: int, count: int) -> list[int]:
    """``count`` ranks spread over the world (first, last, in between)."""
    if count >= world:
        return list(range(world))
    return sorted({round(i * (world - 1) / max(1, count - 1)) for i in range(count)})


# -- the run ---------------------------------------------------------------------------------------------------


def _plans(ckpt: Checkpoint, layout: Layout, ranks: Sequence[int], composition: Any, fresh_plans: int,
           cached_plans: int, *, cooperate: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The first ``fresh_plans`` of ``ranks`` planned as a real rank pays it (trace the conversion,
    then plan), the first ``cached_plans`` with ``composition`` traced already."""
    fresh, cached = [], []
    for i, rank in enumerate(ranks):
        if i < fresh_plans:
            t0 = time.perf_counter()
            traced = build_composition(ckpt)
            traced_s = time.perf_counter() - t0
            row = plan_rank(ckpt, layout, rank, composition=traced, cooperate=cooperate)
            row["composition_s"] = traced_s
            row["plan_s"] += traced_s
            fresh.append(row)
        if i < cached_plans:
            cached.append(plan_rank(ckpt, layout, rank, composition=composition, cooperate=cooperate))
    return fresh, cached


def simulate(arch: str, worlds: Sequence[int], *, layouts_: Sequence[str] = ("fsdp", "hsdp"), fresh_plans: int = 1,
             cached_plans: int = 4, cooperative: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every world x layout: closed-form bytes for all ranks, real plans for sampled ranks (again
    cooperating when ``cooperative``)."""
    start = time.perf_counter()
    ckpt = build_checkpoint(arch)
    log(f"  {arch}: {len(ckpt.entries)} checkpoint tensors in {ckpt.files} files, {ckpt.nbytes / 1e12:.2f} TB (bf16), "
        f"{len(ckpt.model.state_dict())} model tensors; built in {time.perf_counter() - start:.1f} s")
    t0 = time.perf_counter()
    composition = composition_of(ckpt)
    composition_s = time.perf_counter() - t0
    sources = {name: sorted(composition.source_keys(name)) for name in ckpt.model.state_dict()}
    results = []
    for world in worlds:
        for name in layouts_:
            if name == "hsdp" and world <= REPLICA:
                continue
            layout = make_layout(name, world, ckpt.experts)
            t0 = time.perf_counter()
            totals = closed_form(ckpt, layout, sources)
            closed_s = time.perf_counter() - t0
            ranks = sample_ranks(world, max(fresh_plans, cached_plans))
            fresh, cached = _plans(ckpt, layout, ranks, composition, fresh_plans, cached_plans, cooperate=False)
            if world == max(worlds) and fresh_plans:  # tracemalloc slows planning: a separate, untimed run
                fresh[0]["plan_peak_bytes"] = plan_rank(ckpt, layout, ranks[0], memory=True)["plan_peak_bytes"]
            mismatched = [r["rank"] for r in fresh + cached if r["bytes_needed"] != totals["ours"][r["rank"]]]
            record = _summarize(arch, ckpt, layout, totals, fresh, cached, mismatched, closed_s)
            if cooperative:
                coop = _plans(ckpt, layout, ranks, composition, fresh_plans, cached_plans, cooperate=True)
                record.update(_summarize_cooperative(ckpt, totals, *coop))
            log("    " + sim_line(record))
            results.append(record)
    return {"arch": arch, "checkpoint_tensors": len(ckpt.entries), "files": ckpt.files, "checkpoint_bytes": ckpt.nbytes,
            "model_tensors": len(ckpt.model.state_dict()), "composition_s": composition_s,
            "results": results, "elapsed_s": time.perf_counter() - start}


def _summarize(arch: str, ckpt: Checkpoint, layout: Layout, totals: dict[str, list[int]], fresh: list[dict],
               cached: list[dict], mismatched: list[int], closed_s: float) -> dict[str, Any]:
    ours, legacy = totals["ours"], totals["legacy"]
    per_replica = layout.world // layout.replicas
    record: dict[str, Any] = {
        "arch": arch, "layout": layout.name, "world": layout.world, "mesh": layout.describe(), "replicas": layout.replicas,
        "bytes_per_rank_max": max(ours), "bytes_per_rank_mean": statistics.fmean(ours), "bytes_per_rank_min": min(ours),
        "cluster_bytes": sum(ours), "cluster_factor": sum(ours) / ckpt.nbytes,
        "cluster_factor_one_replica": sum(ours[:per_replica]) / ckpt.nbytes,
        "legacy_bytes_per_rank_max": max(legacy), "legacy_cluster_bytes": sum(legacy),
        "legacy_cluster_factor": sum(legacy) / ckpt.nbytes, "closed_form_s": closed_s,
        "planner_matches_closed_form": not mismatched, "mismatched_ranks": mismatched,
    }
    if fresh:
        record.update(
            plan_s_max=max(r["plan_s"] for r in fresh), composition_s=max(r["composition_s"] or 0 for r in fresh),
            plan_peak_bytes=next((r["plan_peak_bytes"] for r in fresh if r["plan_peak_bytes"]), None),
            sampled_fresh=[r["rank"] for r in fresh])
    if cached:
        record.update(
            items_s_max=max(r["plan_s"] for r in cached), read_items_max=max(r["read_items"] for r in cached),
            ranges_max=max(r["ranges"] for r in cached), pickled_plan_bytes_max=max(r["pickled_plan_bytes"] for r in cached),
            coordinator_gather_bytes_est=statistics.fmean(r["pickled_plan_bytes"] for r in cached) * layout.world,
            sampled_cached=[r["rank"] for r in cached])
    return record


def _summarize_cooperative(ckpt: Checkpoint, totals: dict[str, list[int]], fresh: list[dict],
                           cached: list[dict]) -> dict[str, Any]:
    """The cooperative closed form (cluster bytes read and exchanged), its check against the
    planner's ``PlanStats`` on the sampled ranks, and their plan times."""
    keys = (("bytes_needed", "coop"), ("peer_bytes_in", "peer_in"), ("peer_bytes_out", "peer_out"))
    mismatched = sorted({r["rank"] for r in fresh + cached if any(r[a] != totals[b][r["rank"]] for a, b in keys)})
    record: dict[str, Any] = {
        "coop_bytes_per_rank_max": max(totals["coop"]), "coop_bytes_per_rank_mean": statistics.fmean(totals["coop"]),
        "coop_cluster_bytes": sum(totals["coop"]),
        "coop_cluster_factor": sum(totals["coop"]) / ckpt.nbytes, "exchanged_bytes": sum(totals["peer_in"]),
        "received_per_rank_max": max(totals["peer_in"]), "sent_per_rank_max": max(totals["peer_out"]),
        "coop_matches_closed_form": not mismatched, "coop_mismatched_ranks": mismatched,
        "coop_sampled": sorted({r["rank"] for r in fresh + cached}),
        "shared_targets_max": max((r["shared_targets"] for r in fresh + cached), default=None)}
    if fresh:
        record.update(coop_plan_s_max=max(r["plan_s"] for r in fresh),
                      coop_composition_s=max(r["composition_s"] for r in fresh))
    if cached:
        record.update(coop_items_s_max=max(r["plan_s"] for r in cached),
                      coop_pickled_plan_bytes_max=max(r["pickled_plan_bytes"] for r in cached))
    return record


def sim_line(r: dict[str, Any]) -> str:
    plan = f"plan {r['plan_s_max']:.2f} s (composition {r['composition_s']:.2f} s)" if "plan_s_max" in r else ""
    items = f"items {r['items_s_max']:.2f} s" if "items_s_max" in r else ""
    ok = "ok" if r["planner_matches_closed_form"] else f"MISMATCH {r['mismatched_ranks']}"
    line = (f"{r['layout']:<5} {r['world']:>5} ranks: per rank max {r['bytes_per_rank_max'] / 2**30:8.2f} GiB, cluster "
            f"{r['cluster_factor']:.2f}x ckpt (legacy {r['legacy_cluster_factor']:.1f}x); {plan}; {items}; {ok}")
    if "coop_cluster_factor" not in r:
        return line
    coop_ok = "ok" if r["coop_matches_closed_form"] else f"MISMATCH {r['coop_mismatched_ranks']}"
    plan = f"plan {r['coop_plan_s_max']:.2f} s, " if "coop_plan_s_max" in r else ""
    items = f"items {r['coop_items_s_max']:.2f} s; " if "coop_items_s_max" in r else ""
    return (f"{line}\n      cooperating: per rank max {r['coop_bytes_per_rank_max'] / 2**30:.2f} GiB (mean "
            f"{r['coop_bytes_per_rank_mean'] / 2**30:.2f}), cluster reads {r['coop_cluster_factor']:.4f}x ckpt, exchanges "
            f"{r['exchanged_bytes'] / 2**40:.2f} TiB (per rank max in {r['received_per_rank_max'] / 2**30:.2f} GiB, "
            f"out {r['sent_per_rank_max'] / 2**30:.2f} GiB); {plan}{items}{coop_ok}")
