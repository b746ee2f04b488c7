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
  :func:`hp_dcp_hf.geometry.shards.shard_pieces` alone (pure); the legacy pattern reads, for every model
  tensor it holds any part of, all the checkpoint tensors that make it;
* sampled ranks are planned for real by :class:`~hp_dcp_hf.HFMappingPlanner` (meta DTensors under
  torch's ``fake`` process group at that rank's number): plan time (fresh, as a real rank pays it,
  and split into the rank-independent composition and the rank's own items), plan memory
  (tracemalloc peak), pickled plan size (what DCP gathers on the coordinator), read items and
  byte ranges, and a check that the planner's bytes equal the closed form;
* cooperative reads by span ownership (:mod:`hp_dcp_hf.storage.read.spans`): *every* rank's read items
  are planned (the traced composition reused; items only), each turned into the needs a
  cooperative ``read_data`` gathers (the item's box of its stored tensor, cut as the reader cuts
  its chunks, sorted by file and first byte), checked against the closed form on every rank.
  For sampled ranks, what one real rank pays before its first read is timed: decoding the others'
  needs, :meth:`~hp_dcp_hf.storage.read.spans.ClusterPlan.build` over all of them, routing its own
  needs, and routing every other rank's needs into its own spans (what it sends); then the spans,
  the bytes the cluster reads against the checkpoint, the gathered needs' size, and per rank the
  bytes read from storage, received and sent (:func:`~hp_dcp_hf.storage.read.spans.traffic`).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
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
    from bench.workloads import checkpoint_layout, meta_model, split_files
    from hp_dcp_hf.storage import TensorEntry
    from hp_dcp_hf.storage.format.catalog import CheckpointTensor
    from hp_dcp_hf.storage.read.reader import dcp_metadata

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
    # DCP's view as the reader builds it from these entries
    stored = {k: CheckpointTensor(k, e.dtype_name, e.dtype, e.shape, (e,)) for k, e in entries.items()}
    metadata = dcp_metadata(stored, None, checkpoint_id=f"s3://bench/{arch}", load_id="simulate")
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
    from hp_dcp_hf.geometry.shards import local_shape, shard_pieces

    return local_shape(shape, mesh, coord, places), sum(p.global_box.numel for p in shard_pieces(shape, mesh, coord, places))


def closed_form(ckpt: Checkpoint, layout: Layout, sources: dict[str, tuple[int, ...]]) -> dict[str, list[int]]:
    """Per rank: bytes this project reads, and bytes the legacy pattern reads (whole sources)."""
    targets = [(name, tuple(t.shape), t.dtype.itemsize, layout.placements(name, t.ndim))
               for name, t in ckpt.model.state_dict().items()]
    source_bytes = {name: sum(ckpt.entries[k].nbytes for k in keys) for name, keys in sources.items()}
    out: dict[str, list[int]] = {"ours": [], "legacy": []}
    for rank in range(layout.world):
        coords = {"dense": layout.coordinate("dense", rank), "experts": layout.coordinate("experts", rank)}
        mine = theirs = 0
        for name, shape, itemsize, (kind, places) in targets:
            mesh = layout.dense if kind == "dense" else layout.experts
            _, numel = _local_shape(shape, mesh, coords[kind], places)
            mine += numel * itemsize
            theirs += source_bytes[name] if numel else 0
        out["ours"].append(mine)
        out["legacy"].append(theirs)
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

    from hp_dcp_hf.geometry.shards import local_shape

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


def plan_rank(ckpt: Checkpoint, layout: Layout, rank: int, *, composition: Any = None,
              memory: bool = False) -> dict[str, Any]:
    """Plan one rank with the real planner (``composition``: traced already, or None to trace it
    in the timed plan, as every real rank does); times, sizes and counts."""
    from bench.limit import plan_ranges
    from hp_dcp_hf import HFMappingPlanner

    with fake_rank(rank, layout.world):
        state = rank_state_dict(ckpt, layout, rank)
        planner = HFMappingPlanner(ckpt.model, composition=composition)
        if memory:
            tracemalloc.start()
        start = time.perf_counter()
        items = planner.plan_reads(state, ckpt.metadata)
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1] if memory else None
        if memory:
            tracemalloc.stop()
    ranges = plan_ranges(items, ckpt.entries)
    return {"rank": rank, "plan_s": seconds, "plan_peak_bytes": peak, "read_items": len(items),
            "ranges": sum(len(r) for r in ranges.values()), "files": len(ranges),
            "pickled_plan_bytes": len(pickle.dumps(items)), "bytes_needed": planner.stats.bytes_needed,
            "deferred_bytes": planner.stats.deferred_bytes}


def plan_items(ckpt: Checkpoint, layout: Layout, rank: int, composition: Any) -> list[Any]:
    """Only the rank's read items (``composition`` reused): the least one rank of a full world costs."""
    from hp_dcp_hf import HFMappingPlanner

    with fake_rank(rank, layout.world):
        state = rank_state_dict(ckpt, layout, rank)
        return HFMappingPlanner(ckpt.model, composition=composition).plan_reads(state, ckpt.metadata)


def sample_ranks(world: int, count: int) -> list[int]:
    """``count`` ranks spread over the world (first, last, in between)."""
    if count >= world:
        return list(range(world))
    return sorted({round(i * (world - 1) / max(1, count - 1)) for i in range(count)})


# -- span ownership over every rank ------------------------------------------------------------------------


def chunk_bytes() -> int:
    """The most bytes of one chunk a cooperative read's needs are cut to, and of one span request:
    :class:`~hp_dcp_hf.HFStorageReader`'s batch on a local store, with its default settings on a
    node whose cores allow the most read threads (not this machine's: the simulated cluster's
    needs stay the same wherever they are planned)."""
    from hp_dcp_hf.storage.read.options import ALIGN, LOCAL_THREADS, ReaderOptions

    share = ReaderOptions().staging_bytes // LOCAL_THREADS[1]
    return share - share % ALIGN


def stored_table(ckpt: Checkpoint):
    """The :class:`~hp_dcp_hf.storage.read.span_reads.StoredTable` a reader builds of ``ckpt``: files by
    name, tensors by file and first byte."""
    from hp_dcp_hf.storage.format.catalog import assemble
    from hp_dcp_hf.storage.read.span_reads import StoredTable

    return StoredTable.of({key: assemble(key, [entry]) for key, entry in ckpt.entries.items()})


def needs_of(items: Sequence[Any], ckpt: Checkpoint, table: Any, tensors: Sequence[Any], budget: int) -> list[Any]:
    """A rank's needs as its cooperative ``read_data`` tells them: every read item's box of its
    (whole, one-part) stored tensor, cut to ``budget`` bytes as the reader cuts its chunks, sorted by
    file and first byte."""
    from hp_dcp_hf.geometry.box import Box
    from hp_dcp_hf.storage.format.ranges import box_span, split_box
    from hp_dcp_hf.storage.read.needs import Need

    keyed = []
    for item in items:
        entry = ckpt.entries[item.storage_index.fqn]
        box = Box(tuple(item.storage_offsets), tuple(item.lengths))
        if box.is_empty():
            continue
        index = table.index[entry.key, entry.file, entry.data_start]
        for part in split_box(box, entry.itemsize, budget, entry.shape):
            first = entry.data_start + box_span(entry.shape, entry.itemsize, part)[0]
            keyed.append(((tensors[index].file, first), Need(index, part)))
    keyed.sort(key=lambda pair: pair[0])
    return [need for _, need in keyed]


def every_rank_needs(ckpt: Checkpoint, layout: Layout, composition: Any, table: Any, tensors: Sequence[Any],
                     budget: int, log: Callable[[str], None]) -> tuple[list[list[Any]], dict[str, Any]]:
    """Every rank's needs (its items planned for real, nothing else kept), with progress lines."""
    needs, items_count, started = [], [], time.perf_counter()
    step = max(1, layout.world // 16)
    for rank in range(layout.world):
        items = plan_items(ckpt, layout, rank, composition)
        items_count.append(len(items))
        needs.append(needs_of(items, ckpt, table, tensors, budget))
        if (rank + 1) % step == 0 or rank + 1 == layout.world:
            spent = time.perf_counter() - started
            log(f"      planned {rank + 1}/{layout.world} ranks in {spent:.0f} s "
                f"(~{spent * (layout.world - rank - 1) / (rank + 1):.0f} s left)")
    spent = time.perf_counter() - started
    return needs, {"all_ranks_items_s": spent, "all_ranks_items_s_mean": spent / layout.world,
                   "read_items_per_rank_max": max(items_count), "needs_per_rank_max": max(map(len, needs)),
                   "needs_total": sum(map(len, needs))}


def rank_spans(rank: int, mine: Any, encoded: Sequence[Any], tensors: Any, files: Sequence[str],
               nodes: Sequence[int]) -> tuple[Any, dict[str, float], int]:
    """What ``rank`` computes in a cooperative ``read_data`` once the needs are gathered (as
    :func:`~hp_dcp_hf.storage.read.span_reads.read_spans` does): decode the others' needs, build the
    plan, route its own needs and (once per class of twins) the parts it sends each peer, with
    collection paused as ``read_data`` runs. The plan, the seconds of each step, and the bytes it sends."""
    from hp_dcp_hf.util.perf import paused_gc

    with paused_gc():
        return _rank_spans(rank, mine, encoded, tensors, files, nodes)


def _rank_spans(rank: int, mine: Any, encoded: Sequence[Any], tensors: Any, files: Sequence[str],
                nodes: Sequence[int]) -> tuple[Any, dict[str, float], int]:
    from hp_dcp_hf.storage.read.needs import decode_needs
    from hp_dcp_hf.storage.read.spans import ClusterPlan

    t0 = time.perf_counter()
    needs = [mine if r == rank else decode_needs(encoded[r], tensors) for r in range(len(encoded))]
    t1 = time.perf_counter()
    plan = ClusterPlan.build(tensors, needs, files, nodes=nodes, gap=0)
    t2 = time.perf_counter()
    incoming = plan.route(mine)
    t3 = time.perf_counter()
    sends = plan.sends(rank, incoming, plan.owned(rank))
    sent = sum(routed.nbytes for routed in sends if routed is not None)
    t4 = time.perf_counter()
    seconds = {"decode_s": t1 - t0, "build_s": t2 - t1, "route_own_s": t3 - t2, "route_others_s": t4 - t3}
    return plan, seconds, sent


def cached_needs(ckpt: Checkpoint, layout: Layout, composition: Any, table: Any, tensors: Any, budget: int,
                 log: Callable[[str], None]) -> tuple[list[Any], dict[str, Any]]:
    """Every rank's encoded needs, from ``BENCH_CACHE`` when an earlier run planned this layout
    (planning every rank takes minutes; the needs depend on the layout and the chunk size only)."""
    import numpy as np

    from hp_dcp_hf.storage.read.needs import encode_needs

    root = Path(os.environ.get("BENCH_CACHE", Path.home() / ".cache" / "hp-dcp-hf-bench"))
    path = root / f"needs-{ckpt.files}files-{len(ckpt.entries)}-{layout.name}-{layout.world}-{budget}.npz"
    if path.exists():
        with np.load(path) as saved:
            encoded = [saved[f"r{rank}"] for rank in range(layout.world)]
        record = json.loads(path.with_suffix(".json").read_text())
        log(f"      needs of every rank from {path}")
        return encoded, record
    needs, record = every_rank_needs(ckpt, layout, composition, table, tensors.stored, budget, log)
    encoded = [encode_needs(rank, tensors) for rank in needs]
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **{f"r{rank}": e for rank, e in enumerate(encoded)})
    path.with_suffix(".json").write_text(json.dumps(record))
    return encoded, record


def _profile(call: Callable[[], Any], top: int = 20) -> list[dict[str, Any]]:
    """``call()`` under cProfile: its ``top`` functions by own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(call)
    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, name), (calls, primitive, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = file.split("site-packages/")[-1].split("/main/")[-1]
        rows.append({"function": f"{where}:{line}({name})", "calls": calls, "primitive_calls": primitive,
                     "tottime_s": own, "cumtime_s": cumulative})
    total = sum(r["tottime_s"] for r in rows)
    rows.sort(key=lambda r: r["tottime_s"], reverse=True)
    return [{**r, "share": r["tottime_s"] / total if total else 0.0} for r in rows[:top]]


SPANS_TARGET_S = 0.5  # one rank's span planning (decode aside: build, route own, route others)


def spans_record(ckpt: Checkpoint, layout: Layout, composition: Any, totals: dict[str, list[int]], sampled: int,
                 log: Callable[[str], None]) -> dict[str, Any]:
    """Span ownership over every rank of ``layout``: the needs, their check against the closed
    form, the plan timed on ``sampled`` ranks as each pays it, its traffic; cProfile of one
    rank's planning when it misses :data:`SPANS_TARGET_S`."""
    import numpy as np

    from hp_dcp_hf.storage.read.needs import decode_needs
    from hp_dcp_hf.storage.read.spans import SPAN_BYTES, traffic

    budget = chunk_bytes()
    table = stored_table(ckpt)
    tensors = table.tensors
    encoded, record = cached_needs(ckpt, layout, composition, table, tensors, budget, log)
    needs = [decode_needs(e, tensors) for e in encoded]
    need_bytes = [n.nbytes(tensors) for n in needs]
    mismatched = [r for r, b in enumerate(need_bytes) if b != totals["ours"][r]]
    sizes = [int(e.nbytes) + 24 for e in encoded]  # + the three integers gather_needs puts first
    nodes = [rank // NODE for rank in range(layout.world)]
    ranks = sorted({0, layout.world // 2 + 1} & set(range(layout.world)))[:sampled]
    timings = []
    plan = None
    for rank in ranks:
        load = os.getloadavg()
        plan, seconds, sent = rank_spans(rank, needs[rank], encoded, tensors, table.files, nodes)
        timings.append({"rank": rank, **seconds, "sent_bytes": sent, "load_average": load,
                        "spans_s": seconds["build_s"] + seconds["route_own_s"] + seconds["route_others_s"]})
        log(f"      rank {rank}: decode {seconds['decode_s']:.2f} s, build {seconds['build_s']:.2f} s, route own "
            f"{seconds['route_own_s']:.3f} s, route others {seconds['route_others_s']:.2f} s (load {load[0]:.1f})")
    assert plan is not None
    t0 = time.perf_counter()
    flows = traffic(plan, needs, budget)
    traffic_s = time.perf_counter() - t0
    received = [t.received for t in flows]
    sent = [t.sent for t in flows]
    storage = [t.storage_bytes for t in flows]
    union = int(plan.needed.sum())
    worst = max(t["spans_s"] for t in timings)
    record.update(
        spans_chunk_bytes=budget, span_bytes=SPAN_BYTES, spans_gap=0, spans_nodes=layout.world // NODE,
        spans_needs_match_closed_form=not mismatched, spans_mismatched_ranks=mismatched[:20],
        needs_encoded_bytes_per_rank_max=max(sizes), needs_encoded_bytes_per_rank_mean=statistics.fmean(sizes),
        needs_encoded_bytes_total=sum(sizes), needs_gathered_bytes_padded=max(sizes) * layout.world,
        spans=len(plan), span_size_max=int((plan.end - plan.start).max()), spans_owners=int(len(np.unique(plan.owner))),
        spans_cluster_bytes=plan.bytes_read(), spans_needed_union_bytes=union,
        spans_cluster_factor=plan.bytes_read() / ckpt.nbytes, spans_read_over_needed=plan.bytes_read() / union,
        spans_storage_per_rank_max=max(storage), spans_storage_per_rank_mean=statistics.fmean(storage),
        spans_requests_per_rank_max=max(t.requests for t in flows),
        spans_received_per_rank_max=max(received), spans_received_per_rank_mean=statistics.fmean(received),
        spans_sent_per_rank_max=max(sent), spans_sent_per_rank_mean=statistics.fmean(sent),
        spans_exchanged_bytes=sum(received), spans_traffic_s=traffic_s,
        spans_sent_matches_traffic=all(t["sent_bytes"] == flows[t["rank"]].sent for t in timings),
        spans_timings=timings, spans_sampled=ranks, spans_plan_s_max=worst,
        spans_plan_with_decode_s_max=max(t["spans_s"] + t["decode_s"] for t in timings),
        spans_target_s=SPANS_TARGET_S)
    if worst > SPANS_TARGET_S:
        rank = ranks[0]
        log(f"      spans plan {worst:.2f} s > {SPANS_TARGET_S} s: profiling rank {rank}")
        record["spans_profile"] = _profile(lambda: rank_spans(rank, needs[rank], encoded, tensors, table.files, nodes))
    return record


# -- the run ---------------------------------------------------------------------------------------------------


def _plans(ckpt: Checkpoint, layout: Layout, ranks: Sequence[int], composition: Any, fresh_plans: int,
           cached_plans: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The first ``fresh_plans`` of ``ranks`` planned as a real rank pays it (trace the conversion,
    then plan), the first ``cached_plans`` with ``composition`` traced already."""
    fresh, cached = [], []
    for i, rank in enumerate(ranks):
        if i < fresh_plans:
            t0 = time.perf_counter()
            traced = build_composition(ckpt)
            traced_s = time.perf_counter() - t0
            row = plan_rank(ckpt, layout, rank, composition=traced)
            row["composition_s"] = traced_s
            row["plan_s"] += traced_s
            fresh.append(row)
        if i < cached_plans:
            cached.append(plan_rank(ckpt, layout, rank, composition=composition))
    return fresh, cached


def simulate(arch: str, worlds: Sequence[int], *, layouts_: Sequence[str] = ("fsdp", "hsdp"), fresh_plans: int = 1,
             cached_plans: int = 4, spans: bool = True, spans_sampled: int = 2,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every world x layout: closed-form bytes for all ranks, real plans for sampled ranks, and
    (``spans``) span ownership over every rank's real plan, timed on ``spans_sampled`` ranks."""
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
            layout_start = time.perf_counter()
            t0 = time.perf_counter()
            totals = closed_form(ckpt, layout, sources)
            closed_s = time.perf_counter() - t0
            ranks = sample_ranks(world, max(fresh_plans, cached_plans))
            fresh, cached = _plans(ckpt, layout, ranks, composition, fresh_plans, cached_plans)
            if world == max(worlds) and fresh_plans:  # tracemalloc slows planning: a separate, untimed run
                fresh[0]["plan_peak_bytes"] = plan_rank(ckpt, layout, ranks[0], memory=True)["plan_peak_bytes"]
            mismatched = [r["rank"] for r in fresh + cached if r["bytes_needed"] != totals["ours"][r["rank"]]]
            record = _summarize(arch, ckpt, layout, totals, fresh, cached, mismatched, closed_s)
            log("    " + sim_line(record))
            if spans:
                log(f"    {name} {world}: span ownership over every rank's plan")
                record.update(spans_record(ckpt, layout, composition, totals, spans_sampled, log))
                log("      " + spans_line(record))
            record["layout_s"] = time.perf_counter() - layout_start
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


def sim_line(r: dict[str, Any]) -> str:
    plan = f"plan {r['plan_s_max']:.2f} s (composition {r['composition_s']:.2f} s)" if "plan_s_max" in r else ""
    items = f"items {r['items_s_max']:.2f} s" if "items_s_max" in r else ""
    ok = "ok" if r["planner_matches_closed_form"] else f"MISMATCH {r['mismatched_ranks']}"
    return (f"{r['layout']:<5} {r['world']:>5} ranks: per rank max {r['bytes_per_rank_max'] / 2**30:8.2f} GiB, cluster "
            f"{r['cluster_factor']:.2f}x ckpt (legacy {r['legacy_cluster_factor']:.1f}x); {plan}; {items}; {ok}")


def spans_line(r: dict[str, Any]) -> str:
    """One line of a layout's span ownership (empty for a result without it)."""
    if "spans_plan_s_max" not in r:
        return ""
    ok = "ok" if r["spans_needs_match_closed_form"] else f"MISMATCH {r['spans_mismatched_ranks']}"
    worst = max(r["spans_timings"], key=lambda t: t["spans_s"])
    return (f"spans: {r['spans']} spans, cluster reads {r['spans_cluster_factor']:.4f}x ckpt "
            f"({r['spans_read_over_needed']:.4f}x the needed union); storage per rank max "
            f"{r['spans_storage_per_rank_max'] / 2**30:.2f} GiB (mean {r['spans_storage_per_rank_mean'] / 2**30:.2f}); "
            f"received max {r['spans_received_per_rank_max'] / 2**30:.2f} GiB (mean "
            f"{r['spans_received_per_rank_mean'] / 2**30:.2f}), sent max {r['spans_sent_per_rank_max'] / 2**30:.2f} GiB "
            f"(mean {r['spans_sent_per_rank_mean'] / 2**30:.2f}); needs {r['needs_encoded_bytes_per_rank_max'] / 2**10:.0f} "
            f"KiB per rank max, {r['needs_encoded_bytes_total'] / 2**20:.1f} MiB gathered; plan "
            f"{r['spans_plan_s_max']:.2f} s per rank (build {worst['build_s']:.2f}, route own {worst['route_own_s']:.3f}, "
            f"route others {worst['route_others_s']:.2f}; + decode {worst['decode_s']:.2f}); {ok}")
