"""``hp-dcp-hf``: inspect a checkpoint, plan every rank's reads, load under torchrun, run the demo.

    hp-dcp-hf inspect PATH [--tensors] [--match REGEX] [--json]
    hp-dcp-hf plan PATH --mesh dp=2,tp=2 [--transforms fuse_qkv,...] [--items] [--json]
    torchrun --nproc-per-node 4 -m hp_dcp_hf load PATH --mesh dp=2,tp=2 [--forward] [--json]
    hp-dcp-hf load PATH --mesh dp=2,tp=2 --nproc-per-node 4     (one host, ranks started by the package)
    hp-dcp-hf repair PATH [--dry-run]
    hp-dcp-hf demo [--out DIR] [--cache-dir DIR]

Every command that takes a checkpoint PATH takes ``--storage-option KEY=VALUE`` (repeatable): the
options of the store (s3fs, fsspec HTTP, the Hub), so endpoints and credentials need no
environment variables.

This module is argument parsing, command dispatch and printing; the work is done by
:mod:`hp_dcp_hf.tools.toolkit` (inspection, the no-process-group planning of every rank, the layout every
command uses) and :mod:`hp_dcp_hf.tools.demo`, imported by the command that needs them, so ``--help``
never imports torch or transformers.

``plan`` needs no process group and reads no tensor data: it builds the model from the
checkpoint's config on the meta device once per rank, under torch's ``fake`` process group with
that rank's number, applies the rewrites and the layout of :func:`hp_dcp_hf.tools.toolkit.parallelize_for`
(the same layout ``load`` and ``demo`` use), and asks :class:`HFMappingPlanner` for the rank's
ReadItems; the requests are those :class:`HFStorageReader` issues for them (same coalescing and
staging budget).

Errors print one line (``hp-dcp-hf: error: ...``) and exit 1; ``--debug`` shows the traceback.
While a command runs, the package's warnings and log records print one line each on stderr
(``hp-dcp-hf: warning: ...``), and ``load`` names its stages and its progress on rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import posixpath
import re
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

from hp_dcp_hf.version import __version__

PROG = "hp-dcp-hf"

DTYPE_CHOICES = ("auto", "bf16", "bfloat16", "float16", "float32", "fp16", "fp32")
"""``--dtype`` values (:mod:`hp_dcp_hf.model.dtype`: ``auto`` takes the config's, as transformers 5 does)."""
SAVE_QUANTIZE_CHOICES = ("fp8",)
"""``--save-quantize`` values: :data:`hp_dcp_hf.quant.encode.FORMATS`, not imported so that ``--help`` imports no torch."""

TRANSFORMS = ("fuse_gate_up", "fuse_qkv", "grouped_gemm_experts")
"""The rewrites of :mod:`hp_dcp_hf.transforms`, listed by ``--help`` without importing them (a test
checks this list against ``hp_dcp_hf.transforms.__all__``)."""

_PHASES = ("metadata", "plan", "spans", "read", "copy", "exchange", "finalize")
"""The phases of a load the ``load`` table shows per rank (0 where a load has none)."""


def _transforms(spec: str | None) -> tuple[str, ...]:
    return tuple(t.strip() for t in (spec or "").split(",") if t.strip())


def _reader_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"coalesce_gap": args.coalesce_gap, "num_threads": args.threads, "staging_bytes": args.staging_mib * 2**20,
            "map_local_files": not args.no_map, "cooperate": args.cooperate, "storage_options": args.storage_options}


# -- storage options ---------------------------------------------------------------------------


def parse_storage_option(text: str) -> tuple[tuple[str, ...], Any]:
    """``KEY=VALUE`` -> ``(key path, value)``: the key split at its dots (``client_kwargs.endpoint_url``
    is ``("client_kwargs", "endpoint_url")``: s3fs and fsspec's HTTP take nested dicts), the value
    parsed as JSON where it is JSON (``true``, ``10``, ``{...}``), else the string itself. A
    ``ValueError`` names what is wrong."""
    key, equals, raw = text.partition("=")
    path = tuple(key.split("."))
    if not equals or not all(path):
        raise ValueError(f"{text!r} is not KEY=VALUE (nested keys with dots: client_kwargs.endpoint_url=URL)")
    try:
        return path, json.loads(raw)
    except json.JSONDecodeError:
        return path, raw


def add_storage_option(options: dict[str, Any], text: str) -> dict[str, Any]:
    """A copy of ``options`` with ``KEY=VALUE`` set (:func:`parse_storage_option`); a later option
    replaces an earlier value, except that objects merge key by key (``headers.A=1`` then
    ``headers={"B": "2"}`` keeps both). A key under a value that is not an object is a ``ValueError``."""
    path, value = parse_storage_option(text)
    out = json.loads(json.dumps(options))  # a deep copy: options are JSON values
    _set_option(out, path, value, text)
    return out


def _set_option(node: dict[str, Any], path: tuple[str, ...], value: Any, text: str) -> None:
    for depth, key in enumerate(path[:-1]):
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"{text!r}: {'.'.join(path[:depth + 1])} is {json.dumps(node)} already, not an object")
    leaf = path[-1]
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        for key, item in value.items():
            _set_option(node[leaf], (key,), item, text)
    else:
        node[leaf] = value


class _StorageOptions(argparse.Action):
    """Gathers repeated ``--storage-option KEY=VALUE`` into one dict; a malformed one is a usage error."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            setattr(namespace, self.dest, add_storage_option(getattr(namespace, self.dest) or {}, values))
        except ValueError as error:
            parser.error(f"argument {option_string}: {error}")


# -- what the commands print besides their results -----------------------------------------------

_INFO_LOGGERS = ("hp_dcp_hf.integrations.transformers", "hp_dcp_hf.tools.toolkit")
"""The loggers whose INFO records rank 0 prints: the stages before a load, progress lines."""

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _message_line(message: str, level: int, rank: int) -> str:
    """``hp-dcp-hf: [rank N: ][warning: ]message``, on one line."""
    where = f"rank {rank}: " if rank else ""
    kind = f"{logging.getLevelName(level).lower()}: " if level >= logging.WARNING else ""
    return f"{PROG}: {where}{kind}{' '.join(message.split())}"


class _Lines(logging.Handler):
    """Prints the ``hp_dcp_hf`` loggers' records on stderr, one line each: WARNING and above on
    every rank, INFO of :data:`_INFO_LOGGERS` on rank 0."""

    def __init__(self, rank: int) -> None:
        super().__init__(logging.INFO if rank == 0 else logging.WARNING)
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name in _INFO_LOGGERS

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = _message_line(record.getMessage(), record.levelno, self.rank)
        except Exception:  # noqa: BLE001 - logging's own policy for a record that does not format
            self.handleError(record)
            return
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _messages(rank: int = 0) -> Iterator[None]:
    """While a command runs: the package's log records through :class:`_Lines` (not propagated to
    the root logger's handlers), and Python warnings raised from its modules as one line each,
    without the ``file.py:NNN: UserWarning`` prefix and source line Python adds."""
    logger = logging.getLogger("hp_dcp_hf")
    handler = _Lines(rank)
    level, propagate, showwarning = logger.level, logger.propagate, warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep):
            print(_message_line(str(message), logging.WARNING, rank), file=sys.stderr, flush=True)
        else:
            showwarning(message, category, filename, lineno, file, line)

    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = showwarning
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _with_messages(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``command`` under :func:`_messages` (one process: rank 0)."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        with _messages():
            return command(args)

    return run


@contextlib.contextmanager
def _config_from_the_command_line() -> Iterator[None]:
    """The pipeline's error for a checkpoint without ``config.json`` names a Python argument
    (``from_pretrained(..., config=)``); on the command line the fix is the path."""
    from hp_dcp_hf.errors import CheckpointNotFoundError

    try:
        yield
    except CheckpointNotFoundError as error:
        if posixpath.basename(error.file or "") != "config.json":
            raise
        raise CheckpointNotFoundError(
            "no config.json next to the weights, and plan and load build the model from it: point PATH at "
            "the checkpoint's directory that holds its config.json (as save_pretrained writes it), or put the "
            "model's config.json there", file=error.file) from error


# -- inspect -----------------------------------------------------------------------------------


@_with_messages
def cmd_inspect(args: argparse.Namespace) -> int:
    from hp_dcp_hf.tools.toolkit import fmt_bytes, inspect_checkpoint, table

    info = inspect_checkpoint(args.path, args.storage_options)
    listed = info.pop("tensor_list")
    if args.match is not None:
        listed = [t for t in listed if args.match.search(t["name"])]
    if args.json:
        print(json.dumps(info | ({"tensor_list": listed} if args.tensors or args.match else {}), indent=2))
        return 0
    print(f"checkpoint {info['path']}")
    if info["config"]:
        print("config     " + ", ".join(f"{k}={v}" for k, v in info["config"].items()))
    rows = [(f, d["tensors"], fmt_bytes(d["tensor_bytes"]), fmt_bytes(d["file_bytes"]), d["header_bytes"])
            for f, d in info["files"].items()]
    print(table(("file", "tensors", "tensor bytes", "file size", "header bytes"), rows))
    print("dtypes     " + ", ".join(f"{k}: {v['tensors']} tensors, {fmt_bytes(v['bytes'])}"
                                     for k, v in info["dtypes"].items()))
    print(f"total      {info['tensors']} tensors, {fmt_bytes(info['tensor_bytes'])} ({info['tensor_bytes']} bytes) "
          f"in {len(info['files'])} files")
    quantized = info["quantization"]
    if quantized and "error" in quantized:
        print(f"quantized  {quantized['format']}: NOT READABLE AS VALUES: {quantized['error']}")
    elif quantized:
        print(f"quantized  {quantized['format']}: {quantized['weights']} weights ({fmt_bytes(quantized['weight_bytes'])}) "
              f"with their scales ({fmt_bytes(quantized['scale_bytes'])}); a floating-point model gets their values")
    print(f"index      {_index_line(info)}")
    unfinished = info["unfinished_save"]
    if unfinished:
        print("unfinished a save is running or was interrupted: "
              + ", ".join(f"{i['kind']} {i['name']} ({fmt_bytes(i['bytes'])})" for i in unfinished["items"]))
        print(f"repair     hp-dcp-hf repair {info['path']}: {unfinished['repair']}")
    if listed and (args.tensors or args.match):
        print(table(("tensor", "dtype", "shape", "file", "bytes"),
                    [(t["name"], t["dtype"], str(t["shape"]), t.get("file") or f"{len(t['chunks'])} chunks",
                      fmt_bytes(t["bytes"])) for t in listed]))
    if args.match:
        print(f"{len(listed)} of {info['tensors']} tensors match {args.match.pattern}")
    return 0


def _index_line(info: dict[str, Any]) -> str:
    """What ``inspect`` says of the checkpoint's index: what it lists, or what is read without one."""
    index = info["index"]
    if index["file"]:
        line = f"{index['file']}: {index['keys']} keys in {len(info['files'])} files, consistent with the headers"
        if index["unlisted_files"]:
            line += f"; WARNING: safetensors files the index does not list: {', '.join(index['unlisted_files'])}"
        return line
    if index["single_file"]:
        line = f"none: PATH is one file, {index['single_file']}, and only it is read"
        if index["directory_has_index"]:
            line += (f"; its directory has model.safetensors.index.json: the directory ({info['root']}) is the "
                     "checkpoint, pass it to read every shard")
        return line
    if index["model_safetensors_alone"]:
        return "none: model.safetensors is read, alone (as transformers reads it first)"
    return "none: every .safetensors file of the directory is read"


# -- plan --------------------------------------------------------------------------------------


@_with_messages
def cmd_plan(args: argparse.Namespace) -> int:
    from hp_dcp_hf.tools.toolkit import RankPlan, fmt_bytes, plan_ranks, table

    with _config_from_the_command_line():
        result = plan_ranks(
            args.path, args.mesh, transforms=_transforms(args.transforms), dtype=args.dtype,
            strict=not args.no_strict, unexpected=args.unexpected, with_items=args.items, **_reader_options(args),
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
    if result["unexpected"]:
        print(f"  unexpected: {_unexpected_line(result['unexpected'])}")
    rows = [(r.rank, ",".join(map(str, r.coordinate)), r.targets, r.read_items, fmt_bytes(r.bytes_needed),
             fmt_bytes(r.bytes_to_read), r.ranges, r.requests,
             f"{r.deferred_targets} ({fmt_bytes(r.deferred_bytes)})") for r in ranks]
    coordinate = f"coord ({','.join(result['coordinate_dims'])})" if result["coordinate_dims"] else "coord"
    header = ("rank", coordinate, "targets", "items", "bytes needed", "read from storage", "ranges",
              _requests_column(result["mapped"]), "deferred")
    if result["quantization"]:
        print(f"  quantized checkpoint ({result['quantization']}): read as values, weight boxes with their scale blocks")
        rows = [(*row, fmt_bytes(r.quantized_bytes), fmt_bytes(r.scale_bytes)) for row, r in zip(rows, ranks)]
        header = (*header, "quantized", "scales")
    if result["cooperative"]:
        rows = [(*row, fmt_bytes(r.bytes_from_peers), fmt_bytes(r.bytes_to_peers)) for row, r in zip(rows, ranks)]
        header = (*header, "received from peers", "sent to peers")
    print(table(header, rows))
    if result["mapped"]:
        print(_RUNS_NOTE)
    for line in _plan_summary(result):
        print(line)
    if args.items:
        for r in ranks:
            print(f"rank {r.rank} read items:")
            for item in r.items:
                box = ", ".join(f"{o}:{o + n}" for o, n in zip(item["offsets"], item["lengths"]))
                print(f"  {item['key']}[{box}] -> {item['target']} @ {tuple(item['target_offsets'])}")
    return 0


def _plan_summary(result: dict[str, Any]) -> list[str]:
    """``plan``'s closing lines: what the cluster reads from storage and why it is more than the
    checkpoint bytes it needs (holes, ranks that need the same bytes), from ``result["cluster"]``."""
    from hp_dcp_hf.tools.toolkit import fmt_bytes

    cluster, checkpoint = result["cluster"], result["checkpoint_bytes"]
    read, once, by_shards = cluster["bytes_read"], cluster["bytes_needed_once"], cluster["bytes_needed_by_shards"]
    lines = [f"the ranks read {fmt_bytes(read)} from storage in all, {read / max(checkpoint, 1):.2f}x the "
             f"{fmt_bytes(checkpoint)} checkpoint; cluster read amplification {cluster['read_amplification']:.3f} "
             f"(bytes read from storage / the {fmt_bytes(once)} of the checkpoint some rank needs, each byte "
             f"counted once); of what they read, {fmt_bytes(cluster['holes'])} "
             + ("are holes no rank needs, bridged inside spans" if result["cooperative"] else
                "are holes between the ranges a rank needs, read by coalescing them (--coalesce-gap)")]
    if result["cooperative"]:
        lines.append(f"span ownership: each needed byte is read from storage by one rank, in "
                     f"{sum(r.requests for r in result['ranks'])} requests; the ranks' shards need "
                     f"{fmt_bytes(by_shards)} in all, and what a rank needs but does not read itself it receives "
                     f"from the rank that read it: {fmt_bytes(cluster['bytes_received'])} received in all, over the "
                     "process group")
    elif by_shards > once:  # some bytes are needed by several ranks, and each of them reads them
        lines.append(f"several ranks need some of the same checkpoint bytes and each reads its own copy: the ranks' "
                     f"shards need {fmt_bytes(by_shards)} in all, {fmt_bytes(by_shards - once)} more than the "
                     f"{fmt_bytes(once)} they need between them ({by_shards / max(once, 1):.2f}x); --cooperate always "
                     "reads each byte once (the default, auto, does on remote stores and shared file systems)")
    return lines


_RUNS_NOTE = ("(runs: contiguous byte runs copied out of the files' memory mappings, one per row of a "
              "row-sharded box, large ones read with preadv: not requests to storage; --no-map reads by requests)")


def _requests_column(mapped: bool) -> str:
    """The name of the requests figure: mapped reads make no requests, they copy runs (:data:`_RUNS_NOTE`)."""
    return "runs" if mapped else "requests"


def _unexpected_line(keys: Sequence[str]) -> str:
    from hp_dcp_hf.load.planner import describe_keys

    return (f"{len(keys)} checkpoint tensors make no model tensor: {describe_keys(keys)} "
            "(--unexpected ignore silences this, raise refuses the load)")


# -- load --------------------------------------------------------------------------------------


def _launched_rank_and_world() -> tuple[int, int]:
    """This process' rank and world size: the process group's, else torchrun's ``RANK`` /
    ``WORLD_SIZE``, else a world of one. Asks torch only where it is imported already (no process
    group exists without it), so a bad mesh fails before torch is imported."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


def _init_distributed() -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group("gloo")
        else:  # a single process: a world of one
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def _check_launch(args: argparse.Namespace, mesh: str, rank: int, world: int) -> bool:
    """Whether the mesh spec parses and fits the processes launched, and the storage options are
    ones the stores take (checked before torch is imported). When not, rank 0 raises the error (for
    a mesh that does not fit: naming the command that does), printed once, and the other ranks
    return ``False``."""
    from hp_dcp_hf.parallel.mesh import MeshSizeError, mesh_world_size
    from hp_dcp_hf.storage.transport.location import check_options

    try:
        need = mesh_world_size(mesh)
        if need != world:
            argv = getattr(args, "argv", None) or ["load", args.path, "--mesh", mesh]
            if args.nproc_per_node is not None:
                fix = f"pass --nproc-per-node {need}"
            else:
                fix = f"launch with `torchrun --nproc-per-node {need} -m hp_dcp_hf {shlex.join(argv)}`"
            raise MeshSizeError(
                f"mesh {mesh} needs {need} ranks, but {world} process{'es were' if world != 1 else ' was'} "
                f"launched; {fix}"
            )
        check_options(args.path, args.storage_options)
        if args.save_to:
            check_options(args.save_to, _save_options(args))
    except Exception:
        if rank != 0:
            return False  # rank 0 says why, once
        raise
    return True


def _save_options(args: argparse.Namespace) -> dict[str, Any]:
    """The storage options of ``--save-to``: ``--save-storage-option``'s, else ``--storage-option``'s."""
    return args.storage_options if args.save_storage_options is None else args.save_storage_options


def cmd_load(args: argparse.Namespace) -> int:
    if args.nproc_per_node is not None:
        with _messages():
            return _launch(args)
    rank, world = _launched_rank_and_world()
    with _messages(rank):
        return _load(args, rank, world)


_LAUNCH_TIMEOUT_S = 3600.0
"""How long ``--nproc-per-node`` ranks may take (and wait for each other, the process group's timeout)."""


def _launch(args: argparse.Namespace) -> int:
    """``load --nproc-per-node N``: one host's N ranks started by the package's own runner
    (:func:`hp_dcp_hf.tools.launch.run_ranks`, gloo). Everything that can be checked is checked first, in
    this process: the mesh spec and that it needs N ranks, the storage options, and the checkpoint's
    ``config.json`` (transformers' config of a known model type, the mesh as transformers'
    ``DistributedConfig``). A failure, here or on any rank, is one line: the first rank's error."""
    from hp_dcp_hf.errors import ArgumentError
    from hp_dcp_hf.parallel.mesh import distributed_config

    world = args.nproc_per_node
    if world < 1:
        raise ArgumentError(f"--nproc-per-node {world}: need at least 1 process")
    mesh = args.mesh or f"dp={world}"
    _check_launch(args, mesh, 0, world)  # before anything imports torch
    distributed_config(mesh)
    from hp_dcp_hf.model.config import read_config

    with _config_from_the_command_line():
        read_config(args.path, args.storage_options)
    from hp_dcp_hf.tools.launch import run_ranks

    argv = list(getattr(args, "argv", None) or [])
    return run_ranks(world, _launched_load, _without_nproc(argv), timeout=_LAUNCH_TIMEOUT_S)[0]


def _without_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` less its ``--nproc-per-node N`` (or ``--nproc-per-node=N``): what each rank runs."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def _launched_load(rank: int, world: int, argv: list[str]) -> int:
    """One rank of ``load --nproc-per-node``: the command line without the option, in the process
    group :func:`~hp_dcp_hf.tools.launch.run_ranks` made. Errors go back to the launcher, which prints
    the first one; this rank prints none."""
    args = build_parser().parse_args(argv)
    args.argv, args.launched = argv, True
    return cmd_load(args)


def _load(args: argparse.Namespace, rank: int, world: int) -> int:
    mesh = args.mesh or f"dp={world}"
    if not _check_launch(args, mesh, rank, world):
        return 1

    import torch
    import torch.distributed as dist

    from hp_dcp_hf.integrations.transformers import from_pretrained
    from hp_dcp_hf.tools.toolkit import (
        RecordingReader,
        SaveProgress,
        fmt_bytes,
        parallelize_for,
        progress_planner,
        reads_mapped,
    )

    rank, world = _init_distributed()
    try:
        parallelize = parallelize_for(mesh)
        reader = RecordingReader(args.path, **_reader_options(args))
        planner_cls = progress_planner(rank == 0, shard_bytes=True)
        start = time.perf_counter()
        with _config_from_the_command_line():
            model, report = from_pretrained(
                args.path, dtype=args.dtype, transforms=_transforms(args.transforms),
                parallelize=parallelize, loader=args.loader, strict=not args.no_strict,
                unexpected=args.unexpected, reader=reader, planner_cls=planner_cls,
            )
        total_s = time.perf_counter() - start
        layout = parallelize.describe()
        logits = None
        if args.forward:
            ids = torch.arange(16).reshape(2, 8) % model.config.vocab_size
            with torch.no_grad():
                out = model(input_ids=ids).logits
            logits = {"shape": list(out.shape), "mean": float(out.float().mean()), "finite": bool(out.isfinite().all())}
        written = save_s = None
        if args.save_to:
            from hp_dcp_hf.save.api import save_hf_checkpoint
            from hp_dcp_hf.storage import HFStorageWriter

            save_dtype = _save_dtype(args.save_dtype, reader.entries.values(), quantized=args.save_quantize is not None)
            save_options = _save_options(args)
            max_shard_size = args.max_shard_size or _source_shard_size(reader.entries.values(), save_dtype)
            writer = HFStorageWriter(args.save_to, max_shard_size=max_shard_size, dtype=save_dtype,
                                     progress=SaveProgress() if rank == 0 else None, **save_options)
            start = time.perf_counter()
            save_hf_checkpoint(model, args.save_to, writer=writer, quantize=args.save_quantize)
            written, save_s = writer.bytes_written, time.perf_counter() - start
        assert planner_cls.last is not None and planner_cls.last.shard_bytes is not None
        row = {
            "rank": rank, "bytes_needed": planner_cls.last.shard_bytes, "bytes_read": report.read.bytes_read,
            "bytes_planned": report.plan.bytes_needed, "requests": report.read.requests,
            "mapped": reads_mapped(reader), "load_s": report.seconds["load"], "read_s": report.seconds["read"],
            "phases": {k: report.seconds.get(k, 0.0) for k in _PHASES},
            "total_s": total_s,
            "loaded": len(report.loaded_keys), "missing": len(report.missing_keys),
            "unexpected": len(report.unexpected_keys), "initialized": len(report.initialized_keys),
            "bytes_written": written, "save_s": save_s,
            # cooperating: what the rank received from the ranks that read it, and the checkpoint
            # bytes the whole cluster needs, each counted once (the same on every rank)
            "cooperating": reader.spans is not None, "bytes_received": reader.exchange.bytes_received,
            "bytes_needed_once": int(reader.spans.plan.needed.sum()) if reader.spans is not None else None,
        }
        rows: list[dict[str, Any]] = [{}] * world
        dist.all_gather_object(rows, row)
    except Exception as error:
        if world > 1 and getattr(error, "rank", None) is not None and not getattr(args, "launched", False):
            _say_once(error, rank)
        raise
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    if args.json:
        print(json.dumps({"checkpoint": args.path, "layout": layout, "ranks": rows, "logits": logits}, indent=2))
        return 0
    for line in layout:
        print(f"layout: {line}")
    for line in _load_table(rows, legacy=args.loader == "legacy"):
        print(line)
    if logits is not None:
        print(f"forward: logits {logits['shape']}, mean {logits['mean']:.6f}, finite={logits['finite']}")
    if args.save_to:
        print(f"saved to {args.save_to} as save_pretrained writes it, each rank its own bytes: "
              + ", ".join(f"rank {r['rank']} {fmt_bytes(r['bytes_written'])} in {r['save_s']:.2f} s" for r in rows)
              + f"; {fmt_bytes(sum(r['bytes_written'] for r in rows))} in all")
    return 0


def _load_table(rows: Sequence[dict[str, Any]], *, legacy: bool) -> list[str]:
    """``load``'s per-rank table and the lines after it: each rank's bytes needed, read from storage
    and (cooperating) received from peers; the amplification named for what it divides."""
    from hp_dcp_hf.tools.toolkit import fmt_bytes, table

    mapped, cooperating = rows[0]["mapped"], rows[0]["cooperating"]
    received = ("received from peers",) if cooperating else ()
    lines = [table(("rank", "bytes needed", "read from storage", *received, _requests_column(mapped), "load s",
                    *(f"{p} s" for p in _PHASES), "GB/s"),
                   [(r["rank"], fmt_bytes(r["bytes_needed"]), fmt_bytes(r["bytes_read"]),
                     *((fmt_bytes(r["bytes_received"]),) if cooperating else ()), r["requests"],
                     f"{r['load_s']:.2f}", *(f"{r['phases'][p]:.2f}" for p in _PHASES),
                     f"{r['bytes_read'] / max(r['read_s'], 1e-9) / 1e9:.2f}")
                    for r in rows])]
    lines.append("(bytes needed: what the rank's shards need from the checkpoint; "
                 + ("read from storage: the spans the rank owns, for itself and for the others; received from "
                    "peers: what its shards need from spans other ranks own; " if cooperating else "")
                 + "load s: the whole load, its metadata, plan, spans (cooperating: every rank's needs gathered, "
                 "spans planned), read and exchange phases and the agreement after it; copy s: of read s, the reads' "
                 "wait for copies to CUDA devices; finalize s: the model's init of what the checkpoint lacks, tying; "
                 "GB/s: bytes read from storage over read s)")
    if mapped:
        lines.append(_RUNS_NOTE)
    needed = sum(r["bytes_needed"] for r in rows)
    read = sum(r["bytes_read"] for r in rows)
    note = "; the legacy loader reads whole tensors, then keeps the shards" if legacy else ""
    if cooperating:
        once = rows[0]["bytes_needed_once"]
        lines.append(f"cluster read amplification {read / max(once, 1):.3f} (the {fmt_bytes(read)} the ranks read "
                     f"from storage / the {fmt_bytes(once)} of the checkpoint they read for, each byte counted once"
                     f"{note}); the ranks' shards need {fmt_bytes(needed)} in all: what a rank does not read itself it "
                     f"receives from the rank that read it, {fmt_bytes(sum(r['bytes_received'] for r in rows))} "
                     "received in all")
    else:
        lines.append(f"read amplification {read / max(needed, 1):.3f} (bytes read from storage / bytes the shards "
                     f"need, each rank its own{note})")
    first = rows[0]
    lines.append(f"loaded {first['loaded']} tensors, missing {first['missing']}, unexpected {first['unexpected']}, "
                 f"initialized by the model {first['initialized']}")
    return lines


def _say_once(error: Exception, rank: int) -> None:
    """An error every rank raises (``error.rank`` is the rank it came from) is printed by rank 0
    alone. The others wait for that at a barrier: torchrun ends the job when the first rank exits."""
    import torch.distributed as dist

    if rank == 0:
        where = "" if "on rank " in str(error) else f"on rank {error.rank}: "  # type: ignore[attr-defined]
        print(f"{PROG}: error: {where}{_one_line(error)}", file=sys.stderr, flush=True)
    error.reported = True  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):  # a process group broken by the failure: nothing to wait for
        dist.barrier()


def _source_shard_size(entries: Any, dtype: Any) -> int | None:
    """``--save-to``'s default ``max_shard_size``: the source's layout, its files holding the same
    tensors (each file's tensor bytes counted in the dtype the save writes)."""
    from hp_dcp_hf.storage.format.files import source_shard_size

    file_bytes: dict[str, int] = {}
    for entry in entries:
        itemsize = dtype.itemsize if dtype is not None and entry.dtype.is_floating_point else entry.dtype.itemsize
        for part in entry.parts:
            file_bytes[part.file] = file_bytes.get(part.file, 0) + part.nbytes // entry.dtype.itemsize * itemsize
    return source_shard_size(file_bytes)


def _save_dtype(choice: str, entries: Any, quantized: bool = False) -> Any:
    """The dtype ``--save-to`` writes: ``checkpoint`` is the one floating-point dtype of the
    checkpoint's unquantized tensors (a bf16 checkpoint saves back as bf16 whatever ``--dtype``
    loaded it as; a mixed or quantized one keeps the model's dtypes), ``model`` the model's. A save
    that quantizes again (``quantized``) looks past an FP8 checkpoint's own weights and scales, so
    one loaded into float32 is quantized from the bf16 values it was loaded from."""
    from hp_dcp_hf.model.dtype import parse_dtype

    if choice == "model":
        return None
    if choice != "checkpoint":
        return parse_dtype(choice)
    if quantized:
        entries = [e for e in entries if e.dtype.itemsize > 1 and not e.key.endswith("_scale_inv")]
    dtypes = {e.dtype for e in entries}
    floating = [d for d in dtypes if d.is_floating_point]
    return floating[0] if len(floating) == 1 and floating[0].itemsize > 1 else None


# -- repair ------------------------------------------------------------------------------------


@_with_messages
def cmd_repair(args: argparse.Namespace) -> int:
    from hp_dcp_hf.storage.write.writer import destination_for

    print(f"{args.path}: {destination_for(args.path, args.storage_options).repair(dry_run=args.dry_run)}")
    return 0


# -- demo --------------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from hp_dcp_hf.tools.demo import run

    return run(args)


# -- entry point -------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default" in (action.help or ""):
            return action.help
        if action.nargs == 0 and action.default is False:  # a flag
            return f"{action.help or ''} (default: off)"
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks instead of one-line errors (default: off)")
    parser = _Parser(prog=PROG, description=__doc__.split("\n")[0].replace("``", ""), parents=[common],
                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help, description=help, formatter_class=_HelpFormatter)

    path_help = ("the checkpoint: a .safetensors file or a directory of them (local path, s3://..., https://...), "
                 "hf://org/repo[@revision][/subdir], or a bare Hub repo id org/repo when no such local path exists")
    json_help = "print JSON instead of tables"
    transforms_help = f"comma-separated rewrites, applied in order; available: {', '.join(TRANSFORMS)}"

    def storage_option(p: argparse.ArgumentParser) -> None:
        p.add_argument("--storage-option", action=_StorageOptions, dest="storage_options", default={},
                       metavar="KEY=VALUE",
                       help="an option of PATH's store, repeatable: s3fs's (key=, secret=, "
                            "client_kwargs.endpoint_url=http://..., client_kwargs.region_name=, anon=true), "
                            "HTTP's (headers.Authorization='Bearer ...'), the Hub's (token=, endpoint=); VALUE is "
                            "JSON where it parses (true, 10, {...}), else a string; dots nest keys (default: none)")

    p = command("inspect", "files, tensors, dtypes, bytes, index consistency (headers only, no tensor data)")
    p.add_argument("path", help=path_help)
    storage_option(p)
    p.add_argument("--tensors", action="store_true", help="also list every tensor: name, dtype, shape, file, bytes")
    p.add_argument("--match", type=_regex, default=None, metavar="REGEX",
                   help="list the tensors whose name matches REGEX (re.search; implies --tensors) (default: all)")
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(func=cmd_inspect)

    def layout_args(p: argparse.ArgumentParser, mesh_default: str | None) -> None:
        p.add_argument("path", help=path_help)
        mesh_help = ("mesh dims, e.g. dp=2,tp=2 or ep=4: dp_replicate (HSDP replicas), dp (FSDP), tp, ep (experts, "
                     "overlays dp x tp); dp_replicate x dp x tp is the number of ranks; laid out with "
                     "transformers' own plans")
        if mesh_default is None:
            mesh_help += " (default: dp=<number of processes launched>)"
        p.add_argument("--mesh", default=mesh_default, help=mesh_help)
        p.add_argument("--transforms", default="", help=transforms_help + " (default: none)")
        p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                       help="the model's dtype; auto: config.json's dtype, as transformers 5's from_pretrained")
        p.add_argument("--no-strict", action="store_true", help="missing model tensors are not an error")
        p.add_argument("--unexpected", default="warn", choices=("warn", "raise", "ignore"),
                       help="checkpoint tensors that make no model tensor: warn (name them), raise (refuse "
                            "the load before any read) or ignore")
        storage_option(p)
        p.add_argument("--coalesce-gap", type=int, default=None, metavar="BYTES",
                       help="reader: merge ranges at most this far apart (default: 0 local, 1 MiB remote; "
                            "local files only with --no-map)")
        p.add_argument("--no-map", action="store_true",
                       help="reader: read local files with preadv instead of copying out of a memory mapping")
        p.add_argument("--threads", type=int, default=8, help="reader: reads in flight")
        p.add_argument("--staging-mib", type=int, default=64, help="reader: staging budget in MiB")
        p.add_argument("--cooperate", default="auto", choices=("auto", "always", "never"),
                       help="reader: span ownership, each needed byte read by one rank and exchanged (auto: on "
                            "remote stores and shared file systems)")
        p.add_argument("--json", action="store_true", help=json_help)

    p = command("plan", "every rank's reads, without a process group or data")
    layout_args(p, "dp=2,tp=2")
    p.add_argument("--items", action="store_true", help="list every read item")
    p.set_defaults(func=cmd_plan)

    p = command("load", "the real load (under torchrun), with a per-rank table")
    layout_args(p, None)
    p.add_argument("--loader", default="dcp", choices=("dcp", "legacy"),
                   help="dcp: each rank reads only its shards' bytes; legacy: whole tensors, then slice")
    p.add_argument("--forward", action="store_true", help="run one forward pass after loading")
    p.add_argument("--save-to", default=None, metavar="DIR",
                   help="then save the loaded model to DIR as a Hugging Face checkpoint (one parallel write pass, "
                        "published atomically)")
    p.add_argument("--max-shard-size", default=None,
                   help="with --save-to: the file size limit (default: the source's layout, its largest file's "
                        "tensor bytes: the same files with the same tensors; one file stays one)")
    p.add_argument("--save-dtype", default="checkpoint", choices=("checkpoint", "model", *DTYPE_CHOICES[1:]),
                   help="with --save-to: checkpoint writes the checkpoint's floating-point dtype (a bf16 "
                        "checkpoint saves back byte for byte), model the model's (--dtype)")
    p.add_argument("--save-quantize", default=None, choices=SAVE_QUANTIZE_CHOICES,
                   help="with --save-to: write a block-scaled FP8 checkpoint (quant_method fp8, 128x128 blocks) of "
                        "the modules transformers' FP8 quantizer converts, quantized in the same pass")
    p.add_argument("--save-storage-option", action=_StorageOptions, dest="save_storage_options", default=None,
                   metavar="KEY=VALUE", help="with --save-to: an option of DIR's store, as --storage-option, "
                                             "repeatable (default: those of --storage-option)")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="start N ranks on this host (gloo) instead of running under torchrun; the mesh, storage "
                        "options and config.json are checked before any rank starts, and a failure prints one "
                        "line (default: the ranks torchrun launched, or one process)")
    p.set_defaults(func=cmd_load)

    p = command("repair", "finish a save that was killed while publishing (its journal is the commit point), "
                          "drop what saves killed before it left")
    p.add_argument("path", help="a checkpoint directory or s3:// prefix that saves write to")
    storage_option(p)
    p.add_argument("--dry-run", action="store_true", help="say what repair would do, change nothing")
    p.set_defaults(func=cmd_repair)

    p = command("demo", "generate a small MoE checkpoint and load it on 4 ranks")
    p.add_argument("--out", default="demo_out", help="output directory: per-rank JSON, summary.json, pictures")
    p.add_argument("--cache-dir", default=None,
                   help="where the generated checkpoint is kept (default: $HP_DCP_HF_CACHE or ~/.cache/hp_dcp_hf)")
    p.add_argument("--mesh", default="dp=2,tp=2",
                   help="mesh dims as for plan/load (dp_replicate, dp, tp, ep; dp_replicate x dp x tp ranks)")
    p.add_argument("--transforms", default="grouped_gemm_experts", help=transforms_help)
    p.add_argument("--regenerate", action="store_true", help="write the checkpoint again")
    p.add_argument("--quantized", default="none", choices=("none", "fp8"),
                   help="fp8: the same checkpoint with its layer weights FP8 block-quantized (128x128, as "
                        "DeepSeek-V3 ships), loaded as their values into the float32 model")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the single-process transformers forward on rank 0")
    p.add_argument("--timeout", type=float, default=900, help="seconds a rank waits for the others (its process group's timeout)")
    p.set_defaults(func=cmd_demo)
    return parser


def _regex(text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {error}") from None


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    from hp_dcp_hf.errors import HPDCPHFError

    if not isinstance(error, HPDCPHFError | ValueError | RuntimeError):
        text = f"{type(error).__name__}: {text}"
    return text if len(text) <= 400 else text[:400] + "... (--debug for all of it)"


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (``head`` exited): a ``BrokenPipeError`` from
    printing, not one from a connection to storage."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or stdout is no file
        return False


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that Python's flush at exit does not fail on the closed pipe
    again (and print "Exception ignored ... BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv  # for messages that repeat the command line
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if isinstance(error, BrokenPipeError) and _stdout_closed():  # `... | head`: the reader has what it wanted
            _discard_stdout()
            return 0
        if getattr(args, "debug", False):
            raise
        if not getattr(error, "reported", False):
            print(f"{PROG}: error: {_one_line(error)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
