"""Run one function on N gloo ranks in fresh processes and collect what each returns.

For tests, benchmarks and one-machine demos: each rank sets up the default process group over TCP
on 127.0.0.1 and runs ``fn(rank, world_size, *args)``; ``fn`` must be a module-level function of
an importable module, since the rank processes import it by name (they fork from a server that has
imported torch once, and get the launcher's environment and working directory):

    def _check(rank: int, world_size: int, path: str) -> int:
        ...                                  # the default process group is up (gloo, CPU)
        return something_picklable

    results = run_ranks(2, _check, path)     # [rank 0's return, rank 1's return]

A rank that raises makes ``run_ranks`` raise that exception (when it unpickles; ``RankFailed``
otherwise) with the rank's traceback attached and ``error.rank`` the rank it came from. When every
rank raises one cause (the package's collectives make the others raise a copy of the failing rank's
error, ``error.rank`` naming it), the failing rank's own error is raised, whichever rank reported
first; else the earliest failure. A rank that has not answered after ``timeout``
seconds fails the call with ``TimeoutError``, one that dies without answering with ``RankFailed``.
Return values travel pickled by value (a tensor sent through torch's queue would be shared memory
that dies with its process). Every process is ended before ``run_ranks`` returns.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_GRACE_S = 2.0
"""After a first failure, how long to wait for the other ranks' reports before raising."""


class RankFailed(RuntimeError):
    """A rank raised an exception that could not be sent back as itself."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_PRELOAD = ["torch", "torch.distributed.checkpoint"]
"""What the rank server imports once: torch and its DCP are most of a fresh rank's start (about 5 s
of CPU each on the CI machines); modules that read the environment when imported (transformers,
huggingface_hub) are left to each rank."""


def _context() -> Any:
    """Ranks fork from a server that imported :data:`_PRELOAD` once per launching process, instead
    of each spawned rank importing it again; they get the launcher's environment and directory as
    a spawned rank would (:func:`_worker`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(
    rank: int, world_size: int, port: int, timeout: float, fn: Callable, args: tuple, results: Any,
    environ: dict[str, str], cwd: str,
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores
    ok, cause = False, rank
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        # Pickled here, not in the queue's feeder thread, so an unpicklable value fails loudly.
        payload, ok, text = pickle.dumps(fn(rank, world_size, *args)), True, ""
    except BaseException as error:  # everything goes back to the parent, KeyboardInterrupt too
        text = traceback.format_exc()
        named = getattr(error, "rank", None)  # the rank the error says it came from
        cause = named if isinstance(named, int) else rank
        try:
            payload = pickle.dumps(error)
            pickle.loads(payload)
        except Exception:
            payload = pickle.dumps(RankFailed(f"{type(error).__name__}: {error}"))
    # Report before tearing the group down: teardown makes peers blocked in collectives fail too,
    # and the parent must see the first failure, not its echoes.
    results.put((rank, ok, payload, text, time.time(), cause))
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class _Failure:
    """A rank's report that it raised: ``cause`` is the rank its error says it came from."""

    rank: int
    cause: int
    when: float
    payload: bytes
    text: str


def _the_cause(failures: list[_Failure], world_size: int) -> BaseException:
    """The error to raise for ``failures``: a rank's own error before another rank's copy of it,
    then the earliest (later ones are usually peers losing their connection), with ``rank`` set
    to the rank it came from and that rank's traceback as a note."""
    first = min(failures, key=lambda f: (f.rank != f.cause, f.when))
    error = pickle.loads(first.payload)
    with contextlib.suppress(AttributeError):  # an exception type without a __dict__
        error.rank = first.cause
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(f"raised on rank {first.rank} of {world_size}:\n{first.text}")
    return error


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; the list of their return values."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    environ, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, timeout, fn, args, results, environ, cwd),
                    daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    failures: list[_Failure] = []
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(failures) < world_size:
            if time.monotonic() > deadline:
                if failures:
                    break  # the grace period after a failure is over: raise it
                missing = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(f"ranks {missing} gave no result within {timeout} s")
            dead = [r for r, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
            if dead and results.empty() and not failures:
                raise RankFailed(f"ranks {dead} exited with codes {[procs[r].exitcode for r in dead]}")
            try:
                rank, ok, payload, text, when, cause = results.get(timeout=0.2)
            except queue.Empty:
                continue
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                failures.append(_Failure(rank, cause, when, payload, text))
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        if failures:
            raise _the_cause(failures, world_size)
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(values) == world_size else 0)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        results.close()
    return [values[rank] for rank in range(world_size)]
