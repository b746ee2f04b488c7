"""``hp-dcp-hf load PATH --mesh dp=2,tp=2 [--forward] [--verify] [--save-to DIR] [--json]``: the real load,
under torchrun, on ``--nproc-per-node N`` ranks this host starts (:mod:`.nproc`), or in one process;
then a per-rank table (bytes needed, read, received, the load's phases), with ``--verify`` the check
of the loaded shards against the checkpoint's bytes, and with ``--save-to`` the save."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hp_dcp_hf.tools.cli import nproc, save_to
from hp_dcp_hf.tools.cli.arguments import (
    NewCommand,
    add_layout_arguments,
    reader_options,
    transforms,
)
from hp_dcp_hf.tools.cli.messages import config_from_the_command_line, messages
from hp_dcp_hf.tools.cli.ranks import check_launch, init_distributed, launched_rank_and_world, say_once

_PHASES = ("metadata", "plan", "spans", "read", "copy", "exchange", "finalize")
"""The phases of a load the ``load`` table shows per rank (0 where a load has none)."""


def add_parser(new_command: NewCommand) -> None:
    parser = new_command("load", "the real load (under torchrun), with a per-rank table")
    add_layout_arguments(parser, None)
    parser.add_argument("--loader", default="dcp", choices=("dcp", "legacy"),
                        help="dcp: each rank reads only its shards' bytes; legacy: whole tensors, then slice")
    parser.add_argument("--forward", action="store_true", help="run one forward pass after loading")
    parser.add_argument("--verify", action="store_true",
                        help="after loading, compare every rank's shards with the checkpoint's bytes through the "
                             "save's mapping (each byte read once between the ranks); a difference fails naming "
                             "the tensor, the box and the file")
    save_to.add_arguments(parser)
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="start N ranks on this host (gloo) instead of running under torchrun; the mesh, "
                             "storage options and config.json are checked before any rank starts, and a failure "
                             "prints one line (default: the ranks torchrun launched, or one process)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.nproc_per_node is not None:
        with messages():
            return nproc.launch(args)
    rank, world = launched_rank_and_world()
    with messages(rank):
        return _load(args, rank, world)


def _load(args: argparse.Namespace, rank: int, world: int) -> int:
    """This rank's load (and save), the rows of every rank gathered, printed by rank 0."""
    mesh = args.mesh or f"dp={world}"
    if not check_launch(args, mesh, rank, world):
        return 1

    import torch.distributed as dist

    rank, world = init_distributed()
    try:
        model, loaded = _measured_load(args, mesh, rank)
        logits = _forward(model) if args.forward else None
        saved = save_to.save(args, model, loaded.reader, rank) if args.save_to else None
        rows: list[dict[str, Any]] = [{}] * world
        dist.all_gather_object(rows, _row(rank, loaded, saved))
    except Exception as error:
        if world > 1 and getattr(error, "rank", None) is not None and not getattr(args, "launched", False):
            say_once(error, rank)
        raise
    finally:
        dist.destroy_process_group()
    if rank == 0:
        _print(args, loaded.layout, rows, logits)
    return 0


@dataclass(frozen=True)
class _Loaded:
    """What one rank's load measured: its report, reader, planner class, layout and seconds."""

    report: Any
    reader: Any
    planner_cls: Any
    layout: list[str]
    total_s: float


def _measured_load(args: argparse.Namespace, mesh: str, rank: int) -> tuple[Any, _Loaded]:
    """``from_pretrained`` with a reader that records its requests and a planner that shows progress."""
    from hp_dcp_hf.integrations.transformers import from_pretrained
    from hp_dcp_hf.storage.read.recording import RecordingReader
    from hp_dcp_hf.tools.progress import progress_planner
    from hp_dcp_hf.tools.rank_plans import parallelize_for

    parallelize = parallelize_for(mesh)
    reader = RecordingReader(args.path, **reader_options(args))
    planner_cls = progress_planner(rank == 0, shard_bytes=True)
    start = time.perf_counter()
    with config_from_the_command_line():
        model, report = from_pretrained(
            args.path, dtype=args.dtype, transforms=transforms(args.transforms),
            parallelize=parallelize, loader=args.loader, strict=not args.no_strict,
            unexpected=args.unexpected, reader=reader, planner_cls=planner_cls, verify=args.verify,
        )
    return model, _Loaded(report, reader, planner_cls, parallelize.describe(), time.perf_counter() - start)


def _forward(model: Any) -> dict[str, Any]:
    """One forward pass of a fixed batch: the logits' shape, mean and whether they are finite."""
    import torch

    ids = torch.arange(16).reshape(2, 8) % model.config.vocab_size
    with torch.no_grad():
        out = model(input_ids=ids).logits
    return {"shape": list(out.shape), "mean": float(out.float().mean()), "finite": bool(out.isfinite().all())}


def _row(rank: int, loaded: _Loaded, saved: save_to.Saved | None) -> dict[str, Any]:
    """This rank's row of the table (every rank's are gathered to rank 0)."""
    from hp_dcp_hf.tools.rank_plans import reads_mapped

    report, reader, last = loaded.report, loaded.reader, loaded.planner_cls.last
    assert last is not None and last.shard_bytes is not None
    return {
        "rank": rank, "bytes_needed": last.shard_bytes, "bytes_read": report.read.bytes_read,
        "bytes_planned": report.plan.bytes_needed, "requests": report.read.requests,
        "mapped": reads_mapped(reader), "load_s": report.seconds["load"], "read_s": report.seconds["read"],
        "phases": {k: report.seconds.get(k, 0.0) for k in _PHASES},
        "total_s": loaded.total_s,
        "loaded": len(report.loaded_keys), "missing": len(report.missing_keys),
        "unexpected": len(report.unexpected_keys), "initialized": len(report.initialized_keys),
        "bytes_written": saved.bytes_written if saved else None, "save_s": saved.seconds if saved else None,
        "verified": dataclasses.asdict(report.verified) if report.verified is not None else None,
        "verify_s": report.seconds.get("verify"),
        # cooperating: what the rank received from the ranks that read it, and the checkpoint
        # bytes the whole cluster needs, each counted once (the same on every rank)
        "cooperating": reader.spans is not None, "bytes_received": reader.exchange.bytes_received,
        "bytes_needed_once": int(reader.spans.plan.needed.sum()) if reader.spans is not None else None,
    }


def _print(args: argparse.Namespace, layout: Sequence[str], rows: Sequence[dict[str, Any]],
           logits: dict[str, Any] | None) -> None:
    """Rank 0's output: JSON, or the layout, the table, the forward and the save."""
    from hp_dcp_hf.tools.formatting import fmt_bytes

    if args.json:
        print(json.dumps({"checkpoint": args.path, "layout": layout, "ranks": rows, "logits": logits}, indent=2))
        return
    for line in layout:
        print(f"layout: {line}")
    for line in _load_table(rows, legacy=args.loader == "legacy"):
        print(line)
    if logits is not None:
        print(f"forward: logits {logits['shape']}, mean {logits['mean']:.6f}, finite={logits['finite']}")
    if args.verify:
        print(_verified_line(rows))
    if args.save_to:
        print(f"saved to {args.save_to} as save_pretrained writes it, each rank its own bytes: "
              + ", ".join(f"rank {r['rank']} {fmt_bytes(r['bytes_written'])} in {r['save_s']:.2f} s" for r in rows)
              + f"; {fmt_bytes(sum(r['bytes_written'] for r in rows))} in all")


def _verified_line(rows: Sequence[dict[str, Any]]) -> str:
    """What ``--verify`` compared over all ranks (it raised had anything differed)."""
    from hp_dcp_hf.tools.formatting import fmt_bytes

    checked = [r["verified"] for r in rows]
    absent = checked[0]["absent"]
    return (f"verified: {sum(c['slices'] for c in checked)} slices of the checkpoint's tensors, "
            f"{fmt_bytes(sum(c['bytes_compared'] for c in checked))} in the model's dtype, equal to the checkpoint's; "
            f"{fmt_bytes(sum(c['read']['bytes_read'] for c in checked))} read from storage in "
            f"{max(r['verify_s'] for r in rows):.2f} s"
            + (f"; {len(absent)} tensors not in the checkpoint, not compared: {', '.join(absent[:5])}" if absent else ""))


def _load_table(rows: Sequence[dict[str, Any]], *, legacy: bool) -> list[str]:
    """``load``'s per-rank table and the lines after it: each rank's bytes needed, read from storage
    and (cooperating) received from peers; the amplification named for what it divides."""
    from hp_dcp_hf.tools.formatting import RUNS_NOTE, fmt_bytes, requests_column, table

    mapped, cooperating = rows[0]["mapped"], rows[0]["cooperating"]
    received = ("received from peers",) if cooperating else ()
    lines = [table(("rank", "bytes needed", "read from storage", *received, requests_column(mapped), "load s",
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
        lines.append(RUNS_NOTE)
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
