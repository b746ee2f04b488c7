"""Run a function on N gloo ranks in spawned processes and collect what each returns.

Usage from a test module (``fn`` must be a module-level function of an importable module, since
spawned processes import it by name; tests are importable as ``tests.dist.<module>``):

    def _check(rank: int, world_size: int, path: str) -> int:
        ...                                  # the default process group is up (gloo, CPU)
        return something_picklable

    def test_it(tmp_path):
        results = run_ranks(2, _check, str(tmp_path))   # [rank 0's return, rank 1's return]

A rank that raises makes ``run_ranks`` raise that exception (when it unpickles; ``RankFailed``
otherwise) with the rank's traceback text attached; a rank that has not answered after ``timeout``
seconds fails the call with ``TimeoutError``, one that dies without answering with ``RankFailed``. Every process is ended before ``run_ranks`` returns.
"""

from __future__ import annotations

import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank raised an exception that could not be sent back as itself."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, timeout: float, fn: Callable, args: tuple, results: Any) -> None:
    torch.set_num_threads(1)  # N ranks share few cores: no intra-op oversubscription
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value, ""))
    except BaseException as error:  # everything goes back to the parent, KeyboardInterrupt too
        text = traceback.format_exc()
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:
            error = RankFailed(f"{type(error).__name__}: {error}")
        results.put((rank, False, error, text))


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; the list of their return values."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, timeout, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            missing = sorted(set(range(world_size)) - set(values))
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {missing} gave no result within {timeout} s")
            dead = [r for r in missing if procs[r].exitcode not in (None, 0)]
            if dead and results.empty():
                raise RankFailed(f"ranks {dead} exited with codes {[procs[r].exitcode for r in dead]}")
            try:
                rank, ok, value, text = results.get(timeout=0.5)
            except queue.Empty:
                continue
            if not ok:
                value.add_note(f"raised on rank {rank} of {world_size}:\n{text}")
                raise value
            values[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(values) == world_size else 0)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        results.close()
    return [values[rank] for rank in range(world_size)]
