"""A torchtitan llama3 on 2 trainer ranks (torchtitan's own TP and FSDP2) updates a vLLM llama
engine through the ``hp_dcp_hf`` backend, and the engine then computes exactly what a fresh engine
on the trainers' torchtitan save of the same weights computes.

The trainers (:mod:`tests.support.sync_trainer` ``--titan``, under ``torchrun`` in the main venv,
where torchtitan is installed) build torchtitan's model, parallelize it with torchtitan's
``parallelize_llama``, load checkpoint B through :mod:`hp_dcp_hf.integrations.torchtitan` (fused
``wqkv``, q/k permuted for complex RoPE) and send its :func:`~hp_dcp_hf.integrations.torchtitan.weight_source`:
the checkpoint's tensors by their Hugging Face names, each rank its own shards' bytes. Oracle: a
fresh engine on the trainers' ``torchtitan.save_hf_checkpoint`` files, in a process of its own:
every effective weight bit for bit and the greedy generations, after two updates (the second after
a step that changes layer 0's attention).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.engine import (
    ENGINE_CONFIG,
    generate,
    shutdown_engine,
    start_engine,
)
from tests.support.models import make_checkpoint
from tests.support.rl_server import RLServer
from tests.support.sync_run import Oracles, check_update, run_trainers

# tests.support.titan's ENGINE_LLAMA3 (torchtitan: dim 128, 4 heads of 32, 2 kv heads, 2 layers).
SIZES = {**ENGINE_CONFIG, "hidden_size": 128, "tie_word_embeddings": False}
FAMILY = "llama3_engine"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from hp_dcp_hf.integrations.vllm import plugin

    plugin.register()
    root = tmp_path_factory.mktemp("sync-titan")
    initial = make_checkpoint("llama", root / "A", dtype=torch.float32, seed=0, **SIZES)
    trained = make_checkpoint("llama", root / "B", dtype=torch.float32, seed=1, **SIZES)
    llm = start_engine(initial, weight_transfer_config={"backend": "hp_dcp_hf"})
    server = RLServer(llm)
    yield {"llm": llm, "server": server, "trained": trained, "root": root, "initial": generate(llm), "oracles": Oracles(root)}
    server.close()
    shutdown_engine(llm)


@pytest.mark.parametrize("layout", ["tp", "fsdp"])
def test_titan_updates_equal_a_fresh_engine_on_the_titan_save(engine, tmp_path, layout):
    llm = engine["llm"]

    def check(update, files, ranks):
        check_update(llm, engine["oracles"], update, files, ranks, engine["initial"])
        assert [r["bytes_sent"] for r in ranks] == [r["held_bytes"] for r in ranks]  # TP 1: all it holds

    checked, log = run_trainers(engine["server"].url, engine["trained"], tmp_path, 2,
                                ["--layout", layout, "--titan", FAMILY], check)
    assert checked == 2, log[-4000:]
