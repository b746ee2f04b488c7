"""An engine serving a block-scaled FP8 checkpoint, refit with the FP8 tensors and scales of
:class:`~hp_dcp_hf.sync.source.HFWeightSource`, generates what a fresh engine on the FP8 save of
the same weights generates (vLLM 0.32's CPU backend, in its own venv: ``make test-vllm``).

vLLM serves ``quant_method: "fp8"`` only with bf16 or fp16 activations (float32 is refused when
the config is built), and its CPU FP8 kernel (W8A16 block-scaled, without AMX-FP8) only with bf16.
bf16 attention dies with SIGILL on this machine in the AMX kernel, which vLLM picks when
``head_dim`` is a multiple of 32; ``head_dim=48`` takes its ``vec16`` kernel instead. So: bf16,
``head_dim=48`` and projections that are whole 128 x 128 blocks (8 heads of 48: 384 rows).

The update is vLLM's layerwise reload (``reload_weights`` in checkpoint format: what its weight
transfer engines run) of every tensor the source sends, by its checkpoint name; every parameter
of the engine (FP8 weights as its kernel holds them after post-load processing, their scales) is
then the fresh engine's, bit for bit, and so are greedy generations.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.engine import FP8_ENGINE

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
SIZES = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 48, "num_attention_heads": 8,
         "num_key_value_heads": 8}
PROMPTS = ((1, 2, 3, 4, 5), (7, 11, 13), (42,) * 9)
MAX_TOKENS = 8
ROOT = Path(__file__).resolve().parents[2]


def start_engine(path):
    os.environ.update(ENV)
    from vllm import LLM

    return LLM(str(path), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=64)


def generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def llama(seed: int):
    from tests.support.families import family_model_class, tiny_family_config
    from tests.support.models import _randomize_

    torch.manual_seed(seed)
    model = family_model_class("llama")._from_config(tiny_family_config("llama", **SIZES), dtype=torch.float32)
    _randomize_(model, seed)
    return model.eval()


def sent(source) -> dict[str, torch.Tensor]:
    """The tensors one update sends: every slice (one process holds them all) assembled by name."""
    source.snapshot()
    full = {m.name: torch.empty(m.shape, dtype=m.dtype) for m in source.metadata()}
    for held, values in source:
        full[held.name][held.box.slices()] = values
    return full


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The FP8 saves of two llamas' weights (A serves first, B is the update), and B's model."""
    from hp_dcp_hf import save_hf_checkpoint

    root = tmp_path_factory.mktemp("fp8-engine")
    models = {name: llama(seed) for name, seed in (("a", 0), ("b", 1))}
    for name, model in models.items():
        save_hf_checkpoint(model, root / name, quantize="fp8")
    return root, models["b"]


@pytest.fixture(scope="module")
def fresh_b(checkpoints) -> dict:
    """A fresh engine on B's FP8 save, in a process of its own: its greedy generations and its
    parameters (the FP8 weights as its kernel reads them, after its post-load processing)."""
    root, _ = checkpoints
    out = root / "fresh-b.pt"
    subprocess.run([sys.executable, __file__, str(root / "b"), str(out)], check=True, cwd=ROOT,
                   env={**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
                   timeout=300)
    return torch.load(out)


def engine_state(llm) -> dict:
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    return {"generations": generate(llm),
            "parameters": {name: p.detach().clone() for name, p in model.named_parameters()}}


@FP8_ENGINE
def test_fp8_engine_refit_from_the_source_is_a_fresh_engine(checkpoints, fresh_b):
    from hp_dcp_hf.sync.source import HFWeightSource

    root, model_b = checkpoints
    llm = start_engine(root / "a")
    assert generate(llm) != fresh_b["generations"]  # the update has something to change
    tensors = sent(HFWeightSource(model_b, quantize="fp8"))
    assert {k for k, v in tensors.items() if v.dtype == torch.float8_e4m3fn}
    assert all(bool((v > 0).all()) for k, v in tensors.items() if k.endswith("weight_scale_inv"))
    worker = llm.llm_engine.model_executor.driver_worker.worker
    worker.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
    llm.reset_prefix_cache()
    updated = engine_state(llm)
    fp8 = [n for n, p in updated["parameters"].items() if p.dtype == torch.float8_e4m3fn]
    assert fp8 and sorted(updated["parameters"]) == sorted(fresh_b["parameters"])
    assert not [n for n, p in updated["parameters"].items()
                if p.dtype != fresh_b["parameters"][n].dtype
                or not torch.equal(p.view(torch.uint8), fresh_b["parameters"][n].view(torch.uint8))]
    assert updated["generations"] == fresh_b["generations"]


if __name__ == "__main__":  # the fresh engine: python tests/vllm/test_fp8_engine.py CHECKPOINT OUT
    torch.save(engine_state(start_engine(sys.argv[1])), sys.argv[2])
