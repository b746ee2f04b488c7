"""Run one function on N gloo ranks (spawned processes) and collect what each returns.

The benchmark's own small launcher (benchmarks import nothing from ``tests/``): each rank sets up
the default process group over TCP on 127.0.0.1, runs ``fn(rank, world, *args)`` and sends back
its return value or its traceback. Ranks share the machine's cores: torch gets
``cores // world`` intra-op threads per rank (at least one).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, timeout: float, fn: Callable, args: tuple, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        # Pickled here (by value): a tensor sent through torch's queue would be shared memory that
        # dies with this process.
        results.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # everything goes back to the parent, as text
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 1800) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; their return values by rank.

    Raises :class:`RankError` with the first failing rank's traceback, ``TimeoutError`` when a rank
    has not answered within ``timeout`` seconds. Every process is ended before returning.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, timeout, fn, args, results), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(values))} gave no result in {timeout:.0f} s")
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise RankError(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})") from None
                continue
            if not ok:
                raise RankError(f"rank {rank} of {world} failed:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=10 if len(values) == world else 0)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        results.close()
    return [values[r] for r in range(world)]
