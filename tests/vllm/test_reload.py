"""A weight update of a running vLLM CPU engine (``hp_dcp_hf.integrations.vllm.reload``).

One engine per model type, started on checkpoint A; updates load checkpoint B (another seed) by its
checkpoint names through ``model.load_weights``. The oracle is an engine loaded fresh from B in a
process of its own: after the update the kernels compute with the same values, bit for bit, and
greedy generations are equal. vLLM's layerwise reload alone is shown to leave the MoE experts
(checkpoint layout read as prepacked) and the tied LM head (old embedding) wrong, so the fix is
needed; a prefix cache not reset after an update serves KV of the old weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from hp_dcp_hf.integrations.vllm.reload import begin_update, finish_update
from tests.support.engine import (
    EngineSnapshot,
    differing,
    effective_weights,
    engine_model,
    fresh_engine_snapshot,
    generate,
    make_engine_checkpoint,
    shutdown_engine,
    snapshot,
    start_engine,
)
from tests.support.models import read_checkpoint


@dataclass(frozen=True)
class Engine:
    model_type: str
    llm: object
    a: Path
    b: Path
    fresh_a: EngineSnapshot  # the engine itself, right after it started on A
    fresh_b: EngineSnapshot  # an engine started on B in another process


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(request.param)
    a = make_engine_checkpoint(request.param, root / "A", seed=0)
    b = make_engine_checkpoint(request.param, root / "B", seed=1)
    llm = start_engine(a)
    yield Engine(request.param, llm, a, b, snapshot(llm), fresh_engine_snapshot(b, root / "fresh_b"))
    shutdown_engine(llm)


def update(llm, checkpoint: Path, *, vllm_reload_only: bool = False, reset_prefix_cache: bool = True) -> None:
    """Load every tensor of ``checkpoint``, by its checkpoint name, into the running engine."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model, model_config = engine_model(llm), llm.llm_engine.model_config
    if vllm_reload_only:
        initialize_layerwise_reload(model)
    else:
        begin_update(model)
    model.load_weights(iter(read_checkpoint(checkpoint).items()))
    if vllm_reload_only:
        finalize_layerwise_reload(model, model_config)
    else:
        finish_update(model, model_config)
    if reset_prefix_cache:
        llm.reset_prefix_cache()


def test_effective_weights_are_the_checkpoints(engine: Engine) -> None:
    """The identity probe of a packed linear returns the checkpoint's values exactly (fused
    q|k|v rows, the LM head tied to the embedding or not)."""
    import torch

    tensors = read_checkpoint(engine.a)
    weights = engine.fresh_a.weights
    attn = "model.layers.1.self_attn."
    assert weights[attn + "qkv_proj.weight"].shape[0] > 0
    assert torch.equal(weights[attn + "qkv_proj.weight"], torch.cat([tensors[f"{attn}{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(weights[attn + "o_proj.weight"], tensors[attn + "o_proj.weight"])
    assert torch.equal(weights["lm_head.weight"], tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]))
    if engine.model_type == "llama":
        mlp = "model.layers.1.mlp."
        gate_up = torch.cat([tensors[mlp + "gate_proj.weight"], tensors[mlp + "up_proj.weight"]])
        assert torch.equal(weights[mlp + "gate_up_proj.weight"], gate_up)
    else:
        assert torch.equal(weights["model.layers.1.mlp.gate.weight"], tensors["model.layers.1.mlp.gate.weight"])


def test_update_equals_a_fresh_engine(engine: Engine) -> None:
    """A -> B equals the engine started on B; B -> A (a second update) equals the engine on A."""
    update(engine.llm, engine.b)
    assert differing(effective_weights(engine.llm), engine.fresh_b.weights) == []
    assert generate(engine.llm) == engine.fresh_b.generations

    update(engine.llm, engine.a)
    assert differing(effective_weights(engine.llm), engine.fresh_a.weights) == []
    assert generate(engine.llm) == engine.fresh_a.generations


def test_vllm_reload_alone_leaves_kernels_wrong(engine: Engine) -> None:
    """Without begin_update / finish_update the kernels compute with wrong values (silently: the
    update raises nothing); an update through them repairs the engine."""
    update(engine.llm, engine.b, vllm_reload_only=True)
    wrong = differing(effective_weights(engine.llm), engine.fresh_b.weights)
    if engine.model_type == "llama":
        assert wrong == ["lm_head.weight"]  # tied: packed from the old embedding
    else:
        assert wrong == [
            f"model.layers.{i}.mlp.experts.routed_experts.{w}" for i in (0, 1) for w in ("w13_weight", "w2_weight")
        ]
    assert generate(engine.llm) != engine.fresh_b.generations

    update(engine.llm, engine.b)
    assert differing(effective_weights(engine.llm), engine.fresh_b.weights) == []
    assert generate(engine.llm) == engine.fresh_b.generations


def test_prefix_cache_must_be_reset_after_an_update(engine: Engine) -> None:
    """KV blocks cached under the old weights are reused for the same prompt prefix after an
    update that does not reset the prefix cache: the long prompt generates as on the old weights."""
    update(engine.llm, engine.a)
    assert generate(engine.llm) == engine.fresh_a.generations  # caches the long prompt's blocks

    update(engine.llm, engine.b, reset_prefix_cache=False)
    assert differing(effective_weights(engine.llm), engine.fresh_b.weights) == []
    stale = generate(engine.llm)
    assert stale[:2] == engine.fresh_b.generations[:2]  # short prompts: no whole block cached
    assert stale[2] != engine.fresh_b.generations[2]

    engine.llm.reset_prefix_cache()
    assert generate(engine.llm) == engine.fresh_b.generations
