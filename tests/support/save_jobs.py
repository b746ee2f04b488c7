"""Real save jobs to kill: ``save_hf_checkpoint`` on ``world`` gloo ranks, each a real process.

Importing torch and transformers takes seconds, so a :class:`Zygote` process imports them once and
forks every job's ranks from itself (it runs no torch op and starts no thread before forking).
A job may carry a fault point: rank ``kill.rank`` SIGKILLs itself at the ``kill.call``-th call of
the destination step ``kill.op`` (``before`` or ``after`` it runs); a job with ``trace`` logs
rank 0's steps, so a test can kill at each of them. With ``whole`` the zygote
then kills the job's other ranks, as torchrun does; otherwise they live on and report how their
save ended. The test process may also SIGKILL ranks itself at any instant (their pids are given).

Each rank writes ``{"ok": true}`` or its error's type and message to ``<out>/<rank>.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHARD = "40KB"
"""Files of the job's model (a tiny llama, 3 files at this size)."""


def build_model(seed: int) -> Any:
    """The tiny llama of a job, with seeded values (the same on every rank)."""
    from tests.support.families import build_family_model

    return build_family_model("llama", seed=seed)


STEPS = ("lock", "recover", "stage_files", "write", "check_staged", "write_text", "commit", "copy", "remove",
         "after_publish", "unlock")
"""The destination calls a save makes that change the path (or guard it): the fault points."""


def _fault(job: dict[str, Any], rank: int) -> None:
    """Install the job's fault point (and its trace of steps, on rank 0) on the destination classes."""
    kill = job.get("kill")
    trace = Path(job["out"], "trace.txt") if job.get("trace") and rank == 0 else None
    if not (kill and kill["rank"] == rank) and trace is None:
        return
    from hp_dcp_hf.storage.write.destination import Destination, Directory
    from hp_dcp_hf.storage.write.multipart import MultipartUploads

    calls: dict[str, int] = {}
    for op in STEPS:
        for cls in (Destination, Directory, MultipartUploads):
            real = cls.__dict__.get(op)
            if real is None or getattr(real, "__isabstractmethod__", False):
                continue

            def wrapped(self, *args, _real=real, _op=op, **kwargs):
                calls[_op] = calls.get(_op, 0) + 1
                if trace is not None:
                    with trace.open("a") as log:
                        log.write(f"{_op} {calls[_op]}\n")
                hit = kill is not None and kill["rank"] == rank and (kill["op"], kill["call"]) == (_op, calls[_op])
                if hit and kill["when"] == "before":
                    _strike(job, rank)
                result = _real(self, *args, **kwargs)
                if hit:
                    _strike(job, rank)
                return result

            setattr(cls, op, wrapped)


def _strike(job: dict[str, Any], rank: int) -> None:
    """The fault: this rank dies, or with ``action: kill peer`` every other rank of the job does."""
    if job["kill"].get("action") != "kill peer":
        os.kill(os.getpid(), signal.SIGKILL)
    pids = json.loads(Path(job["out"], "pids.json").read_text())
    for other, pid in enumerate(pids):
        if other != rank:
            with contextlib.suppress(ProcessLookupError):  # reaped already: the zygote saw it die
                os.kill(pid, signal.SIGKILL)
            while not _dead(pid):
                time.sleep(0.01)


def _dead(pid: int) -> bool:
    """A zombie (until the zygote reaps it), or gone: reaped between two looks at /proc."""
    try:
        return "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return True


def _run_rank(job: dict[str, Any], rank: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hp_dcp_hf

    world = job["world"]
    result: dict[str, Any]
    try:
        if world > 1:
            store = dist.FileStore(job["store"], world)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=__import__("datetime").timedelta(seconds=60))
        model = build_model(job["seed"])
        if world > 1:
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        _fault(job, rank)
        hp_dcp_hf.save_hf_checkpoint(model, job["path"], max_shard_size=job.get("shard", SHARD),
                                     **job.get("options", {}))
        result = {"ok": True}
    except Exception as e:  # noqa: BLE001 - reported to the test, which checks the type
        result = {"ok": False, "error": type(e).__name__, "message": str(e)}
    temporary = Path(job["out"], f"{rank}.json.tmp")  # a kill while writing leaves no half result
    temporary.write_text(json.dumps(result))
    os.replace(temporary, Path(job["out"], f"{rank}.json"))


def _fork_rank(job: dict[str, Any], rank: int) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _run_rank(job, rank)
        except BaseException:  # noqa: BLE001 - a forked child never returns into the zygote's loop
            code = 1
        finally:
            sys.stdout.flush()
            os._exit(code)
    return pid


def _wait(pids: list[int], whole: bool) -> list[int]:
    """Each rank's exit: its code, or minus the signal that killed it."""
    statuses: dict[int, int] = {}
    while len(statuses) < len(pids):
        pid, status = os.wait()
        if pid not in pids:
            continue
        statuses[pid] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if whole and statuses[pid] == -signal.SIGKILL:  # the launcher tears the job down
            for other in pids:
                if other not in statuses:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGKILL)
    return [statuses[pid] for pid in pids]


def serve() -> None:
    """The zygote's loop: one JSON job a line on stdin; prints the pids, then the exits."""
    import s3fs  # noqa: F401 - S3 jobs: imports only, its event loop starts after the fork
    import torch  # noqa: F401 - imported once here, for every fork
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import transformers  # noqa: F401

    import hp_dcp_hf  # noqa: F401
    import hp_dcp_hf.load.api  # noqa: F401 - the package's own lazy imports too
    import hp_dcp_hf.storage.write.multipart  # noqa: F401
    from tests.support.families import family_model_class, tiny_family_config

    tiny_family_config("llama"), family_model_class("llama")  # transformers' lazy imports; no torch op

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        pids = [_fork_rank(job, rank) for rank in range(job["world"])]
        Path(job["out"], "pids.json").write_text(json.dumps(pids))
        print(json.dumps({"pids": pids}), flush=True)
        print(json.dumps({"exits": _wait(pids, job.get("whole", True))}), flush=True)


class Zygote:
    """The test side: start the zygote, run jobs through it."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.jobs = 0
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.process = subprocess.Popen([sys.executable, "-m", "tests.support.save_jobs"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)
        assert self._answer() == {"ready": True}

    def _answer(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the save-job zygote died")
        return json.loads(line)

    def start(self, path: str, seed: int, *, world: int = 2, kill: dict[str, Any] | None = None,
              whole: bool = True, options: dict[str, Any] | None = None, shard: str = SHARD,
              trace: bool = False) -> Job:
        self.jobs += 1
        out = self.workdir / f"job-{self.jobs}"
        out.mkdir(parents=True)
        job = {"path": path, "seed": seed, "world": world, "kill": kill, "whole": whole, "shard": shard,
               "options": options or {}, "out": str(out), "store": str(out / "store"), "trace": trace}
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        return Job(self, out, self._answer()["pids"], time.perf_counter())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


class Job:
    """A running job: its ranks' pids; :meth:`wait` gives their exits and results."""

    def __init__(self, zygote: Zygote, out: Path, pids: list[int], started: float) -> None:
        self.zygote, self.out, self.pids, self.started = zygote, out, pids, started

    def wait(self) -> tuple[list[int], list[dict[str, Any] | None], float]:
        """Each rank's exit (minus the signal that killed it), result (None if killed), the seconds."""
        exits = self.zygote._answer()["exits"]
        seconds = time.perf_counter() - self.started
        results = []
        for rank in range(len(self.pids)):
            file = self.out / f"{rank}.json"
            results.append(json.loads(file.read_text()) if file.exists() else None)
        return exits, results, seconds


if __name__ == "__main__":
    serve()
