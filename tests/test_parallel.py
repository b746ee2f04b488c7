"""Mesh specs (pure: no process group) and what TransformersPlans refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_dcp_hf.parallel import (
    MeshSizeError,
    ParallelizeError,
    TransformersPlans,
    check_world_size,
    distributed_config,
    format_mesh,
    mesh_spec,
    mesh_world_size,
    parse_mesh,
)
from hp_dcp_hf.parallel.plans import scalars_set_aside


@pytest.mark.parametrize(("spec", "sizes", "world"), [
    ("tp=2,dp=2", {"dp": 2, "tp": 2}, 4),
    ("dp_replicate=2,dp=2,tp=2", {"dp_replicate": 2, "dp": 2, "tp": 2}, 8),
    ("ep=4", {"dp": 4, "ep": 4}, 4),                     # ep without dp: dp = ep / tp
    ("tp=2,ep=4", {"dp": 2, "tp": 2, "ep": 4}, 4),
    ("dp=2,tp=2,ep=2", {"dp": 2, "tp": 2, "ep": 2}, 4),  # experts split over 2, FSDP over the other 2
    ({"tp": 3}, {"tp": 3}, 3),
])
def test_parse_mesh(spec, sizes, world):
    assert parse_mesh(spec) == sizes
    assert list(parse_mesh(spec)) == [d for d in ("dp_replicate", "dp", "tp", "ep") if d in sizes]
    assert mesh_world_size(spec) == world
    assert parse_mesh(format_mesh(spec)) == sizes


@pytest.mark.parametrize(("spec", "message"), [
    ("pp=2", "unknown dim 'pp'; known: dp_replicate, dp, tp, ep"),  # as near to dp, tp and ep: no guess
    ("dp=2,dp=2", "names 'dp' twice"),
    ("dp", "expected name=size"),
    ("tp=0", "every size an integer >= 1"),
    ("", "need at least one dim"),
    ("tp=2,ep=3", "ep=3 must be a multiple of tp=2"),
])
def test_parse_mesh_errors(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_mesh(spec)


@pytest.mark.parametrize(("spec", "named"), [
    ("fsdp=2,tp=2", "'fsdp' (did you mean dp?)"),                   # FSDP's own name
    ("dp_shard=4", "'dp_shard' (did you mean dp?)"),                # torchtitan's
    ("fsdp_size=2", "'fsdp_size' (did you mean dp?)"),              # transformers' DistributedConfig field
    ("data_parallel_replicate_degree=2", "(did you mean dp_replicate?)"),
    ("dp=2,tq=2", "'tq' (did you mean tp?)"),                       # typos of one dim
    ("dp_replcate=2,dp=2", "'dp_replcate' (did you mean dp_replicate?)"),
    ("fsdp=2,tq=2", "dims 'fsdp' (did you mean dp?), 'tq' (did you mean tp?)"),
])
def test_unknown_mesh_dims_suggest_the_dim_meant(spec, named):
    with pytest.raises(ValueError) as caught:
        parse_mesh(spec)
    assert str(caught.value).startswith(f"mesh spec {spec!r}: unknown dim") and named in str(caught.value)
    assert str(caught.value).endswith("known: dp_replicate, dp, tp, ep (dp is FSDP's sharding, dp_replicate HSDP's "
                                      "replicas)")


def test_distributed_config_follows_transformers_names():
    config = distributed_config("dp_replicate=2,dp=2,tp=2,ep=4")
    assert (config.dp_replicate_size, config.fsdp_size, config.tp_size, config.ep_size) == (2, 2, 2, 4)
    assert config.efsdp_size == 1
    assert mesh_spec(config) == {"dp_replicate": 2, "dp": 2, "tp": 2, "ep": 4}
    with pytest.raises(ValueError, match="ep_size"):  # transformers' own check: ep must divide dp x tp
        distributed_config("dp=1,tp=2,ep=4")


def test_world_size_mismatch_names_the_launch_line():
    check_world_size("dp=2,tp=2", 4)
    with pytest.raises(MeshSizeError, match=r"launch with `torchrun --nproc-per-node 4 \.\.\.`"):
        check_world_size("dp=2,tp=2", 1)


def test_plans_refuse_models_without_plans():
    with pytest.raises(ParallelizeError, match="not a transformers model"):
        TransformersPlans("dp=1")(nn.Linear(2, 2))


def test_scalars_set_aside_and_restored():
    module = nn.Module()
    module.scale = nn.Parameter(torch.tensor(2.0))
    module.inner = nn.Linear(2, 2)
    module.inner.gain = nn.Parameter(torch.tensor(3.0))
    before = dict(module.named_parameters())
    with scalars_set_aside(module) as names:
        assert names == ["scale", "gain"]
        assert set(dict(module.named_parameters())) == {"inner.weight", "inner.bias"}
    after = dict(module.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
