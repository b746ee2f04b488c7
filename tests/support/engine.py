"""A real vLLM CPU engine for tests, and the values its kernels actually compute with.

Runs only in the vLLM venv (``make vllm-venv``); vLLM is imported inside functions, so the main venv
can import ``tests.support`` freely.

Why "effective" weights: vLLM's CPU backend packs dense Linear weights into a oneDNN handle (or an
sgl-packed tensor) after loading and leaves the parameter empty (shape ``(0,)``); a tied or
untied ``lm_head`` keeps its parameter but computes through its own packed copy; fused-MoE experts
are prepacked in place. Comparing parameters would compare empty tensors, or tensors the kernel no
longer reads. :func:`effective_weights` recovers each linear's weight by running its kernel on an
identity matrix (``I @ W.T`` is exact: each output is one product by 1.0 plus exact zeros) and
takes every other parameter (embeddings, norms, biases, prepacked experts) as it is.

:func:`fresh_engine_snapshot` is the oracle of a weight update: the same engine loaded from a
checkpoint directory in a separate process (``python -m tests.support.engine CHECKPOINT OUT [DTYPE]``),
whose effective weights and greedy generations come back through files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

__all__ = [
    "ENGINE_CONFIG",
    "FP8_ENGINE",
    "ENGINE_ENV",
    "MAX_TOKENS",
    "PROMPTS",
    "EngineSnapshot",
    "differing",
    "effective_weights",
    "engine_model",
    "fresh_engine_snapshot",
    "generate",
    "make_engine_checkpoint",
    "shutdown_engine",
    "snapshot",
    "start_engine",
    "transfer_engine",
    "worker_call",
    "worker_effective_weights",
    "worker_transfer_stats",
]

FP8_ENGINE = pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(),
    reason="vLLM 0.32's CPU FP8 kernels (block-scaled W8A8 and W8A16) need AMX tiles (Sapphire Rapids or "
           "newer), which this CPU lacks: it cannot build an FP8 engine. The FP8 refit without an engine: "
           "tests/dist/test_sync_fp8_dist.py",
)
"""Marks tests that start a vLLM FP8 engine: vLLM refuses one without the kernels (the same check it makes)."""

#: An in-process engine (no engine-core process: its model is reachable from the test) with a
#: 1 GiB KV cache, small enough for the shared test machine.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}

#: Fixed prompts (token ids: engines run without a tokenizer) and the greedy generation length. The
#: long one fills whole KV blocks, which the prefix cache keeps and reuses across generations.
PROMPTS: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4, 5), (7, 11, 13), tuple(range(3, 67)))
MAX_TOKENS = 8

#: ``tests.support.models`` config overrides that vLLM's CPU kernels take as they are: head_dim
#: >= 32 (the CPU attention kernel refuses 16), hidden and MoE intermediate sizes multiples of 32
#: (the grouped-GEMM experts' alignment, no padding), a vocabulary a multiple of 64 (no padded
#: embedding rows, whose contents no checkpoint fixes).
ENGINE_CONFIG: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=96,
    moe_intermediate_size=32,
    max_position_embeddings=128,
)

_REPO_ROOT = Path(__file__).resolve().parents[2]


def make_engine_checkpoint(model_type: str, directory: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """The tiny float32 ``model_type`` checkpoint (``save_pretrained``) of :data:`ENGINE_CONFIG`
    (a dense model keeps ``moe_intermediate_size`` as an unused config entry)."""
    from tests.support.models import make_checkpoint

    return make_checkpoint(model_type, directory, dtype=torch.float32, seed=seed, **ENGINE_CONFIG)


def start_engine(
    checkpoint: str | os.PathLike[str],
    *,
    weight_transfer_config: Mapping[str, Any] | None = None,
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
    **llm_kwargs: Any,
):
    """An in-process ``vllm.LLM`` on ``checkpoint``: float32 by default (bf16 dies with SIGILL on
    this machine's advertised-but-unusable AMX in the attention vLLM picks when ``head_dim`` is a
    multiple of 32; ``"bfloat16"`` with e.g. ``head_dim=48``, as FP8 serving needs), eager, no tokenizer, 128-token context, KV blocks of
    32 tokens (the CPU attention's smallest; its default 128 would leave every prompt that fits
    the context without a whole block for the prefix cache to keep).

    ``weight_transfer_config`` (e.g. ``{"backend": "hp_dcp_hf"}``) selects the weight-transfer
    backend the RL API (``init_weight_transfer_engine`` ...) drives. ``tensor_parallel_size`` > 1
    runs the workers as processes (vLLM's ``mp`` executor), each bound to one core; the engine core
    stays in this process, so :func:`worker_call` reaches every worker.
    """
    os.environ.update(ENGINE_ENV)
    from vllm import LLM

    if tensor_parallel_size > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1))
                                                           for r in range(tensor_parallel_size))
        llm_kwargs.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp")

    if weight_transfer_config is not None:
        llm_kwargs["weight_transfer_config"] = dict(weight_transfer_config)
    return LLM(
        str(checkpoint),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=dtype,
        max_model_len=128,
        block_size=32,
        **llm_kwargs,
    )


def shutdown_engine(llm) -> None:
    """Stop ``llm`` and tear down vLLM's process groups, so the next test module can start one."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    cleanup_dist_env_and_memory()


def engine_model(llm) -> torch.nn.Module:
    """The model of an in-process engine (``ENGINE_ENV``, tensor_parallel_size 1)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def generate(llm, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Greedy generations (token ids) of ``prompts``."""
    from vllm import SamplingParams

    outputs = llm.generate(
        [{"prompt_token_ids": list(prompt)} for prompt in prompts],
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    return [list(output.outputs[0].token_ids) for output in outputs]


def _computes_through_kernel(module: torch.nn.Module) -> bool:
    """Whether ``module.weight`` reaches the computation only through the packed ``cpu_linear``.

    An embedding (not an LM head) keeps ``cpu_linear`` but looks rows up in its parameter.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    if not hasattr(module, "cpu_linear") or not isinstance(getattr(module, "weight", None), torch.Tensor):
        return False
    return isinstance(module, ParallelLMHead) or not isinstance(module, VocabParallelEmbedding)


@torch.no_grad()
def _kernel_weight(module: torch.nn.Module) -> torch.Tensor:
    """The ``(out, in)`` weight ``module.cpu_linear`` computes with: ``cpu_linear(I) = I @ W.T``."""
    weight = module.weight
    # An emptied weight no longer says its width; a linear does (ReplicatedLinear and its router
    # subclass only as ``input_size``, which is the whole width there).
    in_features = weight.shape[-1] if weight.numel() else getattr(module, "input_size_per_partition", module.input_size)
    identity = torch.eye(in_features, dtype=weight.dtype)
    return module.cpu_linear(identity, weight, None).t().contiguous()


@torch.no_grad()
def effective_weights(llm_or_model) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's model as the kernels read it, by vLLM's parameter name.

    Tied parameters appear under each owner (``lm_head.weight`` is the LM head's packed copy, which
    can go stale while ``model.embed_tokens.weight`` is updated). Values are copies.
    """
    model = llm_or_model if isinstance(llm_or_model, torch.nn.Module) else engine_model(llm_or_model)
    weights: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        through_kernel = _computes_through_kernel(module)
        for name, param in module.named_parameters(recurse=False):
            if through_kernel and name == "weight":
                weights[prefix + name] = _kernel_weight(module)
            else:
                weights[prefix + name] = param.detach().clone()
    return weights


def worker_effective_weights(worker) -> dict[str, torch.Tensor]:
    """:func:`effective_weights` of one worker: ``llm.collective_rpc(worker_effective_weights)``
    gives each tensor-parallel worker's (with the in-process engine core of :data:`ENGINE_ENV`,
    the results come back as tensors)."""
    return effective_weights(worker.model_runner.model)


@dataclass(frozen=True)
class EngineSnapshot:
    """What an engine computes with (:func:`effective_weights`) and what it generates (:data:`PROMPTS`)."""

    weights: dict[str, torch.Tensor]
    generations: list[list[int]]


def worker_call(llm, fn, *args: Any) -> list[Any]:
    """``fn(worker, *args)`` on every worker of ``llm``, in worker order (``fn`` module-level)."""
    return llm.llm_engine.model_executor.collective_rpc(fn, args=args)


def snapshot(llm) -> EngineSnapshot:
    """The :class:`EngineSnapshot` of a running engine; under tensor parallelism every worker's
    weights, named ``worker<i>/<parameter>``."""
    if llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 1:
        return EngineSnapshot(effective_weights(llm), generate(llm))
    weights = {f"worker{i}/{name}": value for i, part in enumerate(worker_call(llm, worker_effective_weights))
               for name, value in part.items()}
    return EngineSnapshot(weights, generate(llm))


def differing(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ bit for bit (dtype, shape or bytes), or that only one side has."""

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    names = sorted(set(actual) | set(expected))
    return [n for n in names if n not in actual or n not in expected or not same(actual[n], expected[n])]


def fresh_engine_snapshot(checkpoint: str | os.PathLike[str], workdir: str | os.PathLike[str], *,
                          dtype: str = "float32", tensor_parallel_size: int = 1) -> EngineSnapshot:
    """The :class:`EngineSnapshot` of an engine loaded from ``checkpoint`` in a separate process
    (``dtype``, ``tensor_parallel_size``: as :func:`start_engine` takes them).

    The reference of an update: what the updated engine must equal. A process of its own, so it
    shares no state (process groups, caches, patched loaders) with the engine under test.
    """
    from safetensors.torch import load_file

    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(_REPO_ROOT), os.environ.get("PYTHONPATH")))))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.engine", str(checkpoint), str(out), dtype, str(tensor_parallel_size)],
        cwd=_REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"reference engine on {checkpoint} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    generations = json.loads((out / "generations.json").read_text())
    return EngineSnapshot(load_file(out / "weights.safetensors"), generations)


def _write_snapshot(checkpoint: str, out: str, dtype: str = "float32", tensor_parallel_size: str = "1") -> None:
    from safetensors.torch import save_file

    llm = start_engine(checkpoint, dtype=dtype, tensor_parallel_size=int(tensor_parallel_size))
    state = snapshot(llm)
    # Tied names are separate copies already (effective_weights clones), which save_file requires.
    save_file(state.weights, str(Path(out) / "weights.safetensors"))
    (Path(out) / "generations.json").write_text(json.dumps(state.generations))


def transfer_engine(llm):
    """The weight-transfer engine of an in-process engine's worker (tensor_parallel_size 1)."""
    return llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine


def worker_transfer_stats(worker) -> dict[str, int]:
    """The last update's receive figures of a worker's ``hp_dcp_hf`` transfer engine
    (:func:`worker_call`): bytes received, and bytes the worker consumes."""
    receiver = worker.weight_transfer_engine.receiver
    return {"bytes_received": receiver.stats.bytes_received, "needed_bytes": receiver.needed_bytes}


if __name__ == "__main__":
    _write_snapshot(*sys.argv[1:5])
