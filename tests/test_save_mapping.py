"""Custom checkpoint mappings saved back exactly: a model loaded with ``weights_mapping=M`` saves,
by default, the checkpoint it was loaded from (the save inverts the mapping the load recorded),
and with ``weights_mapping=M`` given to the save too, before or without a load.

The cases are the round trips of transformers' own tests (``tests/utils/test_core_model_loading.py``:
prefix removed / added at the root and in a submodule, scoped renames, a renaming interleaved with a
scoped converter, ``GroupWeightRename``, MoE + q/k/v reversed, ernie4_5_vl_moe reversed), on models
of the same structure (built from their config alone, as a save's skeleton is), plus a tiny Mixtral
with a custom renaming in front of transformers' mapping. The checkpoint of each case is what
``save_pretrained`` writes with ``M`` in effect, checked first against the checkpoint transformers'
test builds by hand. Mappings that cannot be inverted exactly fail before a byte is written.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    ConversionOps,
    ErnieFuseAndSplitTextVisionExperts,
    GroupWeightRename,
    Interleave,
    MergeModulelist,
    PrefixChange,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
)

import hp_dcp_hf
from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.mapping.stages import recorded_checkpoint_mapping
from tests.support.models import _randomize_

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

HIDDEN = 32
EXPERTS = 2

# -- models: the structure of transformers' test models, sized by their config -----------------------


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


# -- the cases ---------------------------------------------------------------------------------------

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


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mapped")
    return {case: write_checkpoint(case, root / case) for case in ALL_CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_save_pretrained_writes_the_checkpoint_transformers_tests_build(checkpoints, case):
    """The oracle agrees with transformers' tests: ``save_pretrained`` with the mapping in effect
    writes the checkpoint they build by hand (so it is not the model's own names)."""
    source = build_source(case)
    expected = CASES[case].checkpoint(source.state_dict())
    (saved,) = weights(checkpoints[case]).values()
    assert sorted(saved) == sorted(expected) and sorted(saved) != sorted(source.state_dict())
    assert all(torch.equal(saved[k], v) for k, v in expected.items())


@pytest.mark.parametrize("case", ALL_CASES)
def test_a_model_loaded_with_a_mapping_saves_the_checkpoint(checkpoints, case, tmp_path):
    """Load with ``weights_mapping=M``, then save: with the mapping the load recorded, and with
    ``M`` given again; both write the checkpoint's keys and bytes."""
    model = build_source(case, seed=1)
    hp_dcp_hf.load_hf_checkpoint(model, str(checkpoints[case]), weights_mapping=case_mapping(case))
    source = build_source(case).state_dict()
    assert all(torch.equal(v, source[k]) for k, v in model.state_dict().items())
    assert recorded_checkpoint_mapping(model)
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "recorded")
    assert_same_weights(tmp_path / "recorded", checkpoints[case])
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "given", weights_mapping=case_mapping(case))
    assert_same_weights(tmp_path / "given", checkpoints[case])


@pytest.mark.parametrize("case", ALL_CASES)
def test_a_mapping_given_to_the_save_alone_writes_the_checkpoint(checkpoints, case, tmp_path):
    """A model that was never loaded (``HFSavePlanner(model, weights_mapping=M)``)."""
    model = build_source(case)
    planner = hp_dcp_hf.HFSavePlanner(model, weights_mapping=case_mapping(case))
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "out", planner=planner)
    assert_same_weights(tmp_path / "out", checkpoints[case])


@pytest.mark.parametrize("case", ["remove_prefix", "add_prefix", "group_weight_rename"])
def test_an_already_converted_checkpoint_saves_as_it_was(checkpoints, case, tmp_path):
    """A checkpoint in the model's own names, loaded with the same mapping object another load used
    (which renamed): that mapping did nothing here, so the save renames nothing."""
    mapping = case_mapping(case)
    hp_dcp_hf.load_hf_checkpoint(build_source(case, seed=1), str(checkpoints[case]), weights_mapping=mapping)
    good = tmp_path / "good"
    build_source(case).save_pretrained(good)
    assert sorted(next(iter(weights(good).values()))) == sorted(build_source(case).state_dict())
    model = build_source(case, seed=1)
    hp_dcp_hf.load_hf_checkpoint(model, str(good), weights_mapping=mapping)
    assert recorded_checkpoint_mapping(model) == []
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "out")
    assert_same_weights(tmp_path / "out", good)


def test_a_mapping_given_to_the_save_wins_over_the_recorded_one(checkpoints, tmp_path):
    model = build_source("remove_prefix", seed=1)
    hp_dcp_hf.load_hf_checkpoint(model, str(checkpoints["remove_prefix"]), weights_mapping=case_mapping("remove_prefix"))
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "identity", weights_mapping=[])
    (saved,) = weights(tmp_path / "identity").values()
    assert sorted(saved) == sorted(model.state_dict())
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


class _Tiny(nn.Module):
    """Not a transformers model: the save knows its checkpoint only through the mapping."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.norm = nn.LayerNorm(HIDDEN)


def test_a_module_that_is_not_a_transformers_model_saves_its_checkpoint(tmp_path):
    """Its checkpoint interleaves the rows of q and k (each checkpoint element still makes one model
    element, though the rows of q and of k span the same region) and names the norm ``ln``."""
    checkpoint = {"qk.weight": torch.randn(2 * HIDDEN, HIDDEN), "ln.weight": torch.randn(HIDDEN),
                  "ln.bias": torch.randn(HIDDEN)}
    (tmp_path / "ckpt").mkdir()
    save_file(checkpoint, tmp_path / "ckpt" / "model.safetensors")
    mapping = [WeightConverter("qk.weight", ["q.weight", "k.weight"], operations=[Interleave(dim=0), Chunk(dim=0)]),
               WeightRenaming(r"^ln\.", "norm.")]
    model = _Tiny()
    hp_dcp_hf.load_hf_checkpoint(model, str(tmp_path / "ckpt"), weights_mapping=mapping)
    assert torch.equal(model.q.weight, checkpoint["qk.weight"][0::2])
    hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "out")
    assert_same_weights(tmp_path / "out", tmp_path / "ckpt")


# -- mappings that cannot be inverted exactly ----------------------------------------------------------


class _OneWayChunk(Chunk):
    """A user's op that defines no reverse."""

    @property
    def reverse_op(self) -> ConversionOps:
        raise NotImplementedError


class _Scale(ConversionOps):
    """Math on values: invertible on paper, not element for element."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {k: (v[0] if isinstance(v, list) else v) * self.factor for k, v in input_dict.items()}

    @property
    def reverse_op(self) -> ConversionOps:
        return _Scale(1 / self.factor)


class _FirstThirdTwice(ConversionOps):
    """A buggy split: q and k both from the first third, the second third unused."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        (tensor,) = (v[0] if isinstance(v, list) else v for v in input_dict.values())
        third = tensor.shape[0] // 3
        return dict(zip(target_patterns, (tensor[:third], tensor[:third], tensor[2 * third:])))

    @property
    def reverse_op(self) -> ConversionOps:
        return Concatenate(dim=0)


FUSED = "encoder.attn.qkv_proj.weight"
UNFUSED = [f"encoder.attn.{p}_proj.weight" for p in "qkv"]
NOT_INVERTIBLE = {  # name -> (operations, the key the error names)
    "no_reverse_op": ([_OneWayChunk(dim=0)], UNFUSED),
    "untraceable": ([Chunk(dim=0), _Scale(2.0)], UNFUSED),
    "claims_twice": ([_FirstThirdTwice()], [FUSED]),
}


@pytest.mark.parametrize("name", list(NOT_INVERTIBLE))
def test_a_mapping_that_cannot_be_inverted_fails_before_writing(tmp_path, name):
    operations, keys = NOT_INVERTIBLE[name]
    (tmp_path / "ckpt").mkdir()
    save_file({FUSED: torch.randn(3 * HIDDEN, HIDDEN)}, tmp_path / "ckpt" / "model.safetensors")
    mapping = [WeightConverter("attn.qkv_proj.weight", [k.removeprefix("encoder.") for k in UNFUSED],
                               operations=operations)]
    model = CASES["interleaved_renaming"].build()
    hp_dcp_hf.load_hf_checkpoint(model, str(tmp_path / "ckpt"), weights_mapping=copy.deepcopy(mapping))
    with pytest.raises(MappingError) as raised:
        hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "out")
    assert raised.value.key in keys
    assert not (tmp_path / "out").exists()
    shutil.copytree(tmp_path / "ckpt", tmp_path / "older")
    before = {p.name: p.read_bytes() for p in (tmp_path / "older").iterdir()}
    with pytest.raises(MappingError):
        hp_dcp_hf.save_hf_checkpoint(model, tmp_path / "older", weights_mapping=mapping)
    assert {p.name: p.read_bytes() for p in (tmp_path / "older").iterdir()} == before
