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
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    ConversionOps,
    Interleave,
    WeightConverter,
    WeightRenaming,
)

import hp_dcp_hf
from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.mapping.stages import recorded_checkpoint_mapping
from tests.support.save_cases import (
    ALL_CASES,
    CASES,
    HIDDEN,
    assert_same_weights,
    build_source,
    case_mapping,
    weights,
    write_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# -- models: the structure of transformers' test models, sized by their config -----------------------


# -- the cases ---------------------------------------------------------------------------------------


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
