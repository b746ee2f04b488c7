"""``hp-dcp-hf plan``: every rank's reads without a process group and without reading tensor data.

Each rank's model is built on the meta device under a fake rank (:mod:`hp_dcp_hf.tools.fake_ranks`),
laid out by :func:`parallelize_for` (the one place the layout of every command is made: ``plan``'s
fake ranks, ``load`` and the demo's ranks all call it), and asked for its ReadItems; the requests are
those :class:`HFStorageReader` issues for them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hp_dcp_hf.model.dtype import AUTO, DtypeSpec, resolve_dtype
from hp_dcp_hf.parallel.mesh import DENSE_DIMS, mesh_world_size, parse_mesh
from hp_dcp_hf.storage.format.catalog import QUANTIZATION_CONFIG
from hp_dcp_hf.tools.fake_ranks import fake_rank, register_fake_backend
from hp_dcp_hf.tools.formatting import describe_quantization

if TYPE_CHECKING:
    from hp_dcp_hf.load.planner import HFMappingPlanner, Unexpected
    from hp_dcp_hf.parallel import TransformersPlans
    from hp_dcp_hf.storage import HFStorageReader
    from hp_dcp_hf.storage.read.spans import ClusterPlan, Traffic


def parallelize_for(mesh: str | Mapping[str, int]) -> TransformersPlans:
    """The layout of every command, for ``from_pretrained(parallelize=)``: transformers' own plans
    over the mesh spec ``mesh`` (``"dp=2,tp=2"``, dims of :mod:`hp_dcp_hf.parallel.mesh`), on the
    default process group. After the call its ``describe()`` lines say what it sharded and what
    it left whole, and ``coordinate`` is this rank's place on the mesh. ``plan``, ``load`` and the
    demo all come here, so they describe, plan and load the same layout.
    """
    from hp_dcp_hf.parallel import TransformersPlans

    return TransformersPlans(mesh, warn=False)


@dataclass
class RankPlan:
    """One rank's planned load: what it needs and the requests its reader will issue.

    ``bytes_needed``: the checkpoint bytes its shards need; ``bytes_to_read``: the bytes it reads
    from storage (cooperating: the spans it owns, for itself and for others); ``bytes_from_peers`` /
    ``bytes_to_peers``: cooperating, the bytes it receives from / sends to other ranks."""

    rank: int
    coordinate: tuple[int, ...]
    targets: int = 0
    read_items: int = 0
    bytes_needed: int = 0
    bytes_to_read: int = 0
    ranges: int = 0
    requests: int = 0
    deferred_targets: int = 0
    deferred_bytes: int = 0
    quantized_bytes: int = 0
    scale_bytes: int = 0
    bytes_from_peers: int = 0
    bytes_to_peers: int = 0
    files: dict[str, dict[str, int]] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)
    reads: list[tuple[str, int, int]] = field(default_factory=list)


def plan_ranks(
    path: str,
    mesh: str | Mapping[str, int],
    *,
    transforms: Sequence[str] = (),
    dtype: DtypeSpec = AUTO,
    strict: bool = True,
    unexpected: Unexpected = "warn",
    with_items: bool = False,
    **reader_options: Any,
) -> dict[str, Any]:
    """Every rank's plan for loading ``path`` into the model its config describes, laid out by
    :func:`parallelize_for` over ``mesh``; no process group, no tensor data read.

    Each rank's model is built on the meta device under torch's ``fake`` process group with that
    rank's number; its ReadItems come from :class:`HFMappingPlanner`, its requests from
    :meth:`HFStorageReader.plan_requests` (the reader's own coalescing and staging budget).
    ``unexpected``: as the planner's; the result's ``unexpected`` lists the checkpoint tensors that
    make no model tensor (none with ``"ignore"``; ``"raise"`` raises). ``coordinate_dims`` names the
    dims of each rank's ``coordinate``; ``mapped``: whether the reads are copies out of memory
    mappings (then ``requests`` count contiguous runs, not requests to storage); ``cluster``: the
    whole cluster's reads (:func:`_cluster_reads`).
    """
    import torch.distributed as dist

    from hp_dcp_hf.load.planner import HFMappingPlanner
    from hp_dcp_hf.model.config import read_config, resolve_model_class
    from hp_dcp_hf.storage import HFStorageReader

    if dist.is_initialized():
        raise RuntimeError("plan runs without a process group; call it outside torchrun / init_process_group")
    register_fake_backend()
    sizes = parse_mesh(mesh)
    world = mesh_world_size(sizes)
    reader = HFStorageReader(path, **reader_options)
    metadata = reader.read_metadata()
    config = read_config(path, reader.storage_options)
    dtype = resolve_dtype(dtype, config, lambda: (md.properties.dtype for md in metadata.state_dict_metadata.values()))
    model_cls = resolve_model_class(config)
    ranks: list[RankPlan] = []
    items_by_rank = []
    layout: list[str] = []
    unused: tuple[str, ...] = ()
    for rank in range(world):
        with fake_rank(rank, world):
            model, mapping, parallelize = rank_model(sizes, config, model_cls, dtype, transforms)
            planner = HFMappingPlanner(model, weights_mapping=mapping, strict=strict, unexpected=unexpected)
            items = planner.plan_reads(model.state_dict(), metadata)
            items_by_rank.append(items)
            coordinate = parallelize.coordinate
            layout = parallelize.describe()
            unused = planner.reported_unexpected  # every rank's model uses the same checkpoint tensors
        ranks.append(_direct_plan(rank, coordinate, planner, reader.plan_requests(items), items if with_items else ()))
    spans, shares, pays = reader.plan_spans(items_by_rank)
    cooperate = reader.cooperates(world) and pays  # what a load would do
    if cooperate:
        _plan_cooperation(reader, spans, shares, ranks)
    checkpoint_bytes = sum(e.nbytes for e in reader.entries.values())
    return {
        "checkpoint": path,
        "model": model_cls.__name__,
        "mesh": sizes,
        "world_size": world,
        "coordinate_dims": [dim for dim in sizes if dim in DENSE_DIMS],  # TransformersPlans.coordinate's
        "transforms": list(transforms),
        "layout": layout,
        "checkpoint_bytes": checkpoint_bytes,
        "quantization": describe_quantization(metadata.planner_data.get(QUANTIZATION_CONFIG)),
        "cooperative": cooperate,
        "mapped": reads_mapped(reader),
        "unexpected": list(unused),
        "cluster": _cluster_reads(ranks, int(spans.needed.sum()), cooperate),
        "ranks": ranks,
    }


def _direct_plan(rank: int, coordinate: tuple[int, ...], planner: HFMappingPlanner,
                 requests: Sequence[tuple[str, Any]], items: Sequence[Any]) -> RankPlan:
    """Rank ``rank``'s plan reading directly: its planner's figures, and the requests its reader
    issues for them (``items``: the read items to list, none unless asked for)."""
    stats = planner.stats
    return RankPlan(
        rank, coordinate,
        targets=stats.targets, read_items=stats.read_items, bytes_needed=stats.bytes_needed,
        bytes_to_read=sum(r.nbytes for _, r in requests),
        ranges=sum(len(r.pieces) for _, r in requests),
        requests=len(requests),
        deferred_targets=stats.deferred_targets, deferred_bytes=stats.deferred_bytes,
        quantized_bytes=stats.quantized_bytes, scale_bytes=stats.scale_bytes,
        files=_per_file((file, r.nbytes, 1) for file, r in requests),
        items=[{"key": i.storage_index.fqn, "offsets": list(i.storage_offsets), "lengths": list(i.lengths),
                "target": i.dest_index.fqn, "target_offsets": list(i.dest_offsets)} for i in items],
        reads=[(f, r.start, r.end) for f, r in requests],
    )


def _per_file(reads: Iterable[tuple[str, int, int]]) -> dict[str, dict[str, int]]:
    """``(file, bytes, requests)`` of each read -> per file (sorted by name), its bytes and requests."""
    per_file: dict[str, dict[str, int]] = defaultdict(lambda: {"bytes": 0, "requests": 0})
    for file, nbytes, requests in reads:
        per_file[file]["bytes"] += nbytes
        per_file[file]["requests"] += requests
    return dict(sorted(per_file.items()))


def _cluster_reads(ranks: Sequence[RankPlan], needed_once: int, cooperative: bool) -> dict[str, Any]:
    """The whole cluster's reads, named apart so that none reads as another: ``bytes_read`` from
    storage by all ranks, ``bytes_needed_once`` (the checkpoint bytes some rank needs, each counted
    once), ``bytes_needed_by_shards`` (each rank's needs summed: a byte two ranks need counts twice),
    ``bytes_received`` from peers (cooperating), ``holes`` (bytes read that the reading rank does
    not need, bridged by coalescing; cooperating, that no rank needs, bridged inside spans) and
    ``read_amplification`` (``bytes_read / bytes_needed_once``: 1.0 when the cluster reads each
    needed byte once)."""
    read = sum(r.bytes_to_read for r in ranks)
    by_shards = sum(r.bytes_needed for r in ranks)
    # Reading directly, each rank reads its own needs and the holes between them; cooperating, the
    # owners read the union of all needs once, and the spans' holes.
    holes = read - needed_once if cooperative else sum(r.bytes_to_read - r.bytes_needed for r in ranks)
    return {
        "bytes_read": read,
        "bytes_needed_once": needed_once,
        "bytes_needed_by_shards": by_shards,
        "bytes_received": sum(r.bytes_from_peers for r in ranks),
        "holes": holes,
        "read_amplification": read / max(needed_once, 1),
    }


def _plan_cooperation(reader: HFStorageReader, spans: ClusterPlan, shares: Sequence[Traffic],
                      ranks: list[RankPlan]) -> None:
    """Cooperating, a rank reads the spans it owns (:meth:`HFStorageReader.plan_spans`) and
    receives from their owners the rest of what it needs: its reads and requests are those."""
    for plan, share in zip(ranks, shares, strict=True):
        plan.bytes_to_read, plan.requests = share.storage_bytes, share.requests
        plan.bytes_from_peers, plan.bytes_to_peers = share.received, share.sent
        owned = spans.owned(plan.rank).tolist()
        plan.reads = [(spans.files[int(spans.file[i])], int(spans.start[i]), int(spans.end[i])) for i in owned]
        plan.files = _per_file((file, end - start, -(-(end - start) // reader.request_bytes))
                               for file, start, end in plan.reads)


def rank_model(sizes: Mapping[str, int], config: Any, model_cls: type, dtype: torch.dtype,
                transforms: Sequence[str]):
    """This (fake) rank's model on the meta device, laid out over ``sizes``, with its checkpoint
    mapping and parallelizer."""
    from hp_dcp_hf.integrations.transformers import apply_transforms
    from hp_dcp_hf.model.skeleton import build_skeleton, checkpoint_mapping

    parallelize = parallelize_for(sizes)
    model = build_skeleton(config, model_cls, dtype=dtype)
    mapping = checkpoint_mapping(model)
    return parallelize(apply_transforms(model, transforms)), mapping, parallelize


def reads_mapped(reader: HFStorageReader) -> bool:
    """Whether ``reader`` (after ``read_metadata``) copies out of memory mappings of the files: its
    ``requests`` then count contiguous byte runs copied (one per row of a row-sharded box), not
    requests to storage (see :mod:`hp_dcp_hf.storage.transport.stats`)."""
    return reader.settings.mapped
