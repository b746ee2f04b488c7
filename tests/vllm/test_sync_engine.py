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
from pathlib import Path

import pytest

from tests.support.engine import (
    differing,
    make_engine_checkpoint,
    shutdown_engine,
    snapshot,
    start_engine,
    worker_call,
    worker_transfer_stats,
)
from tests.support.models import read_checkpoint
from tests.support.rl_server import RLServer
from tests.support.sync_run import Oracles, run_trainers

CHANGED = "self_attn"  # layer 0's q, k, v, o projections: what the trainer's step changes


@pytest.fixture(scope="module")
def engine(request, tmp_path_factory):
    """One engine per (model type, tensor_parallel_size) (tests select it by indirect
    parametrization; pytest keeps one alive at a time), started on checkpoint A; the trainers
    load checkpoint B."""
    from hp_dcp_hf.integrations.vllm import plugin

    model_type, tp = request.param
    plugin.register()
    root = tmp_path_factory.mktemp(f"{model_type}-tp{tp}")
    initial = make_engine_checkpoint(model_type, root / "A", seed=0)
    trained = make_engine_checkpoint(model_type, root / "B", seed=1)
    llm = start_engine(initial, weight_transfer_config={"backend": "hp_dcp_hf"}, tensor_parallel_size=tp)
    server = RLServer(llm)
    yield {"llm": llm, "server": server, "trained": trained, "oracles": Oracles(root, tensor_parallel_size=tp),
           "tp": tp, "model_type": model_type}
    server.close()
    shutdown_engine(llm)


def _received(engine) -> list[dict[str, int]]:
    """Each engine worker's figures of the last update."""
    return worker_call(engine["llm"], worker_transfer_stats)


def _train(engine, tmp_path: Path, layout: str, world: int, *, delta: bool = False, die_rank: int = -1,
           torchrun_args=()):
    """Run the trainers; after each update compare the engine against the oracle. Returns each
    checked update's figures (every rank's, every engine worker's) and the trainers' log."""
    figures = []

    def check(update: int, files: Path, ranks: list[dict]) -> None:
        workers = _received(engine)
        state, oracle = snapshot(engine["llm"]), engine["oracles"](update, files)
        assert differing(state.weights, oracle.weights) == [], (layout, update)
        assert state.generations == oracle.generations
        figures.append((ranks, workers))

    args = ["--layout", layout, "--die-rank", str(die_rank)] + (["--delta"] if delta else [])
    _, log = run_trainers(engine["server"].url, engine["trained"], tmp_path, world, args, check,
                          torchrun_args=torchrun_args)
    return figures, log


LLAMA, MOE, LLAMA_TP2 = ("llama", 1), ("qwen3_moe", 1), ("llama", 2)  # engines: (model type, TP)
UPDATES = [  # (engine, the trainers' layout, trainer ranks)
    (LLAMA, "tp", 2), (LLAMA, "fsdp", 2), (LLAMA, "fsdp_tp", 4),
    (MOE, "ep", 4), (MOE, "fsdp", 2),
    (LLAMA_TP2, "tp", 2), (LLAMA_TP2, "fsdp_tp", 4),
]


def _checkpoint_bytes(path: Path) -> int:
    return sum(t.numel() * t.element_size() for t in read_checkpoint(path).values())


@pytest.mark.parametrize("engine,layout,world", UPDATES, indirect=["engine"],
                         ids=[f"{m}-engine-tp{tp}-{layout}{world}" for (m, tp), layout, world in UPDATES])
def test_updates_equal_a_fresh_engine_on_the_saved_weights(engine, tmp_path, layout, world):
    figures, log = _train(engine, tmp_path, layout, world)
    assert len(figures) == 2, log[-4000:]
    whole = _checkpoint_bytes(engine["trained"])
    for ranks, workers in figures:
        received = sum(w["bytes_received"] for w in workers)
        assert sum(r["bytes_sent"] for r in ranks) == received  # counted on both sides
        assert [w["bytes_received"] for w in workers] == [w["needed_bytes"] for w in workers]
        if engine["tp"] == 1:  # one worker consumes everything: each rank sends all it holds
            assert [r["bytes_sent"] for r in ranks] == [r["held_bytes"] for r in ranks]
            assert received == whole
        else:  # each worker receives its slice only: matrices split, vectors (norms) on both
            assert all(w["needed_bytes"] < whole for w in workers)
            assert whole < received < whole * engine["tp"]


@pytest.mark.parametrize("engine", [LLAMA, MOE], indirect=True, ids=["llama", "qwen3_moe"])
def test_a_delta_update_sends_exactly_what_changed(engine, tmp_path):
    figures, log = _train(engine, tmp_path, "fsdp", 2, delta=True)
    assert len(figures) == 2, log[-4000:]
    changed = sum(t.numel() * t.element_size() for name, t in read_checkpoint(engine["trained"]).items()
                  if name.startswith("model.layers.0.") and CHANGED in name)
    (first, first_workers), (second, second_workers) = figures
    assert sum(w["bytes_received"] for w in first_workers) == _checkpoint_bytes(engine["trained"])
    assert sum(r["bytes_sent"] for r in second) == sum(w["bytes_received"] for w in second_workers) == changed > 0
    assert sum(r["pieces_unchanged"] for r in second) > 0


@pytest.mark.parametrize("engine", [LLAMA_TP2], indirect=True, ids=["llama-engine-tp2"])
def test_a_trainer_rank_dying_leaves_every_worker_on_its_previous_weights(engine, tmp_path):
    """Rank 1 exits without a word as update 2 begins (torchrun is told to notice late, so rank 0
    lives to report): the update is dropped on both workers of the TP 2 engine and finished, rank 0
    raises a SyncError, the engine serves update 1's weights, exactly, and it takes the next update."""
    figures, log = _train(engine, tmp_path, "tp", 2, die_rank=1, torchrun_args=["--monitor-interval", "20"])
    assert len(figures) == 1, log[-4000:]  # the first update landed and was compared; the second failed
    rank0 = json.loads((tmp_path / "trainer" / "rank0-update2.json").read_text())
    assert rank0["error"] == "SyncError", rank0  # from a worker's verdict, or the broken agreement
    assert "trainer rank 1" in rank0["reason"] or "a rank is gone" in rank0["reason"], rank0
    state, previous = snapshot(engine["llm"]), engine["oracles"].seen(1)
    assert differing(state.weights, previous.weights) == []  # every worker still on update 1, exactly
    assert state.generations == previous.generations
    figures, log = _train(engine, tmp_path / "after", "tp", 2)  # not left inside the failed update
    assert len(figures) == 2, log[-4000:]
