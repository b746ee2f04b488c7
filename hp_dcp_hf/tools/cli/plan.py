"""``hp-dcp-hf plan PATH --mesh dp=2,tp=2 [--transforms ...] [--items] [--json]``: every rank's reads,
without a process group and without reading tensor data.

It builds the model from the checkpoint's config on the meta device once per rank, under torch's
``fake`` process group with that rank's number, applies the rewrites and the layout of
:func:`hp_dcp_hf.tools.rank_plans.parallelize_for` (the same layout ``load`` and ``demo`` use), and
asks :class:`HFMappingPlanner` for the rank's ReadItems; the requests are those
:class:`HFStorageReader` issues for them (same coalescing and staging budget).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from hp_dcp_hf.tools.cli.arguments import NewCommand, add_layout_arguments, reader_options, transforms
from hp_dcp_hf.tools.cli.messages import config_from_the_command_line, with_messages


def add_parser(new_command: NewCommand) -> None:
    parser = new_command("plan", "every rank's reads, without a process group or data")
    add_layout_arguments(parser, "dp=2,tp=2")
    parser.add_argument("--items", action="store_true", help="list every read item")
    parser.set_defaults(func=run)


@with_messages
def run(args: argparse.Namespace) -> int:
    from hp_dcp_hf.tools.formatting import RUNS_NOTE, fmt_bytes, requests_column, table
    from hp_dcp_hf.tools.rank_plans import RankPlan, plan_ranks

    with config_from_the_command_line():
        result = plan_ranks(
            args.path, args.mesh, transforms=transforms(args.transforms), dtype=args.dtype,
            strict=not args.no_strict, unexpected=args.unexpected, with_items=args.items, **reader_options(args),
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
              requests_column(result["mapped"]), "deferred")
    if result["quantization"]:
        print(f"  quantized checkpoint ({result['quantization']}): read as values, weight boxes with their scale blocks")
        rows = [(*row, fmt_bytes(r.quantized_bytes), fmt_bytes(r.scale_bytes)) for row, r in zip(rows, ranks)]
        header = (*header, "quantized", "scales")
    if result["cooperative"]:
        rows = [(*row, fmt_bytes(r.bytes_from_peers), fmt_bytes(r.bytes_to_peers)) for row, r in zip(rows, ranks)]
        header = (*header, "received from peers", "sent to peers")
    print(table(header, rows))
    if result["mapped"]:
        print(RUNS_NOTE)
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
    from hp_dcp_hf.tools.formatting import fmt_bytes

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
                     "reads each byte once (the default, auto, does on remote stores and shared file systems where that pays)")
    return lines


def _unexpected_line(keys: Sequence[str]) -> str:
    from hp_dcp_hf.load.planner import describe_keys

    return (f"{len(keys)} checkpoint tensors make no model tensor: {describe_keys(keys)} "
            "(--unexpected ignore silences this, raise refuses the load)")
