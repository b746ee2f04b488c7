"""What gloo alone takes to move a cooperative load's exchanged bytes between ranks of one host.

``python -m bench.gloo_floor [--ranks 4] [--mib 1086] [--round-mib 10] [--reps 3]``

A cooperative load on CPU moves the bytes owners send through gloo (``all_to_all_single`` rounds,
:mod:`hp_dcp_hf.storage.read.exchange`), over loopback TCP between the ranks of one host. Here the
same number of bytes (``--mib``: all ranks together, as ``exchanged`` in ``bench/remote``'s tables)
moves as each rank sending its twin (rank ``r`` and ``r + ranks / 2``: HSDP with two replicas) in
rounds of ``--round-mib`` per peer, each a counts collective and a data one, with no reads, copies
or planning around them: the floor of the exchange phase on this transport. One line of JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

MIB = 2**20


def _rank(rank: int, world: int, per_rank: int, round_bytes: int, reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    twin = (rank + world // 2) % world
    send = torch.ones(round_bytes, dtype=torch.uint8)
    receive = torch.empty(round_bytes, dtype=torch.uint8)
    sizes = [round_bytes if peer == twin else 0 for peer in range(world)]
    seconds = []
    for _ in range(reps + 1):  # the first: connections and buffers warmed
        dist.barrier()
        start = time.perf_counter()
        for _ in range(-(-per_rank // round_bytes)):
            counts = torch.tensor([[n, 0, 1, 0, 0] for n in sizes], dtype=torch.int64)
            dist.all_to_all_single(torch.empty_like(counts), counts)
            dist.all_to_all_single(receive, send, output_split_sizes=sizes, input_split_sizes=sizes)
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    return {"rank": rank, "seconds": seconds[1:]}


def main(argv: list[str] | None = None) -> int:
    from hp_dcp_hf.tools.launch import run_ranks

    p = argparse.ArgumentParser(prog="python -m bench.gloo_floor", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mib", type=float, default=1086.0, help="bytes exchanged, all ranks together (MiB)")
    p.add_argument("--round-mib", type=float, default=10.0, help="bytes a rank sends a peer per round (MiB)")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if args.ranks < 2 or args.ranks % 2:
        p.error("--ranks: an even number, at least 2 (each rank has a twin)")
    per_rank = int(args.mib * MIB / args.ranks)
    ranks = run_ranks(args.ranks, _rank, per_rank, int(args.round_mib * MIB), args.reps, timeout=600)
    wall = statistics.median(max(r["seconds"][i] for r in ranks) for i in range(args.reps))
    print(json.dumps({"ranks": args.ranks, "exchanged_mib": args.mib, "round_mib": args.round_mib,
                      "seconds": round(wall, 3), "gb_per_s": round(args.mib * MIB / wall / 1e9, 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
