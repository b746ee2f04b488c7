"""Trainer ranks update a real vLLM CPU engine through the ``hp_dcp_hf`` backend, and the engine
then computes exactly what the same engine loaded from the trainer's saved files computes.

The engine runs in this process (vLLM's venv); the trainers run under ``torchrun`` in the project's
main venv (no vLLM there, and transformers' TP plans of a newer release), as trainers and engines
do: separate environments, one HTTP control plane (vLLM's RL routes, :mod:`tests.support.rl_server`).
They load checkpoint B into fused-qkv / gate-up llama or grouped-expert qwen3_moe models under
TP, FSDP2, FSDP2 x TP and EP, and update an engine started on checkpoint A twice: B itself, then B
after a step that changes layer 0's attention. Oracle: a fresh engine, in a process of its own, on
the trainer's ``save_hf_checkpoint`` of the same weights (bit-identical to ``save_pretrained``'s,
tested in the main suite): every effective weight bit for bit, and the greedy generations.
Bytes are counted on both sides: each trainer rank sends what it holds, the engine receives what
it needs, once.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from hp_dcp_hf.tools.launch import free_port
from tests.support.engine import (
    differing,
    fresh_engine_snapshot,
    make_engine_checkpoint,
    shutdown_engine,
    snapshot,
    start_engine,
)
from tests.support.models import read_checkpoint
from tests.support.rl_server import RLServer

REPO = Path(__file__).resolve().parents[2]
TRAINER_PYTHON = os.environ.get("HP_DCP_HF_TRAINER_PYTHON", str(REPO / ".venv" / "bin" / "python"))
CHANGED = "self_attn"  # layer 0's q, k, v, o projections: what the trainer's step changes


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def engine(request, tmp_path_factory):
    """One engine per model type, started on checkpoint A; the trainers load checkpoint B."""
    from hp_dcp_hf.integrations.vllm import plugin

    plugin.register()
    root = tmp_path_factory.mktemp(request.param)
    initial = make_engine_checkpoint(request.param, root / "A", seed=0)
    trained = make_engine_checkpoint(request.param, root / "B", seed=1)
    llm = start_engine(initial, weight_transfer_config={"backend": "hp_dcp_hf"})
    server = RLServer(llm)
    yield {"llm": llm, "server": server, "trained": trained, "root": root, "oracles": {}}
    server.close()
    shutdown_engine(llm)


def _transfer_engine(llm):
    worker = llm.llm_engine.model_executor.driver_worker.worker
    return worker.weight_transfer_engine


def _oracle(engine, update: int, files: Path):
    """The fresh engine's snapshot of the trainer's files of ``update``, computed once per model:
    every layout's trainer must have saved the same bytes (checked here)."""
    tensors = read_checkpoint(files)
    cached = engine["oracles"].get(update)
    if cached is None:
        cached = engine["oracles"][update] = (tensors, fresh_engine_snapshot(files, engine["root"] / f"oracle{update}"))
    assert differing(tensors, cached[0]) == [], "the trainers of two layouts saved different weights"
    return cached[1]


def _wait(path: Path, proc: subprocess.Popen, timeout_s: float = 240.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _train(engine, tmp_path: Path, layout: str, world: int, *, delta: bool = False, die_rank: int = -1):
    """Run the trainers; after each update compare the engine against the oracle. Returns the
    per-update figures of every rank and of the engine's worker."""
    workdir = tmp_path / "trainer"
    workdir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):
        env.pop(name, None)
    command = [TRAINER_PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-port", str(free_port()), "-m", "tests.support.sync_trainer",
               "--checkpoint", str(engine["trained"]), "--engine", engine["server"].url, "--workdir", str(workdir),
               "--layout", layout] + (["--delta"] if delta else []) + ["--die-rank", str(die_rank)]
    figures = []
    with open(tmp_path / "trainer.log", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            for update in (1, 2):
                if not _wait(workdir / f"saved{update}", proc):
                    break
                ranks = [json.loads((workdir / f"rank{r}-update{update}.json").read_text()) for r in range(world)]
                received = _transfer_engine(engine["llm"]).receiver.stats
                state, oracle = snapshot(engine["llm"]), _oracle(engine, update, workdir / f"update{update}")
                assert differing(state.weights, oracle.weights) == [], (layout, update)
                assert state.generations == oracle.generations
                figures.append((ranks, received))
                (workdir / f"continue{update}").touch()
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    return figures, workdir, (tmp_path / "trainer.log").read_text()


LAYOUTS = {"llama": [("tp", 2), ("fsdp", 2), ("fsdp_tp", 4)], "qwen3_moe": [("ep", 4)]}


@pytest.mark.parametrize("case", range(3))
def test_updates_equal_a_fresh_engine_on_the_saved_weights(engine, tmp_path, case):
    layouts = LAYOUTS[engine["llm"].llm_engine.model_config.hf_config.model_type]
    if case >= len(layouts):
        pytest.skip("this model type has fewer layouts")  # the parametrization is shared by both types
    layout, world = layouts[case]
    figures, _, log = _train(engine, tmp_path, layout, world)
    assert len(figures) == 2, log[-4000:]
    for ranks, received in figures:
        assert sum(r["bytes_sent"] for r in ranks) == received.bytes_received  # counted on both sides
        assert received.bytes_received == _transfer_engine(engine["llm"]).receiver.needed_bytes
        assert [r["bytes_sent"] for r in ranks] == [r["held_bytes"] for r in ranks]  # TP 1: all it holds
