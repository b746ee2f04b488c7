"""An engine serving a block-scaled FP8 checkpoint, updated through the ``hp_dcp_hf`` backend by
trainer ranks whose weight source quantizes as the engine's own quantization config says, computes
exactly what a fresh engine on the trainers' FP8 save of the same weights computes.

The engine (this process, vLLM's venv) starts on the FP8 save of checkpoint A; trainers under
``torchrun`` in the main venv (:mod:`tests.support.sync_trainer`, ``--quantize`` the engine's
``quantization_config``) load checkpoint B in float32 under TP and FSDP2 on 2 ranks and send
``HFWeightSource(model, quantize=...)``: FP8 weights (1 byte an element on the wire, into the
worker's float8 buffers) and their ``weight_scale_inv``, the amax of blocks a TP or FSDP border
splits agreed across the ranks. Oracle: a fresh engine on the trainer's
``save_hf_checkpoint(quantize=...)`` files, in a process of its own: every parameter bit for bit
(FP8 weights as the kernel holds them after post-load processing, their scales, non-zero) and the
greedy generations; two updates, the second after a step that changes layer 0's attention.

bf16 and ``head_dim=48``, as :mod:`tests.vllm.test_fp8_engine` explains: vLLM serves FP8 only with
bf16 activations, and bf16 attention runs here only off the AMX kernel (``head_dim % 32 != 0``).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.engine import (
    ENGINE_CONFIG,
    FP8_ENGINE,
    generate,
    shutdown_engine,
    start_engine,
)
from tests.support.models import build_model, make_checkpoint
from tests.support.rl_server import RLServer
from tests.support.sync_run import Oracles, check_update, run_trainers

# Projections of whole 128 x 128 blocks (8 heads of 48: 384 rows), split inside blocks by TP 2.
SIZES = {**ENGINE_CONFIG, "hidden_size": 256, "intermediate_size": 512, "head_dim": 48,
         "num_attention_heads": 8, "num_key_value_heads": 8}
DTYPE = "bfloat16"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The FP8 engine on A's FP8 save, its RL routes, and B (what the trainers load)."""
    from hp_dcp_hf import save_hf_checkpoint
    from hp_dcp_hf.integrations.vllm import plugin

    plugin.register()
    root = tmp_path_factory.mktemp("sync-fp8")
    save_hf_checkpoint(build_model("llama", dtype=torch.float32, seed=0, **SIZES), root / "A", quantize="fp8")
    trained = make_checkpoint("llama", root / "B", dtype=torch.float32, seed=1, **SIZES)
    llm = start_engine(root / "A", weight_transfer_config={"backend": "hp_dcp_hf"}, dtype=DTYPE)
    server = RLServer(llm)
    quantization = json.loads((root / "A" / "config.json").read_text())["quantization_config"]
    yield {"llm": llm, "server": server, "trained": trained, "root": root, "quantization": quantization,
           "initial": generate(llm), "oracles": Oracles(root, dtype=DTYPE)}
    server.close()
    shutdown_engine(llm)


@FP8_ENGINE
@pytest.mark.parametrize("layout", ["tp", "fsdp"])
def test_fp8_updates_equal_a_fresh_engine_on_the_fp8_save(engine, tmp_path, layout):
    llm = engine["llm"]

    def check(update, files, ranks):
        state, receiver = check_update(llm, engine["oracles"], update, files, ranks, engine["initial"])
        fp8 = [name for name, meta in receiver.tensors.items() if meta.dtype == torch.float8_e4m3fn]
        assert fp8 and all(receiver.kept[name].dtype == torch.float8_e4m3fn for name in fp8)
        scales = [v for n, v in state.weights.items() if "scale" in n]
        assert scales and all(bool((v > 0).all()) for v in scales)

    checked, log = run_trainers(engine["server"].url, engine["trained"], tmp_path, 2,
                                ["--layout", layout, "--quantize", json.dumps(engine["quantization"])], check)
    assert checked == 2, log[-4000:]
