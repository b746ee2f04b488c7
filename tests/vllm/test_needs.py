"""consumed_boxes against real vLLM CPU engines: which slice of each checkpoint tensor a worker reads.

Tiny llama (untied head, vocabulary 251: vLLM pads it to 256 and splits the padded rows) and tiny
qwen3_moe checkpoints, float32, written by transformers' ``save_pretrained``. TP=1: every tensor is
read whole, and probing changes nothing. TP=2: each worker reads its TP slice, the two workers
together read every element (replicated tensors twice), and the slices are enough: an engine fed
buffers that hold checkpoint B's values only inside its boxes (NaN elsewhere) generates exactly
what a fresh engine on B generates.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from hp_dcp_hf.geometry.box import Box, disjoint_cover
from hp_dcp_hf.sync.source import TensorMeta

_COMMON = dict(vocab_size=251, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)
_MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_COMMON)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**_COMMON, moe_intermediate_size=64, num_experts=4,
                                                            num_experts_per_tok=2)),
}
_PROMPTS = [{"prompt_token_ids": [1, 5, 9, 22]}, {"prompt_token_ids": [7, 3, 200]}]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """``(model type, "A" | "B")`` -> a checkpoint directory; A and B differ in every weight."""
    paths = {}
    for model_type, build in _MODELS.items():
        for seed, version in enumerate("AB"):
            torch.manual_seed(seed)
            path = tmp_path_factory.mktemp(f"{model_type}_{version}")
            build().to(torch.float32).save_pretrained(path)
            paths[model_type, version] = path
    return paths


def _metas(path: Path) -> list[TensorMeta]:
    with safe_open(path / "model.safetensors", "pt") as handle:
        return [TensorMeta(name, torch.float32, tuple(handle.get_slice(name).get_shape())) for name in handle.keys()]  # noqa: SIM118


@contextmanager
def _engine(path: Path, tp: int) -> Iterator[object]:
    """An engine with its core in this process; TP=2 workers are processes of their own."""
    from vllm import LLM

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(rank) for rank in range(tp)))
        parallel = dict(tensor_parallel_size=tp, distributed_executor_backend="mp") if tp > 1 else {}
        llm = LLM(str(path), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128,
                  **parallel)
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def _generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outputs = llm.generate(_PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _on_workers(llm, fn, *args) -> list:
    """``fn(worker, *args)`` on every engine worker, in rank order."""
    return llm.llm_engine.model_executor.collective_rpc(fn, args=args)


# --- run inside the engine workers ---------------------------------------------------------------


def _module_state(model: torch.nn.Module) -> list[tuple[str, str, int, torch.Tensor | None]]:
    """Every attribute of every module (parameters and buffers included), by identity, with a copy
    of each tensor's values: what a probe must leave exactly as it found it."""
    state = []
    for module_name, module in model.named_modules():
        attributes = {**vars(module), **module._parameters, **module._buffers}
        for name, value in attributes.items():
            if isinstance(value, torch.Tensor):
                copy = value.detach().clone() if not value.is_meta else None
                state.append((module_name, name, id(value), copy))
            else:
                state.append((module_name, name, id(value), None))
    return state


def _probe_unchanged(worker, metas: list[TensorMeta]) -> tuple[dict[str, list[Box]], bool]:
    from hp_dcp_hf.integrations.vllm.needs import consumed_boxes

    model = worker.model_runner.model
    before = _module_state(model)
    boxes = consumed_boxes(model, metas)
    after = _module_state(model)
    same = len(before) == len(after) and all(
        b[:3] == a[:3] and (b[3] is None or torch.equal(b[3], a[3])) for b, a in zip(before, after))
    return boxes, same


def _probe(worker, metas: list[TensorMeta]) -> dict[str, list[Box]]:
    from hp_dcp_hf.integrations.vllm.needs import consumed_boxes

    return consumed_boxes(worker.model_runner.model, metas)


def _reload(worker, path: str, boxes: list[dict[str, list[Box]]] | None) -> None:
    """Load checkpoint ``path`` through vLLM's layerwise reload; with ``boxes`` (every worker's, in
    rank order), each tensor as a full-shape buffer holding the checkpoint's values inside this
    worker's boxes only, NaN elsewhere.

    The experts' processing re-run here stands in for hp_dcp_hf.integrations.vllm.reload (not on
    main yet): vLLM 0.32's CPU reload skips it and its MoE kernel then reads checkpoint layout.
    """
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.model_runner.model
    mine = boxes[worker.rank] if boxes is not None else None
    methods = [module.quant_method for module in model.modules()
               if isinstance(getattr(module, "quant_method", None), FusedMoEMethodBase)]
    for method in methods:
        method.process_weights_after_loading = _with_experts_processing(method)
    initialize_layerwise_reload(model)
    with safe_open(Path(path) / "model.safetensors", "pt") as handle:
        for name in handle.keys():  # noqa: SIM118
            values = handle.get_tensor(name)
            if mine is not None:
                buffer = torch.full_like(values, float("nan"))
                for box in mine[name]:
                    buffer[box.slices()] = values[box.slices()]
                values = buffer
            model.load_weights([(name, values)])
    finalize_layerwise_reload(model, worker.model_runner.model_config)
    for method in methods:
        del method.process_weights_after_loading


def _with_experts_processing(method):
    process = type(method).process_weights_after_loading

    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        process(method, layer)
        method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    return process_weights_after_loading


# --- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", sorted(_MODELS))
def test_tp1_reads_every_tensor_whole_and_changes_nothing(checkpoints, model_type):
    path = checkpoints[model_type, "A"]
    metas = _metas(path)
    with _engine(path, tp=1) as llm:
        generated = _generate(llm)
        [(boxes, unchanged)] = _on_workers(llm, _probe_unchanged, metas)
        assert unchanged
        assert _generate(llm) == generated
    assert boxes == {meta.name: [Box.full(meta.shape)] for meta in metas}


def _tp_slice(name: str, shape: tuple[int, ...], rank: int) -> Box:
    """The slice of ``name`` TP rank ``rank`` of 2 serves, as vLLM's layers split them (written
    out here only to check the probe against)."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):  # row-parallel: input columns
        half = shape[1] // 2
        return Box((0, rank * half), (shape[0], half))
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
        half = shape[0] // 2
        return Box((rank * half, 0), (half, shape[1]))
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):  # the padded vocabulary (256) split
        return Box((0, 0), (128, shape[1])) if rank == 0 else Box((128, 0), (shape[0] - 128, shape[1]))
    return Box.full(shape)  # norms, q/k norms, the router: replicated


@pytest.mark.parametrize("model_type", sorted(_MODELS))
def test_tp2_each_worker_reads_its_slice_and_the_slices_suffice(checkpoints, model_type):
    a, b = checkpoints[model_type, "A"], checkpoints[model_type, "B"]
    metas = _metas(b)
    with _engine(b, tp=2) as llm:
        fresh_b = _generate(llm)
        _on_workers(llm, _reload, str(a), None)
        llm.reset_prefix_cache()
        assert _generate(llm) != fresh_b  # the update changed the weights (and a probe after it must still see)
        boxes = _on_workers(llm, _probe, metas)
        _on_workers(llm, _reload, str(b), boxes)
        llm.reset_prefix_cache()
        assert _generate(llm) == fresh_b

    split = 0
    for meta in metas:
        per_worker = [worker[meta.name] for worker in boxes]
        assert per_worker == [[_tp_slice(meta.name, meta.shape, rank)] for rank in range(2)], meta.name
        if per_worker[0] != per_worker[1]:
            assert disjoint_cover(per_worker[0] + per_worker[1], meta.shape), meta.name
            split += 1
    assert split > len(metas) // 2
