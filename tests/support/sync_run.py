"""Run :mod:`tests.support.sync_trainer` under ``torchrun`` against an engine's RL routes and check
the engine after every update: the driver of the tests in which trainers in the main venv update
a vLLM engine in this process (tests/vllm).

The trainer's environment: the main venv's python (``HP_DCP_HF_TRAINER_PYTHON``, as ``make
test-vllm`` sets it), the repository first on ``PYTHONPATH``, one OpenMP thread per rank, and none
of the in-process engine's variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from hp_dcp_hf.tools.launch import free_port

REPO = Path(__file__).resolve().parents[2]
TRAINER_PYTHON = os.environ.get("HP_DCP_HF_TRAINER_PYTHON", str(REPO / ".venv" / "bin" / "python"))


def _wait(path: Path, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def run_trainers(url: str, checkpoint: Path, workdir: Path, world: int, args: Sequence[str],
                 check: Callable[[int, Path, list[dict]], None], *, updates: int = 2,
                 timeout_s: float = 300.0, torchrun_args: Sequence[str] = ()) -> tuple[int, str]:
    """Run ``world`` trainer ranks on ``checkpoint`` (``args``: more sync_trainer options,
    ``torchrun_args``: torchrun's) against the engine at ``url``. After update K has been saved,
    ``check(K, saved_files, figures)`` runs (figures: each rank's JSON) before the trainers go on.
    Returns how many updates were checked and the trainers' log; the figures of every update stay
    in ``workdir / "trainer"``."""
    trainer_dir = workdir / "trainer"
    trainer_dir.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):
        env.pop(name, None)
    command = [TRAINER_PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-port", str(free_port()), *torchrun_args, "-m", "tests.support.sync_trainer",
               "--checkpoint", str(checkpoint), "--engine", url, "--workdir", str(trainer_dir),
               "--updates", str(updates), *args]
    checked = 0
    log_path = workdir / "trainer.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            for update in range(1, updates + 1):
                if not _wait(trainer_dir / f"saved{update}", proc, timeout_s):
                    break
                figures = [json.loads((trainer_dir / f"rank{r}-update{update}.json").read_text())
                           for r in range(world)]
                check(update, trainer_dir / f"update{update}", figures)
                checked += 1
                (trainer_dir / f"continue{update}").touch()
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:  # torchrun stops its ranks (each in a session of its own) on SIGTERM
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return checked, log_path.read_text()


class Oracles:
    """The oracle of each update: a fresh engine (:func:`tests.support.engine.fresh_engine_snapshot`,
    ``engine_options`` as it takes them) on the trainers' saved files, computed once per update
    number. The trainers of every layout must have saved the same tensors, which each call checks:
    then one fresh engine per update serves every layout's test."""

    def __init__(self, root: Path, **engine_options) -> None:
        self.root = root
        self.engine_options = engine_options
        self._by_update: dict[int, tuple[dict, object]] = {}

    def __call__(self, update: int, files: Path):
        from tests.support.engine import differing, fresh_engine_snapshot
        from tests.support.models import read_checkpoint

        tensors = read_checkpoint(files)
        if update not in self._by_update:
            self._by_update[update] = tensors, fresh_engine_snapshot(files, self.root / f"oracle{update}",
                                                                     **self.engine_options)
        saved, oracle = self._by_update[update]
        assert differing(tensors, saved) == [], "the trainers of two layouts saved different weights"
        return oracle

    def seen(self, update: int):
        """The oracle of an update an earlier check computed."""
        return self._by_update[update][1]


def check_update(llm, oracles: Oracles, update: int, files: Path, ranks: list[dict], initial):
    """What every update of an in-process engine (tensor_parallel_size 1) must satisfy: no rank
    failed; bytes sent by the ranks = bytes the worker received = bytes it needs; every effective
    weight as the oracle's, bit for bit; the oracle's generations, which differ from ``initial``
    (the engine's before any update). Returns the engine's snapshot and receiver for more checks."""
    from tests.support.engine import differing, snapshot, transfer_engine

    assert not [r for r in ranks if "error" in r], ranks
    oracle = oracles(update, files)
    receiver = transfer_engine(llm).receiver
    assert sum(r["bytes_sent"] for r in ranks) == receiver.stats.bytes_received == receiver.needed_bytes
    state = snapshot(llm)
    assert differing(state.weights, oracle.weights) == [], update
    assert state.generations == oracle.generations != initial
    return state, receiver
