"""torchtitan's models loaded from and saved to Hugging Face checkpoints, by byte ranges.

torchtitan (0.3) converts with a hand-written ``StateDictAdapter`` per model: ``from_hf`` on a
whole HF state dict, after every rank read every tensor it maps. Here each family is a mapping of
transformers ``WeightRenaming`` / ``WeightConverter`` s from the checkpoint's keys to the names its
adapter's ``from_hf`` makes (the module's stock layout: ``qkv_linear.wq`` / ``wk`` / ``wv``,
stacked experts); a fused ``wqkv`` (``FusedQKVLinear``, torchtitan's default) is a rewrite of
that layout, recorded on the model (:func:`record_fused_qkv`) as the project's own rewrites are.
The planners then read, on every rank, only the bytes of its own shards under whatever
torchtitan's parallelize functions made of the model (FSDP, TP, EP, and their products).

The load goes into the model's own parameters and persistent buffers (:func:`model_tensors`),
not into ``state_dict()``: torchtitan's fused attention hands out ``wq`` / ``wk`` / ``wv`` made
by a hook, gathered whole on every rank, and only its ``load_state_dict`` hook merges them back.

Families (the model's class): ``Llama3Model`` (q/k permuted for complex RoPE, as its adapter
does), ``Qwen3Model`` (dense and MoE), ``DeepSeekV3Model`` (with and without ``q_lora_rank``;
``e_score_correction_bias`` into ``expert_bias_E``; multi-token-prediction layers are refused) and
``GptOssModel`` (experts transposed from the checkpoint's ``[E, in, out]``, which torchtitan's own
adapter does not load). A buffer no HF checkpoint holds (``expert_bias_E`` of Qwen3 and GPT-OSS,
torchtitan's load-balancing state) is left as it is, as torchtitan's ``strict=False`` load leaves
it, and is not saved.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import (
    MergeModulelist,
    Transpose,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
)

from hp_dcp_hf.errors import ArgumentError, CheckpointNotFoundError, MappingError
from hp_dcp_hf.load.api import load_hf_checkpoint as _load
from hp_dcp_hf.load.planner import LoadReport
from hp_dcp_hf.load.written import own_state_dict
from hp_dcp_hf.mapping.ops import ConcatenateInGroups, PermuteHeadsForRope
from hp_dcp_hf.mapping.stages import add_weight_mapping
from hp_dcp_hf.save.api import save_hf_checkpoint as _save
from hp_dcp_hf.storage import HFStorageReader
from hp_dcp_hf.sync.source import HFWeightSource


def missing_torchtitan(version: tuple[int, ...] = tuple(sys.version_info)) -> str:
    """What to do when torchtitan cannot be imported: install the extra, or, on a Python older
    than torchtitan 0.3 supports (3.11), know that the extra installed nothing."""
    if tuple(version[:2]) < (3, 11):
        return (f"hp_dcp_hf.integrations.torchtitan needs torchtitan, and torchtitan 0.3 needs Python >= 3.11: "
                f"this is Python {'.'.join(map(str, version[:3]))}, where the [torchtitan] extra installs nothing")
    return ("hp_dcp_hf.integrations.torchtitan needs torchtitan: pip install 'hp-dcp-hf[torchtitan]' (from a "
            "checkout: pip install -e '.[torchtitan]')")


try:
    import torchtitan  # noqa: F401 - its models are what this module maps
except ImportError as error:
    raise ImportError(missing_torchtitan()) from error

__all__ = ["hf_weights_mapping", "load_hf_checkpoint", "model_tensors", "record_fused_qkv", "save_hf_checkpoint",
           "weight_source"]

_HF_CONFIG = "_hp_torchtitan_hf_config"  # the checkpoint config a load read: what a save writes back
_FUSED = "_hp_torchtitan_fused_qkv"  # set once the fused-qkv stage is recorded

# -- the families -----------------------------------------------------------------------------------

_DECODER = [  # every decoder family: the checkpoint's top-level and per-layer names
    WeightRenaming(r"^model\.embed_tokens\.", "tok_embeddings."),
    WeightRenaming(r"^model\.norm\.", "norm."),
    WeightRenaming(r"^model\.layers\.", "layers."),
    WeightRenaming(r"\.input_layernorm\.", ".attention_norm."),
    WeightRenaming(r"\.post_attention_layernorm\.", ".ffn_norm."),
    WeightRenaming(r"\.self_attn\.o_proj\.", ".attention.wo."),
]
_DENSE_MLP = [
    WeightRenaming(r"\.mlp\.gate_proj\.", ".feed_forward.w1."),
    WeightRenaming(r"\.mlp\.up_proj\.", ".feed_forward.w3."),
    WeightRenaming(r"\.mlp\.down_proj\.", ".feed_forward.w2."),
]
_QKV = [
    WeightRenaming(r"\.self_attn\.q_proj\.", ".attention.qkv_linear.wq."),
    WeightRenaming(r"\.self_attn\.k_proj\.", ".attention.qkv_linear.wk."),
    WeightRenaming(r"\.self_attn\.v_proj\.", ".attention.qkv_linear.wv."),
]
_EXPERTS = "moe.routed_experts.inner_experts"
_STACKED_EXPERTS = [  # per-expert checkpoint tensors stacked, as the adapters' _concatenate_expert_weights
    WeightConverter("mlp.experts.*.gate_proj.weight", f"{_EXPERTS}.w1_EFD", [MergeModulelist(dim=0)]),
    WeightConverter("mlp.experts.*.up_proj.weight", f"{_EXPERTS}.w3_EFD", [MergeModulelist(dim=0)]),
    WeightConverter("mlp.experts.*.down_proj.weight", f"{_EXPERTS}.w2_EDF", [MergeModulelist(dim=0)]),
]


def _attentions(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "n_heads") and hasattr(m, "n_kv_heads") and hasattr(m, "head_dim")]


def _llama3(model: nn.Module) -> list[WeightTransform]:
    heads = {(a.n_heads, a.n_kv_heads) for a in _attentions(model)}
    if len(heads) != 1:
        raise MappingError(f"llama3: the layers disagree on their head counts {sorted(heads)}")
    (n_heads, n_kv_heads), = heads
    return [
        *_DECODER, *_DENSE_MLP,
        WeightRenaming(r"\.self_attn\.v_proj\.", ".attention.qkv_linear.wv."),
        WeightConverter("self_attn.q_proj.weight", "attention.qkv_linear.wq.weight",
                        [PermuteHeadsForRope(n_heads, inverse=True)]),
        WeightConverter("self_attn.k_proj.weight", "attention.qkv_linear.wk.weight",
                        [PermuteHeadsForRope(n_kv_heads, inverse=True)]),
    ]


def _qwen3(model: nn.Module) -> list[WeightTransform]:
    return [
        *_DECODER, *_DENSE_MLP, *_QKV,
        WeightRenaming(r"\.self_attn\.q_norm\.", ".attention.q_norm."),
        WeightRenaming(r"\.self_attn\.k_norm\.", ".attention.k_norm."),
        WeightRenaming(r"\.mlp\.gate\.weight", ".moe.router.gate.weight"),
        *_STACKED_EXPERTS,
    ]


def _deepseek_v3(model: nn.Module) -> list[WeightTransform]:
    if len(getattr(model, "mtp_layers", None) or ()):
        raise MappingError("deepseek_v3: multi-token-prediction layers (mtp_layers) are not mapped; build the "
                           "model with num_mtp_layers=0")
    return [
        *_DECODER, *_DENSE_MLP,
        WeightRenaming(r"\.self_attn\.q_proj\.", ".attention.wq."),
        WeightRenaming(r"\.self_attn\.q_a_proj\.", ".attention.wq_a."),
        WeightRenaming(r"\.self_attn\.q_a_layernorm\.", ".attention.q_norm."),
        WeightRenaming(r"\.self_attn\.q_b_proj\.", ".attention.wq_b."),
        WeightRenaming(r"\.self_attn\.kv_a_proj_with_mqa\.", ".attention.wkv_a."),
        WeightRenaming(r"\.self_attn\.kv_a_layernorm\.", ".attention.kv_norm."),
        WeightRenaming(r"\.self_attn\.kv_b_proj\.", ".attention.wkv_b."),
        WeightRenaming(r"\.mlp\.shared_experts\.gate_proj\.", ".moe.shared_experts.w1."),
        WeightRenaming(r"\.mlp\.shared_experts\.up_proj\.", ".moe.shared_experts.w3."),
        WeightRenaming(r"\.mlp\.shared_experts\.down_proj\.", ".moe.shared_experts.w2."),
        WeightRenaming(r"\.mlp\.gate\.e_score_correction_bias", ".moe.expert_bias_E"),
        WeightRenaming(r"\.mlp\.gate\.weight", ".moe.router.gate.weight"),
        *_STACKED_EXPERTS,
    ]


def _gpt_oss(model: nn.Module) -> list[WeightTransform]:
    # The checkpoint's experts are [E, in, out] (transformers' GptOssExperts); torchtitan's [E, out, in].
    return [
        *_DECODER, *_QKV,
        WeightRenaming(r"\.self_attn\.sinks", ".attention.sinks"),
        WeightRenaming(r"\.mlp\.router\.", ".moe.router.gate."),
        WeightRenaming(r"\.mlp\.experts\.gate_up_proj_bias", f".{_EXPERTS}.mlp1_bias_EG"),
        WeightRenaming(r"\.mlp\.experts\.down_proj_bias", f".{_EXPERTS}.mlp2_bias_ED"),
        WeightConverter("mlp.experts.gate_up_proj", f"{_EXPERTS}.mlp1_weight_EGD", [Transpose(1, 2)]),
        WeightConverter("mlp.experts.down_proj", f"{_EXPERTS}.mlp2_weight_EDF", [Transpose(1, 2)]),
    ]


_FAMILIES: dict[str, tuple[Callable[[nn.Module], list[WeightTransform]], tuple[str, ...]]] = {
    # class name: (mapping, buffers no HF checkpoint holds, left as they are)
    "Llama3Model": (_llama3, ()),
    "Qwen3Model": (_qwen3, ("moe.expert_bias_E",)),
    "DeepSeekV3Model": (_deepseek_v3, ()),
    "GptOssModel": (_gpt_oss, ("moe.expert_bias_E",)),
}


def _family(model: nn.Module) -> tuple[Callable[[nn.Module], list[WeightTransform]], tuple[str, ...]]:
    for cls in type(model).__mro__:
        if cls.__name__ in _FAMILIES and cls.__module__.startswith("torchtitan."):
            return _FAMILIES[cls.__name__]
    raise ArgumentError(f"{type(model).__name__} is not one of torchtitan's models this integration maps "
                        f"({', '.join(_FAMILIES)}); pass weights_mapping= to hp_dcp_hf.load_hf_checkpoint")


def hf_weights_mapping(model: nn.Module) -> list[WeightTransform]:
    """The checkpoint -> model mapping of ``model``'s family, to the names its stock modules have
    (what its ``StateDictAdapter.from_hf`` makes); fused q/k/v follow from :func:`record_fused_qkv`."""
    return _family(model)[0](model)


# -- the fused q/k/v rewrite ------------------------------------------------------------------------


def record_fused_qkv(model: nn.Module) -> nn.Module:
    """Record, once, how every ``FusedQKVLinear``'s ``wqkv`` is made of the stock ``wq`` / ``wk`` /
    ``wv``: per key/value head, its query heads, its key head, its value head (rows; biases alike),
    as its own ``load_state_dict`` hook merges them (:class:`ConcatenateInGroups`)."""
    if getattr(model, _FUSED, False):
        return model
    by_groups: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "FusedQKVLinear":
            rows = module.wqkv.weight.shape[0]
            by_groups.setdefault(rows // (module.r_dim * module.head_dim), []).append(name)
    stage: list[WeightTransform] = []
    # One converter per parameter when every layer has the same groups, else one per module.
    scopes = {groups: [("qkv_linear", "qkv_linear")] if len(by_groups) == 1 else [(re.escape(n), n) for n in names]
              for groups, names in by_groups.items()}
    for groups, pairs in sorted(scopes.items()):
        for source, target in pairs:
            for param in ("weight", "bias"):
                stage.append(WeightConverter([f"{source}.{part}.{param}" for part in ("wq", "wk", "wv")],
                                             f"{target}.wqkv.{param}", [ConcatenateInGroups(dim=0, groups=groups)]))
    if stage:
        add_weight_mapping(model, stage)
    setattr(model, _FUSED, True)
    return model


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a load writes and a save reads: the model's own parameters and persistent buffers, one
    name per tied group, without the buffers no HF checkpoint holds."""
    skipped = _family(model)[1]
    return {name: tensor for name, tensor in own_state_dict(model).items()
            if not any(name.endswith("." + suffix) for suffix in skipped)}


# -- load and save -----------------------------------------------------------------------------------


def _refuse_own_arguments(kwargs: dict[str, Any]) -> None:
    if "weights_mapping" in kwargs or "state_dict" in kwargs:
        raise ArgumentError("the torchtitan integration supplies weights_mapping and state_dict itself")


def load_hf_checkpoint(model: nn.Module, path: str, *, reader: HFStorageReader | None = None,
                       **kwargs: Any) -> LoadReport:
    """Load the Hugging Face checkpoint at ``path`` into torchtitan model ``model`` (built, and
    parallelized by torchtitan's parallelize function, or not), in place; every rank calls it.

    ``kwargs`` are :func:`hp_dcp_hf.load_hf_checkpoint`'s (``strict``, ``unexpected``, storage
    options, ...). The checkpoint's ``config.json``, read with the reader's storage options, is kept
    on the model: a later :func:`save_hf_checkpoint` writes it back (a checkpoint without one loads,
    and its save needs ``hf_config=``).
    """
    from hp_dcp_hf.model.config import read_config

    _refuse_own_arguments(kwargs)
    if reader is None:  # built here, as hp_dcp_hf.load_hf_checkpoint would, for its storage options
        own = inspect.signature(_load).parameters
        reader = HFStorageReader(path, **{k: kwargs.pop(k) for k in list(kwargs) if k not in own})
    record_fused_qkv(model)
    report = _load(model, path, weights_mapping=hf_weights_mapping(model), state_dict=model_tensors(model),
                   reader=reader, **kwargs)
    try:
        config = read_config(path, reader.storage_options)
    except CheckpointNotFoundError:
        config = None
    setattr(model, _HF_CONFIG, config)
    return report


def save_hf_checkpoint(model: nn.Module, path: str | os.PathLike, *, hf_config: Any = None, **kwargs: Any) -> None:
    """Write torchtitan model ``model`` to ``path`` as the checkpoint ``save_pretrained`` writes for
    the transformers model of ``hf_config`` holding the same weights; every rank calls it.

    ``hf_config``: a transformers ``PretrainedConfig`` or a checkpoint path to read its
    ``config.json`` from; default, the config of the checkpoint the model was loaded from. The files,
    keys and grouping are transformers' for that config's class; each rank writes its own shards'
    bytes, in the single parallel pass of :func:`hp_dcp_hf.save_hf_checkpoint` (``kwargs``).
    """
    _refuse_own_arguments(kwargs)
    _save(model, path, **_save_arguments(model, hf_config, "save_hf_checkpoint"), **kwargs)


def weight_source(model: nn.Module, *, hf_config: Any = None, **kwargs: Any) -> HFWeightSource:
    """The :class:`~hp_dcp_hf.sync.source.HFWeightSource` of torchtitan model ``model``: the
    checkpoint tensors :func:`save_hf_checkpoint` would write, as slices of each rank's shards, for
    a weight update of an inference engine; every rank calls it. ``hf_config`` as
    :func:`save_hf_checkpoint` takes it; ``kwargs``: ``HFWeightSource``'s (``dtype``, ``quantize``)."""
    _refuse_own_arguments(kwargs)
    return HFWeightSource(model, **_save_arguments(model, hf_config, "weight_source"), **kwargs)


def _save_arguments(model: nn.Module, hf_config: Any, caller: str) -> dict[str, Any]:
    """What a save of ``model`` (or a weight source over it) plans with: the family's mapping,
    the checkpoint config (given, or the one its load read), the model's own tensors."""
    from hp_dcp_hf.model.config import read_config

    if isinstance(hf_config, (str, os.PathLike)):
        hf_config = read_config(os.fspath(hf_config))
    hf_config = hf_config if hf_config is not None else getattr(model, _HF_CONFIG, None)
    if hf_config is None:
        raise ArgumentError(f"{caller} needs hf_config= (a transformers config, or the path of a "
                            "checkpoint to take config.json from) for a model not loaded by this integration")
    record_fused_qkv(model)
    return {"weights_mapping": hf_weights_mapping(model), "hf_config": hf_config, "state_dict": model_tensors(model)}

