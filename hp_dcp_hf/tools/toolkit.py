"""What the ``hp-dcp-hf`` commands and the demo share: formatting, inspection, planning, recording.

* :func:`fmt_bytes`, :func:`table`: the numbers and tables both print.
* :func:`inspect_checkpoint`: files, tensors, dtypes, bytes and index consistency of a checkpoint.
* :func:`parallelize_for`: the one place the parallel layout of every command is made (``plan``'s
  fake ranks, ``load`` and the demo's ranks all call it).
* :func:`plan_ranks`: every rank's reads without a process group and without reading tensor data.
* :class:`RecordingReader`, :func:`progress_planner`, :class:`SaveProgress`: a reader keeping its
  requests, a planner and a writer hook driving a :class:`Progress` (a bar on a terminal, lines in a log).

This module imports torch and the storage layer; :mod:`hp_dcp_hf.tools.cli` imports it inside its
command functions only, so ``hp-dcp-hf --help`` stays fast.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hp_dcp_hf.errors import QuantizationError
from hp_dcp_hf.mapping.families import natural_sorted
from hp_dcp_hf.model.dtype import AUTO, DtypeSpec, resolve_dtype
from hp_dcp_hf.parallel.mesh import DENSE_DIMS, mesh_world_size, parse_mesh
from hp_dcp_hf.storage import INDEX_FILE, ReadStats, filesystem, locate, scan
from hp_dcp_hf.storage.format.catalog import QUANTIZATION_CONFIG, Catalog
from hp_dcp_hf.storage.format.journal import SINGLE_FILE, leftovers_warning
from hp_dcp_hf.storage.read.leftovers import unfinished_save
from hp_dcp_hf.storage.transport.stats import FileStats
from hp_dcp_hf.util.lazy import lazy_exports

if TYPE_CHECKING:
    from hp_dcp_hf.load.planner import HFMappingPlanner, Unexpected
    from hp_dcp_hf.parallel import TransformersPlans
    from hp_dcp_hf.storage import HFStorageReader
    from hp_dcp_hf.storage.read.recording import RecordingReader
    from hp_dcp_hf.storage.read.spans import ClusterPlan, Traffic

__all__ = [
    "Progress",
    "RankPlan",
    "RecordingReader",
    "SaveProgress",
    "fmt_bytes",
    "inspect_checkpoint",
    "parallelize_for",
    "plan_ranks",
    "progress_planner",
    "reads_mapped",
    "table",
]

logger = logging.getLogger(__name__)


# RecordingReader is a DCP StorageReader: imported when asked for, so inspect never imports DCP
__getattr__ = lazy_exports(__name__, globals(), {"RecordingReader": "hp_dcp_hf.storage.read.recording"})

# -- formatting ---------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``1.50 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table: first column left-aligned, the others right-aligned, a rule under the header."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- inspect ------------------------------------------------------------------------------------


def inspect_checkpoint(path: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Files, tensors, dtypes, bytes and index consistency of the checkpoint at ``path``, from its
    index and headers alone (no tensor data is read). ``tensor_list``: every tensor, naturally sorted
    by name, with its dtype, shape, bytes, file and byte range there (``chunks`` instead of a file
    for a tensor stored in chunks across files). ``storage_options`` go to the store (s3fs, HTTP, Hub)."""
    location, single = locate(*filesystem(path, storage_options))
    stats = ReadStats()
    catalog = scan(location, single, stats)  # raises on any index / header inconsistency
    unfinished = unfinished_save_report(location.url(), storage_options) \
        if single is None and unfinished_save(location) else None
    files: dict[str, dict[str, Any]] = {
        f: {"tensors": 0, "tensor_bytes": 0, "file_bytes": location.size(f),
            "header_bytes": stats.per_file.get(f, FileStats()).header_bytes} for f in catalog.files
    }
    dtypes: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    for entry in catalog.entries.values():
        for part in entry.parts:
            files[part.file]["tensors"] += 1
            files[part.file]["tensor_bytes"] += part.nbytes
        dtypes[entry.dtype_name]["tensors"] += 1
        dtypes[entry.dtype_name]["bytes"] += entry.nbytes
    tensor_list = []
    for key in natural_sorted(catalog.entries):
        entry = catalog.entries[key]
        row: dict[str, Any] = {"name": key, "dtype": entry.dtype_name, "shape": list(entry.shape), "bytes": entry.nbytes}
        places = [{"file": p.file, "file_offsets": [p.data_start, p.data_end]} for p in entry.parts]
        if entry.chunked:
            row["chunks"] = [{"offsets": list(p.offsets or ()), "shape": list(p.shape), **place}
                             for p, place in zip(entry.parts, places)]
        else:
            row.update(places[0])
        tensor_list.append(row)
    quantized = _quantized_tensors(catalog)
    model_alone = single is None and catalog.files == (SINGLE_FILE,)  # read first, as transformers does: no index
    has_index = single is None and not model_alone and location.exists(INDEX_FILE)
    listed = set(catalog.files)
    stray = sorted(n for n in location.list_files() if n.endswith(".safetensors") and n not in listed) \
        if has_index else []
    config = None
    if location.exists("config.json"):
        with location.open("config.json") as handle:
            try:
                raw = json.loads(handle.read(0, location.size("config.json")))
                config = {k: raw.get(k) for k in ("model_type", "architectures", "torch_dtype", "dtype")
                          if raw.get(k) is not None}
            except (json.JSONDecodeError, UnicodeDecodeError):
                config = {"error": "config.json is not JSON"}
    return {
        "path": path,
        "root": location.root,
        "files": files,
        "tensors": len(catalog.entries),
        "tensor_bytes": sum(e.nbytes for e in catalog.entries.values()),
        "dtypes": dict(sorted(dtypes.items())),
        "index": {
            "file": INDEX_FILE if has_index else None,
            "consistent": True,  # scan() refuses any disagreement between the index and the headers
            "keys": len(catalog.entries) if has_index else None,
            "unlisted_files": stray,
            # what is read without an index: the one file PATH names (when its directory has an
            # index, the directory is the checkpoint), model.safetensors alone, or every
            # .safetensors file of the directory
            "single_file": single,
            "directory_has_index": single is not None and location.exists(INDEX_FILE),
            "model_safetensors_alone": model_alone,
        },
        "config": config,
        "quantization": quantized,
        "unfinished_save": unfinished,
        "tensor_list": tensor_list,
    }


def unfinished_save_report(url: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a running or dead save left at ``url`` (a directory or S3 prefix that saves write to),
    each with its size, and what ``hp-dcp-hf repair PATH`` would do about it; warned in one line."""
    import warnings

    from hp_dcp_hf.storage.write.writer import destination_for

    destination = destination_for(url, dict(storage_options or {}))
    items = destination.leftovers()
    warnings.warn(leftovers_warning(url, [item.name for item in items if item.kind != "upload"]), stacklevel=3)
    return {"items": [item.to_json() for item in items], "repair": destination.repair(dry_run=True)}


def _quantized_tensors(catalog: Catalog) -> dict[str, Any] | None:
    """The checkpoint's quantization, and how many weights and bytes are quantized (or why the
    loader cannot read them as values)."""
    if not catalog.quantization_config:
        return None
    from hp_dcp_hf.geometry.box import Box
    from hp_dcp_hf.mapping.compose import TensorSpec
    from hp_dcp_hf.quant.decode import quantized_tensors

    out: dict[str, Any] = {"format": _quantization(catalog.quantization_config)}
    specs = {key: TensorSpec(e.shape, e.dtype) for key, e in catalog.entries.items()}
    try:
        tensors, _ = quantized_tensors(catalog.quantization_config, specs)
    except QuantizationError as e:
        return out | {"error": str(e)}
    whole = [t.reads(Box.full(t.shape(specs))) for t in tensors.values()]
    return out | {
        "weights": len(tensors),
        "weight_bytes": sum(catalog.entries[data].nbytes for (data, _), *_ in whole),
        "scale_bytes": sum(catalog.entries[key].nbytes for _, *scales in whole for key, _ in scales),
    }


# -- the parallel layout ------------------------------------------------------------------------


def parallelize_for(mesh: str | Mapping[str, int]) -> TransformersPlans:
    """The layout of every command, for ``from_pretrained(parallelize=)``: transformers' own plans
    over the mesh spec ``mesh`` (``"dp=2,tp=2"``, dims of :mod:`hp_dcp_hf.parallel.mesh`), on the
    default process group. After the call its ``describe()`` lines say what it sharded and what
    it left whole, and ``coordinate`` is this rank's place on the mesh. ``plan``, ``load`` and the
    demo all come here, so they describe, plan and load the same layout.
    """
    from hp_dcp_hf.parallel import TransformersPlans

    return TransformersPlans(mesh, warn=False)


# -- plan ---------------------------------------------------------------------------------------


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


def _register_fake_backend() -> None:
    """torch's ``fake`` process group backend (registered by importing its module)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


def _clear_sharding_caches() -> None:
    """Forget DTensor's sharding-propagation caches.

    They key device meshes by value, so after a fake rank's group is gone the next rank's DTensors
    would come back carrying the previous rank's mesh object, hence its coordinate.
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


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
    _register_fake_backend()
    sizes = parse_mesh(mesh)
    world = mesh_world_size(sizes)
    reader = HFStorageReader(path, **reader_options)
    metadata = reader.read_metadata()
    config = read_config(path, reader.storage_options)
    dtype = resolve_dtype(dtype, config, lambda: (md.properties.dtype for md in metadata.state_dict_metadata.values()))
    model_cls = resolve_model_class(config)
    cooperate = reader.cooperates(world)
    ranks: list[RankPlan] = []
    items_by_rank = []
    layout: list[str] = []
    unused: tuple[str, ...] = ()
    for rank in range(world):
        with _fake_rank(rank, world):
            model, mapping, parallelize = _rank_model(sizes, config, model_cls, dtype, transforms)
            planner = HFMappingPlanner(model, weights_mapping=mapping, strict=strict, unexpected=unexpected)
            items = planner.plan_reads(model.state_dict(), metadata)
            items_by_rank.append(items)
            coordinate = parallelize.coordinate
            layout = parallelize.describe()
            unused = planner.reported_unexpected  # every rank's model uses the same checkpoint tensors
        requests = reader.plan_requests(items)
        plan = RankPlan(
            rank, coordinate,
            targets=planner.stats.targets, read_items=planner.stats.read_items,
            bytes_needed=planner.stats.bytes_needed,
            bytes_to_read=sum(r.nbytes for _, r in requests),
            ranges=sum(len(r.pieces) for _, r in requests),
            requests=len(requests),
            deferred_targets=planner.stats.deferred_targets, deferred_bytes=planner.stats.deferred_bytes,
            quantized_bytes=planner.stats.quantized_bytes, scale_bytes=planner.stats.scale_bytes,
            reads=[(f, r.start, r.end) for f, r in requests],
        )
        per_file: dict[str, dict[str, int]] = defaultdict(lambda: {"bytes": 0, "requests": 0})
        for file, request in requests:
            per_file[file]["bytes"] += request.nbytes
            per_file[file]["requests"] += 1
        plan.files = dict(sorted(per_file.items()))
        if with_items:
            plan.items = [{"key": i.storage_index.fqn, "offsets": list(i.storage_offsets),
                           "lengths": list(i.lengths), "target": i.dest_index.fqn,
                           "target_offsets": list(i.dest_offsets)} for i in items]
        ranks.append(plan)
    spans, shares = reader.plan_spans(items_by_rank)
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
        "quantization": _quantization(metadata.planner_data.get(QUANTIZATION_CONFIG)),
        "cooperative": cooperate,
        "mapped": reads_mapped(reader),
        "unexpected": list(unused),
        "cluster": _cluster_reads(ranks, int(spans.needed.sum()), cooperate),
        "ranks": ranks,
    }


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
        per_file: dict[str, dict[str, int]] = defaultdict(lambda: {"bytes": 0, "requests": 0})
        for file, start, end in plan.reads:
            per_file[file]["bytes"] += end - start
            per_file[file]["requests"] += -(-(end - start) // reader.request_bytes)
        plan.files = dict(sorted(per_file.items()))


@contextmanager
def _fake_rank(rank: int, world: int) -> Iterator[None]:
    """Rank ``rank`` of ``world`` under torch's ``fake`` process group (no communication)."""
    import torch.distributed as dist

    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_caches()


def _rank_model(sizes: Mapping[str, int], config: Any, model_cls: type, dtype: torch.dtype,
                transforms: Sequence[str]):
    """This (fake) rank's model on the meta device, laid out over ``sizes``, with its checkpoint
    mapping and parallelizer."""
    from hp_dcp_hf.integrations.transformers import apply_transforms
    from hp_dcp_hf.model.skeleton import build_skeleton, checkpoint_mapping

    parallelize = parallelize_for(sizes)
    model = build_skeleton(config, model_cls, dtype=dtype)
    mapping = checkpoint_mapping(model)
    return parallelize(apply_transforms(model, transforms)), mapping, parallelize


def _quantization(quantization_config: Mapping[str, Any] | None) -> str | None:
    """``"fp8, blocks 128x128"`` or ``"compressed-tensors: float-quantized, pack-quantized"``: the
    checkpoint's quantization in a few words (None when plain)."""
    if not quantization_config:
        return None
    block = quantization_config.get("weight_block_size")
    blocks = f", blocks {'x'.join(map(str, block))}" if isinstance(block, (list, tuple)) else ""
    groups = quantization_config.get("config_groups")
    formats = sorted({str(g.get("format") or quantization_config.get("format")) for g in groups.values()
                      if isinstance(g, Mapping)}) if isinstance(groups, Mapping) else []
    return f"{quantization_config.get('quant_method')}{blocks}" + (f": {', '.join(formats)}" if formats else "")


# -- load instrumentation -----------------------------------------------------------------------


def reads_mapped(reader: HFStorageReader) -> bool:
    """Whether ``reader`` (after ``read_metadata``) copies out of memory mappings of the files: its
    ``requests`` then count contiguous byte runs copied (one per row of a row-sharded box), not
    requests to storage (see :mod:`hp_dcp_hf.storage.transport.stats`)."""
    return reader._maps


PROGRESS_EVERY_S = 5.0
"""Seconds between two progress lines when stderr is not a terminal."""


class Progress:
    """Bytes done of ``total``, for work long enough to look stuck: a tqdm bar on stderr when it is a
    terminal, else an INFO record of this module's logger every :data:`PROGRESS_EVERY_S` seconds and
    one at :meth:`close` (a log gets lines, not carriage returns; the CLI prints them). ``note``
    (``"tensors 3/10"``) goes after the bytes. Thread-safe."""

    def __init__(self, desc: str, total: int, note: str = "") -> None:
        self.desc, self.total, self.done, self.note = desc, total, 0, note
        self._lock = threading.Lock()
        self._start = self._shown = time.monotonic()
        self._closed = False
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                             dynamic_ncols=True, file=sys.stderr, postfix=note or None)

    def update(self, nbytes: int, note: str | None = None) -> None:
        with self._lock:
            self.done += nbytes
            self.note = self.note if note is None else note
            if self._bar is not None:
                self._bar.update(nbytes)
                if note is not None:
                    self._bar.set_postfix_str(note, refresh=False)
            elif time.monotonic() - self._shown >= PROGRESS_EVERY_S:
                self._line()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._bar is not None:
                self._bar.close()
            else:
                self._line()

    def _line(self) -> None:
        self._shown = time.monotonic()
        share = self.done / self.total if self.total else 1.0
        note = f", {self.note}" if self.note else ""
        logger.info("%s: %s of %s (%.0f%%)%s, %.1f s", self.desc, fmt_bytes(self.done), fmt_bytes(self.total),
                    100 * share, note, self._shown - self._start)


class SaveProgress:
    """A :class:`~hp_dcp_hf.storage.HFStorageWriter` ``progress`` hook: a :class:`Progress` of this
    rank's bytes written, from the first call of a save to the one that reaches its total."""

    def __init__(self, desc: str = "rank 0 saving") -> None:
        self.desc = desc
        self._progress: Progress | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._progress is None:
            self._progress = Progress(self.desc, total)
        self._progress.update(done - self._progress.done)
        if done >= total:
            self._progress.close()
            self._progress = None


def progress_planner(show: bool, desc: str = "rank 0 loading", *, shard_bytes: bool = False) -> type[HFMappingPlanner]:
    """A planner class whose planners drive a :class:`Progress` (bytes, tensors done) when ``show``.

    The class's ``last`` is its last planner, to read after ``from_pretrained`` made and used it.
    With ``shard_bytes``, a planner's ``shard_bytes`` is what this rank's shards need from the
    checkpoint: its own ``stats.bytes_needed`` when it traces, and for the legacy (untraced) plan,
    which reads whole tensors, that of a traced plan made first (on this rank alone, no collective):
    the bytes the legacy loader's reads amplify.
    """
    from hp_dcp_hf.load.planner import HFMappingPlanner

    class ProgressPlanner(HFMappingPlanner):
        last: ProgressPlanner | None = None
        shard_bytes: int | None = None

        def create_local_plan(self):
            traced = self._traced_bytes() if shard_bytes and not self.trace else None
            plan = super().create_local_plan()  # after the traced plan: what it records on the model is this one's
            type(self).last = self
            if shard_bytes:
                self.shard_bytes = self.stats.bytes_needed if traced is None else traced
            self._progress = None
            self._lock_bar = threading.Lock()
            self._left = Counter(item.dest_index.fqn for item in plan.items)
            self._tensors, self._done = len(self._left), 0
            if show and plan.items:
                total = sum(self._item_bytes(item) for item in plan.items)
                self._progress = Progress(desc, total, f"tensors 0/{self._tensors}")
            return plan

        def _traced_bytes(self) -> int:
            planner = HFMappingPlanner(
                self.model, weights_mapping=self.weights_mapping, strict=False, unexpected="ignore",
                external_target_fqns=self.external_target_fqns, claimed_source_keys=self.claimed_source_keys,
            )
            planner.plan_reads(self.state_dict, self.metadata)
            return planner.stats.bytes_needed

        def _item_bytes(self, item) -> int:
            md = self.metadata.state_dict_metadata[item.storage_index.fqn]
            return math.prod(item.lengths) * md.properties.dtype.itemsize

        def commit_tensor(self, read_item, tensor) -> None:
            super().commit_tensor(read_item, tensor)
            if self._progress is None:
                return
            with self._lock_bar:
                self._left[read_item.dest_index.fqn] -= 1
                if not self._left[read_item.dest_index.fqn]:
                    self._done += 1
                self._progress.update(self._item_bytes(read_item), f"tensors {self._done}/{self._tensors}")
                if self._done == self._tensors:
                    self._progress.close()
                    self._progress = None

    return ProgressPlanner
