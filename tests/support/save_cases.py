"""The save-mapping cases (a checkpoint, a rewrite, its inverse) the one-process and multi-rank save tests share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    ConversionOps,
    ErnieFuseAndSplitTextVisionExperts,
    GroupWeightRename,
    MergeModulelist,
    PrefixChange,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
)

from tests.support.models import _randomize_

HIDDEN = 32


EXPERTS = 2


class _Weight(nn.Module):
    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (_Weight(HIDDEN, HIDDEN) for _ in range(3))


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = _Weight(EXPERTS, 2 * HIDDEN, HIDDEN)
        self.down_proj = _Weight(EXPERTS, HIDDEN, HIDDEN)


class _Layer(nn.Module):
    def __init__(self, extra_moe: bool) -> None:
        super().__init__()
        self.self_attn = _Attention()
        self.experts = _Experts()
        if extra_moe:
            self.extra_experts = _Experts()


class _Body(nn.Module):
    def __init__(self, extra_moe: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(extra_moe) for _ in range(2)])


class MoERoot(PreTrainedModel):
    """transformers' ``DummyRoot`` (``with_mlp``, ``extra_moe``) and ``DummyModelWithNorm`` (``with_norms``)."""

    base_model_prefix = "model"
    config: PreTrainedConfig

    def __init__(self, config: PreTrainedConfig) -> None:
        super().__init__(config)
        self.model = _Body(getattr(config, "extra_moe", False))
        if getattr(config, "with_mlp", True):
            self.mlp = nn.Module()
            self.mlp.down_proj = _Weight(HIDDEN, HIDDEN)
        if getattr(config, "with_norms", False):
            self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.post_init()


class _Sub(PreTrainedModel):
    config: PreTrainedConfig

    def __init__(self, config: PreTrainedConfig) -> None:
        super().__init__(config)
        self.q = _Weight(HIDDEN, HIDDEN)
        self.post_init()


class ScopedRoot(PreTrainedModel):
    """``scope_prefix == base_model_prefix``: the submodel under ``model``."""

    base_model_prefix = "model"
    config: PreTrainedConfig

    def __init__(self, config: PreTrainedConfig) -> None:
        super().__init__(config)
        self.model = _Sub(config)
        self.post_init()


class _HoldsQ(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = _Weight(HIDDEN, HIDDEN)


class Composite(PreTrainedModel):
    """Two sibling submodels and a root weight, each with a ``q``."""

    base_model_prefix = ""
    config: PreTrainedConfig

    def __init__(self, config: PreTrainedConfig) -> None:
        super().__init__(config)
        self.vision_model, self.language_model = _HoldsQ(), _HoldsQ()
        self.q = _Weight(HIDDEN, HIDDEN)
        self.post_init()


class Interleaved(PreTrainedModel):
    """An encoder whose attention the checkpoint stores fused, under ``decoder``."""

    base_model_prefix = ""
    config: PreTrainedConfig

    def __init__(self, config: PreTrainedConfig) -> None:
        super().__init__(config)
        self.encoder = nn.Module()
        self.encoder.attn = _Attention()
        self.post_init()


State = Mapping[str, torch.Tensor]


def _scoped(transform: WeightTransform, scope: str, base: str | None = None) -> WeightTransform:
    transform.scope_prefix, transform.base_model_prefix = scope, base
    return transform


def _renamed(state: State, rename: Callable[[str], str]) -> dict[str, torch.Tensor]:
    return {rename(k): v for k, v in state.items()}


def _moe_checkpoint(state: State, experts: tuple[str, ...] = ("experts",)) -> dict[str, torch.Tensor]:
    """Per-expert w1/w3/w2 (the experts of every module of ``experts`` numbered on), fused q/k/v,
    ``mlp.w2``: the checkpoint of transformers' MoE + q/k/v tests."""
    out = {"mlp.w2.weight": state["mlp.down_proj.weight"]}
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        attn = [state[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"]
        out[f"{prefix}.self_attn.qkv_proj.weight"] = torch.cat(attn)
        for m, module in enumerate(experts):
            gate_up, down = state[f"{prefix}.{module}.gate_up_proj.weight"], state[f"{prefix}.{module}.down_proj.weight"]
            for e in range(EXPERTS):
                n = m * EXPERTS + e
                out[f"{prefix}.experts.{n}.w1.weight"] = gate_up[e, :HIDDEN]
                out[f"{prefix}.experts.{n}.w3.weight"] = gate_up[e, HIDDEN:]
                out[f"{prefix}.experts.{n}.w2.weight"] = down[e]
    return out


def _moe_mapping(gate_up: Callable[[], list[ConversionOps]], down: Callable[[], list[ConversionOps]],
                 targets: Callable[[str], list[str]]) -> Callable[[], list[WeightTransform]]:
    """transformers' MoE + q/k/v mapping, with the expert ops and targets of one test."""
    def mapping() -> list[WeightTransform]:
        return [
            WeightConverter(["experts.*.w1.weight", "experts.*.w3.weight"], targets("gate_up_proj"), operations=gate_up()),
            WeightConverter("experts.*.w2.weight", targets("down_proj"), operations=down()),
            WeightConverter("self_attn.qkv_proj.weight",
                            ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                            operations=[Chunk(dim=0)]),
            WeightRenaming("mlp.w2.weight", "mlp.down_proj.weight"),
        ]
    return mapping


def _ernie() -> list[ConversionOps]:
    return [ErnieFuseAndSplitTextVisionExperts(stack_dim=0, concat_dim=1)]


@dataclass(frozen=True)
class Case:
    """A model class and config, the mapping ``M``, and the checkpoint transformers' test builds from
    the model's state dict (None: only ``save_pretrained``'s)."""

    model_cls: type[PreTrainedModel]
    config: Mapping[str, object]
    mapping: Callable[[], list[WeightTransform]]
    checkpoint: Callable[[State], dict[str, torch.Tensor]] | None

    def build(self, seed: int = 0) -> PreTrainedModel:
        model = self.model_cls(PreTrainedConfig(**self.config))
        with torch.no_grad():
            _randomize_(model, seed)
        return model.eval()


def _tiny_mixtral(seed: int = 0) -> PreTrainedModel:
    from tests.support.families import build_family_model

    return build_family_model("mixtral", seed=seed)


def _mixtral_mapping() -> list[WeightTransform]:
    """A checkpoint that names the attention output ``out_proj``, then transformers' Mixtral mapping."""
    from hp_dcp_hf.model.skeleton import checkpoint_mapping

    return [WeightRenaming(r"\.self_attn\.out_proj\.", ".self_attn.o_proj."), *checkpoint_mapping(_tiny_mixtral())]


CASES: dict[str, Case] = {
    "remove_prefix": Case(MoERoot, {}, lambda: [PrefixChange(prefix_to_remove="bad_name")],
                          lambda s: _renamed(s, lambda k: f"bad_name.{k}")),
    "add_prefix": Case(MoERoot, {"with_mlp": False}, lambda: [PrefixChange(prefix_to_add="model")],
                       lambda s: _renamed(s, lambda k: k.removeprefix("model."))),
    "remove_prefix_submodule": Case(
        MoERoot, {}, lambda: [PrefixChange(prefix_to_remove="bad_name", model_prefix="model.layers")],
        lambda s: _renamed(s, lambda k: k.replace("model.layers.", "model.layers.bad_name."))),
    "add_prefix_submodule": Case(
        MoERoot, {"with_mlp": False}, lambda: [PrefixChange(prefix_to_add="layers", model_prefix="model")],
        lambda s: _renamed(s, lambda k: k.replace(".layers.", "."))),
    "scope_is_base_prefix": Case(ScopedRoot, {}, lambda: [_scoped(WeightRenaming("^old_q", "q"), "", "model")],
                                 lambda s: _renamed(s, lambda k: k.replace(".q.", ".old_q."))),
    "scoped_sibling": Case(Composite, {}, lambda: [_scoped(WeightRenaming("^old_q", "q"), "vision_model")],
                           lambda s: _renamed(s, lambda k: k.replace("vision_model.q.", "vision_model.old_q."))),
    "interleaved_renaming": Case(
        Interleaved, {},
        lambda: [WeightRenaming("^decoder", "encoder"), _scoped(WeightConverter(
            "^attn.qkv_proj.weight", ["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"],
            operations=[Chunk(dim=0)]), "encoder")],
        lambda s: {"decoder.attn.qkv_proj.weight": torch.cat([s[f"encoder.attn.{p}_proj.weight"] for p in "qkv"])}),
    "group_weight_rename": Case(
        MoERoot, {"with_mlp": False, "with_norms": True},
        lambda: [GroupWeightRename(source_patterns=[r"norm0", r"norm1"], target_patterns=[r"norm1", r"norm2"])],
        lambda s: _renamed(s, lambda k: k.replace("norm1", "norm0").replace("norm2", "norm1"))),
    "moe_qkv": Case(MoERoot, {}, _moe_mapping(lambda: [MergeModulelist(dim=0), Concatenate(dim=1)],
                                              lambda: [MergeModulelist(dim=0)], lambda p: f"experts.{p}.weight"),
                    _moe_checkpoint),
    "ernie4_5_vl_moe": Case(
        MoERoot, {"extra_moe": True},
        _moe_mapping(_ernie, _ernie, lambda p: [f"experts.{p}.weight", f"extra_experts.{p}.weight"]),
        lambda s: _moe_checkpoint(s, ("experts", "extra_experts"))),
}


MIXTRAL = "mixtral_out_proj"


def build_source(case: str, seed: int = 0) -> PreTrainedModel:
    return _tiny_mixtral(seed) if case == MIXTRAL else CASES[case].build(seed)


def case_mapping(case: str) -> list[WeightTransform]:
    return _mixtral_mapping() if case == MIXTRAL else CASES[case].mapping()


def write_checkpoint(case: str, directory: Path) -> Path:
    """What ``save_pretrained`` writes for the case's model with its mapping in effect."""
    model = build_source(case)
    model._weight_conversions = case_mapping(case)
    model.save_pretrained(directory)
    return directory


def weights(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every safetensors file of ``directory``, by name."""
    return {file.name: load_file(file) for file in sorted(directory.glob("*.safetensors"))}


def assert_same_weights(ours: Path, reference: Path) -> None:
    """Same safetensors files, same keys in each, bit-identical tensors of the same dtypes."""
    expected, actual = weights(reference), weights(ours)
    assert expected and sorted(actual) == sorted(expected)
    for name, tensors in expected.items():
        assert sorted(actual[name]) == sorted(tensors), name
        for key, value in tensors.items():
            assert actual[name][key].dtype == value.dtype and torch.equal(actual[name][key], value), key


ALL_CASES = [*CASES, MIXTRAL]
