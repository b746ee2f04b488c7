"""What the load and the save planners share: one target per tied group, the shape check, the
composition both trace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_dcp_hf.errors import MappingError
from hp_dcp_hf.mapping.compose import TensorSpec
from hp_dcp_hf.planning.composition import compose
from hp_dcp_hf.planning.targets import refuse, shape_problem, tied_targets


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(4)


def test_one_target_per_tied_group_is_the_name_the_composition_makes():
    model = Tied()
    names = list(model.state_dict())  # tied: embed.weight and head.weight both
    targets = tied_targets(model, names, made={"head.weight", "norm.weight"})
    assert targets.names == ("head.weight", "norm.weight")  # the alias the checkpoint makes, not the first
    assert targets.covered == ("embed.weight", "head.weight", "norm.weight")
    assert targets.unmade == (("norm.bias",),)
    both = tied_targets(model, names, made={"embed.weight", "head.weight", "norm.weight", "norm.bias"})
    assert both.names == ("embed.weight", "norm.bias", "norm.weight") and not both.unmade


def test_composition_traces_the_model_from_its_sources_with_the_model_facts():
    model = Tied()
    sources = {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    composition = compose(model, sources, set(sources), weights_mapping=[])
    assert set(composition.traced) == set(sources)
    assert shape_problem(model.norm.weight, composition.traced["norm.weight"]) is None
    wrong = shape_problem(torch.empty(5), composition.traced["norm.weight"])
    assert wrong == "model expects (5,), checkpoint makes (4,) from ['norm.weight']"


def test_problems_are_refused_together_keyed_by_the_first():
    refuse([], "tensors cannot be written back exactly")  # nothing to refuse
    with pytest.raises(MappingError) as caught:
        refuse([("a.weight", "too short"), ("b.weight", "too long")], "model tensors do not match the checkpoint")
    assert caught.value.key == "a.weight"
    assert caught.value.reason == "2 model tensors do not match the checkpoint:\n  a.weight: too short\n  b.weight: too long"
