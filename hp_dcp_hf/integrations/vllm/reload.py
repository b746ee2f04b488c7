"""Weight updates into a running vLLM model that its kernels then compute with, also on CPU.

vLLM's layerwise reload (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``, what its
``nccl`` and ``ipc`` weight-transfer engines run around ``model.load_weights``) puts each layer
back in checkpoint format, lets ``load_weights`` fill it, re-runs the layer's processing and
copies the result into the tensors the kernels hold. On vLLM 0.32's CPU backend that leaves two
kernels computing with wrong values, silently:

* **fused-MoE experts** (``UnquantizedFusedMoEMethod``): on an update its ``_setup_kernel`` skips
  the experts' own ``process_weights_after_loading`` (CPU: pad the intermediate dimension, prepack
  for the grouped GEMM), so the kernel reads checkpoint layout as if it were prepacked;
* **a tied LM head**: its packed copy (``cpu_linear``) is made from the embedding by its own
  processing, which the reload runs only for the embedding (vLLM's "tied parameters reflect the
  processing of one parent"), so the logits keep the old embedding.

:func:`begin_update` and :func:`finish_update` wrap vLLM's reload with the two missing steps (the
experts' processing, the head's repacking) and refuse, with a :class:`~hp_dcp_hf.errors.SyncError`,
MoE layers whose update path is not known to re-run the experts' processing. After
:func:`finish_update` the engine's prefix cache still holds KV computed with the old weights:
``LLM.reset_prefix_cache()`` (or the engine's equivalent) must follow before serving.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

import torch

from hp_dcp_hf.errors import SyncError

if TYPE_CHECKING:
    from vllm.config import ModelConfig

__all__ = ["begin_update", "finish_update"]

# Per model under update: the MoE quant methods whose processing begin_update extended.
_EXTENDED: WeakKeyDictionary[torch.nn.Module, list[object]] = WeakKeyDictionary()


def begin_update(model: torch.nn.Module) -> None:
    """Prepare ``model`` (an engine worker's) for ``model.load_weights`` calls with new values.

    Raises :class:`SyncError` (``key``: the layer) for a MoE layer on CPU whose experts need
    processing after loading that vLLM's update path is not known to re-run.
    """
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    methods = _EXTENDED.setdefault(model, [])
    for method in _moe_methods_missing_experts_processing(model):
        if method not in methods:
            method.process_weights_after_loading = _with_experts_processing(method)
            methods.append(method)
    initialize_layerwise_reload(model)


def finish_update(model: torch.nn.Module, model_config: ModelConfig) -> None:
    """Process what the ``load_weights`` calls since :func:`begin_update` left, so that every
    kernel of ``model`` computes with the new values."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    for method in _EXTENDED.pop(model, []):
        del method.process_weights_after_loading  # the class's again
    _repack_tied_lm_heads(model)


def _moe_methods_missing_experts_processing(model: torch.nn.Module) -> list[object]:
    """The quant methods of ``model``'s MoE layers whose update skips the experts' processing.

    ``UnquantizedFusedMoEMethod._setup_kernel`` runs ``fused_experts.process_weights_after_loading``
    only when it builds the kernel (the first load); experts without such processing lose nothing.
    """
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsModular
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    methods = []
    for name, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if not isinstance(method, FusedMoEMethodBase) or method.moe_kernel is None:
            continue
        experts = type(method.moe_kernel.fused_experts)
        if experts.process_weights_after_loading is FusedMoEExpertsModular.process_weights_after_loading:
            continue
        if type(method) is not UnquantizedFusedMoEMethod:
            raise SyncError(
                f"{type(method).__name__} with {experts.__name__} on CPU: vLLM's update path is not "
                "known to re-run the experts' processing after loading (without it the kernel reads "
                "checkpoint layout as prepacked); reload the engine from a checkpoint instead",
                key=name,
            )
        methods.append(method)
    return methods


def _with_experts_processing(method) -> Callable[[torch.nn.Module], None]:
    """``method``'s processing followed by its experts' (on the layer the reload re-materialized,
    before the reload copies the result into the kernel's tensors)."""
    process = type(method).process_weights_after_loading

    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        process(method, layer)
        method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    return process_weights_after_loading


def _repack_tied_lm_heads(model: torch.nn.Module) -> None:
    """Re-run the processing of every LM head that shares its weight with an embedding: on CPU it
    packs its own copy of the weight (``cpu_linear``), which the reload does not refresh."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    modules = list(model.modules())
    for head in modules:
        if not isinstance(head, ParallelLMHead) or not hasattr(head, "cpu_linear"):
            continue
        if any(
            isinstance(other, VocabParallelEmbedding) and other is not head and other.weight is head.weight
            for other in modules
        ):
            head.quant_method.process_weights_after_loading(head)
