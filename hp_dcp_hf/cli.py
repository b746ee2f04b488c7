"""``hp-dcp-hf``: inspect a checkpoint, plan every rank's reads, load under torchrun, run the demo.

    hp-dcp-hf inspect PATH [--json]
    hp-dcp-hf plan PATH --mesh dp=2,tp=2 [--transforms fuse_qkv,...] [--items] [--json]
    torchrun --nproc-per-node 4 -m hp_dcp_hf load PATH --mesh dp=2,tp=2 [--forward] [--json]
    hp-dcp-hf demo [--out DIR] [--cache-dir DIR]

``plan`` needs no process group and reads no tensor data: it builds the model from the
checkpoint's config on the meta device once per rank, under torch's ``fake`` process group with
that rank's number, applies the rewrites and :class:`hp_dcp_hf.pipeline.FsdpTp` (the same layout
``load`` and ``demo`` use), and asks :class:`HFMappingPlanner` for the rank's ReadItems; the
requests are those :class:`HFStorageReader` issues for them (same coalescing and staging budget).

Errors print one line (``hp-dcp-hf: error: ...``) and exit 1; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hp_dcp_hf.storage import INDEX_FILE, HFStorageReader, ReadStats, filesystem, locate, scan
from hp_dcp_hf.storage.stats import FileStats

PROG = "hp-dcp-hf"

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``1.50 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _transforms(spec: str | None) -> tuple[str, ...]:
    return tuple(t.strip() for t in (spec or "").split(",") if t.strip())


def _reader_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"coalesce_gap": args.coalesce_gap, "num_threads": args.threads, "staging_bytes": args.staging_mib * 2**20,
            "map_local_files": not args.no_map}


# -- inspect -----------------------------------------------------------------------------------


def inspect_checkpoint(path: str) -> dict[str, Any]:
    """Files, tensors, dtypes, bytes and index consistency of the checkpoint at ``path``."""
    location, single = locate(*filesystem(path))
    stats = ReadStats()
    catalog = scan(location, single, stats)  # raises on any index / header inconsistency
    files: dict[str, dict[str, Any]] = {
        f: {"tensors": 0, "tensor_bytes": 0, "file_bytes": location.size(f),
            "header_bytes": stats.per_file.get(f, FileStats()).header_bytes} for f in catalog.files
    }
    dtypes: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    for entry in catalog.entries.values():
        files[entry.file]["tensors"] += 1
        files[entry.file]["tensor_bytes"] += entry.nbytes
        dtypes[entry.dtype_name]["tensors"] += 1
        dtypes[entry.dtype_name]["bytes"] += entry.nbytes
    has_index = single is None and location.exists(INDEX_FILE)
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
        },
        "config": config,
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    info = inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"checkpoint {info['path']}")
    if info["config"]:
        print("config     " + ", ".join(f"{k}={v}" for k, v in info["config"].items()))
    rows = [(f, d["tensors"], fmt_bytes(d["tensor_bytes"]), fmt_bytes(d["file_bytes"]), d["header_bytes"])
            for f, d in info["files"].items()]
    print(_table(("file", "tensors", "tensor bytes", "file size", "header bytes"), rows))
    print("dtypes     " + ", ".join(f"{k}: {v['tensors']} tensors, {fmt_bytes(v['bytes'])}"
                                     for k, v in info["dtypes"].items()))
    print(f"total      {info['tensors']} tensors, {fmt_bytes(info['tensor_bytes'])} ({info['tensor_bytes']} bytes) "
          f"in {len(info['files'])} files")
    index = info["index"]
    if index["file"]:
        line = f"index      {index['file']}: {index['keys']} keys in {len(info['files'])} files, consistent with the headers"
        if index["unlisted_files"]:
            line += f"; WARNING: safetensors files the index does not list: {', '.join(index['unlisted_files'])}"
        print(line)
    else:
        print("index      none (every .safetensors file of the directory is read)")
    return 0


# -- plan --------------------------------------------------------------------------------------


@dataclass
class RankPlan:
    """One rank's planned load: what it needs and the requests its reader will issue."""

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
    dtype: torch.dtype = torch.float32,
    strict: bool = True,
    experts_over_all_ranks: bool = True,
    with_items: bool = False,
    **reader_options: Any,
) -> dict[str, Any]:
    """Every rank's plan for loading ``path`` into the model its config describes, laid out by
    :class:`~hp_dcp_hf.pipeline.FsdpTp` over ``mesh``; no process group, no tensor data read."""
    import torch.distributed as dist

    from hp_dcp_hf.pipeline import (
        FsdpTp,
        apply_transforms,
        build_skeleton,
        checkpoint_mapping,
        init_mesh,
        parse_mesh,
        read_config,
        resolve_model_class,
    )
    from hp_dcp_hf.planner import HFMappingPlanner
    from hp_dcp_hf.storage import HFStorageReader

    if dist.is_initialized():
        raise RuntimeError("plan runs without a process group; call it outside torchrun / init_process_group")
    _register_fake_backend()
    sizes = parse_mesh(mesh)
    world = math.prod(sizes.values())
    reader = HFStorageReader(path, **reader_options)
    metadata = reader.read_metadata()
    config = read_config(path, reader.storage_options)
    model_cls = resolve_model_class(config)
    ranks: list[RankPlan] = []
    layout: list[str] = []
    for rank in range(world):
        dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)
        try:
            device_mesh = init_mesh(sizes)
            model = build_skeleton(config, model_cls, dtype=dtype)
            mapping = checkpoint_mapping(model)
            model = apply_transforms(model, transforms)
            recipe = FsdpTp(device_mesh, experts_over_all_ranks=experts_over_all_ranks)
            model = recipe(model)
            layout = recipe.applied
            planner = HFMappingPlanner(model, weights_mapping=mapping, strict=strict)
            items = planner.plan_reads(model.state_dict(), metadata)
            coordinate = tuple(device_mesh.get_coordinate() or ())
        finally:
            dist.destroy_process_group()
            _clear_sharding_caches()
        requests = reader.plan_requests(items)
        plan = RankPlan(
            rank, coordinate,
            targets=planner.stats.targets, read_items=planner.stats.read_items,
            bytes_needed=planner.stats.bytes_needed,
            bytes_to_read=sum(r.nbytes for _, r in requests),
            ranges=sum(len(r.pieces) for _, r in requests),
            requests=len(requests),
            deferred_targets=planner.stats.deferred_targets, deferred_bytes=planner.stats.deferred_bytes,
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
    checkpoint_bytes = sum(e.nbytes for e in reader.entries.values())
    return {
        "checkpoint": path,
        "model": model_cls.__name__,
        "mesh": sizes,
        "world_size": world,
        "transforms": list(transforms),
        "layout": layout,
        "checkpoint_bytes": checkpoint_bytes,
        "ranks": ranks,
    }


def cmd_plan(args: argparse.Namespace) -> int:
    result = plan_ranks(
        args.path, args.mesh, transforms=_transforms(args.transforms), dtype=DTYPES[args.dtype],
        strict=not args.no_strict, with_items=args.items, **_reader_options(args),
    )
    ranks: list[RankPlan] = result["ranks"]
    if args.json:
        out = dict(result)
        out["ranks"] = [{k: v for k, v in asdict(r).items() if k != "reads" and (k != "items" or args.items)}
                        for r in ranks]
        print(json.dumps(out, indent=2))
        return 0
    mesh = ",".join(f"{k}={v}" for k, v in result["mesh"].items())
    print(f"plan for {result['checkpoint']} -> {result['model']} on mesh {mesh} ({result['world_size']} ranks)"
          + (f", transforms {','.join(result['transforms'])}" if result["transforms"] else ""))
    for line in result["layout"]:
        print(f"  layout: {line}")
    rows = [(r.rank, ",".join(map(str, r.coordinate)), r.targets, r.read_items, fmt_bytes(r.bytes_needed),
             fmt_bytes(r.bytes_to_read), r.ranges, r.requests,
             f"{r.deferred_targets} ({fmt_bytes(r.deferred_bytes)})") for r in ranks]
    print(_table(("rank", "coord", "targets", "items", "bytes needed", "bytes to read", "ranges", "requests",
                  "deferred"), rows))
    total = sum(r.bytes_to_read for r in ranks)
    print(f"all ranks read {fmt_bytes(total)} of a {fmt_bytes(result['checkpoint_bytes'])} checkpoint "
          f"({total / max(1, result['checkpoint_bytes']):.2f}x; replicated shards are read by every rank holding them)")
    if args.items:
        for r in ranks:
            print(f"rank {r.rank} read items:")
            for item in r.items:
                box = ", ".join(f"{o}:{o + n}" for o, n in zip(item["offsets"], item["lengths"]))
                print(f"  {item['key']}[{box}] -> {item['target']} @ {tuple(item['target_offsets'])}")
    return 0


# -- load --------------------------------------------------------------------------------------


class RecordingReader(HFStorageReader):
    """An :class:`HFStorageReader` that keeps every request it issues (``reads``: ``(file, start,
    end)``, coalescing gaps included) and the wall time of its ``read_data`` calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, record_requests=True, **kwargs)
        self.read_seconds = 0.0

    @property
    def reads(self) -> list[tuple[str, int, int]]:
        return self.requests_log

    def read_data(self, plan, planner):
        start = time.perf_counter()
        try:
            return super().read_data(plan, planner)
        finally:
            self.read_seconds += time.perf_counter() - start


def progress_planner(show: bool, desc: str = "rank 0 loading") -> Callable[..., Any]:
    """A planner class whose planners drive a tqdm bar (bytes, tensors done) when ``show``."""
    from hp_dcp_hf.planner import HFMappingPlanner

    class ProgressPlanner(HFMappingPlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            self._bar = None
            self._lock_bar = threading.Lock()
            self._left = Counter(item.dest_index.fqn for item in plan.items)
            self._tensors, self._done = len(self._left), 0
            if show and plan.items:
                from tqdm import tqdm

                total = sum(self._item_bytes(item) for item in plan.items)
                self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                                 dynamic_ncols=True, file=sys.stderr)
                self._bar.set_postfix_str(f"tensors 0/{self._tensors}")
            return plan

        def _item_bytes(self, item) -> int:
            md = self.metadata.state_dict_metadata[item.storage_index.fqn]
            return math.prod(item.lengths) * md.properties.dtype.itemsize

        def commit_tensor(self, read_item, tensor) -> None:
            super().commit_tensor(read_item, tensor)
            if self._bar is None:
                return
            with self._lock_bar:
                self._left[read_item.dest_index.fqn] -= 1
                if not self._left[read_item.dest_index.fqn]:
                    self._done += 1
                self._bar.update(self._item_bytes(read_item))
                self._bar.set_postfix_str(f"tensors {self._done}/{self._tensors}", refresh=False)
                if self._done == self._tensors:
                    self._bar.close()
                    self._bar = None

    return ProgressPlanner


def _init_distributed() -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group("gloo")
        else:  # a single process: a world of one
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def cmd_load(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from hp_dcp_hf.pipeline import FsdpTp, from_pretrained, init_mesh

    rank, world = _init_distributed()
    try:
        mesh = init_mesh(args.mesh or f"dp={world}")
        recipe = FsdpTp(mesh)
        reader = RecordingReader(args.path, **_reader_options(args))
        start = time.perf_counter()
        model, report = from_pretrained(
            args.path, dtype=DTYPES[args.dtype], transforms=_transforms(args.transforms), parallelize=recipe,
            loader=args.loader, strict=not args.no_strict, reader=reader, planner_cls=progress_planner(rank == 0),
        )
        total_s = time.perf_counter() - start
        logits = None
        if args.forward:
            ids = torch.arange(16).reshape(2, 8) % model.config.vocab_size
            with torch.no_grad():
                out = model(input_ids=ids).logits
            logits = {"shape": list(out.shape), "mean": float(out.float().mean()), "finite": bool(out.isfinite().all())}
        row = {
            "rank": rank, "bytes_needed": report.plan.bytes_needed, "bytes_read": report.read.bytes_read,
            "requests": report.read.requests, "load_s": report.seconds["load"], "read_s": reader.read_seconds,
            "total_s": total_s,
            "loaded": len(report.loaded_keys), "missing": len(report.missing_keys),
            "unexpected": len(report.unexpected_keys), "initialized": len(report.initialized_keys),
        }
        rows: list[dict[str, Any]] = [{}] * world
        dist.all_gather_object(rows, row)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    if args.json:
        print(json.dumps({"checkpoint": args.path, "layout": recipe.applied, "ranks": rows, "logits": logits},
                         indent=2))
        return 0
    for line in recipe.applied:
        print(f"layout: {line}")
    print(_table(("rank", "bytes needed", "bytes read", "requests", "load s", "read s", "GB/s"),
                 [(r["rank"], fmt_bytes(r["bytes_needed"]), fmt_bytes(r["bytes_read"]), r["requests"],
                   f"{r['load_s']:.2f}", f"{r['read_s']:.2f}", f"{r['bytes_read'] / max(r['read_s'], 1e-9) / 1e9:.2f}")
                  for r in rows]))
    print("(load s: the whole dcp.load, metadata and plan exchange included; read s and GB/s: its reads)")
    needed = sum(r["bytes_needed"] for r in rows)
    read = sum(r["bytes_read"] for r in rows)
    print(f"read amplification {read / max(needed, 1):.3f} (bytes read / bytes needed); "
          f"loaded {rows[0]['loaded']} tensors, missing {rows[0]['missing']}, unexpected {rows[0]['unexpected']}, "
          f"initialized by the model {rows[0]['initialized']}")
    if logits is not None:
        print(f"forward: logits {logits['shape']}, mean {logits['mean']:.6f}, finite={logits['finite']}")
    return 0


# -- entry point -------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks instead of one-line errors")
    parser = _Parser(prog=PROG, description=__doc__.split("\n")[0], parents=[common])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("inspect", parents=[common], help="files, tensors, dtypes, bytes, index consistency")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    def layout_args(p: argparse.ArgumentParser, mesh_default: str | None) -> None:
        p.add_argument("path")
        p.add_argument("--mesh", default=mesh_default, help="mesh dims, e.g. dp=2,tp=2 (dims: dp, tp)")
        p.add_argument("--transforms", default="", help="comma-separated rewrites: fuse_qkv,fuse_gate_up,...")
        p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
        p.add_argument("--no-strict", action="store_true", help="missing model tensors are not an error")
        p.add_argument("--coalesce-gap", type=int, default=None,
                       help="reader: merge ranges at most this far apart (default: 0 local, 1 MiB remote; "
                            "local files only with --no-map)")
        p.add_argument("--no-map", action="store_true",
                       help="reader: read local files with preadv instead of copying out of a memory mapping")
        p.add_argument("--threads", type=int, default=8, help="reader: reads in flight")
        p.add_argument("--staging-mib", type=int, default=64, help="reader: staging budget in MiB")
        p.add_argument("--json", action="store_true")

    p = sub.add_parser("plan", parents=[common], help="every rank's reads, without a process group or data")
    layout_args(p, "dp=2,tp=2")
    p.add_argument("--items", action="store_true", help="list every read item")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("load", parents=[common], help="the real load (under torchrun), with a per-rank table")
    layout_args(p, None)
    p.add_argument("--loader", default="dcp", choices=("dcp", "legacy"))
    p.add_argument("--forward", action="store_true", help="run one forward pass after loading")
    p.set_defaults(func=cmd_load)

    p = sub.add_parser("demo", parents=[common], help="generate a small MoE checkpoint and load it on 4 ranks")
    from hp_dcp_hf.demo import add_arguments, run

    add_arguments(p)
    p.set_defaults(func=run)
    return parser


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    from hp_dcp_hf.errors import HPDCPHFError

    if not isinstance(error, HPDCPHFError | ValueError | RuntimeError):
        text = f"{type(error).__name__}: {text}"
    return text if len(text) <= 400 else text[:400] + "... (--debug for all of it)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if getattr(args, "debug", False):
            raise
        print(f"{PROG}: error: {_one_line(error)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
