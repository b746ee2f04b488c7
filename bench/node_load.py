"""One rank of the multi-node smoke: ``torchrun ... -m bench.node_load --path CKPT --out FILE``.

Every rank builds the checkpoint's model in the benchmark layout (``dp`` across the two
launchers, ``tp`` inside each), loads it with this project's loader, then with the legacy loader
as the reference, and rank 0 writes one JSON document with every rank's figures (host, node and
local rank, time, bytes needed and read, requests, and whether its shards equal legacy's).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch.distributed as dist

from bench import layouts, measure
from bench.contenders import Job, build_model, project_load, refill_nan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.node_load")
    parser.add_argument("--path", required=True)
    parser.add_argument("--kind", default="dense")
    parser.add_argument("--mesh", default=None, help="default: dp=<nodes>,tp=<ranks per node>")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    mesh = layouts.parse_mesh(args.mesh) if args.mesh else {"dp": world // local, "tp": local}
    job = Job("dcp", args.kind, args.path, mesh, reps=1, threads=args.threads, warmup=0)
    try:
        model = build_model(job)
        with measure.timed_across_ranks() as timer:
            counts = project_load(model, job, trace=True)
        ours = measure.digests(model)
        refill_nan(model)
        project_load(model, job, trace=False)
        row = {"rank": rank, "host": socket.gethostname(), "node_rank": int(os.environ.get("GROUP_RANK", -1)),
               "local_rank": int(os.environ.get("LOCAL_RANK", -1)), "wall_s": timer.wall_s, "own_s": timer.own_s,
               "bytes_needed": counts["bytes_needed"], "bytes_read": counts["bytes_read"],
               "requests": counts["requests"], "mismatched": measure.compare_digests(ours, measure.digests(model))}
        rows: list = [None] * world
        dist.all_gather_object(rows, row)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        doc = {"world": world, "mesh": layouts.mesh_label(mesh), "checkpoint": args.path, "ranks": rows,
               "correct": all(not r["mismatched"] for r in rows), "finished": time.time()}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
